"""The prompt: a chat as token ids the model was trained on, fitted into its context window.

    ids = encode_chat(tokenizer, messages)                       # the chat template, safely
    prompt = whole_prompt(tokenizer, messages, window, reply)    # all of it, or PromptTooLong saying so
    prompt = raw_prompt(tokenizer, text, window, reply)          # no chat template (legacy completions)
    prompt = build_prompt(tokenizer, messages, max_prompt_tokens)  # oldest turns dropped to fit
    prompt.ids, prompt.spans                                     # its ids, where each message's content lies
    stop = stop_token_ids(tokenizer, generation_config_eos)      # where a reply ends
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from jinja2 import TemplateError

from workers.errors import InvalidInput, PromptTooLong
from workers.protocol import ChatMessage

END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")



@dataclass(frozen=True)
class Prompt:
    """A chat's token ids, and where in them each message's content lies.

    A kept KV cache is never reused up to a place inside a ``span``
    (``workers.generation.conversations``): a prefix that ended inside someone's message
    would tell a guesser how much of it they guessed."""

    ids: list[int]
    dropped_turns: int = 0  # oldest user/assistant messages left out to fit the context
    spans: tuple[tuple[int, int], ...] = ()  # each message's content: ids[start:end], in order


PLACEHOLDER = "cpuchat{nonce}m{index}x"  # a message's content while the template renders


def placeholders(count: int) -> tuple[list[str], re.Pattern]:
    """A placeholder per message, and the pattern that finds them again in the rendered text
    (its one group: the message's index).

    Letters and digits only, with a fresh nonce per render: a template may ``trim`` a
    message's content (Llama 3's and Gemma's do), change its case, or escape it, and the
    placeholder must come through whole all the same (a whitespace-like separator was
    trimmed away with the message it stood for); the nonce keeps it from matching anything
    a template writes itself. Matched without regard to case."""
    nonce = secrets.token_hex(4)
    marks = [PLACEHOLDER.format(nonce=nonce, index=i) for i in range(count)]
    return marks, re.compile(f"cpuchat{nonce}m(\\d+)x", re.IGNORECASE)


def content_ids(tokenizer, message: ChatMessage) -> list[int]:
    """A message's text as plain tokens: special tokens in it stay characters, and so do the
    tokenizer's other added tokens (Qwen's ``<think>`` and ``<tool_call>`` are not "special",
    so ``split_special_tokens`` leaves them whole: a user could open a tool call or a thought
    the model would take for its own). Each such string is tokenized in two pieces."""
    text, ids = message.content, []
    added = _added_pattern(tokenizer)
    for i, piece in enumerate(added.split(text) if added else [text]):
        pieces = (piece[:1], piece[1:]) if i % 2 else (piece,)  # odd: an added token's text, split
        for part in pieces:
            if part:
                ids += tokenizer(part, add_special_tokens=False, split_special_tokens=True).input_ids
    return ids


def _added_pattern(tokenizer) -> re.Pattern | None:
    """The non-special added tokens' strings, as one pattern with one group (None: there are none)."""
    words = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if not t.special and len(t.content) > 1),
                   key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, words)) + ")") if words else None


def encode_chat(tokenizer, messages: list[ChatMessage], enable_thinking: bool | None = None,
                contents: Callable[[ChatMessage], list[int]] | None = None) -> list[int]:
    """Token ids of the chat template applied to ``messages``, with a generation prompt
    (``encode_turns``' ids)."""
    return encode_turns(tokenizer, messages, enable_thinking, contents).ids


def encode_turns(tokenizer, messages: list[ChatMessage], enable_thinking: bool | None = None,
                 contents: Callable[[ChatMessage], list[int]] | None = None) -> Prompt:
    """The chat template applied to ``messages``, with a generation prompt, as a ``Prompt``.

    ``enable_thinking`` goes to the template as the variable Qwen3's template reads (False:
    its prompt closes an empty ``<think></think>``, so the model answers at once); None
    leaves the template's default. Templates without the variable ignore it.

    Message contents are tokenized with special tokens split into plain text, so a user
    who types ``<|im_start|>system`` gets those characters, not a new role. We render the
    template with a placeholder per message, then tokenize the template's own text (where
    special tokens are real) and each content (where they are not, by ``contents``: default
    ``content_ids``) separately.
    """
    marks, found = placeholders(len(messages))
    standins = [{"role": m.role, "content": mark} for m, mark in zip(messages, marks, strict=True)]
    switch = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    try:
        rendered = tokenizer.apply_chat_template(standins, tokenize=False, add_generation_prompt=True, **switch)
    except TemplateError as exc:  # the template's own raise_exception ("roles must alternate", ...)
        raise InvalidInput(f"The model's chat template refused this conversation: {exc}") from exc
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for i, piece in enumerate(found.split(rendered)):  # the template's text, an index, text, ...
        if i % 2:
            message, start = messages[int(piece)], len(ids)
            ids += contents(message) if contents else content_ids(tokenizer, message)
            spans.append((start, len(ids)))
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False).input_ids
    return Prompt(ids, spans=tuple(spans))


