"""The Ray backend on a real two-node Ray cluster on this machine: launch.py --backend ray,
one worker actor per node, the bundled model, real SIGKILLs.

Ray also talks to the machine's own interface address, and tests may reach only
127.0.0.0/8: these tests run only in a network namespace that has loopback alone, which
scripts/test.sh (what CI runs) sets up with ``unshare -n``. Outside one, or without Ray
installed (it is an optional extra, requirements-ray.txt), they skip: local runs only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from app.pool.local import respawn_delay
from tests.asks import CAPITAL, LONG
from tests.e2e import running_app, wait_gone

REQUIRED = os.environ.get("CPU_CHAT_RAY_TESTS") == "required"  # set by scripts/test.sh: CI never skips these
try:
    import ray  # noqa: F401
except ImportError:
    if REQUIRED:
        raise
    pytest.skip("the Ray backend is an optional extra: pip install -r requirements-ray.txt", allow_module_level=True)
if {name for _, name in socket.if_nameindex()} != {"lo"}:
    if REQUIRED:
        raise RuntimeError("the Ray tests must run in a network namespace with loopback alone")
    pytest.skip("Ray tests run in a loopback-only network namespace (scripts/test.sh)", allow_module_level=True)

from ray.cluster_utils import Cluster

COUNT = {"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 300}


def ray_pids() -> list[int]:
    """Ray's processes (gcs_server, raylet, workers, actors) in this network namespace: only ours."""
    here = os.readlink("/proc/self/ns/net")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(entry / "ns/net") != here:
                continue
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (Path(argv[0]).name in ("raylet", "gcs_server") or argv[0].startswith("ray::")
                or any("/site-packages/ray/" in arg for arg in argv)):
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def app(cluster, tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("ray-app"), "--model", "bundled", "--backend", "ray",
                     "--ray-address", cluster.address, "--workers", "2", "--threads-per-worker", "1",
                     "--max-batch", "1") as running:
        yield running


def chat(app, text: str, max_tokens: int = 24) -> dict:
    body = {"model": "any", "messages": [{"role": "user", "content": text}], "temperature": 0.0,
            "max_tokens": max_tokens}
    return httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=120).json()


def stream(app, text: str, events: list, params: dict = COUNT, stop_after: int | None = None) -> None:
    """Stream a reply, appending (time, tokens or final json) to ``events``; with ``stop_after``,
    drop the connection after that many chunks (what Stop does)."""
    body = {"model": "any", "messages": [{"role": "user", "content": text}], "stream": True, **params}
    with httpx.stream("POST", f"{app.url}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append((time.monotonic(), event))
            if stop_after is not None and len(events) >= stop_after:
                return


def node_of(app, worker: int) -> str:
    return next(w["node"] for w in app.health()["workers"] if w["id"] == worker)


def test_each_worker_is_an_actor_on_its_own_node_and_a_chat_names_it(app, cluster):
    health = app.health()
    nodes = {w["node"] for w in health["workers"]}
    assert len(nodes) == 2, health["workers"]  # one worker per node
    assert {n.split("/")[1] for n in nodes} == {n.node_id[:8] for n in cluster.list_all_nodes()}
    assert len({w["pid"] for w in health["workers"]}) == 2 and all(w["pid"] > 0 for w in health["workers"])
    assert sorted(w["cores"] for w in health["workers"]) == [[c] for c in sorted(os.sched_getaffinity(0))[:2]]
    for w in health["workers"]:  # each thread: pinned, and at a local worker's priority, not Ray's nice 15
        for task in Path(f"/proc/{w['pid']}/task").iterdir():
            assert os.sched_getaffinity(int(task.name)) == set(w["cores"])
            assert int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]) == 0
    reply = chat(app, CAPITAL)
    assert "Paris" in reply["choices"][0]["message"]["content"]
    assert node_of(app, reply["metrics"]["worker"]) in nodes
    metrics = httpx.get(f"{app.url}/metrics", timeout=5).text
    assert all(f'node="{n}"' in metrics for n in nodes)


def test_two_concurrent_chats_run_on_the_two_nodes(app):
    replies: list[dict] = []
    threads = [threading.Thread(target=lambda q=q: replies.append(chat(app, q, 48)))
               for q in (CAPITAL, "Name a large ocean.")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(replies) == 2 and all(r["choices"][0]["finish_reason"] in ("stop", "length") for r in replies)
    assert {node_of(app, r["metrics"]["worker"]) for r in replies} == {w["node"] for w in app.health()["workers"]}


def test_a_conversation_stays_on_the_node_that_holds_its_cache(app):
    def turn(messages: list) -> dict:
        body = {"model": "any", "messages": messages, "temperature": 0.0, "max_tokens": 24, "session_id": "ray-1"}
        return httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=120).json()

    history = [{"role": "user", "content": CAPITAL}]
    first = turn(history)
    history += [first["choices"][0]["message"], {"role": "user", "content": "And of Italy?"}]
    second = turn(history)
    assert second["metrics"]["worker"] == first["metrics"]["worker"]
    assert second["metrics"]["cached_prompt_tokens"] > 0  # its KV cache, on that node, was reused


