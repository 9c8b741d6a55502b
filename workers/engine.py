"""Token generation for one worker: sequences over a loaded decoder, no I/O.

    begin(prompt)      ─▶ a sequence whose prompt still has to be prefilled
    prefill(seq, n)    ─▶ prefill up to n more prompt tokens (only those the conversation
                          cache lacks); after the last chunk, sample the first token
    step([seqs])       ─▶ one batched decode step for every prefilled live sequence
    finish(seq)        ─▶ keep its cache for the next turn, report its metrics

``start`` is ``begin`` plus a whole prefill. The worker loop admits requests with
``begin``, prefills a long prompt in chunks between decode steps (so it never freezes the
other replies in the batch), steps all prefilled sequences together (several users share
one pass over the weights) and ends one with ``finish`` on a stop token, the budget, or a
Cancel — so a Stop takes effect within one decode step. The engine knows nothing about
pipes or requests; the prompt is ``workers.prompt``'s, the draw ``workers.sampling``'s.

A conversation's KV cache is kept after each turn (keyed by session id, least recently
used evicted past a memory budget), and the next turn prefills only the token ids that
do not share a prefix with the cached ones. Prefixes are matched on token ids, never on
re-tokenized text.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from workers.detokenize import IncrementalDetokenizer, StopStrings
from workers.prompt import Prompt, build_prompt
from workers.protocol import ChatMessage, EngineConfig, FinishReason, Metrics, SamplingParams
from workers.sampling import sample


@dataclass(frozen=True)
class Step:
    """One generated token and the text it made safe to show (``""`` while mid-character)."""

    text: str


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    metrics: Metrics
    tail_text: str = ""  # text held back until the end (an incomplete character)


@dataclass
class Sequence:
    """One request being generated: its cache, sampled tokens, text state and timings."""

    prompt_ids: list[int]
    params: SamplingParams
    session_id: str | None
    budget: int  # most new tokens: max_new_tokens, capped by the context window
    detok: IncrementalDetokenizer
    stop_strings: StopStrings
    history: torch.Tensor  # [<= repetition_window] recent ids, for repetition_penalty
    generator: torch.Generator | None
    key: str = ""  # the caller's name for it (the worker uses the request id)
    cache: object = None
    cached: int = 0  # prompt tokens whose KV came from the conversation cache
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    generated: list[int] = field(default_factory=list)  # the last one is sampled, not yet fed
    reason: FinishReason | None = None  # set once it must not be stepped again
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    last_token_at: float = 0.0


@dataclass
class _Session:
    ids: list[int]  # token ids whose keys/values are in ``cache``
    cache: object  # the decoder's cache: has .length, .truncate(n), .nbytes


@dataclass
class Engine:
    """Generation over a decoder: anything with ``new_cache()`` and ``forward(ids [S], cache) -> [V]``
    (``workers.model.Transformer``, or ``workers.hf_decoder.HFDecoder`` for other architectures)."""

    decoder: object
    tokenizer: object
    stop_ids: set[int]
    config: EngineConfig
    worker: int = -1  # named in each reply's metrics

    def __post_init__(self) -> None:
        self.context_tokens = min(self.decoder.max_seq_len, self.config.max_context_tokens)
        self._sessions: OrderedDict[str, _Session] = OrderedDict()

    # prompt --------------------------------------------------------------------------

    def prompt(self, messages: list[ChatMessage], max_new_tokens: int, enable_thinking: bool | None = None) -> Prompt:
        """The prompt, fitted to leave room for the reply: ``max_new_tokens``, but at most a
        quarter of the window (so a long history still fits) and at least one token."""
        room = min(max_new_tokens, self.context_tokens // 4)
        return build_prompt(self.tokenizer, messages, self.context_tokens - max(room, 1), enable_thinking)

    # conversation caches --------------------------------------------------------------

    def _session_cache(self, session_id: str | None, prompt_ids: list[int]):
        """A cache holding the longest cached prefix of ``prompt_ids``, and that prefix's length."""
        session = self._sessions.pop(session_id, None) if session_id else None
        if session is None:
            return self.decoder.new_cache(), 0
        common = 0
        for a, b in zip(session.ids, prompt_ids, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt_ids) - 1)  # at least one token to prefill for logits
        session.cache.truncate(common)
        return session.cache, common

    def _keep_session(self, session_id: str | None, ids: list[int], cache) -> None:
        """Keep this conversation's cache; evict least recently used ones past the memory budget."""
        if not session_id:
            return
        self._sessions[session_id] = _Session(ids=ids, cache=cache)
        budget = self.config.session_cache_bytes
        while len(self._sessions) > 1 and sum(s.cache.nbytes for s in self._sessions.values()) > budget:
            self._sessions.popitem(last=False)

    # generation ----------------------------------------------------------------------

    def start(self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None,
              key: str = "") -> tuple[Sequence, Step | None]:
        """Prefill (only what the conversation cache lacks) and sample the first token."""
        seq = self.begin(prompt_ids, params, session_id, key)
        return seq, self.prefill(seq)

    def begin(self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None,
              key: str = "") -> Sequence:
        """A sequence for this prompt, holding the conversation's cache; nothing computed yet."""
        seq = Sequence(
            key=key,
            prompt_ids=list(prompt_ids),
            params=params,
            session_id=session_id,
            budget=max(0, min(params.max_new_tokens, self.context_tokens - len(prompt_ids))),
            detok=IncrementalDetokenizer(self.tokenizer),
            stop_strings=StopStrings(params.stop),
            history=torch.tensor(prompt_ids[-self.config.repetition_window :], dtype=torch.long),
            generator=torch.Generator().manual_seed(params.seed) if params.seed is not None else None,
        )
        seq.cache, seq.cached = self._session_cache(session_id, prompt_ids)
        if seq.budget == 0:
            seq.reason = FinishReason.LENGTH
        else:
            seq.pending = list(prompt_ids[seq.cached :])
            seq.cache.reserve(len(prompt_ids))  # now, not by doubling between prefill chunks
        return seq

    @torch.no_grad()
    def prefill(self, seq: Sequence, max_tokens: int | None = None) -> Step | None:
        """Prefill up to ``max_tokens`` (default: all) of the prompt; once it is all in the
        cache, sample the first token and return its step."""
        if not seq.pending:
            return None
        n = len(seq.pending) if max_tokens is None else max(1, max_tokens)
        chunk, seq.pending = seq.pending[:n], seq.pending[n:]
        logits = self.decoder.forward(torch.tensor(chunk), seq.cache, logits=not seq.pending)  # [V]
        if seq.pending:
            return None
        return self._take(seq, sample(logits, seq.params, seq.history, seq.generator))

    @torch.no_grad()
    def step(self, seqs: list[Sequence]) -> list[tuple[Sequence, Step]]:
        """One decode step for every unfinished, prefilled sequence, batched; the new tokens' steps."""
        live = [s for s in seqs if s.reason is None and not s.pending]
        if not live:
            return []
        tokens = torch.tensor([s.generated[-1] for s in live])  # [B]
        logits = self.decoder.forward_batch(tokens, [s.cache for s in live])  # [B, V]
        steps = []
        for seq, row in zip(live, logits, strict=True):
            step = self._take(seq, sample(row, seq.params, seq.history, seq.generator))
            if step is not None:
                steps.append((seq, step))
        return steps

    def _take(self, seq: Sequence, token: int) -> Step | None:
        """Record a sampled token: a stop token ends the sequence, others add text."""
        now = time.perf_counter()
        seq.first_token_at = seq.first_token_at or now
        seq.last_token_at = now
        if token in self.stop_ids:
            seq.reason = FinishReason.STOP
            return None
        seq.generated.append(token)
        seq.history = torch.cat([seq.history[1 - self.config.repetition_window :], torch.tensor([token])])
        if len(seq.generated) >= seq.budget:
            seq.reason = FinishReason.LENGTH
        text, stopped = seq.stop_strings.push(seq.detok.push(token))
        if stopped:
            seq.reason = FinishReason.STOP
        return Step(text)

    def finish(self, seq: Sequence, reason: FinishReason | None = None) -> Finished:
        """End a sequence (``reason`` overrides, e.g. CANCELLED): keep its cache, report metrics."""
        reason = reason or seq.reason or FinishReason.CANCELLED
        seq.reason = reason
        in_cache = (seq.prompt_ids + seq.generated)[: seq.cache.length]
        self._keep_session(seq.session_id, in_cache, seq.cache)  # a stopped turn's cache is still useful
        n = len(seq.generated)
        decode_s = seq.last_token_at - seq.first_token_at
        metrics = Metrics(
            worker=self.worker,
            prompt_tokens=len(seq.prompt_ids),
            cached_prompt_tokens=seq.cached,
            completion_tokens=n,
            ttft_ms=(seq.first_token_at - seq.started) * 1000 if seq.first_token_at else 0.0,
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        )
        tail, _ = seq.stop_strings.push(seq.detok.flush())
        return Finished(reason, metrics, tail + seq.stop_strings.flush())
