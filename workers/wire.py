"""A worker's pipe, carrying ``workers.protocol`` messages pickled by the standard library.

``multiprocess`` pickles what ``Connection.send`` is given with dill, which can pickle
lambdas and closures but takes ~50 µs for a message as small as a ``Chunk``; the standard
pickle takes ~3 µs. Every decoded token crosses the pipe once, and the protocol's messages
are plain frozen dataclasses and enums that both ends import, so dill buys nothing here.
On Zen 4 a decode step's sends took 0.24 ms this way against 0.45 ms in dill, of an 11 ms
step of the bundled model (``benchmarks/results/avx512-bf16/step-profile.md``). Both ends
must wrap their end of the pipe; the Ray backend's queues (``workers.ray_actor.QueueConn``)
carry the same messages without it.
"""

from __future__ import annotations

import pickle


class Wire:
    """One end of a ``multiprocess`` ``Pipe``: ``send``, ``recv`` and ``poll`` as a
    ``Connection`` has them, the message as standard-pickle bytes."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def send(self, msg) -> None:
        self.conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.conn.poll(timeout)
