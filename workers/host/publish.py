"""Build a cache entry beside its final path, then rename it into place: readers see all or nothing.

Every cache here (converted models, prepared weights, the onnxruntime graph and its packed
copy, the kernel and engine timings) is written by whichever process needs it first, and
several may start at once: workers, the calibration processes, Ray actors on one node. A
rename within a directory is atomic on POSIX, so a reader finds either no entry (and builds
one) or a complete one, never half a file; an interrupted build leaves only a temporary
path, named so it is never taken for an entry.

    with publishing(cache / "prepared" / "model.weights") as tmp:
        write_weights(tmp)                            # a file at tmp
    with publishing(cache / "converted" / "model", directory=True) as tmp:
        model.save_pretrained(tmp)                    # tmp is an empty directory
    publish_json(cache / "kernels" / "abc.json", timings)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def publishing(final: Path, directory: bool = False) -> Iterator[Path]:
    """A fresh temporary path beside ``final`` to build into (an empty directory with
    ``directory``), renamed onto ``final`` when the block ends without an error and removed
    otherwise. A file replaces whatever is at ``final``; a directory that another process
    published first stands, and this one is dropped (both were built from the same inputs)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    else:
        fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.")
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        try:
            if directory:
                tmp.rename(final)  # refused where ``final`` exists and is not empty
            else:
                os.replace(tmp, final)
        except OSError:
            if not (directory and final.is_dir()):  # else: another process got there first
                raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def publish_json(path: Path, value) -> None:
    """``value`` as JSON at ``path``, written whole or not at all."""
    with publishing(path) as tmp:
        tmp.write_text(json.dumps(value, indent=1))