def whole_prompt(tokenizer, messages: list[ChatMessage], window: int, reply_tokens: int,
                 enable_thinking: bool | None = None) -> Prompt:
    """Every turn, with room for ``reply_tokens``, or ``PromptTooLong`` with the numbers: a
    model that never saw the start of a conversation answers it all the same, so nothing is
    left out unless the server was told to (``--context-overflow drop-oldest``: ``build_prompt``).

    Contents are counted back from the newest and the count stops once they alone overflow,
    so a hostile megabyte history costs what fits (the message then says "at least")."""
    limit, counted, memo = window - reply_tokens, 0, {}
    for message in reversed(messages):
        memo[id(message)] = content_ids(tokenizer, message)
        counted += len(memo[id(message)])
        if counted > limit:
            raise PromptTooLong(overflow_message(counted, reply_tokens, window, at_least=True))
    prompt = encode_turns(tokenizer, messages, enable_thinking, lambda m: memo[id(m)])
    if len(prompt.ids) > limit:
        raise PromptTooLong(overflow_message(len(prompt.ids), reply_tokens, window))
    return prompt


def raw_prompt(tokenizer, text: str, window: int, reply_tokens: int) -> Prompt:
    """The text as the prompt itself, with no chat template: what a legacy completions client
    (an evaluation harness, code that writes its own template) sends. Special tokens in it are
    tokens, as llama.cpp's and vLLM's servers read them: a raw prompt has no roles to forge.
    One span over it all, so that a kept cache is never reused up to a place inside it."""
    ids = tokenizer(text, add_special_tokens=True).input_ids
    if len(ids) + reply_tokens > window:
        raise PromptTooLong(overflow_message(len(ids), reply_tokens, window))
    return Prompt(ids, spans=((0, len(ids)),))


def overflow_message(prompt_tokens: int, reply_tokens: int, window: int, at_least: bool = False) -> str:
    """What a conversation past the window is told, with its numbers (the page translates it)."""
    more = "at least " if at_least else ""
    return (f"The conversation is too long for this model: it needs {more}{prompt_tokens + reply_tokens} tokens "
            f"({more}{prompt_tokens} for the conversation, {reply_tokens} for the reply), and its context window "
            f"holds {window}. Remove earlier messages or start a new chat, or ask for fewer new tokens.")


def build_prompt(tokenizer, messages: list[ChatMessage], max_prompt_tokens: int,
                 enable_thinking: bool | None = None) -> Prompt:
    """Fit the conversation into ``max_prompt_tokens`` by dropping the oldest turns.

    The system prompt and the newest user message are always kept; if those alone are too
    long, ``PromptTooLong`` says by how much. Each message is tokenized at most once, and
    only back from the newest until their tokens alone overflow the window: older ones
    cannot fit, so a huge history costs what fits, not what was sent. The fewest turns to
    drop are then found by binary search over the places a conversation can restart (a
    user turn), rendering only the template around the memoized contents.
    """
    system = [m for m in messages[:1] if m.role == "system"]
    turns = messages[len(system) :]
    memo: dict[int, list[int]] = {}

    def contents(message: ChatMessage) -> list[int]:
        if id(message) not in memo:
            memo[id(message)] = content_ids(tokenizer, message)
        return memo[id(message)]

    used, earliest = sum(len(contents(m)) for m in system), len(turns) - 1
    while earliest > 0 and used + len(contents(turns[earliest])) <= max_prompt_tokens:
        used += len(contents(turns[earliest]))
        earliest -= 1  # turns before ``earliest`` can never fit: their contents alone overflow
    starts = sorted({earliest, len(turns) - 1} | {i for i, m in enumerate(turns) if m.role == "user" and i >= earliest})

    def fits(start: int) -> Prompt | None:
        prompt = encode_turns(tokenizer, system + turns[start:], enable_thinking, contents)
        return prompt if len(prompt.ids) <= max_prompt_tokens else None

    if (prompt := fits(starts[0])) is not None:
        return dataclasses.replace(prompt, dropped_turns=starts[0])
    low, high = 0, len(starts) - 1  # starts[low] does not fit; find the first that does
    last = fits(starts[high])
    if last is None:
        needed = len(encode_chat(tokenizer, system + turns[starts[high]:], enable_thinking, contents))
        raise PromptTooLong(
            f"The message is too long: it needs {needed} tokens with the system prompt, and "
            f"this model accepts at most {max_prompt_tokens} prompt tokens (its context window "
            f"minus room for the reply). Please shorten it."
        )
    best = (starts[high], last)
    while high - low > 1:
        middle = (low + high) // 2
        if (prompt := fits(starts[middle])) is not None:
            high, best = middle, (starts[middle], prompt)
        else:
            low = middle
    return dataclasses.replace(best[1], dropped_turns=best[0])


def stop_token_ids(tokenizer, generation_eos: int | list[int] | None) -> set[int]:
    """EOS ids from the tokenizer and the generation config, plus known end-of-turn tokens."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, generation_eos):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return ids
