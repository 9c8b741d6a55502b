"""Checks at the edge, shared by the page and the API, with limits that have names.

Text is cleaned, not rejected, where a person would not notice the difference (control
characters, unpaired surrogates from a broken client); what cannot be served gets an
``InvalidInput`` whose message is shown to the user as is.
"""

from __future__ import annotations

import dataclasses
import math
import re
import unicodedata

from workers.errors import InvalidInput
from workers.protocol import SamplingParams

MAX_MESSAGE_CHARS = 32_000  # ~8k tokens: past any context window this app serves
MAX_REQUEST_BYTES = 2 * 2**20  # an API body: many times what any context window holds
MAX_MESSAGES = 200
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_LOGPROBS = 20  # top_logprobs, as OpenAI's API
MAX_NEW_TOKENS = 2048
TEMPERATURE_RANGE = (0.0, 2.0)
TOP_P_RANGE = (0.01, 1.0)
TOP_K_RANGE = (0, 1000)  # 0 = no top-k
REPETITION_PENALTY_RANGE = (1.0, 2.0)
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty: as OpenAI's API
MIN_P_RANGE = (0.0, 1.0)  # 0 = no min-p
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # as OpenAI's API
MAX_LOGIT_BIAS = 300  # tokens one request may bias

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")



def clean_text(text: str) -> str:
    """Drop control characters (keeping tab and newlines) and replace unpaired surrogates."""
    text = text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates -> "?"
    return unicodedata.normalize("NFC", _CONTROL.sub("", text))


def check_message(text: str) -> str:
    """The user's new message, cleaned; refuses empty and oversized ones."""
    text = clean_text(text)
    if not text.strip():
        raise InvalidInput("The message is empty. Type something to send.")
    if len(text) > MAX_MESSAGE_CHARS:
        raise InvalidInput(
            f"The message is {len(text):,} characters long; the limit is {MAX_MESSAGE_CHARS:,}."
        )
    return text


def check_conversation(system_prompt: str, history: list) -> None:
    """The page's limits on what comes with a message, the API's own (``app.edge.schema``): the
    system prompt and each earlier message at most ``MAX_MESSAGE_CHARS``, at most
    ``MAX_MESSAGES`` of them, and ``MAX_REQUEST_BYTES`` characters in all. Gradio caps no body,
    and a crafted page request can carry any history: without these a stranger's megabytes were
    cleaned on the event loop and tokenized in a worker's serve loop before being refused."""
    if len(system_prompt) > MAX_MESSAGE_CHARS:
        raise InvalidInput(f"The system prompt is {len(system_prompt):,} characters long; the limit is "
                           f"{MAX_MESSAGE_CHARS:,}.")
    if len(history) > MAX_MESSAGES:
        raise InvalidInput(f"This conversation has {len(history):,} messages; the limit is {MAX_MESSAGES}. "
                           "Clear the chat to start a new one.")
    sizes = [_content_chars(turn.get("content") if isinstance(turn, dict) else turn) for turn in history]
    if any(n > MAX_MESSAGE_CHARS for n in sizes):
        raise InvalidInput(f"A message in this conversation is longer than {MAX_MESSAGE_CHARS:,} characters.")
    if len(system_prompt) + sum(sizes) > MAX_REQUEST_BYTES:
        raise InvalidInput(f"This conversation is longer than {MAX_REQUEST_BYTES:,} characters in all. "
                           "Clear the chat to start a new one.")


def _content_chars(content) -> int:
    """A history entry's text length: a string, or Gradio's list of parts; anything else counts as
    its printed size, so that no shape of content escapes the caps."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_content_chars(part.get("text", "") if isinstance(part, dict) else part) for part in content)
    return len(str(content)) if content is not None else 0


SAMPLING_RANGES = {  # what each sampling field may be (the API's request model has the same bounds)
    "temperature": TEMPERATURE_RANGE,
    "top_p": TOP_P_RANGE,
    "top_k": TOP_K_RANGE,
    "repetition_penalty": REPETITION_PENALTY_RANGE,
    "max_new_tokens": (1, MAX_NEW_TOKENS),
}
WHOLE_NUMBERS = frozenset({"top_k", "max_new_tokens"})


def check_number(name: str, value) -> int | float:
    """One sampling field as a client sent it → its number (a whole one rounded); anything else
    (NaN, which every comparison calls in range; infinity; a string; a huge number; a bool)
    gets an ``InvalidInput`` that names the field and its range."""
    low, high = SAMPLING_RANGES[name]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and (isinstance(value, int) or math.isfinite(value)) and low <= value <= high):
        kind = "a whole number" if name in WHOLE_NUMBERS else "a number"
        raise InvalidInput(f"{name} must be {kind} from {low:g} to {high:g}, not {_shown(value)}.")
    return int(round(value)) if name in WHOLE_NUMBERS else float(value)


def _shown(value) -> str:
    """A value a client sent, short enough for a message."""
    try:
        shown = repr(value)
    except ValueError:  # an int past Python's limit on digits to print
        return "a number too long to print"
    return shown if len(shown) <= 40 else shown[:39] + "…"


def check_params(params: SamplingParams) -> SamplingParams:
    """The page's sampling fields as its client sent them, checked by ``check_number``. The
    sliders keep a browser's values in range; a crafted request (gradio_client sends anything)
    reaches this unchecked (``app.page.ui.control``)."""
    return dataclasses.replace(params, **{name: check_number(name, getattr(params, name)) for name in SAMPLING_RANGES})
