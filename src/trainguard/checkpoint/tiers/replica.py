"""The peer replica tier: a rank's snapshot copied to other nodes' ckptds (``replica.py``), read
by a rank whose own node does not hold the point (a replaced node's ranks): its ckptd pulls
the replica, verified, into a local slot, which is then read as the memory tier reads one."""

from __future__ import annotations

from typing import Any, ClassVar

from trainguard.checkpoint.api import CheckpointError
from trainguard.checkpoint.tiers.api import Held, Index, Point, Tier, per_rank
from trainguard.checkpoint.tiers.memory import has_slot, read_verified
from trainguard.runtime import api as rt_api

Holders = dict[int, list[tuple[str, str, set[Point]]]]


class ReplicaTier(Tier):
    name: ClassVar[str] = "replica"

    @staticmethod
    def holds(index: Index) -> Held:
        """Each rank's verified replicas on healthy nodes other than its own."""
        held = holders(index) if index.memory else {}

        def points(rank: int, node: str) -> set[Point]:
            return set().union(*(p for n, _, p in held.get(rank, []) if n != node))

        return per_rank(index, points)

    def restore(self, state: dict[str, Any], point: Point) -> bool:
        from trainguard.checkpoint.backend import CkptdBackend

        rk = self.side
        source = rk.env.get(rt_api.ENV_REPLICA_SOURCE, "")
        if not rk.memory or not source or has_slot(rk, point):
            return False  # not a replaced node's rank, or the memory tier had its copy
        backend = rk.backend()
        if not isinstance(backend, CkptdBackend):
            return False
        try:
            backend.fetch(rk.rank, point[0], point[1], source)
        except CheckpointError as e:
            rk.emit("ckpt_corrupt", step=point[0], tier="replica", problems=[str(e)])
            return False
        return read_verified(rk, state, point)


def holders(index: Index) -> Holders:
    """rank → (node, replica server, verified points) of each healthy node holding replicas
    of that rank, by node name: one pass over the reports (the restore point and the
    replica sources then cost O(ranks + replicas), not O(ranks × nodes))."""
    out: Holders = {}
    if not index.replicas:
        return out
    for name in sorted(index.nodes):
        n = index.nodes[name]
        if not n.replica_addr or not n.healthy:
            continue
        for rank, points in n.replicas.items():
            out.setdefault(int(rank), []).append(
                (name, n.replica_addr, {(int(p[0]), int(p[1])) for p in points})
            )
    return out


def sources(index: Index, point: Point) -> dict[str, str]:
    """rank → replica server of a healthy node holding ``point`` for a rank whose own node
    does not (a replaced node's ranks)."""
    held = holders(index)
    out: dict[str, str] = {}
    for rank, node in index.ranks.items():
        n = index.nodes.get(node)
        if n is not None and point in {tuple(p) for p in n.memory.get(rank, [])}:
            continue
        for name, addr, points in held.get(rank, []):
            if name != node and point in points:
                out[str(rank)] = addr
                break
    return out
