"""Constrained decoding: a grammar per sequence decides which tokens may come next.

A request that asks for JSON (``response_format``) or a tool call carries a grammar
(``SamplingParams.grammar``: llguidance's grammar text, built by the API in
``app.shaping.structured``). Its sequence gets a ``GrammarMask`` among its logits processors
(``workers.generation.processors``): before each draw the tokens the grammar forbids get a
logit of -inf (a copy: the raw logits stay for ``logprobs``), after it the grammar consumes
the token. Once the grammar is complete it allows only the end-of-turn tokens, so the reply
ends there and then, never running on in whitespace until ``max_tokens``.

llguidance (MIT, a Rust parser with Python bindings) computes a mask of the whole vocabulary
in tens of microseconds: it walks the tokenizer's trie against the grammar's lexer once per
step, instead of trying each token. Its view of the tokenizer (an ``LLTokenizer``) takes
about a second to build for a 49k vocabulary, so ``Grammars`` builds it on the first
constrained request of a worker, not at start, and compiles each distinct grammar once.

A grammar's quoted tags (``"<tool_call>"``, from ``app.shaping.tools``) are matched as text; where the
tokenizer has such a tag as one token of its own (Qwen2.5's and Qwen3's ``<tool_call>``, an
added token llguidance treats as special), ``Vocabulary.adapt`` rewrites them to that token
(``<[id]>``), the token the model was trained to write; a lexeme that held the tag becomes a
rule, since a special token cannot be part of one.

A thinking model (its tokenizer has ``<think>`` and ``</think>``) may open a thinking block
first: its first token may also be ``<think>``, and the grammar then waits for ``</think>``
before it applies, so the constraint starts after the thinking.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from workers.errors import InvalidInput

log = logging.getLogger(__name__)

COMPILED_KEPT = 32  # distinct grammars a worker keeps compiled (a client repeats its schemas)
TAGS = ("<tool_call>", "</tool_call>")  # written quoted by app.shaping.tools; a token of their own in some tokenizers


class Phase(enum.Enum):
    FIRST = "first"  # nothing generated yet: the grammar's tokens, or <think>
    THINKING = "thinking"  # inside <think>…</think>: unconstrained
    CONSTRAINED = "constrained"


@dataclass
class GrammarMask:
    """One sequence's grammar, as a logits processor (``workers.generation.processors``)."""

    matcher: object  # llguidance.LLMatcher, this sequence's own copy
    vocab: int  # tokens the grammar knows; logits past them (padding rows of the LM head) are never allowed
    think: tuple[int, int] | None  # (<think>, </think>) ids, for a thinking model
    stop_ids: tuple[int, ...]  # what ends the reply
    phase: Phase = Phase.FIRST
    bitmask: np.ndarray = field(init=False)  # [1, ceil(vocab / 32)] int32, refilled each step

    def __post_init__(self) -> None:
        self.bitmask = np.zeros((1, (self.vocab + 31) // 32), dtype=np.int32)
        if self.think is None:
            self.phase = Phase.CONSTRAINED

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the grammar allows next. A matcher in error (a token it
        refused, or the parser's limits reached) allows only the end of the reply: this
        sequence ends, logged, and the others in its batch never notice."""
        from llguidance.numpy import fill_next_token_bitmask  # not llguidance.torch: its import compiles a
        # kernel with torch.compile, seconds of importing torch's compiler that held the GIL beside the
        # worker's first requests (a 1-token step took 220-290 ms while it ran, measured on Zen 4)

        fill_next_token_bitmask(self.matcher, self.bitmask)
        if self.matcher.is_error():
            log.warning("a grammar failed mid-reply, which ends here: %s", self.matcher.get_error())
            allowed = np.zeros(self.vocab, dtype=np.bool_)
            allowed[list(self.stop_ids)] = True
            return allowed
        return np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: self.vocab].view(np.bool_)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with every token the grammar forbids at -inf, in a new tensor. In numpy,
        on this thread: torch would split a 50k-150k element op across the worker's thread
        pool, and waking it cost 10-20 ms a token on a busy machine (measured)."""
        if self.phase is Phase.THINKING:
            return logits
        scores = logits.float().numpy()
        out = np.full(scores.shape[-1], -np.inf, dtype=np.float32)
        width = min(scores.shape[-1], self.vocab)
        np.copyto(out[:width], scores[:width], where=self.allowed()[:width])
        if self.phase is Phase.FIRST:
            out[self.think[0]] = scores[self.think[0]]
        return torch.from_numpy(out)

    def advance(self, token: int) -> None:
        if self.phase is Phase.FIRST and token == self.think[0]:
            self.phase = Phase.THINKING
        elif self.phase is Phase.THINKING:
            if token == self.think[1]:
                self.phase = Phase.CONSTRAINED
        else:
            self.phase = Phase.CONSTRAINED
            self.matcher.consume_token(token)  # a refused token puts it in error: the next mask says so


@dataclass(frozen=True)
class Vocabulary:
    """What llguidance needs of the tokenizer, built once: ~0.4 s for a 49k vocabulary (Zen 4)."""

    llg: object  # llguidance.LLTokenizer
    size: int  # its tokens: the bitmask's width
    think: tuple[int, int] | None  # (<think>, </think>) ids, where the tokenizer has both
    tags: dict[str, int]  # the ``TAGS`` the tokenizer has as one token each → its id

    @classmethod
    def of(cls, tokenizer, stop_ids: tuple[int, ...]) -> Vocabulary:
        from llguidance.hf import from_tokenizer

        llg = from_tokenizer(tokenizer, eos_token=list(stop_ids))
        vocab = tokenizer.get_vocab()
        think = vocab.get("<think>"), vocab.get("</think>")
        added = {token.content: i for i, token in tokenizer.added_tokens_decoder.items()}
        return cls(llg, llg.vocab_size, think if None not in think else None,
                   {tag: added[tag] for tag in TAGS if tag in added})

    def adapt(self, grammar: str) -> str:
        """A Lark ``grammar`` with its quoted ``TAGS`` as this tokenizer's own tokens, where it
        has them (a JSON schema's grammar, JSON text, has no tags)."""
        if grammar.startswith("{") or not any(f'"{tag}"' in grammar for tag in self.tags):
            return grammar
        lines = []
        for line in grammar.splitlines():
            for tag, token in self.tags.items():
                if f'"{tag}"' in line:
                    line = line.replace(f'"{tag}"', f"<[{token}]>").replace("[lazy]:", ":")
            lines.append(line)
        return "\n".join(lines)


@dataclass
class Grammars:
    """Compiles request grammars for one tokenizer; ``mask`` gives a sequence its own matcher."""

    tokenizer: object  # a transformers fast tokenizer
    stop_ids: tuple[int, ...]  # what ends a reply: the only tokens a complete grammar allows
    _vocab: Vocabulary | None = None  # built by ``warm``, or on the first constrained request
    _compiled: OrderedDict = field(default_factory=OrderedDict)  # grammar text → a fresh matcher to copy
    _building: threading.Lock = field(default_factory=threading.Lock)

    @property
    def vocab(self) -> Vocabulary:
        with self._building:  # a request that comes while ``warm`` builds it waits for that one
            if self._vocab is None:
                self._vocab = Vocabulary.of(self.tokenizer, self.stop_ids)
            return self._vocab

    def warm(self) -> None:
        """Build the tokenizer's view and take llguidance's first mask with it (its token trie is
        built then): 0.4-0.6 s for a 49k vocabulary (Zen 4), that the first constrained request
        would otherwise wait for. Reading the tokenizer holds the GIL for ~0.25 s, so the worker
        runs this beside its model's warm-up and waits for it before it is ready
        (``workers.process.load_engine``)."""
        from llguidance import LLMatcher

        try:
            self.mask(LLMatcher.grammar_from_json_schema({"type": "object"})).allowed()
        except Exception:  # noqa: BLE001 - a tokenizer llguidance cannot read: the first request will say so
            log.warning("could not prepare constrained decoding for this tokenizer", exc_info=True)

    def _matcher(self, grammar: str):
        from llguidance import LLMatcher

        if (kept := self._compiled.get(grammar)) is not None:
            self._compiled.move_to_end(grammar)
            return kept
        matcher = LLMatcher(self.vocab.llg, self.vocab.adapt(grammar), log_level=0)
        if matcher.is_error():
            raise InvalidInput(f"The response format cannot be used: {matcher.get_error()}")
        self._compiled[grammar] = matcher
        while len(self._compiled) > COMPILED_KEPT:
            self._compiled.popitem(last=False)
        return matcher

    def check(self, grammar: str) -> None:
        """Compile ``grammar`` (kept for the sequence that follows); InvalidInput if it cannot be."""
        self._matcher(grammar)

    def mask(self, grammar: str) -> GrammarMask:
        return GrammarMask(self._matcher(grammar).deep_copy(), self.vocab.size, self.vocab.think, self.stop_ids)
