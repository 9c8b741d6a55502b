"""Token generation for one worker: sequences over a loaded decoder, no I/O.

    begin(prompt)      ─▶ a sequence whose prompt still has to be prefilled
    prefill(seq, n)    ─▶ prefill up to n more prompt tokens (only those the conversation
                          cache lacks); after the last chunk, sample the first token
    step([seqs])       ─▶ one batched decode step for every prefilled live sequence
    step([seqs], seq, n) ─▶ the same, with seq's next n prompt tokens in the same call
                          (decoders that declare ``fuses_chunks``)
    finish(seq)        ─▶ keep its cache for the next turn, report its metrics

``start`` is ``begin`` plus a whole prefill. ``prefill`` and ``step`` take a ``decoder``:
one of its decoder's ``halves``, where it declares them, so that a prompt prefills on
half the threads while the others decode on the other half. The worker's scheduler
(``workers.scheduler``) admits requests with ``begin``, prefills a long prompt apart or in
chunks with the decode steps (so it never freezes the other replies in the batch), steps
all prefilled sequences together (several users share one pass over the weights) and ends
one with ``finish`` on a stop token, the budget, or a Cancel — so a Stop takes effect
within one decode step (a prompt apart: within one of its calls). The engine knows nothing
about pipes or requests, and its decoder only through ``workers.decoders.base``.

Every token goes the same way (``_take``): the decoder's logits → the sequence's processors
(``workers.generation.processors``) → the draw (``workers.generation.sampling``) → stop
tokens, the budget, stop strings → UTF-8-safe text (``workers.generation.detokenize``).

A conversation's KV cache is kept after each turn, and a later prompt in the same scope
prefills only the token ids that do not share a prefix with a kept one; every sequence's
KV memory is committed against the worker's budget (``workers.generation.conversations``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from workers.decoders.base import Decoder, KVCache
from workers.generation.conversations import Conversations
from workers.generation.detokenize import IncrementalDetokenizer, StopStrings, TokenBytes
from workers.generation.grammar import Grammars
from workers.generation.processors import LogitsProcessor, process, processors_for
from workers.generation.prompt import Prompt, build_prompt, raw_prompt, whole_prompt
from workers.generation.reproducible import Cuts, reproducible
from workers.errors import InvalidInput
from workers.protocol import ChatMessage, EngineConfig, FinishReason, Metrics, SamplingParams, TokenLogprob
from workers.generation.sampling import logprobs, sample
from workers.generation.speculation import Draft, Speculation


@dataclass(frozen=True)
class Step:
    """One generated token and the text it made safe to show (``""`` while mid-character)."""

    text: str


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    metrics: Metrics
    tail_text: str = ""  # text held back until the end (an incomplete character)
    stop_sequence: str | None = None  # the client's stop string that ended the reply (not in its text)


@dataclass
class Sequence:
    """One request being generated: its cache, sampled tokens, text state and timings."""

    prompt_ids: list[int]
    prompt_spans: tuple[tuple[int, int], ...]  # where its messages' contents lie (``Prompt.spans``)
    params: SamplingParams
    scope: str  # whose conversation (workers.generation.conversations)
    session_id: str | None
    budget: int  # most new tokens (Engine._budget)
    kv_bytes: int  # KV memory committed for the prompt and the whole budget (0 once released)
    detok: IncrementalDetokenizer
    stop_strings: StopStrings
    processors: tuple[LogitsProcessor, ...]  # between its logits and the draw
    generator: torch.Generator | None
    key: str = ""  # the caller's name for it (the worker uses the request id)
    cache: KVCache | None = None
    cached: int = 0  # prompt tokens whose KV came from the conversation cache
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    generated: list[int] = field(default_factory=list)  # the last one is sampled, not yet fed
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked for: until their text is sent
    draft: Draft | None = None  # its prompt-lookup state, once it drafts (workers.generation.speculation)
    reason: FinishReason | None = None  # set once it must not be stepped again
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    drawn: int = 0  # tokens sampled, a stop token included: the steps between first_token_at and last_token_at


@dataclass
class Engine:
    """Generation over a ``Decoder`` (``workers.decoders.base``): the lean decoder, the
    onnxruntime graph, or transformers for other architectures."""

    decoder: Decoder
    tokenizer: object
    stop_ids: set[int]
    config: EngineConfig
    worker: int = -1  # named in each reply's metrics

    def __post_init__(self) -> None:
        self.cuts = Cuts()  # how prompts are cut into calls, and what of a turn is kept
        if self.config.reproducible:  # replies that do not depend on the load (workers.generation.reproducible)
            self.decoder, self.cuts = reproducible(self.decoder)
        self.context_tokens = min(self.decoder.max_seq_len, self.config.max_context_tokens)
        self.conversations = Conversations(self.decoder.new_cache, self.decoder.kv_bytes_per_token,
                                           self.config.kv_cache_bytes, self.cuts.reusable)
        self.token_bytes = TokenBytes(self.tokenizer)
        self.vocab_size = len(self.tokenizer)
        self.grammars = Grammars(self.tokenizer, tuple(sorted(self.stop_ids)))
        self.speculation = Speculation(self.config.speculation == "auto" and not self.config.reproducible
                                       and self.decoder.scores_positions)

    def check(self, params: SamplingParams) -> None:
        """Refuse what only this model can tell is wrong: a ``logit_bias`` token id outside its
        vocabulary, a grammar its tokenizer cannot follow (the API checks everything else, the
        grammar's syntax too, before a worker sees the request)."""
        if outside := sorted(i for i, _ in params.logit_bias if not 0 <= i < self.vocab_size):
            raise InvalidInput(f"logit_bias names token id {outside[0]}, outside this model's vocabulary "
                               f"(ids 0 to {self.vocab_size - 1}) (field 'logit_bias').")
        if params.grammar:
            self.grammars.check(params.grammar)

    # prompt --------------------------------------------------------------------------

    def prompt(self, messages: list[ChatMessage], max_new_tokens: int, enable_thinking: bool | None = None,
               raw: bool = False) -> Prompt:
        """The whole conversation with room for the reply (else ``PromptTooLong``): its
        ``max_new_tokens``, at least one token and at most a quarter of the window (a short window
        must still take a prompt; the reply is cut at the window). ``context_overflow``
        "drop-oldest": fitted by dropping old turns instead. ``raw``: the text, no template."""
        room = max(min(max_new_tokens, self.context_tokens // 4), 1)
        if raw:
            return raw_prompt(self.tokenizer, messages[-1].content, self.context_tokens, room)
        if self.config.context_overflow == "error":
            return whole_prompt(self.tokenizer, messages, self.context_tokens, room, enable_thinking)
        return build_prompt(self.tokenizer, messages, self.context_tokens - room, enable_thinking)

    # memory ---------------------------------------------------------------------------

    def _budget(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Most new tokens: ``max_new_tokens``, capped by what the context window leaves."""
        return max(0, min(params.max_new_tokens, self.context_tokens - len(prompt_ids)))

    def kv_need(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Bytes of KV cache a request commits: its prompt and its whole reply budget."""
        return self.conversations.bytes_for(len(prompt_ids) + self._budget(prompt_ids, params))

    def fits(self, need: int) -> bool:
        """Whether a request needing ``need`` bytes can start now (kept caches make way)."""
        return self.conversations.room_for(need)

    # generation ----------------------------------------------------------------------

    def start(self, prompt: Prompt, params: SamplingParams, scope: str = "", session_id: str | None = None,
              key: str = "") -> tuple[Sequence, Step | None]:
        """Prefill (only what the conversation cache lacks) and sample the first token."""
        seq = self.begin(prompt, params, scope, session_id, key)
        return seq, self.prefill(seq)

    def begin(self, prompt: Prompt, params: SamplingParams, scope: str = "", session_id: str | None = None,
              key: str = "") -> Sequence:
        """A sequence for this prompt, holding its scope's longest cached prefix (in whole turns);
        nothing computed yet. Its KV memory is committed now (check ``fits`` first to stay within
        the budget)."""
        prompt_ids = prompt.ids
        budget = self._budget(prompt_ids, params)
        seq = Sequence(
            key=key,
            prompt_ids=list(prompt_ids),
            prompt_spans=prompt.spans,
            params=params,
            scope=scope,
            session_id=session_id,
            budget=budget,
            kv_bytes=self.kv_need(prompt_ids, params),
            detok=IncrementalDetokenizer(self.tokenizer),
            stop_strings=StopStrings(params.stop),
            processors=processors_for(params, prompt_ids, self.config.repetition_window, self.grammars),
            generator=torch.Generator().manual_seed(params.seed) if params.seed is not None else None,
        )
        self.conversations.commit(seq.kv_bytes)
        try:
            seq.cache, seq.cached = self.conversations.lookup(scope, session_id, seq.prompt_ids,
                                                              len(prompt_ids) + budget, prompt.spans)
            if seq.budget > 0:
                seq.cache.reserve(len(prompt_ids) + budget)  # now, never by copying between prefill chunks or steps
        except BaseException:  # e.g. out of memory: nothing of it stays committed
            self.conversations.release(seq.kv_bytes)
            raise
        if seq.budget == 0:
            seq.reason = FinishReason.LENGTH
        else:
            seq.pending = list(prompt_ids[seq.cached :])
        return seq

    def seat(self, seqs: list[Sequence], newcomer: Sequence) -> None:
        """Before ``newcomer``'s prompt prefills beside the decoding ``seqs`` (``Decoder.seat``)."""
        self.decoder.seat([s.cache for s in seqs], newcomer.cache)

    @torch.no_grad()
    def prefill(self, seq: Sequence, max_tokens: int | None = None, decoder: Decoder | None = None) -> Step | None:
        """Prefill up to ``max_tokens`` (default: all, in as many calls as ``Cuts`` makes) of the
        prompt, on ``decoder`` (default: the engine's; e.g. one of ``Decoder.halves``); once it is all
        in the cache, sample the first token and return its step."""
        if not seq.pending:
            return None
        while True:
            chunk = torch.tensor(self._next_chunk(seq, max_tokens))
            logits = (decoder or self.decoder).forward(chunk, seq.cache, logits=not seq.pending)  # [V]
            if not seq.pending or max_tokens is not None:
                return None if seq.pending else self._take(seq, logits)

    @torch.no_grad()
    def step(self, seqs: list[Sequence], chunk_of: Sequence | None = None,
             chunk_tokens: int | None = None, decoder: Decoder | None = None) -> list[tuple[Sequence, Step]]:
        """One decode step for every unfinished, prefilled sequence, batched (on ``decoder``,
        default: the engine's); the new tokens' steps.

        With ``chunk_of`` (a sequence still prefilling; only where the decoder declares
        ``fuses_chunks``), up to ``chunk_tokens`` more of its prompt go into the same call, and
        once its prompt is all in, its first token's step comes with the others'."""
        decoder = decoder or self.decoder
        live = [s for s in seqs if s.reason is None and not s.pending]
        if not live:
            first = self.prefill(chunk_of, chunk_tokens, decoder) if chunk_of is not None else None
            return [(chunk_of, first)] if first is not None else []
        where = (id(decoder), len(live))  # what a call's time depends on (workers.generation.speculation.Costs)
        if chunk_of is None and (plan := self.speculation.plan(live, self._room, where)) is not None:
            return self._verify(decoder, live, *plan, where)
        tokens = torch.tensor([s.generated[-1] for s in live])  # [B]
        caches = [s.cache for s in live]
        started = time.perf_counter()
        if chunk_of is None:
            logits, last = decoder.forward_batch(tokens, caches), None  # [B, V]
            self.speculation.record(where, 0, time.perf_counter() - started)
        else:
            chunk = torch.tensor(self._next_chunk(chunk_of, chunk_tokens))
            logits, last = decoder.forward_mixed(tokens, caches, chunk, chunk_of.cache, logits=not chunk_of.pending)
        steps = []
        for seq, row in [*zip(live, logits, strict=True), *([(chunk_of, last)] if last is not None else [])]:
            step = self._take(seq, row)
            if step is not None:
                steps.append((seq, step))
        return steps

    def _verify(self, decoder: Decoder, live: list[Sequence], seq: Sequence, draft: list[int],
                where: tuple) -> list[tuple[Sequence, Step]]:
        """A decode step for ``live`` in which ``seq`` also scores its ``draft``: its tokens are
        drawn position by position as plain steps would draw them, up to the first that differs
        from the draft (then one more: the model's own); its cache keeps what was accepted.
        Its text goes out as one step, so its log-probabilities go with it."""
        others = [s for s in live if s is not seq]
        length = seq.cache.length
        started = time.perf_counter()
        logits, scored = decoder.forward_verify(torch.tensor([s.generated[-1] for s in others], dtype=torch.long),
                                                [s.cache for s in others],
                                                torch.tensor([seq.generated[-1], *draft]), seq.cache)
        self.speculation.record(where, len(draft), time.perf_counter() - started)
        steps = [(s, step) for s, row in zip(others, logits, strict=True) if (step := self._take(s, row)) is not None]
        texts, accepted = [], 0
        for i, row in enumerate(scored):
            count = len(seq.generated)
            step = self._take(seq, row)
            texts.append(step.text if step is not None else "")
            hit = i < len(draft) and len(seq.generated) > count and seq.generated[-1] == draft[i]
            accepted += hit
            if not hit or seq.reason is not None:
                break
        seq.cache.truncate(length + 1 + accepted)  # the token fed, and the drafts accepted
        self.speculation.verified(seq, len(draft), accepted)
        return steps + [(seq, Step("".join(texts)))]

    @staticmethod
    def _room(seq: Sequence) -> int:
        """The most tokens ``seq`` may draft: each accepted one, and the one after, are new tokens."""
        return seq.budget - len(seq.generated) - 1

    def _next_chunk(self, seq: Sequence, max_tokens: int | None) -> list[int]:
        """Take the next ``max_tokens`` (default: all) prompt tokens still to prefill, or where
        prompts are cut at fixed places, the rest of the block (``Cuts.chunk``)."""
        wanted = len(seq.pending) if max_tokens is None else max_tokens
        n = self.cuts.chunk(seq.cache.length, wanted, len(seq.pending))
        chunk, seq.pending = seq.pending[:n], seq.pending[n:]
        return chunk

    def _take(self, seq: Sequence, logits: torch.Tensor) -> Step | None:
        """Choose the next token from the sequence's ``logits`` [V] and record it: a stop token
        ends the sequence, others add text (and, when asked for, their log-probabilities,
        from the raw logits)."""
        token = sample(process(seq.processors, logits), seq.params, seq.generator)
        for processor in seq.processors:
            processor.advance(token)
        now = time.perf_counter()
        seq.first_token_at = seq.first_token_at or now
        seq.last_token_at = now
        seq.drawn += 1
        if token in self.stop_ids:
            seq.reason = FinishReason.STOP
            return None
        seq.generated.append(token)
        if seq.params.logprobs is not None:
            logp, top = logprobs(logits, token, seq.params.logprobs)
            seq.unsent_logprobs.append(self._logprob(token, logp, tuple(self._logprob(i, p) for i, p in top)))
        if len(seq.generated) >= seq.budget:
            seq.reason = FinishReason.LENGTH
        text, stopped = seq.stop_strings.push(seq.detok.push(token))
        if stopped:
            seq.reason = FinishReason.STOP
        return Step(text)

    def _logprob(self, token: int, logprob: float, top: tuple[TokenLogprob, ...] = ()) -> TokenLogprob:
        """A token as ``logprobs`` report it: its own text, and its own bytes (``TokenBytes``)."""
        return TokenLogprob(self.tokenizer.decode([token]), logprob, top, self.token_bytes(token))

    def abandon(self, seq: Sequence) -> None:
        """Drop a sequence that failed: release its KV memory, keep nothing of it."""
        self.conversations.release(seq.kv_bytes)
        seq.kv_bytes, seq.cache, seq.reason = 0, None, seq.reason or FinishReason.CANCELLED

    def finish(self, seq: Sequence, reason: FinishReason | None = None) -> Finished:
        """End a sequence (``reason`` overrides, e.g. CANCELLED): release its memory, keep its
        cache for the conversation's next turn, report metrics."""
        reason = reason or seq.reason or FinishReason.CANCELLED
        seq.reason = reason
        self.conversations.release(seq.kv_bytes)
        seq.kv_bytes = 0  # released once, whatever happens next
        in_cache = (seq.prompt_ids + seq.generated)[: self.cuts.kept(len(seq.prompt_ids), seq.cache.length)]
        reply = ((len(seq.prompt_ids), len(in_cache)),)  # reusable whole or not at all, like a message
        self.conversations.keep(seq.scope, seq.session_id, in_cache, seq.cache,  # a stopped turn's is useful too
                                seq.prompt_spans + reply)
        n = len(seq.generated)
        decode_s = seq.last_token_at - seq.first_token_at  # over drawn - 1 steps: a stop token's counts
        metrics = Metrics(
            worker=self.worker,
            prompt_tokens=len(seq.prompt_ids),
            cached_prompt_tokens=seq.cached,
            completion_tokens=n,
            ttft_ms=(seq.first_token_at - seq.started) * 1000 if seq.first_token_at else 0.0,
            decode_tokens_per_s=(seq.drawn - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            drafted_tokens=seq.draft.drafted if seq.draft else 0,
            accepted_tokens=seq.draft.accepted if seq.draft else 0,
        )
        tail, _ = seq.stop_strings.push(seq.detok.flush())
        return Finished(reason, metrics, tail + seq.stop_strings.flush(), seq.stop_strings.matched)
