"""A sequence's KV cache on the onnxruntime graph (``OrtCache``) and the array the sequences
decoding together share (``Arena``), apart from the decoder that runs them.

Why numpy arrays of our own and not onnxruntime-genai's cache: they are bound in place with
``IOBinding`` (``workers.decoders.ort.decoder``), so a conversation's next turn grows its cache
and reuses it, another conversation copies a shared prefix, and the replies decoding together
sit in the slots of one array, moved once when the batch changes. The memory is counted by
what each cache wrote (``OrtCache.touched``) and given back slot by slot (``forget``), so the
KV budget (``workers.generation.conversations``) sees the real bytes.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import weakref
from typing import Protocol

import numpy as np


class Memory(Protocol):
    """What a cache asks of its decoder (``OrtDecoder``): KV arrays, and how long one may grow.
    Declared here so that this module does not import the decoder, which imports it."""

    max_seq_len: int

    def empty_kv(self, slots: int, capacity: int) -> np.ndarray: ...

    def own_kv(self, capacity: int) -> np.ndarray: ...

MADV_DONTNEED = 4  # Linux: the pages of a private anonymous map are freed, and read as zeros if touched again
_madvise = ctypes.CDLL(None, use_errno=True).madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def forget(kv: np.ndarray) -> None:
    """Give back the memory of a slot no cache lives in any more (``kv``: the slot's view,
    [2, layers, 1, kv heads, capacity, head size] of an array from ``OrtDecoder.empty_kv``).

    Why: the KV budget counts what each cache holds (``resident_tokens``), and an array's pages
    stay resident as long as the array lives, whoever wrote them. An arena lives on while its
    batch decodes, so a kept conversation moved out of a slot (``Arena.take``), one evicted
    from the budget while it sat in one, or a newcomer's prefix moved into one, left pages
    there that no cache counted: on the bundled model, a 30-token reply seated in the slot of a
    700-token conversation held 1,567 tokens' worth where the caches held 865. Each layer's
    keys (and values) of one slot are one contiguous block; the pages wholly inside it are freed."""
    page = mmap.PAGESIZE
    for block in (kv[i, layer] for i in range(kv.shape[0]) for layer in range(kv.shape[1])):  # contiguous
        start = -(-block.ctypes.data // page) * page
        end = (block.ctypes.data + block.nbytes) // page * page
        if end > start:
            _madvise(start, end - start, MADV_DONTNEED)


class OrtCache:
    """One sequence: the token ids it holds and their keys and values, ``kv`` of shape
    [2, layers, 1, kv heads, capacity, head size], in the decoder's KV dtype (float32 as the
    builder writes the graph; int8 in the graph retyped for it: ``workers.decoders.ort.kv``). ``kv`` is
    slot 0 of the cache's own array (``room``: two slots, the other for a newcomer to be seated
    beside it, ``OrtDecoder.seat``), or its slot in an ``Arena`` while it decodes in a batch.
    Pages past ``length`` are never touched (``OrtDecoder.empty_kv``), nor is an empty slot."""

    def __init__(self, decoder: Memory, capacity: int = 256) -> None:
        self.decoder = decoder
        self.ids: list[int] = []
        self.room: np.ndarray | None = decoder.own_kv(capacity)
        self.kv = self.room[:, :, 0:1]
        self.arena: Arena | None = None
        self.slot = 0
        self.touched = 0  # the most tokens ever written into ``kv`` (its pages are resident)
        self.held = False  # being written by a thread of its own (workers.scheduler.prefill.PromptApart): never moved

    def __del__(self) -> None:
        if self.arena is not None and not self.held and sys.meta_path is not None:  # a slot of an array that
            # may outlive it (not at the interpreter's exit, when numpy's ``ctypes`` can no longer be imported)
            forget(self.kv)

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    @property
    def resident_tokens(self) -> int:
        """Tokens' worth of memory it holds: the pages written, also past a truncated ``length``."""
        return self.touched

    def reserve(self, total: int) -> None:
        if total > self.capacity:
            self.move_to(self.decoder.own_kv(max(total, min(2 * self.capacity, self.decoder.max_seq_len))), 0)

    def truncate(self, length: int) -> None:
        """Forget everything after ``length`` tokens (the attention mask stops there)."""
        del self.ids[length:]

    def copy_prefix(self, length: int, capacity: int = 0) -> OrtCache:
        """A new cache holding the first ``length`` tokens of this one (this one is unchanged)."""
        copy = OrtCache(self.decoder, max(length, capacity, 1))
        copy.kv[..., :length, :] = self.kv[..., :length, :]
        copy.ids = self.ids[:length]
        copy.touched = length
        return copy

    def move_to(self, kv: np.ndarray, slot: int, arena: Arena | None = None) -> None:
        """Copy what is cached into ``kv``'s ``slot`` and live there from now on (``kv``: an
        arena's, or, without ``arena``, a room of its own: ``OrtDecoder.own_kv``)."""
        dest = kv[:, :, slot : slot + 1]
        if dest.ctypes.data != self.kv.ctypes.data:
            dest[..., : self.length, :] = self.kv[..., : self.length, :]
            forget(self.kv)  # the slot it leaves may live on, in an arena or another cache's room
            self.touched = self.length  # what it holds in its new place
        self.kv, self.arena, self.slot = dest, arena, slot
        self.room = kv if arena is None else None


