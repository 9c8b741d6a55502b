"""Stop strings end a reply, and the text of one is never shown in part, however the reply's
pieces split it (``workers.generation.detokenize.StopStrings``)."""

from workers.generation.detokenize import StopStrings


def test_stop_strings_end_the_reply_and_are_never_shown_in_part():
    stops = StopStrings(("\n\nUser:", "END"))
    shown, stopped = [], False
    for piece in ["Hello", " wor", "ld\n", "\nUs", "er: more", " text"]:
        text, stopped = stops.push(piece)
        shown.append(text)
        if stopped:
            break
    assert "".join(shown) == "Hello world" and stopped and stops.matched == "\n\nUser:"  # named in Done
    assert stops.push("after") == ("", True) and stops.flush() == ""
    almost = StopStrings(("END",))
    assert almost.push("abcEN") == ("abc", False)  # "EN" might start "END": held back
    assert almost.push("x") == ("ENx", False) and almost.flush() == "" and almost.matched is None
    first = StopStrings(("b", "a"))
    assert first.push("xab") == ("x", True) and first.matched == "a"  # the first in the text, not in the list
    assert StopStrings(()).push("anything") == ("anything", False)
