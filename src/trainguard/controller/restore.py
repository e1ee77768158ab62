"""Where a restart restores from: the restore point every rank can read, the replica
servers of ranks on replaced nodes, and each node's replica peers. Pure functions of the
job state and the agents' reports (no I/O)."""

from __future__ import annotations

from trainguard.checkpoint.tiers import TIERS, Index, NodeIndex, Point
from trainguard.checkpoint.tiers import replica as replica_tier
from trainguard.controller.api import NodeObs, Pool
from trainguard.controller.config import JobConfig
from trainguard.controller.jobstate import JobState, suspect


def restore_point(
    s: JobState,
    obs: dict[str, NodeObs],
    cfg: JobConfig,
    durable: list[tuple[int, int]],
    *,
    memory: bool = True,
) -> tuple[tuple[int, int] | None, dict[str, int]]:
    """The newest (step, generation) that every rank of the assignment can restore, and how
    many ranks read it from each tier the controller tracks (``tiers.TIERS``, fastest first:
    a rank counts for the first that holds the point for it). A point is restorable when
    every rank can read a verified copy of it from some tier: its own node's memory, a
    replica on another live node (replica_sources says where), the durable tier. Points some
    rank already failed to restore from every tier (``s.unusable``), and points a silent
    data corruption may have reached (``jobstate.suspect``), are never chosen."""
    index = tier_index(s, obs, cfg, durable, memory=memory)
    held = [(t.name, h) for t in TIERS if (h := t.holds(index)) is not None]
    every: set[Point] = set().union(*(h.every_rank for _, h in held))
    ranks = [set().union(*(h.per_rank.get(r, ()) for _, h in held)) for r in index.ranks]
    restorable = (set.intersection(*ranks) if ranks else set()) | every
    unusable = {(p[0], p[1]) for p in s.unusable}
    candidates = {p for p in restorable - unusable if not suspect(s, p)}
    if not candidates:
        return None, {}
    point = max(candidates)
    tiers = dict.fromkeys((name for name, _ in held), 0)
    for r in index.ranks:
        name = next(name for name, h in held if h.serves(r, point))
        tiers[name] += 1
    return point, tiers


def tier_index(
    s: JobState,
    obs: dict[str, NodeObs],
    cfg: JobConfig,
    durable: list[tuple[int, int]],
    *,
    memory: bool = True,
) -> Index:
    """What the tiers are asked about: the assignment's ranks and each node's reported copies."""
    n = cfg.nproc_per_node
    ranks = {r * n + i: node for node, r in s.assignment.items() for i in range(n)}
    nodes = {
        name: NodeIndex(
            healthy=_healthy(s, name),
            memory=o.memory,
            replicas=o.replicas,
            replica_addr=o.replica_addr,
        )  # fmt: skip
        for name, o in obs.items()
    }
    return Index(
        ranks=ranks,
        nodes=nodes,
        durable=tuple(durable),
        memory=memory,
        replicas=cfg.checkpoint.replicas,
    )


def _healthy(s: JobState, node: str) -> bool:
    return s.pools.get(node) in (Pool.RUNNING, Pool.STANDBY)


def replica_sources(s: JobState, obs: dict[str, NodeObs], cfg: JobConfig) -> dict[str, str]:
    """rank → replica server of a live node holding the restore point for a rank whose own
    node does not (a replaced node's ranks)."""
    if s.restore_step is None or s.restore_gen is None or not cfg.checkpoint.replicas:
        return {}
    index = tier_index(s, obs, cfg, [])
    return replica_tier.sources(index, (s.restore_step, s.restore_gen))


def ring_of(s: JobState) -> list[str]:
    """The assigned nodes ordered by node rank (O(n log n): compute once per tick)."""
    return sorted(s.assignment, key=lambda n: s.assignment[n])


def replica_peers(
    s: JobState,
    node_id: str,
    obs: dict[str, NodeObs],
    cfg: JobConfig,
    ring: list[str] | None = None,
) -> list[str]:
    """Where ``node_id``'s ckptd replicates: the next ``cfg.checkpoint.replica_copies`` nodes by node
    rank (a ring); a one-node job replicates to standby nodes. ``ring``: ``ring_of(s)``,
    when the caller has it (then this is O(replica_copies))."""
    if not cfg.checkpoint.replicas or node_id not in s.assignment:
        return []
    ring = ring if ring is not None else ring_of(s)
    if len(ring) > 1:
        i = s.assignment[node_id]
        peers = [
            ring[(i + k) % len(ring)]
            for k in range(1, min(cfg.checkpoint.replica_copies, len(ring) - 1) + 1)
        ]
    else:
        standby = sorted(n for n, p in s.pools.items() if p == Pool.STANDBY and n in obs)
        peers = standby[: cfg.checkpoint.replica_copies]
    return [a for n in peers if n in obs and (a := obs[n].replica_addr)]