class Arena:
    """The caches of the sequences decoding together, one slot each in one array, so that a
    step for all of them is one call: ``kv`` [2, layers, slots, kv heads, capacity, head size].

    When the batch moves to a new arena, the caches it leaves behind (kept conversations, a
    reply that ended) stay in their slots of this one, which lives on while any of them does:
    moving them out, each into an array of its own, is a copy into fresh pages on the batch's
    thread. On Zen 4 (Qwen1.5-0.5B shape, int8 cache) seating a prompt beside a reply took
    44 ms that way against 8 ms now, and that reply's longest gap was 4.8x its pace against
    3.5x (``benchmarks/results/avx512-bf16/seat.md``). Staying costs no memory the KV budget
    misses: a cache's pages are counted where they are (``OrtCache.touched``), and every slot
    a cache leaves is given back (``forget``); what is left is the pages at the edges of its
    blocks that it shares with an empty neighbour, a few per layer."""

    def __init__(self, decoder: Memory, caches: list[OrtCache], kv: np.ndarray | None = None) -> None:
        """``kv``: the array to use (the first cache's room, where it is already in slot 0),
        else a new one with a slot to spare for a newcomer (``OrtDecoder.seat``)."""
        self.kv = decoder.empty_kv(len(caches) + 1, max(c.capacity for c in caches)) if kv is None else kv
        self.members = [weakref.ref(c) for c in caches]  # a cache dropped meanwhile need not move out
        for slot, cache in enumerate(caches):
            cache.move_to(self.kv, slot, self)

    def take(self, newcomer: OrtCache, slot: int) -> None:
        """Seat ``newcomer`` in ``slot``, moving out whoever sat there (a kept conversation)."""
        for cache in (ref() for ref in self.members):
            if cache is not None and cache is not newcomer and cache.arena is self and cache.slot == slot:
                cache.move_to(cache.decoder.own_kv(cache.capacity), 0)
        if newcomer.arena is not self or newcomer.slot != slot:
            newcomer.move_to(self.kv, slot, self)
            self.members.append(weakref.ref(newcomer))

    def swap(self, a: OrtCache, b: OrtCache) -> None:
        """Exchange the slots of two of its caches (nothing where they are one)."""
        if a is b:
            return
        saved = a.kv[..., : a.length, :].copy()
        a.kv[..., : b.length, :] = b.kv[..., : b.length, :]
        b.kv[..., : a.length, :] = saved
        a.kv, b.kv, a.slot, b.slot = b.kv, a.kv, b.slot, a.slot
        a.touched, b.touched = max(a.length, b.touched), max(b.length, a.touched)  # the pages of its new slot

    def holds(self, caches: list[OrtCache]) -> bool:
        """Whether ``caches`` are exactly the first ``len(caches)`` slots (in any order)."""
        return all(c.arena is self for c in caches) and {c.slot for c in caches} == set(range(len(caches)))
