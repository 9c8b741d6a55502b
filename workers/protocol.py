"""Every message that crosses a worker pipe, and the settings a worker starts with, in one place.

The dispatcher and the worker speak only in these frozen dataclasses; each carries the
``request_id`` it belongs to, so one request's tokens can only ever reach that request's
own channel. ``multiprocess`` pickles them with dill, so they need no hand-written codec.

    dispatcher ──Generate/Cancel/Shutdown──▶ worker
    dispatcher ◀──Ready/Chunk/Done/Failed/Heartbeat─── worker
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a generation ended; the values are the OpenAI API's words where it has one."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"  # failures travel as ``Failed`` messages, not as a finish reason


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` means greedy.

    The defaults here change nothing (plain sampling from the model's distribution); the
    app's own defaults live in configs/default.toml ``[sampling]``.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the reply ends before the first of these strings
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest alternatives
    enable_thinking: bool | None = None  # the chat template's switch (Qwen3); None: the template's default
    min_p: float = 0.0  # keep tokens at least this fraction as likely as the likeliest; 0: off
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    raw_prompt: bool = False  # the one message's text is the prompt, no chat template (legacy completions)
    grammar: str = ""  # what the reply must match (llguidance's grammar text: app.shaping.structured); "": anything

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class EngineConfig:
    """How a worker's engine generates; given to each worker when it starts."""

    max_context_tokens: int  # cap on the model's own window, to bound CPU memory (from the app's config)
    kv_cache_bytes: int = 1024 * 2**20  # KV memory of live replies and kept conversations (workers.generation.conversations)
    # how many recent ids (prompt and reply) repetition_penalty looks at: llama.cpp's and Ollama's
    # ``repeat_last_n``. Short loops fall inside it; the text a reply quotes or edits mostly lies
    # further back, so the penalty does not push a grounded reply off it (a 256-token window did:
    # benchmarks/results/avx512-bf16/speculation.md)
    repetition_window: int = 64
    speculation: str = "auto"  # "auto": prompt-lookup drafts where they pay; "off" (workers.generation.speculation)
    reproducible: bool = False  # replies that do not depend on the load (workers.generation.reproducible)
    # a conversation past the window: "error" (refused, with its numbers); "drop-oldest": its
    # oldest turns left out, and the reply told so (workers.generation.prompt)
    context_overflow: str = "error"


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


# --- dispatcher -> worker -------------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    request_id: str
    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    scope: str = ""  # whose conversation: kept caches are matched within one scope only
    session_id: str | None = None  # a hint within the scope, never a key across scopes


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    """Ask the worker to exit after the current step."""


# --- worker -> dispatcher -------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    pid: int
    cores: tuple[int, ...]
    threads: int
    dtype: str
    load_s: float
    kernels: str = ""  # which linear kernels it runs (chosen by measurement in the parent)
    private_weight_bytes: int = 0  # packed weights it holds privately (kernels that cannot read the shared map)


@dataclass(frozen=True)
class Notice:
    """Something the user should be told about this request, e.g. that old turns were dropped."""

    request_id: str
    text: str


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token as text, its log-probability under the model, its own bytes (a
    byte-fallback token's are part of a character, which its text cannot show), and the
    likeliest alternatives at its position (``SamplingParams.logprobs`` of them, each with
    no ``top`` of its own)."""

    token: str
    logprob: float
    top: tuple[TokenLogprob, ...] = ()
    raw: bytes = b""


@dataclass(frozen=True)
class Chunk:
    request_id: str
    text: str
    tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens this text came from, when asked for


@dataclass(frozen=True)
class Metrics:
    worker: int
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    drafted_tokens: int = 0  # prompt-lookup speculation: tokens drafted and verified
    accepted_tokens: int = 0  # ... and accepted (each is a step saved)


@dataclass(frozen=True)
class Done:
    request_id: str
    finish_reason: FinishReason
    metrics: Metrics = field(default_factory=lambda: Metrics(worker=-1))
    stop_sequence: str | None = None  # the client's stop string that ended the reply (its text never shows it)


class ErrorCode(str, enum.Enum):
    """What kind of failure, so the API can pick a status code (400, 503, 500)."""

    INVALID_REQUEST = "invalid_request"  # the user can fix it (e.g. a bad setting)
    CONTEXT_LENGTH = "context_length_exceeded"  # the conversation does not fit the window: OpenAI's code for it
    BUSY = "busy"  # every worker busy and the queue full: try again in a minute
    TOO_MANY = "too_many"  # this caller already has caller_queue requests waiting (API: 429)
    UNAVAILABLE = "unavailable"  # try again (worker crashed and restarts, server stopping)
    INTERNAL = "internal"  # a bug: logged with its traceback


@dataclass(frozen=True)
class Failed:
    """The request could not be served; ``message`` is shown to the user as is."""

    request_id: str
    message: str
    code: ErrorCode = ErrorCode.INTERNAL


ToWorker = Generate | Cancel | Shutdown
@dataclass(frozen=True)
class Heartbeat:
    """The worker's serve loop is alive: sent between steps when it has sent nothing else for
    a while, so the pool can tell a stopped worker (SIGSTOP, a deadlock) from a busy one."""


FromWorker = Ready | Notice | Chunk | Done | Failed | Heartbeat
