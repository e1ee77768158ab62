"""Fault detection for the current generation: where a node is declared lost (``lost``:
no heartbeat for ``node_timeout_s`` or a rebooted agent), crashed or non-zero workers
(culprit before victims), ranks that left early, hangs (agent-suspected, or a script
without the runtime idle on every rank), stuck exits, rendezvous timeouts. Pure.

The checks read the node summaries (``summary.gen_view``) and look at workers only on the
nodes where something goes on, or when a verdict needs every rank (a hang to localize, the
end of the job); lost nodes come from the deadlines of ``summary.Liveness`` when the caller
has one (issue 31: a tick at 16,384 nodes × 8 workers)."""

from __future__ import annotations

from trainguard.controller.analysis import localize_hang
from trainguard.controller.api import Fault, NodeObs, Phase, WorkerObs
from trainguard.controller.config import JobConfig
from trainguard.controller.jobstate import (
    Event,
    JobState,
)
from trainguard.controller.pools import is_alive, rebooted, world_of
from trainguard.controller.summary import GenView, LiveTick, gen_view, idle_s
from trainguard.protocol import FaultCause

# Errors a rank raises when a *peer* died under a collective (gloo, NCCL): such a rank
# is a victim; the culprit's own report may arrive a little later.
_PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited",
)


