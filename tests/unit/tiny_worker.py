"""A worker process that loads nothing, for ``app.pool.local``'s own specs: it sends ``Ready``, then
behaves as ``spec.mode`` says, and exits on the first message it is sent (``Shutdown``).

    "beating"  a Heartbeat every ``spec.beat_s``, as a healthy idle worker does
    "silent"   nothing more, as a stopped one (SIGSTOP, a deadlock)
    "garbage"  bytes that are no pickle, then beating: its reader cannot read them
"""

from __future__ import annotations

import os

from workers.protocol import Heartbeat, Ready
from workers.wire import Wire


def serve(spec, conn) -> None:
    conn = Wire(conn)  # as ``workers.process.run_worker`` does
    conn.send(Ready(pid=os.getpid(), cores=(), threads=1, dtype="float32", load_s=0.0))
    if spec.mode == "garbage":
        conn.conn.send_bytes(b"this is not a pickle")
    while not conn.poll(spec.beat_s):
        if spec.mode != "silent":
            conn.send(Heartbeat())
