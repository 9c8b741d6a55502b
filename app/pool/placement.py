"""Where each worker runs on a Ray cluster: which node, and which of that machine's cores.

The same core planning as on one machine (``workers.host.cores.plan_layout``), applied per
machine: workers go to the nodes with the most free CPUs, then each machine's physical
cores are split among the workers placed on it. Ray nodes that share a machine (the same
address: a test cluster, or several raylets on one big host) share its cores, so their
workers are pinned to disjoint cores rather than all to the first ones.

    >>> nodes = [RayNode("a" * 56, "h1", "10.0.0.1", 4), RayNode("b" * 56, "h2", "10.0.0.2", 4)]
    >>> cores = {"10.0.0.1": [(0,), (1,), (2,), (3,)], "10.0.0.2": [(0,), (1,), (2,), (3,)]}
    >>> [(n.host, l.cpus) for n, l in place(nodes, cores, workers=2, threads=None)]
    [('h1', (0, 1, 2, 3)), ('h2', (0, 1, 2, 3))]
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from workers.host.cores import PhysicalCore, WorkerLayout, plan_layout
from workers.errors import LayoutError


@dataclass(frozen=True)
class RayNode:
    id: str  # Ray's node id (hex)
    host: str
    address: str  # the machine: nodes with one address share its cores
    cpus: int  # its Ray CPU resource

    @property
    def label(self) -> str:
        """How the panel, /health and /metrics name it: the host, and the node for hosts with several."""
        return f"{self.host}/{self.id[:8]}"


def assign(nodes: list[RayNode], workers: int, threads: int | None, oversubscribe: bool = False) -> list[RayNode]:
    """The node of each worker: the one with the most CPUs left (``threads`` each), or with
    ``threads=None`` the one whose CPUs per worker stay highest; first listed among equals."""
    if not nodes:
        raise LayoutError("The Ray cluster has no node with a CPU.")
    count: dict[str, int] = defaultdict(int)
    chosen = []
    for _ in range(workers):
        if threads is None:
            node = max(nodes, key=lambda n: n.cpus / (count[n.id] + 1))
        else:
            node = max(nodes, key=lambda n: n.cpus - count[n.id] * threads)
            if node.cpus - count[node.id] * threads < threads and not oversubscribe:
                total = sum(n.cpus for n in nodes)
                raise LayoutError(f"{workers} workers × {threads} threads need {workers * threads} CPUs, but the "
                                  f"Ray cluster's {len(nodes)} node(s) have {total}. Use fewer workers or threads, "
                                  f"add nodes, or pass --oversubscribe.")
        count[node.id] += 1
        chosen.append(node)
    return chosen


def place(nodes: list[RayNode], cores: dict[str, list[PhysicalCore]], workers: int, threads: int | None,
          oversubscribe: bool = False) -> list[tuple[RayNode, WorkerLayout]]:
    """(node, layout) per worker id, the layout's cpus being that machine's own cores."""
    chosen = assign(nodes, workers, threads, oversubscribe)
    by_machine: dict[str, list[int]] = defaultdict(list)
    for worker_id, node in enumerate(chosen):
        by_machine[node.address].append(worker_id)
    layouts: dict[int, WorkerLayout] = {}
    for address, ids in by_machine.items():
        machine_threads = threads
        if threads is None:  # the machine's cores split evenly, within what each Ray node offers
            per_node = min(chosen[i].cpus // sum(chosen[j] is chosen[i] for j in ids) for i in ids)
            machine_threads = max(1, min(len(cores[address]) // len(ids), per_node))
        planned = plan_layout(cores[address], len(ids), machine_threads, allow_oversubscribe=oversubscribe)
        for worker_id, layout in zip(ids, planned):
            layouts[worker_id] = WorkerLayout(worker_id, layout.cpus, layout.threads)
    return [(chosen[i], layouts[i]) for i in range(workers)]
