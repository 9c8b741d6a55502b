"""Every error the app tells a person about, in one tree; each message is shown as is.

    ChatError                  an error whose message is written for the user or operator
    ├── SetupError             start-up cannot go on as configured (exit code 2 before listening)
    │   ├── ConfigError        a config key or flag has a bad value; the message names it
    │   ├── AuthError          --auth is malformed or its file unreadable
    │   ├── LayoutError        workers × threads does not fit this machine's cores
    │   ├── ModelNotFound      the model cannot be found or loaded
    │   └── CalibrationError   no linear kernel fits the flags on this CPU
    ├── UnsupportedModel       the lean decoder lacks this architecture: transformers serves it
    └── RequestError           one request cannot be served; the server goes on
        ├── InvalidInput       the request itself is bad (API: 400)
        └── PromptTooLong      the conversation does not fit the context window (400,
                               code context_length_exceeded)

A request is refused in one way only: as the ``workers.protocol.Failed`` event that ends
its stream, with an ``ErrorCode`` (invalid, busy, too many, unavailable, internal) that the API maps
to a status code and the page shows in the reply. ``RequestError``s raised while a
request is checked become exactly that.

Lives in ``workers/`` (which never imports ``app/``) so both sides can raise from it.
"""

from __future__ import annotations


class ChatError(Exception):
    """An error whose message is written for the person who will read it."""


class SetupError(ChatError):
    """Start-up cannot go on as configured."""


class ConfigError(SetupError, ValueError):
    """A config file key or flag value is invalid; the message names the key."""


class AuthError(SetupError, ValueError):
    """``--auth`` is malformed, or its file cannot be read."""


class LayoutError(SetupError, ValueError):
    """The requested workers × threads does not fit on this machine's cores."""


class ModelNotFound(SetupError, RuntimeError):
    """The model the user asked for cannot be found or loaded; the message says what to do."""


class CalibrationError(SetupError, RuntimeError):
    """No candidate kernel is allowed, available and accurate; the message says which flags to change."""


class UnsupportedModel(ChatError, ValueError):
    """This architecture is not one the lean decoder implements (the engine then uses transformers)."""


class RequestError(ChatError, ValueError):
    """One request cannot be served as sent; ``code`` is its ``workers.protocol.ErrorCode``'s value."""

    code = "invalid_request"


class InvalidInput(RequestError):
    """A message or field is bad; the message says what to change."""


class PromptTooLong(RequestError):
    """The conversation (or, dropping old turns, its newest message alone) does not fit in the
    context window; the message says by how much."""

    code = "context_length_exceeded"
