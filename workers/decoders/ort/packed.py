"""The graph's weights as onnxruntime's kernels pack them, saved once per machine and mapped by
every session (``open_session``), instead of packed again into each session's own memory."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from pathlib import Path

from workers.host.machine import machine_id
from workers.host.publish import publishing

DIFFERS, DIFFERS_EXIT = "DIFFERS", 3  # what ``packed`` leaves where onnxruntime's packed copy computes otherwise
log = logging.getLogger("workers")


def open_session(graph: Path, threads: int, pack: bool = True, kv: str = "float32", scales=None):
    """An onnxruntime session on ``graph`` whose weights, as its kernels pack them, are mapped
    from a file (``packed``): shared by every session and worker on this machine, not copied.
    (``pack=False``: the graph as it is, its weights packed into the session's own memory.)

    Why: onnxruntime prepacks each weight for MLAS when a session starts, into memory of the
    session's own: 565 MB per worker for the int8 graph of the Qwen1.5-0.5B shape and 1.38 GB
    for its fp32 twin (measured), held again by every worker and by every session with another
    thread count. Loaded from the file, a session holds 30-60 MB of its own, decodes as fast
    and gives the same logits (measured on Zen 3).

    ``kv``: the KV cache's dtype (``workers.decoders.ort.kv``), its graph retyped from the packed
    one and sharing its weights file (``scales``: int8's)."""
    import onnxruntime as ort

    from workers.decoders.ort.kv import retyped

    path = retyped(packed(graph) if pack else graph, kv, scales)
    return ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])


def packed(graph: Path) -> Path:
    """``graph`` saved by onnxruntime with its prepacked weights in its data file, once per
    machine (the packing depends on the CPU and the onnxruntime version: ``machine_id``): a
    directory beside ``graph``, published whole (``workers.host.publish``), so that workers
    starting at once neither read a half-written one nor mix two. It is written by a process of its own:
    the packing session's memory, freed, would stay in this process's heap (1.2 GB).

    Where the saved graph does not compute what ``graph`` does (``save_packed`` checks), the
    directory holds only ``DIFFERS`` and ``graph`` itself serves: onnxruntime 1.31 saved wrong
    weights for some tiny test models (2 layers, 64 wide) and right ones for every real one."""
    done = graph.parent / f"{graph.stem}.packed-{machine_key()}"
    if not (done / graph.name).is_file() and not (done / DIFFERS).is_file():
        _pack(graph, done)
    return graph if (done / DIFFERS).is_file() else done / graph.name


def machine_key() -> str:
    """What a packed copy is for: this machine (threads do not change the packing)."""
    return hashlib.sha256(machine_id(0).encode()).hexdigest()[:12]


def _pack(graph: Path, done: Path) -> None:
    with publishing(done, directory=True) as writing:
        ran = subprocess.run([sys.executable, "-c", "import sys; from workers.decoders.ort.decoder import save_packed; "
                              "save_packed(*sys.argv[1:])", str(graph), str(writing / graph.name)],
                             cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, check=False)
        if ran.returncode == DIFFERS_EXIT:
            log.warning("onnxruntime's packed copy of %s computes other logits; using the graph as it is", graph)
            for leftover in writing.iterdir():
                leftover.unlink()
            (writing / DIFFERS).write_text("the packed graph's logits differed from the graph's\n")
        elif ran.returncode != 0:
            raise RuntimeError(f"onnxruntime could not pack {graph}: {ran.stderr.strip()[-2000:]}")


SPIN_AFTER_CALL_US = 2000  # how long an idle pool thread spins before it sleeps (see ``session_options``)


def session_options(threads: int, spin_us: int | None = SPIN_AFTER_CALL_US):
    """A session on ``threads`` threads whose idle pool threads spin for ``spin_us`` at most
    before they sleep (None: onnxruntime's default, the "before" of ``benchmarks.spin_bench``).

    Why bounded: by default a pool thread spins on for ~40 ms of CPU after a call ends. When a
    prompt goes apart (``workers.scheduler.prefill``), the batch's thread is pinned to one core
    and the prompt's to the other, and the full session's pool thread, still spinning from the
    batch's last step, took 40-50 ms of the batch's core: the first step on one thread took
    70-107 ms against ~45, the prompt's longest gap (Zen 4, Qwen1.5-0.5B shape). Why not zero
    (``session.force_spinning_stop``): between two of a served reply's steps the worker spends
    ~0.5 ms sampling and sending, and a pool thread woken from sleep for each step cost ~10% of
    one stream's decode through the API on the bundled model. 2 ms spans that gap: one stream
    decodes as before, several 1.04-1.07x faster through the app (the spinning thread no longer
    takes a core from the dispatcher's process), ``benchmarks/results/<class>/spin*.md``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3  # not the warning that a saved optimized graph suits this machine only: it is keyed so
    if spin_us is not None:
        options.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
    return options
