"""One caller cannot shut everyone else out (issue 22, item 7), on the real server with the
bundled model: one worker of two slots, ``caller_slots = 1``, ``caller_queue = 2``, and two
logins, so that two API callers differ (without ``--auth`` every local client is 127.0.0.1).

Alice takes both slots (alone, a caller is not held to its cap), queues two more and is
refused a fifth with 429; Bob's one request then gets the first slot that frees, ahead of
Alice's two queued ones. The policy's details are ``tests/unit/test_fair_callers.py``'s.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.asks import CAPITAL, LONG
from tests.e2e import running_app

ALICE, BOB = ("alice", "s3cret"), ("bob", "hunter2")
LONG_REPLY = {"messages": [{"role": "user", "content": LONG}], "stream": True,
              "max_tokens": 1000, "temperature": 0, "repetition_penalty": 1.0}
SHORT_REPLY = {"messages": [{"role": "user", "content": CAPITAL}], "stream": True, "max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    where = tmp_path_factory.mktemp("fair")
    (where / "fair.toml").write_text("caller_slots = 1\ncaller_queue = 2\n")
    (where / "users.txt").write_text(f"{':'.join(ALICE)}\n{':'.join(BOB)}\n")
    with running_app(where, "--model", "bundled", "--workers", "1", "--threads-per-worker", "1",
                     "--max-batch", "2", "--config", str(where / "fair.toml"),
                     "--auth", str(where / "users.txt")) as running:
        yield running


class Reply(threading.Thread):
    """One streamed request in a thread of its own: its status, when its first token came,
    its text. ``stop`` closes the connection (the server then cancels the reply)."""

    def __init__(self, app, auth, body) -> None:
        super().__init__(daemon=True)
        self.app, self.auth, self.body = app, auth, body
        self.status, self.first_token_at, self.text, self.error = None, None, "", ""
        self.started, self.stop = threading.Event(), threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.app.url + "/v1/chat/completions", json=self.body, auth=self.auth,
                          timeout=300) as r:
            self.status = r.status_code
            if r.status_code != 200:
                self.error = r.read().decode()
                self.started.set()
                return
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                if self.text and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                    self.started.set()
                if self.stop.is_set():
                    return

    def result(self, timeout: float = 300) -> Reply:
        self.join(timeout)
        assert not self.is_alive(), "the reply did not end in time"
        return self


def queue_depth(app) -> int:
    return app.health()["queue_depth"]


def wait_for(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_one_caller_cannot_shut_another_out(app):
    running = [Reply(app, ALICE, LONG_REPLY) for _ in range(2)]  # both slots: alone, Alice is not capped
    for reply in running:
        assert reply.started.wait(120), reply.error
    queued = [Reply(app, ALICE, SHORT_REPLY) for _ in range(2)]
    wait_for(lambda: queue_depth(app) == 2)

    with httpx.Client(timeout=60) as client:  # her fifth: two are waiting, her caller_queue
        refused = client.post(app.url + "/v1/chat/completions", auth=ALICE, json={**SHORT_REPLY, "stream": False})
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) > 0
    error = refused.json()["error"]
    assert "caller_queue = 2" in error["message"] and error["type"] == "rate_limit_error"

    bob = Reply(app, BOB, SHORT_REPLY)
    wait_for(lambda: queue_depth(app) == 3)  # behind Alice's two in time, but she holds her cap
    running[0].stop.set()  # one of Alice's slots frees (her client leaves: the server cancels it)
    assert bob.started.wait(120), bob.error
    running[1].stop.set()

    bob.result()
    assert bob.status == 200 and "Paris" in bob.text
    for reply in queued:  # first come first served, Bob's would start after both of these
        reply.result()
        assert reply.status == 200 and reply.first_token_at > bob.first_token_at, "Alice's queued one went first"
    for reply in running:
        reply.result()
    metrics = httpx.get(app.url + "/metrics", auth=ALICE, timeout=10).text
    assert 'cpu_chat_requests_total{outcome="rejected"} 1.0' in metrics