def test_stop_reaches_the_actor_within_a_few_decode_steps(app):
    events: list = []
    stream(app, LONG, events, stop_after=12)
    stopped_at = time.monotonic()
    step_s = (events[-1][0] - events[2][0]) / (len(events) - 3)  # this reply's own time per token
    poll_s = 0.0  # the longest poll (a /health round trip and a pause): how late one may have seen it free
    while True:  # the worker is busy until the actor confirms
        polled = time.monotonic()
        if not any(w["active"] for w in app.health()["workers"]):
            break
        time.sleep(0.02)
        poll_s = max(poll_s, time.monotonic() - polled)
    freed_s = time.monotonic() - stopped_at
    poll_s = max(poll_s, time.monotonic() - polled)
    print(f"freed {freed_s * 1000:.0f} ms after the stop: {freed_s / step_s:.1f} of its steps of "
          f"{step_s * 1000:.0f} ms, polls of up to {poll_s * 1000:.0f} ms")
    assert freed_s <= 10 * step_s + poll_s, (freed_s, step_s, poll_s)
    metrics = httpx.get(f"{app.url}/metrics", timeout=5).text
    assert 'cpu_chat_requests_total{outcome="cancelled"} 1.0' in metrics


def test_sigkill_of_an_actor_fails_its_reply_only_and_a_new_actor_replaces_it(app):
    victim_events: list = []
    survivor_events: list = []
    victim = threading.Thread(target=stream, args=(app, LONG, victim_events))
    victim.start()
    while len(victim_events) < 5:
        time.sleep(0.02)
    [old] = [w for w in app.health()["workers"] if w["active"]]  # the victim's worker
    survivor = threading.Thread(target=stream, args=(app, "Count from 1 to 100.", survivor_events,
                                                     {**COUNT, "max_tokens": 120}))
    survivor.start()
    while len(survivor_events) < 3:
        time.sleep(0.02)
    killed_at = time.monotonic()
    os.kill(old["pid"], signal.SIGKILL)
    victim.join(120)
    survivor.join(120)
    (failed_at, failure), completed = victim_events[-1], survivor_events[-1][1]
    assert "stopped unexpectedly" in failure["error"]["message"], failure
    assert completed["choices"][0]["finish_reason"] in ("stop", "length"), completed
    assert completed["metrics"]["worker"] != old["id"]
    while app.health()["workers_ready"] < 2:
        time.sleep(0.1)
    recovered_s = time.monotonic() - killed_at
    replaced = next(w for w in app.health()["workers"] if w["id"] == old["id"])
    assert replaced["pid"] != old["pid"] and replaced["restarts"] == 1 and replaced["node"] == old["node"]
    warm_start_s = initial_warm_start_s(app.log())
    noticed_s = failed_at - killed_at  # Ray noticing the death: the victim's reply failed then
    # then the backoff of a worker that had loaded (respawn_delay(1)), then a start like the first one
    print(f"back to full strength {recovered_s:.1f} s after the kill (its reply failed after {noticed_s:.1f} s); "
          f"the first start took {warm_start_s:.1f} s")
    assert recovered_s <= noticed_s + respawn_delay(1) + 1.5 * warm_start_s, \
        (recovered_s, noticed_s, warm_start_s)
    assert "Paris" in chat(app, CAPITAL)["choices"][0]["message"]["content"]


def initial_warm_start_s(log: str) -> float:
    """From the pool starting the first actors to the last of them ready, from the app's log."""
    def at(line: str) -> datetime:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")

    lines = log.splitlines()
    first = next(line for line in lines if "starting an actor" in line)
    ready = next(line for line in lines if "workers ready" in line and " 2/2 " in line)
    return (at(ready) - at(first)).total_seconds()


def test_shutdown_leaves_no_ray_process(app, cluster):
    actor_pids = [w["pid"] for w in app.health()["workers"]]
    assert app.stop() == 0
    assert wait_gone(actor_pids) == []
    cluster.shutdown()
    deadline = time.monotonic() + 20
    while ray_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_pids() == []
