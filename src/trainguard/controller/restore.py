"""Where a restart restores from: the restore point every rank can read, the replica
servers of ranks on replaced nodes, and each node's replica peers. Pure functions of the
job state and the agents' reports (no I/O)."""

from __future__ import annotations

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
    many ranks read it from each tier. A point is restorable when it is durable, or when
    every rank can read a verified memory copy of it: on its own node, or as a replica on
    another live node (replica_sources says where). Points some rank already failed to
    restore from every tier (``s.unusable``), and points a silent data corruption may have
    reached (``jobstate.suspect``), are never chosen."""
    ranks: dict[int, set[tuple[int, int]]] = {}
    local: dict[int, set[tuple[int, int]]] = {}
    held = _replica_index(s, obs, cfg) if memory else {}
    for node, node_rank in s.assignment.items():
        mem = obs[node].memory if node in obs else {}
        for i in range(cfg.nproc_per_node):
            rank = node_rank * cfg.nproc_per_node + i
            local[rank] = {tuple(p) for p in mem.get(rank, [])} if memory else set()  # type: ignore[misc]
            ranks[rank] = local[rank].union(
                *(points for n, _, points in held.get(rank, []) if n != node)
            )
    in_memory = set.intersection(*ranks.values()) if ranks else set()
    unusable = {(p[0], p[1]) for p in s.unusable}
    candidates = {p for p in (in_memory | set(durable)) - unusable if not suspect(s, p)}
    if not candidates:
        return None, {}
    point = max(candidates)
    tiers = {"memory": sum(point in m for m in local.values())}
    tiers["replica"] = sum(point in ranks[r] and point not in local[r] for r in ranks)
    tiers["durable"] = len(ranks) - tiers["memory"] - tiers["replica"]
    return point, tiers


def _healthy(s: JobState, node: str) -> bool:
    return s.pools.get(node) in (Pool.RUNNING, Pool.STANDBY)


def _replica_index(
    s: JobState, obs: dict[str, NodeObs], cfg: JobConfig
) -> dict[int, list[tuple[str, str, set[tuple[int, int]]]]]:
    """rank → (node, replica server, verified points) of each healthy node holding replicas
    of that rank, by node name: one pass over the reports (the restore point and the
    replica sources then cost O(ranks + replicas), not O(ranks × nodes))."""
    out: dict[int, list[tuple[str, str, set[tuple[int, int]]]]] = {}
    if not cfg.checkpoint.replicas:
        return out
    for n in sorted(obs):
        o = obs[n]
        if not o.replica_addr or not _healthy(s, n):
            continue
        for rank, points in o.replicas.items():
            out.setdefault(int(rank), []).append(
                (n, o.replica_addr, {(int(p[0]), int(p[1])) for p in points})
            )
    return out


def replica_sources(s: JobState, obs: dict[str, NodeObs], cfg: JobConfig) -> dict[str, str]:
    """rank → replica server of a live node holding the restore point for a rank whose own
    node does not (a replaced node's ranks)."""
    if s.restore_step is None or s.restore_gen is None or not cfg.checkpoint.replicas:
        return {}
    point = (s.restore_step, s.restore_gen)
    held = _replica_index(s, obs, cfg)
    out: dict[str, str] = {}
    for node, node_rank in s.assignment.items():
        mem = obs[node].memory if node in obs else {}
        for i in range(cfg.nproc_per_node):
            rank = node_rank * cfg.nproc_per_node + i
            if point in {tuple(p) for p in mem.get(rank, [])}:
                continue
            for n, addr, points in held.get(rank, []):
                if n != node and point in points:
                    out[str(rank)] = addr
                    break
    return out


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
