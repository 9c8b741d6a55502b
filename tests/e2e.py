"""Start ``launch.py`` as a real subprocess on a free port, and stop it by signal."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningApp:
    process: subprocess.Popen
    url: str
    log_path: Path
    worker_pids: list[int] = field(default_factory=list)
    auth: tuple[str, str] | None = None  # its --auth login, when it was started with one

    def health(self) -> dict:
        """/health in full (with ``--auth``, the details need the login)."""
        return httpx.get(f"{self.url}/health", auth=self.auth, timeout=5).json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30) -> int:
        self.process.send_signal(sig)
        return self.process.wait(timeout_s)


@contextlib.contextmanager
def running_app(tmp_path: Path, *args: str, **kwargs) -> Iterator[RunningApp]:
    """``start_app`` for a fixture: the process is killed (by pid) if a test left it running."""
    app = start_app(tmp_path, *args, **kwargs)
    try:
        yield app
    finally:
        if app.process.poll() is None:
            app.process.kill()
            app.process.wait()


def start_app(tmp_path: Path, *args: str, ready_timeout_s: float = 240, env: dict | None = None,
              wait_for_workers: bool = True, root: Path = ROOT) -> RunningApp:
    """Returns once every worker is ready, or (``wait_for_workers=False``) once /health answers.
    ``root``: the checkout to run (another one: an A/B, ``benchmarks.serve_ab``)."""
    port = free_port()
    log_path = tmp_path / "app.log"
    process = subprocess.Popen(
        [sys.executable, str(root / "launch.py"), "--port", str(port), *args],
        cwd=root, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    auth = args[args.index("--auth") + 1] if "--auth" in args else None
    if auth and Path(auth).is_file():  # a file of logins: /health's details with its first
        auth = Path(auth).read_text().split()[0]
    login = auth.split(":", 1) if auth else None
    app = RunningApp(process, f"http://127.0.0.1:{port}", log_path, auth=tuple(login) if login else None)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"launch.py exited with {process.returncode}:\n{app.log()}")
        try:
            health = app.health()
            if not wait_for_workers or health["workers_ready"] == len(health["workers"]):
                app.worker_pids = [w["pid"] for w in health["workers"]]
                return app
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"app not ready after {ready_timeout_s} s:\n{app.log()}")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def busy_worker_step_s(app: RunningApp) -> float:
    """The time per token of the one reply being generated, from its worker's live tokens/s
    (what the worker panel shows)."""
    [rate] = [w["current_tokens_per_s"] for w in app.health()["workers"] if w["state"] == "busy"]
    assert rate > 0, app.health()["workers"]
    return 1 / rate


def gradio_round_trip_s(client, tries: int = 3) -> float:
    """The longest of ``tries`` round trips through Gradio (``client``: a ``gradio_client.Client``
    of the page; its ``/banner``), timed now: a Stop from the page goes through Gradio (a
    request, then its task cancelled) before the worker hears it, so a bound on how soon a
    Stop frees the worker allows this much, under the load of the moment."""
    longest = 0.0
    for _ in range(tries):
        started = time.monotonic()
        client.predict(api_name="/banner")
        longest = max(longest, time.monotonic() - started)
    return longest


def wait_all_idle(app, timeout_s: float = 60) -> tuple[float, float]:
    """Seconds until /health shows every worker idle, and the longest of its polls (a /health
    round trip and a pause): how late a poll may have seen it. ``timeout_s``: only against a hang."""
    started, longest = time.monotonic(), 0.0
    while time.monotonic() - started < timeout_s:
        polled = time.monotonic()
        idle = all(w["state"] == "idle" for w in app.health()["workers"])
        if idle:
            return time.monotonic() - started, max(longest, time.monotonic() - polled)
        time.sleep(0.02)
        longest = max(longest, time.monotonic() - polled)
    raise AssertionError(f"workers still busy after {timeout_s} s: {app.health()['workers']}")
