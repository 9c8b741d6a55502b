"""Kept caches are reused in whole turns: never up to a place inside a message."""

from workers.generation.conversations import Conversations, whole_turns

SPANS = ((3, 10), (14, 20))  # two messages' contents, template text around them


def test_a_prefix_that_ends_inside_a_message_falls_back_to_its_start():
    assert whole_turns(9, SPANS) == 3
    assert whole_turns(15, SPANS) == 14


def test_a_prefix_that_ends_between_messages_or_on_their_edges_is_reused_whole():
    assert [whole_turns(n, SPANS) for n in (0, 2, 3, 10, 12, 14, 20, 25)] == [0, 2, 3, 10, 12, 14, 20, 25]


class Cache:
    """Enough of a KVCache for ``Conversations``: what it holds, truncated or copied."""

    def __init__(self, length: int = 0) -> None:
        self.length = self.resident_tokens = length

    def truncate(self, length: int) -> None:
        self.length = length

    def copy_prefix(self, length: int, capacity: int) -> "Cache":
        return Cache(length)


def test_guessing_a_kept_pin_digit_by_digit_reuses_the_same_for_every_digit():
    kept = Conversations(Cache, bytes_per_token=1, budget_bytes=10_000)
    head, pin, tail = [1, 2, 3], [40, 48, 43, 41], [7, 8]  # template, "My PIN is 4 8 3 1", template
    prompt, reply = head + [50, 51] + pin + tail, list(range(60, 70))
    kept.keep("client:a", None, prompt + reply, Cache(len(prompt + reply)), ((3, 9), (len(prompt), len(prompt) + 10)))
    reused = {d: kept.lookup("client:a", None, head + [50, 51, 40 + d] + tail)[1] for d in range(10)}
    assert set(reused.values()) == {3}  # the template before the message, whatever the digit
    assert kept.lookup("client:a", None, prompt + reply[:5])[1] == len(prompt)  # nor inside the reply
    assert kept.lookup("client:a", None, prompt + reply + [9, 9])[1] == len(prompt + reply)  # its next turn: all


def test_a_message_that_begins_with_a_whole_earlier_one_reuses_none_of_it():
    """"My PIN is 9 5" after someone's "My PIN is 9": the shared prefix ends at the end of the
    earlier message, inside the new one, so it goes back to the new one's start."""
    kept = Conversations(Cache, bytes_per_token=1, budget_bytes=10_000)
    head, said, tail = [1, 2, 3], [50, 51, 49], [7, 8]
    kept.keep("client:a", None, head + said + tail, Cache(8), ((3, 6),))
    longer = head + said + [45] + tail  # the earlier message, and one more token, as one message
    assert kept.lookup("client:a", None, longer, prompt_spans=((3, 7),))[1] == 3
    kept.keep("client:a", None, head + said + tail, Cache(8), ((3, 6),))  # (the lookup took it: keep it again)
    assert kept.lookup("client:a", None, head + said + tail + [9, 10], prompt_spans=((3, 6),))[1] == 8  # the same, whole
    assert whole_turns(6, ((3, 6),), ((3, 7),)) == 3 and whole_turns(6, ((3, 6),), ((3, 6),)) == 6