def last_line(text: str) -> str:
    """The most telling line of an error: its exception line (the traceback's last)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _worker_fault(
    gen: int, node: str, w: WorkerObs, t: float, now: float, cause: FaultCause, what: str
) -> Fault:
    """The fault of rank ``w`` on ``node``, first seen at ``t``: "rank R <what>"."""
    return Fault(
        cause=cause,
        generation=gen,
        rank=w.rank,
        node_id=node,
        step=w.step,
        t_fault=t,
        t_detected=now,
        message=f"rank {w.rank} {what}",
    )


def victim(error: str | None) -> bool:
    return error is not None and any(p in error for p in _PEER_LOSS)


def lost_nodes(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    live: LiveTick | None = None,
) -> list[str]:
    """The assigned nodes that are lost, in the assignment's order: no observation, none for
    over ``node_timeout_s`` (``pools.is_alive``), or a rebooted agent. ``live``: the liveness
    of ``obs``'s nodes (``Liveness.at``): the not-alive ones then come from it, and the
    rest is checked in C over the assigned nodes; without it, one scan (the same answer)."""
    if live is None or live.timeout_s != cfg.timeouts.node_timeout_s:
        return [
            n
            for n in s.assignment
            if n not in obs or not is_alive(obs[n], now, cfg) or rebooted(s, n, obs)
        ]
    dead = live.dead
    a = s.assignment
    if not a.keys() <= obs.keys() or not live.index.incarnations_cover(s.gen_incarnations):
        return [n for n in a if n not in obs or n in dead or rebooted(s, n, obs)]
    lost = [n for n in dead if n in a]
    if len(lost) > 1:
        order = {n: i for i, n in enumerate(a)}
        lost.sort(key=order.__getitem__)
    return lost


def node_fault(
    s: JobState, cause: FaultCause, node: str, t_fault: float, now: float, why: str
) -> Fault:
    return Fault(
        cause=cause,
        generation=s.generation,
        rank=None,
        node_id=node,
        step=s.max_step.get(s.generation),
        t_fault=t_fault,
        t_detected=now,
        message=why,
    )


def stuck_at_exit(
    w: WorkerObs, workers: list[WorkerObs], cfg: JobConfig, events: list[Event], gen: int
) -> bool:
    """``w`` is still running, every peer exited 0, and its processes used no CPU for
    ``exit_grace_s``: its work is over and its exit is stuck (a destructor blocked on a
    thread). It counts as finished (the end-of-job stop kills it); whether the job finished
    is then judged by its steps as for any rank. An epilogue that computes is never this."""
    if w.state != "running" or idle_s(w) < cfg.timeouts.exit_grace_s:
        return False
    peers = [x for x in workers if x is not w]
    done = [x for x in peers if x.state == "succeeded"]
    stuck = [x for x in peers if x.state == "running" and idle_s(x) >= cfg.timeouts.exit_grace_s]
    if not done or len(done) + len(stuck) < len(peers):
        return False
    events.append(
        (
            "exit_stuck",
            {"generation": gen, "rank": w.rank, "step": w.step, "idle_s": round(idle_s(w), 1),
             "action": "stopped with the job's end: every peer had exited 0"},
        )
    )  # fmt: skip
    return True


def finished(
    s: JobState, obs: dict[str, NodeObs], cfg: JobConfig, events: list[Event], v: GenView
) -> list[WorkerObs] | None:
    """Every rank of the generation (``world_of``) exited 0, or the ones still running are
    stuck at exit (``stuck_at_exit``, its events recorded): the generation's workers; else
    None. The workers are looked at only once the summaries (``v``) allow it: every one
    succeeded or running, and, if any runs, one succeeded and each running one idle for
    ``exit_grace_s``."""
    if v.count != world_of(s, cfg) or v.running + v.succeeded != v.count:
        return None
    if v.running and not (v.succeeded and v.idle_min_s >= cfg.timeouts.exit_grace_s):
        return None
    workers = [w for _, w in gen_workers(s, obs)]
    gen = s.generation
    if len(workers) == world_of(s, cfg) and all(
        w.state == "succeeded" or stuck_at_exit(w, workers, cfg, events, gen) for w in workers
    ):
        return workers
    return None


def _wedge_limit(cfg: JobConfig) -> float:
    """Seconds without CPU use on every rank that make a script without the runtime hung: the
    fixed hang timeout, else its ceiling (``TimeoutsConfig``)."""
    t = cfg.timeouts
    return t.hang_timeout_s if t.hang_timeout_s is not None else t.hang_timeout_max_s


def _wedged_without_runtime(
    s: JobState, cfg: JobConfig, workers: list[tuple[str, WorkerObs]]
) -> tuple[str, WorkerObs, float] | None:
    """A generation whose script runs no trainguard runtime, in which every rank's processes
    used no CPU for the hang timeout (``_wedge_limit``): (node, the rank idle longest,
    limit). One idle rank alone is no verdict: it may wait for a busy peer."""
    if s.phase != Phase.RUNNING or (workers and workers[0][1].runtime):
        return None  # any rank with the runtime rules this out (the first, checked cheaply)
    live = [(n, w) for n, w in workers if w.state == "running"]
    limit = _wedge_limit(cfg)
    if len(live) < world_of(s, cfg) or any(w.runtime for _, w in live):
        return None
    if all(w.cpu_idle_s is not None and w.cpu_idle_s > limit for _, w in live):
        n, w = max(live, key=lambda nw: (nw[1].cpu_idle_s or 0.0, -nw[1].rank))
        return n, w, limit
    return None


def gen_workers(s: JobState, obs: dict[str, NodeObs]) -> list[tuple[str, WorkerObs]]:
    """(node, worker) of every worker the assigned nodes report for the current generation:
    O(workers), made only where a verdict needs every rank (the summaries tell when)."""
    gen = s.generation
    return [
        (n, w)
        for n in s.assignment
        if n in obs and obs[n].generation == gen
        for w in obs[n].workers.values()
    ]


def detect_fault(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    workers: list[tuple[str, WorkerObs]] | None = None,
    *,
    live: LiveTick | None = None,
    view: GenView | None = None,
) -> Fault | None:
    """First fault of the current generation, culprit localized where the reports allow.
    In order: a lost or fenced node, a failed worker, a hang (runtime progress, then CPU use
    of plain scripts), a rendezvous past its timeout. ``workers``: ``gen_workers(s, obs)`` if
    the caller has it (else made only where a verdict needs every rank); ``live``: the nodes'
    deadlines (``lost_nodes``); ``view``: ``gen_view(s, obs)`` if the caller has it."""
    v = gen_view(s, obs) if view is None else view
    fault = _node_fault(s, obs, now, cfg, live, v)
    if fault is not None:
        return fault
    # A parked rank (in process) left its training function on a failed collective: a victim
    # whose process lives on, as a failed one is a victim whose process exited.
    failed = [
        (w.exited_at or w.parked_at or now, n, w)
        for n in v.failed
        for w in obs[n].workers.values()
        if w.state in ("failed", "parked")
    ]
    if failed:
        return _exit_fault(s, obs, now, cfg, workers, failed)
    return (
        _hang_fault(s, obs, now, cfg, v, workers)
        or _wedged_fault(s, obs, now, cfg, v, workers)
        or _rendezvous_fault(s, now, cfg)
    )


def _node_fault(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    live: LiveTick | None,
    v: GenView,
) -> Fault | None:
    """A node lost (no heartbeat, or a rebooted agent) or fenced (it lost the controller)."""
    lost = lost_nodes(s, obs, now, cfg, live)
    if lost:
        n = lost[0]
        if rebooted(s, n, obs):
            seen, why = now, f"node {n} restarted (new agent incarnation)"
        elif n in obs and obs[n].leaving:
            seen, why = obs[n].last_seen, f"node {n}'s agent exited (its last report said so)"
        else:
            seen = obs[n].last_seen if n in obs else s.phase_since
            why = f"no heartbeat from {n} for {now - seen:.1f}s"
        return node_fault(s, FaultCause.NODE_LOST, n, seen, now, why)
    if v.fenced:
        why = f"node {v.fenced[0]} stopped its workers: it lost contact with the controller"
        return node_fault(s, FaultCause.NODE_FENCED, v.fenced[0], now, now, why)
    return None


def _exit_fault(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    workers: list[tuple[str, WorkerObs]] | None,
    failed: list[tuple[float, str, WorkerObs]],
) -> Fault | None:
    """The first failed worker that is not a victim of a peer's death; None while only
    victims have failed, for a moment (the culprit's report, or its node's loss, follows).
    ``workers``: ``gen_workers(s, obs)``, made here if None and needed."""
    gen = s.generation
    culprits = [f for f in failed if f[2].state == "failed" and not victim(f[2].error)]
    if not culprits and now - min(f[0] for f in failed) < 2 * cfg.timeouts.heartbeat_s:
        return None  # only victims so far: give the culprit's report (or node loss) a moment
    if not culprits:
        # The peers lost their connection: a rank that had already exited 0 left them (a
        # trainer that exits 0 on SIGTERM, a rank that skipped its last steps).
        first = min(f[0] for f in failed)
        early = [
            (w.exited_at, n, w)
            for n, w in (gen_workers(s, obs) if workers is None else workers)
            if w.state == "succeeded" and w.exited_at is not None and w.exited_at <= first
        ]
        if early:
            t, n, w = min(early, key=lambda x: x[0])
            why = "exited with status 0 at step {} while its peers were still running (left "
            why += "early); they lost their connection to it"
            return _worker_fault(gen, n, w, t, now, FaultCause.WORKER_EXIT, why.format(w.step))
    t, n, w = min(culprits or failed, key=lambda x: x[0])
    if w.state == "parked":  # no culprit seen: the peer's node may have gone silent
        what = f"parked on a failed collective: {w.error or 'no reason given'}"
        return _worker_fault(gen, n, w, t, now, FaultCause.COLLECTIVE, what)
    code = w.exit_code or 0
    cause = FaultCause.WORKER_CRASH if code < 0 else FaultCause.WORKER_EXIT
    what = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return _worker_fault(gen, n, w, t, now, cause, what + (f": {w.error}" if w.error else ""))


def _hang_fault(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    v: GenView,
    workers: list[tuple[str, WorkerObs]] | None,
) -> Fault | None:
    """A node's hang watch fired (no failed worker): the rank that holds the others, found
    among every rank (``workers``, made here if None)."""
    gen = s.generation
    if not v.hung or v.running < world_of(s, cfg):
        return None  # the others exited 0: the last ranks are finishing; exit_grace_s bounds it
    if v.in_trainguard:
        return None  # a rank waits inside trainguard (ckptd, a slot, durability): its deadlines bound it
    workers = gen_workers(s, obs) if workers is None else workers
    n, w, how, waiting = localize_hang(workers, 2 * cfg.timeouts.heartbeat_s + 1)
    victims = f"; ranks {sorted(waiting)} wait in a collective" if waiting else ""
    return Fault(
        cause=FaultCause.HANG,
        generation=gen,
        rank=w.rank,
        node_id=n,
        step=w.step,
        t_fault=w.last_progress_at or now,
        t_detected=now,
        message=f"no progress; rank {w.rank} on {n} {how}"
        + (f", at step {w.step}" if w.step is not None else "")
        + victims,
    )


def _wedged_fault(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    v: GenView,
    workers: list[tuple[str, WorkerObs]] | None,
) -> Fault | None:
    """A script without the runtime whose ranks all stopped using CPU. Every rank is looked
    at only once the summaries show it may be: in RUNNING, no running rank with the runtime,
    every rank running, and each idle past the limit."""
    if not (
        s.phase == Phase.RUNNING
        and v.runtime_running == 0
        and v.running >= world_of(s, cfg)
        and v.cpu_idle_min_s > _wedge_limit(cfg)
    ):
        return None
    wedged = _wedged_without_runtime(s, cfg, gen_workers(s, obs) if workers is None else workers)
    if wedged is None:
        return None
    n, w, limit = wedged
    return Fault(
        cause=FaultCause.HANG,
        generation=s.generation,
        rank=w.rank,
        node_id=n,
        step=None,
        t_fault=now - (w.cpu_idle_s or 0.0),
        t_detected=now,
        message=f"no progress; no rank used CPU for {limit:.0f}s (the script reports no "
        f"steps, so which rank holds the others is unknown; rank {w.rank} on {n} idled "
        "longest)",
    )


def _rendezvous_fault(s: JobState, now: float, cfg: JobConfig) -> Fault | None:
    if s.phase != Phase.RENDEZVOUS or now - s.phase_since <= cfg.timeouts.rendezvous_timeout_s:
        return None
    return Fault(
        cause=FaultCause.RENDEZVOUS_TIMEOUT,
        generation=s.generation,
        rank=None,
        node_id=None,
        step=None,
        t_fault=s.phase_since,
        t_detected=now,
        message=f"not all ranks started in {cfg.timeouts.rendezvous_timeout_s}s",
    )


def blame_lost_node(
    s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig, events: list[Event]
) -> None:
    """A fault first seen as a victim's peer-loss error was a node loss if a node is gone now."""
    assert s.recovery is not None
    fault = s.recovery.fault
    lost = lost_nodes(s, obs, now, cfg)
    seen_as_victim = fault.cause == FaultCause.COLLECTIVE or victim(fault.message)
    if fault.cause != FaultCause.NODE_LOST and lost and seen_as_victim:
        fault.cause, fault.node_id, fault.rank = FaultCause.NODE_LOST, lost[0], None
        fault.message = f"node {lost[0]} lost; first seen as: {fault.message}"
        events.append(("fault_refined", fault.to_json()))
