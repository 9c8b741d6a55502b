"""Choosing the next token from a sequence's logits (after its processors,
``workers.generation.processors``): greedy, or temperature → top-k → top-p → min-p → one draw."""

from __future__ import annotations

import torch

from workers.protocol import SamplingParams


def sample(
    logits: torch.Tensor,  # [V], float32
    params: SamplingParams,
    generator: torch.Generator | None,
) -> int:
    """Greedy, or temperature → top-k → top-p → min-p → one draw.

    Draws by inverting the cumulative distribution with one uniform number:
    ``torch.multinomial`` over the full vocabulary costs milliseconds per token. Greedy is
    numpy's ``argmax`` (the first of equal maxima, as ``torch.argmax``): on Zen 4 it took
    16 µs over Qwen's 151,936 logits where ``torch.argmax`` took 252 µs, 1% of a decode step
    (``benchmarks/results/avx512-bf16/step-profile.md``).
    """
    if params.greedy:
        return int(logits.numpy().argmax())
    probs, ids = candidates(logits, params)
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(1, generator=generator) * cdf[-1]
    pick = min(int(torch.searchsorted(cdf, u)), cdf.numel() - 1)
    return int(ids[pick]) if ids is not None else pick


def candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The distribution a draw is made from: (weights of the candidates, not normalized, with
    0 for those cut; their ids, or None when they are the whole vocabulary, position = id).

    Each cut is judged on the temperature-scaled distribution, so a token is kept when it
    passes all of them: among the ``top_k`` likeliest; within the smallest set of likeliest
    tokens whose mass reaches ``top_p``; at least ``min_p`` times as likely as the likeliest
    (llama.cpp's and vLLM's ``min_p``). Works on the top-k candidates only (``top_k``; a sort
    of a 150k vocabulary is slow).
    """
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        scores, ids = top_k(logits, params.top_k)  # [k], sorted descending
    elif params.top_p < 1.0:
        scores, ids = torch.sort(logits, descending=True)  # top-p needs the order
    else:
        scores, ids = logits, None  # the full distribution, unordered
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:  # keep the smallest prefix whose mass reaches top_p
        keep = probs.cumsum(dim=-1) - probs < params.top_p
        probs = probs * keep
    if params.min_p > 0.0:  # the likeliest token passes every cut above, so its probability is the max
        probs = probs * (probs >= params.min_p * probs.max())
    return probs, ids


def top_k(logits: torch.Tensor, k: int, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits, k)`` [V] → (values, ids), sorted descending, from the blocks of
    ``width`` logits whose maxima are the ``k`` largest: a block holding none of them has a
    maximum below the k-th largest logit, and at most k blocks hold one. On Zen 4, top 50 of
    151,936 took 88 µs this way and 350 µs by ``torch.topk`` over them all (step-profile.md)."""
    blocks = -(-logits.numel() // width)
    if k >= blocks:
        return torch.topk(logits, k)
    padded = logits  # vocabularies are mostly a multiple of 64: then no copy
    if blocks * width != logits.numel():
        padded = torch.full((blocks * width,), float("-inf"), dtype=logits.dtype)
        padded[: logits.numel()] = logits
    padded = padded.reshape(blocks, width)
    best = torch.topk(padded.amax(dim=1), k).indices  # [k] blocks
    values, within = torch.topk(padded[best].reshape(-1), k)
    return values, (best[:, None] * width + torch.arange(width)).reshape(-1)[within]


def logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability under the model's own distribution (before the
    sampling settings reshape it, as OpenAI-compatible servers report it), and the ``k``
    likeliest ids with theirs."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, k) if k > 0 else None
    alternatives = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
    return float(logp[token]), alternatives
