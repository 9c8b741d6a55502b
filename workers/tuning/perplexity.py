"""What fewer bits in a graph's weights cost in quality: its perplexity against the model's own in
float32, measured once per graph and cached beside it (``--quantize int4``; ``benchmarks/int4_bench.py``).

A user who trades quality for speed should see the price, not a promise: the rise depends on
the model (a small one loses more per bit; one converted from a GGUF lies on that file's grid,
which another 4-bit scheme may miss: ``docs/design/int4.md``), so it is measured on the model
being served. The text is one that ships
with CPython (``pydoc_data``'s topics: prose, code and tables), cut into ``WINDOWS`` windows of
``WINDOW`` tokens, every position after a window's first scored. The reference is the model in
float32 under transformers (exact), the graph is called as a worker calls it; both run in a
process pinned and threaded like a worker (``workers.tuning.pinned.run_pinned``), so the
server process never holds the float32 copy.

    rise = measure(model_path, graph_dir, layout)   # rise.summary(): "perplexity 16.87 against ..."
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from workers.host.cores import WorkerLayout
from workers.host.publish import publish_json
from workers.tuning.pinned import run_pinned

VERSION = 1  # bump when what is measured changes
WINDOW, WINDOWS = 512, 4  # tokens per call, calls: ~2,000 tokens, a few seconds on the bundled model
CACHE = "perplexity.json"  # in the graph's directory
TEXT = "CPython's pydoc topics"


@dataclass(frozen=True)
class Rise:
    """A graph's perplexity and the float32 model's, on the same tokens."""

    reference: float  # the model in float32 (transformers)
    graph: float
    tokens: int  # positions scored

    @property
    def percent(self) -> float:
        return 100 * (self.graph / self.reference - 1)

    def summary(self) -> str:
        return (f"perplexity {self.graph:.2f} against {self.reference:.2f} in float32 ({self.percent:+.1f}%, "
                f"{self.tokens} tokens of {TEXT})")


def topics_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def text_ids(tokenizer) -> list[int]:
    """The text's first ``WINDOW * WINDOWS`` tokens."""
    return tokenizer(topics_text()).input_ids[: WINDOW * WINDOWS]


def windows(ids: list[int]) -> list[list[int]]:
    return [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]


def token_nlls(logits, ids: list[int]):
    """Each of ``ids[1:]``'s negative log-likelihood under the logits before it (``logits``:
    [len(ids), vocab]) — a small tensor, so the logits of one window at a time are held."""
    import torch

    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return -logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def reference_nlls(model_path: str, pieces: list[list[int]]) -> list:
    """``token_nlls`` of each piece under the model in float32 (transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [token_nlls(model(torch.tensor([w])).logits[0], w) for w in pieces]


def graph_nlls(decoder, pieces: list[list[int]]) -> list:
    """``token_nlls`` of each piece under an onnxruntime graph (``workers.decoders.ort.decoder.OrtDecoder``),
    each window one call from an empty cache, every position's logits computed."""
    import torch

    return [token_nlls(decoder.forward_verify(torch.empty(0, dtype=torch.long), [], torch.tensor(w),
                                              decoder.new_cache())[1], w) for w in pieces]


def of(nlls: list, first: int = 1) -> tuple[float, int]:
    """The perplexity of the windows' tokens from position ``first`` on (1: all but each window's
    first; half a window: what llama.cpp's ``llama-perplexity`` scores), and how many were scored."""
    import torch

    scored = torch.cat([n[first - 1 :] for n in nlls])
    return math.exp(scored.mean().item()), len(scored)


def measure(model_path: str, graph_dir: str, layout: WorkerLayout) -> Rise:
    """The graph's rise, from its cache file, else measured (in a pinned process) and cached."""
    path = Path(graph_dir) / CACHE
    try:
        cached = json.loads(path.read_text())
        if cached.pop("version") == VERSION:
            return Rise(**cached)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    rise = run_pinned(layout, _measure, model_path, graph_dir, layout.threads)
    publish_json(path, {"version": VERSION, **asdict(rise)})
    return rise


def _measure(model_path: str, graph_dir: str, threads: int) -> Rise:
    import torch
    from transformers import AutoTokenizer

    from workers.decoders.ort.decoder import OrtDecoder

    torch.set_num_threads(threads)
    pieces = windows(text_ids(AutoTokenizer.from_pretrained(model_path)))
    reference, scored = of(reference_nlls(model_path, pieces))
    graph, _ = of(graph_nlls(OrtDecoder(graph_dir, threads, halves=False), pieces))
    return Rise(reference, graph, scored)
