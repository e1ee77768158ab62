"""Which recovery a fault gets: in process (the survivors keep their processes) or a restart of
every rank. Pure.

In process when every rank of the generation that is still alive runs its script under
``trainguard.run`` (its heartbeats say so), the fault is of a rank or a node (a crash, an exit,
a hang, a lost or fenced node), and in-process recovery is on (``restart.inprocess``). Kept:
every live rank on a live node but the failed one (for a node fault: every rank of that
node). A silent data corruption restarts every rank (the corrupt state must not live on in a
kept process's memory), as does a rendezvous that timed out (the world never formed). The
agents carry the choice out (``agent/inprocess.py``); a kept rank that cannot be brought back
is killed there and restarted the old way, and says so in an event.
"""

from __future__ import annotations

from trainguard.controller.api import Fault, NodeObs
from trainguard.controller.config import JobConfig
from trainguard.controller.detect import gen_workers, lost_nodes
from trainguard.controller.jobstate import JobState
from trainguard.protocol import FaultCause

_CAUSES = (
    FaultCause.WORKER_CRASH,
    FaultCause.WORKER_EXIT,
    FaultCause.HANG,
    FaultCause.NODE_LOST,
    FaultCause.NODE_FENCED,
    FaultCause.COLLECTIVE,
)


def plan(
    s: JobState, fault: Fault, obs: dict[str, NodeObs], now: float, cfg: JobConfig
) -> tuple[list[int], str]:
    """(the ranks that keep their processes, why); no ranks: every rank restarts."""
    if not cfg.restart.inprocess:
        return [], "in-process recovery is off (restart.inprocess = false)"
    if fault.cause not in _CAUSES:
        return [], f"a {fault.cause.value} fault restarts every rank"
    lost = set(lost_nodes(s, obs, now, cfg))
    if fault.rank is None and fault.node_id is not None:
        lost.add(fault.node_id)
    workers = gen_workers(s, obs)
    # The failed rank is not kept, unless it is parked: a fault first seen as a parked rank's
    # failed collective (no culprit reported yet: a node that went silent) blames a victim.
    alive = [
        (n, w) for n, w in workers
        if n not in lost and (w.state == "parked" or (w.state == "running" and w.rank != fault.rank))
    ]  # fmt: skip
    # Every other rank must have said it runs under trainguard.run (a plain script's victims
    # exit on their own, and are then no survivors either).
    plain = sorted(w.rank for n, w in workers if n not in lost and w.rank != fault.rank
                   and not w.inprocess)  # fmt: skip
    if plain:
        shown = ", ".join(map(str, plain[:8])) + (", …" if len(plain) > 8 else "")
        return [], f"rank(s) {shown} run a script without trainguard.run"
    keep = sorted(w.rank for _, w in alive)
    if not keep:
        return [], "no rank survived"
    if fault.rank is not None and fault.rank not in keep:
        failed = f"rank {fault.rank} restarts"
    elif fault.rank is None:
        failed = f"the ranks of {fault.node_id} restart"
    else:  # a parked victim is blamed: the culprit is not known yet (a node gone silent?)
        failed = "no failed rank seen yet"
    return keep, f"{len(keep)} surviving rank(s) keep their processes; {failed}"


def refine(s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig) -> None:
    """Once the workers stopped: the kept ranks of nodes found lost since are not kept (their
    processes are gone; a standby or the rebooted node starts them anew)."""
    rec = s.recovery
    if rec is None or not rec.kept:
        return
    lost = {s.assignment[n] for n in lost_nodes(s, obs, now, cfg) if n in s.assignment}
    kept = [r for r in rec.kept if r // cfg.nproc_per_node not in lost]
    if kept == rec.kept:
        return
    rec.kept = kept
    if not kept:
        rec.mode, rec.mode_reason = "restart", "no rank survived"
    else:  # the reason said how many were kept, and maybe that no failed rank was seen yet
        nodes = ", ".join(n for n in lost_nodes(s, obs, now, cfg) if n in s.assignment)
        rec.mode_reason = (
            f"{len(kept)} surviving rank(s) keep their processes; the ranks of lost node(s) "
            f"{nodes} restart"
        )
