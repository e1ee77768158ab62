"""The job state machine as a pure function: ``decide(state, obs, now, cfg, durable)``.

No I/O, no clock, no processes: tests drive it with a fake clock. The executor
(server.py) feeds it the agents' latest reports and applies what it returns:
the new state (from which every node's desired state follows, ``desired_for``)
and events to record.
"""

from __future__ import annotations

from typing import Any

from trainguard.controller.analysis import localize_hang
from trainguard.controller.api import (
    Fault,
    JobConfig,
    NodeObs,
    Phase,
    Pool,
    Recovery,
    WorkerObs,
)
from trainguard.controller.jobstate import Inputs, JobState, copy_state, fold_inputs
from trainguard.controller.restore import replica_peers, replica_sources, restore_point, ring_of
from trainguard.protocol import CkptConf, Desired, FaultCause, Idle, Run, Shutdown, Stop

Event = tuple[str, dict[str, Any]]
# Errors a rank raises when a *peer* died under a collective (gloo, NCCL): such a rank
# is a victim; the culprit's own report may arrive a little later.
_PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited",
)
_ACTIVE_GEN = (Phase.RENDEZVOUS, Phase.RUNNING)


def _alive(o: NodeObs, now: float, cfg: JobConfig) -> bool:
    return now - o.last_seen <= cfg.node_timeout_s


def _goto(s: JobState, phase: Phase, now: float, events: list[Event], reason: str) -> None:
    events.append(
        (
            "phase",
            {
                "from": s.phase.value,
                "to": phase.value,
                "reason": reason,
                "generation": s.generation,
            },
        )
    )
    s.phase, s.phase_since = phase, now


def _update_pools(
    s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig, events: list[Event]
) -> None:
    for node_id, o in sorted(obs.items(), key=lambda kv: kv[1].last_seen):
        alive = _alive(o, now, cfg)
        pool = s.pools.get(node_id)
        if pool is None and alive:
            _admit(s, o, now, cfg, events)
        elif pool == Pool.FAULTY and alive:
            fresh = s.faulty_incarnations.get(node_id) != o.incarnation
            due = now >= s.recheck_at.get(node_id, now)
            if fresh or due:
                _recheck(s, o, now, cfg, events, fresh)
        elif pool == Pool.STANDBY and not alive:
            mark_faulty(s, node_id, now, cfg, events, f"no heartbeat for {now - o.last_seen:.1f}s")
        if alive:
            s.incarnations[node_id] = o.incarnation


def _admit(s: JobState, o: NodeObs, now: float, cfg: JobConfig, events: list[Event]) -> None:
    """A node seen for the first time joins standby, once it passed pre-flight (if on); a
    node that failed pre-flight joins quarantined (faulty), re-checked later."""
    node = o.node_id
    if cfg.preflight != "off" and o.checked_at is None:
        return  # being checked
    s.join_order.append(node)
    s.incarnations[node] = o.incarnation
    if cfg.preflight != "off" and o.check_problems:
        events.append(("node_joined", {"node": node, "addr": o.addr, "pool": "faulty"}))
        why = "failed pre-flight: " + "; ".join(o.check_problems)
        mark_faulty(s, node, now, cfg, events, why)
        return
    s.pools[node] = Pool.STANDBY
    events.append(("node_joined", {"node": node, "addr": o.addr, "pool": "standby"}))
    if cfg.preflight != "off":
        events.append(
            (
                "pool_changed",
                {"node": node, "from": None, "to": "standby", "reason": "passed pre-flight"},
            )
        )


def needs_recheck(s: JobState, o: NodeObs, now: float, cfg: JobConfig) -> bool:
    """A quarantined node that is reachable, due for its re-check (or back with a fresh agent)
    and passes its host checks, but has no pre-flight verdict newer than its fault."""
    if cfg.preflight == "off" or s.pools.get(o.node_id) != Pool.FAULTY or not o.health_ok:
        return False
    fresh = s.faulty_incarnations.get(o.node_id) != o.incarnation
    due = now >= s.recheck_at.get(o.node_id, now)
    checked = o.checked_at is not None and o.checked_at > s.faulty_since.get(o.node_id, 0.0)
    return (fresh or due) and not checked


def _recheck(
    s: JobState, o: NodeObs, now: float, cfg: JobConfig, events: list[Event], fresh: bool
) -> None:
    """Return a quarantined node to standby when its host checks pass and (pre-flight on) a
    pre-flight newer than its fault passed; else back off before the next re-check."""
    node = o.node_id
    checked = cfg.preflight == "off" or (
        o.checked_at is not None and o.checked_at > s.faulty_since.get(node, 0.0)
    )
    if o.health_ok and not checked:
        return  # the coordinator is checking it
    failed = [] if o.health_ok else list(o.health_problems) or ["host checks fail"]
    if cfg.preflight != "off":
        failed += list(o.check_problems)
    if not failed:
        s.pools[node] = Pool.STANDBY
        s.recheck_at.pop(node, None)
        why = "node returned with a fresh agent" if fresh else "reachable again"
        passed = "host checks pass" if cfg.preflight == "off" else "host checks and pre-flight pass"
        events.append(
            (
                "pool_changed",
                {"node": node, "from": "faulty", "to": "standby", "reason": f"{why}; {passed}"},
            )
        )
        return
    if cfg.preflight != "off" and o.check_problems:  # a failed pre-flight counts as a fault
        s.node_faults[node] = s.node_faults.get(node, 0) + 1
        if s.node_faults[node] >= cfg.retire_after:
            s.pools[node] = Pool.RETIRED
            s.recheck_at.pop(node, None)
            why = f"retired: failed {s.node_faults[node]} checks (last: {'; '.join(failed)})"
            events.append(
                ("pool_changed", {"node": node, "from": "faulty", "to": "retired", "reason": why})
            )
            return
    delay = _recheck_delay(cfg, s.node_faults.get(node, 1)) * 2
    s.recheck_at[node] = now + delay
    s.faulty_since[node] = now  # the next re-check needs a newer verdict
    events.append(("recheck_failed", {"node": node, "problems": failed, "next_in_s": delay}))


def _recheck_delay(cfg: JobConfig, faults: int) -> float:
    return min(600.0, cfg.recheck_s * 2 ** max(0, faults - 1))


def mark_faulty(
    s: JobState, node: str, now: float, cfg: JobConfig, events: list[Event], reason: str
) -> None:
    """Move a node to the faulty pool (re-checked later), or retire it after
    ``cfg.retire_after`` faults."""
    before = s.pools.get(node)
    k = s.node_faults[node] = s.node_faults.get(node, 0) + 1
    s.faulty_incarnations[node] = s.gen_incarnations.get(node) or s.incarnations.get(node, "")
    s.faulty_since[node] = now
    if k >= cfg.retire_after:
        s.pools[node] = Pool.RETIRED
        s.recheck_at.pop(node, None)
        why = f"retired: lost {k} times (last: {reason})"
    else:
        s.pools[node] = Pool.FAULTY
        s.recheck_at[node] = now + _recheck_delay(cfg, k)
        why = f"{reason}; re-check in {_recheck_delay(cfg, k):.0f}s"
    events.append(
        (
            "pool_changed",
            {
                "node": node,
                "from": before.value if before else None,
                "to": s.pools[node].value,
                "reason": why,
            },
        )
    )


def _last_line(text: str) -> str:
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


def _victim(error: str | None) -> bool:
    return error is not None and any(p in error for p in _PEER_LOSS)


def _rebooted(s: JobState, node_id: str, obs: dict[str, NodeObs]) -> bool:
    """The node's agent restarted since the generation began: its workers died with it."""
    o = obs.get(node_id)
    return (
        o is not None
        and node_id in s.gen_incarnations
        and o.incarnation != s.gen_incarnations[node_id]
    )


def _lost(s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig) -> list[str]:
    return [
        n
        for n in s.assignment
        if n not in obs or not _alive(obs[n], now, cfg) or _rebooted(s, n, obs)
    ]


def _healthy_standby(s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig) -> list[str]:
    return [
        n
        for n in s.join_order
        if s.pools.get(n) == Pool.STANDBY and n in obs and _alive(obs[n], now, cfg)
    ]


def _node_fault(
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


def _idle_s(w: WorkerObs) -> float:
    """Seconds ``w`` has done nothing: with the runtime, since its last step or a heartbeat
    that showed its main thread working (its reporter thread's own CPU is not work); without,
    since its process tree last used CPU."""
    idle = w.progress_age_s if w.runtime else w.cpu_idle_s
    return 0.0 if idle is None else idle


def _stuck_at_exit(
    w: WorkerObs, workers: list[WorkerObs], cfg: JobConfig, events: list[Event], gen: int
) -> bool:
    """``w`` is still running, every peer exited 0, and its processes used no CPU for
    ``exit_grace_s``: its work is over and its exit is stuck (a destructor blocked on a
    thread). It counts as finished (the end-of-job stop kills it); whether the job finished
    is then judged by its steps as for any rank. An epilogue that computes is never this."""
    if w.state != "running" or _idle_s(w) < cfg.exit_grace_s:
        return False
    peers = [x for x in workers if x is not w]
    done = [x for x in peers if x.state == "succeeded"]
    stuck = [x for x in peers if x.state == "running" and _idle_s(x) >= cfg.exit_grace_s]
    if not done or len(done) + len(stuck) < len(peers):
        return False
    events.append(
        (
            "exit_stuck",
            {"generation": gen, "rank": w.rank, "step": w.step, "idle_s": round(_idle_s(w), 1),
             "action": "stopped with the job's end: every peer had exited 0"},
        )
    )  # fmt: skip
    return True


def _wedged_without_runtime(
    s: JobState, cfg: JobConfig, workers: list[tuple[str, WorkerObs]]
) -> tuple[str, WorkerObs, float] | None:
    """A generation whose script runs no trainguard runtime, in which every rank's processes
    used no CPU for the hang timeout (fixed, else its ceiling): (node, the rank idle longest,
    limit). One idle rank alone is no verdict: it may wait for a busy peer."""
    if s.phase != Phase.RUNNING or (workers and workers[0][1].runtime):
        return None  # any rank with the runtime rules this out (the first, checked cheaply)
    live = [(n, w) for n, w in workers if w.state == "running"]
    limit = cfg.hang_timeout_s if cfg.hang_timeout_s is not None else cfg.hang_timeout_max_s
    if len(live) < world_of(s, cfg) or any(w.runtime for _, w in live):
        return None
    if all(w.cpu_idle_s is not None and w.cpu_idle_s > limit for _, w in live):
        n, w = max(live, key=lambda nw: (nw[1].cpu_idle_s or 0.0, -nw[1].rank))
        return n, w, limit
    return None


def gen_workers(s: JobState, obs: dict[str, NodeObs]) -> list[tuple[str, WorkerObs]]:
    """(node, worker) of every worker the assigned nodes report for the current generation:
    one pass over the reports per tick, shared by the checks below."""
    gen = s.generation
    return [
        (n, w)
        for n in s.assignment
        if n in obs and obs[n].generation == gen
        for w in obs[n].workers.values()
    ]


def _detect_fault(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    workers: list[tuple[str, WorkerObs]] | None = None,
) -> Fault | None:
    """First fault of the current generation, culprit localized where the reports allow.
    ``workers``: ``gen_workers(s, obs)`` if the caller has it."""
    gen = s.generation
    workers = gen_workers(s, obs) if workers is None else workers
    lost = _lost(s, obs, now, cfg)
    if lost:
        n = lost[0]
        if _rebooted(s, n, obs):
            seen, why = now, f"node {n} restarted (new agent incarnation)"
        else:
            seen = obs[n].last_seen if n in obs else s.phase_since
            why = f"no heartbeat from {n} for {now - seen:.1f}s"
        return _node_fault(s, FaultCause.NODE_LOST, n, seen, now, why)
    fenced = [n for n in s.assignment if n in obs and obs[n].fenced_generation == gen]
    if fenced:
        why = f"node {fenced[0]} stopped its workers: it lost contact with the controller"
        return _node_fault(s, FaultCause.NODE_FENCED, fenced[0], now, now, why)
    failed = [(w.exited_at or now, n, w) for n, w in workers if w.state == "failed"]
    culprits = [f for f in failed if not _victim(f[2].error)]
    settle_s = 2 * cfg.heartbeat_s
    if failed and not culprits and now - min(f[0] for f in failed) < settle_s:
        return None  # only victims so far: give the culprit's report (or node loss) a moment
    if failed and not culprits:
        # The peers lost their connection: a rank that had already exited 0 left them (a
        # trainer that exits 0 on SIGTERM, a rank that skipped its last steps).
        first = min(f[0] for f in failed)
        early = [
            (w.exited_at, n, w)
            for n, w in workers
            if w.state == "succeeded" and w.exited_at is not None and w.exited_at <= first
        ]
        if early:
            t, n, w = min(early, key=lambda x: x[0])
            why = "exited with status 0 at step {} while its peers were still running (left "
            why += "early); they lost their connection to it"
            return _worker_fault(gen, n, w, t, now, FaultCause.WORKER_EXIT, why.format(w.step))
    if failed:
        t, n, w = min(culprits or failed, key=lambda x: x[0])
        code = w.exit_code or 0
        cause = FaultCause.WORKER_CRASH if code < 0 else FaultCause.WORKER_EXIT
        what = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return _worker_fault(gen, n, w, t, now, cause, what + (f": {w.error}" if w.error else ""))
    hung = [n for n in s.assignment if n in obs and obs[n].hang and obs[n].generation == gen]
    live = [w for _, w in workers if w.state == "running"]
    if hung and len(live) < world_of(s, cfg) and not failed:
        hung = []  # the others exited 0: the last ranks are finishing; exit_grace_s bounds it
    if hung and any(w.in_trainguard for w in live):
        hung = []  # a rank waits inside trainguard (ckptd, a slot, durability): its deadlines bound it
    if hung:
        n, w, how, waiting = localize_hang(workers, 2 * cfg.heartbeat_s + 1)
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
    wedged = _wedged_without_runtime(s, cfg, workers)
    if wedged is not None:
        n, w, limit = wedged
        return Fault(
            cause=FaultCause.HANG,
            generation=gen,
            rank=w.rank,
            node_id=n,
            step=None,
            t_fault=now - (w.cpu_idle_s or 0.0),
            t_detected=now,
            message=f"no progress; no rank used CPU for {limit:.0f}s (the script reports no "
            f"steps, so which rank holds the others is unknown; rank {w.rank} on {n} idled "
            "longest)",
        )
    if s.phase == Phase.RENDEZVOUS and now - s.phase_since > cfg.rendezvous_timeout_s:
        return Fault(
            cause=FaultCause.RENDEZVOUS_TIMEOUT,
            generation=gen,
            rank=None,
            node_id=None,
            step=None,
            t_fault=s.phase_since,
            t_detected=now,
            message=f"not all ranks started in {cfg.rendezvous_timeout_s}s",
        )
    return None


def decide(
    s0: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    durable: list[tuple[int, int]],
    inputs: Inputs | None = None,
) -> tuple[JobState, list[Event]]:
    """One step of the state machine, the only writer of the job state. ``durable``: verified
    committed (step, generation) pairs; the memory tier comes from the agents' reports
    (``NodeObs.memory``); ``inputs``: what else happened since the last step (``Inputs``).

    Returns the new state (``s0`` is not modified) and the events to record.
    """
    s = copy_state(s0)
    events: list[Event] = []
    if inputs is not None:
        fold_inputs(s, inputs, events)
    _update_pools(s, obs, now, cfg, events)
    gen = s.generation
    for n in s.assignment:
        o = obs.get(n)
        if o is None:
            continue
        steps = [o.steps_seen[gen]] if gen in o.steps_seen else []
        if o.generation == gen:
            steps += [w.step for w in o.workers.values() if w.step is not None]
        if steps:
            s.max_step[gen] = max(s.max_step.get(gen, 0), *steps)

    if (
        s.stop_requested
        and not s.phase.terminal
        and s.phase not in (Phase.STOPPING, Phase.CLEANING, Phase.FAULTED)
    ):
        if s.assignment and s.phase in _ACTIVE_GEN:
            _goto(s, Phase.STOPPING, now, events, "stop requested")
        else:
            s.reason = "stopped by request"
            _goto(s, Phase.STOPPED, now, events, s.reason)
        return s, events

    if s.phase == Phase.PENDING:
        # Start once the whole pool joined (or, after join_timeout_s, with enough nodes);
        # node ranks follow node names, so node0 is node rank 0 when it is there.
        healthy = sorted(_healthy_standby(s, obs, now, cfg), key=lambda n: (len(n), n))
        everyone = len(healthy) >= cfg.nodes + cfg.standby
        enough = len(healthy) >= (cfg.min_nodes or cfg.nodes)  # elastic: MIN will do
        failed = sorted(n for n, p in s.pools.items() if p in (Pool.FAULTY, Pool.RETIRED))
        # Every expected node joined, some failed pre-flight: start on the ones that passed.
        settled = enough and len(healthy) + len(failed) >= cfg.nodes + cfg.standby
        waited = now - s.phase_since > cfg.join_timeout_s
        # A node whose pre-flight is still running is waited for: the check has deadlines
        # of its own (stage deadlines; inconclusive runs are retried a bounded number of times).
        checking = [
            n for n, o in obs.items()
            if n not in s.pools and cfg.preflight != "off" and o.checked_at is None
            and _alive(o, now, cfg)
        ]  # fmt: skip
        if (
            failed
            and not enough
            and waited
            and not checking
            and len(healthy) + len(failed) >= cfg.nodes
        ):
            need = cfg.min_nodes or cfg.nodes
            why = "; ".join(
                f"{n}: {(obs[n].check_problems or obs[n].health_problems or ('lost',))[0]}"
                if n in obs
                else f"{n}: lost"
                for n in failed
            )
            s.reason = (
                f"only {len(healthy)} of the {need} nodes needed passed pre-flight in "
                f"{now - s.phase_since:.0f}s; failed: {why}"
            )
            _goto(s, Phase.FAILED, now, events, s.reason)
            return s, events
        if everyone or settled or (enough and waited):
            s.assignment = {n: i for i, n in enumerate(healthy[: cfg.nodes])}
            why = (
                "all nodes joined"
                if everyone
                else f"{len(healthy)} nodes passed pre-flight; left out: {', '.join(failed)}"
                if settled
                else f"{len(healthy)} nodes joined in {now - s.phase_since:.0f}s"
            )
            _start_generation(s, obs, cfg, now, events, durable, why)

    elif s.phase in _ACTIVE_GEN:
        master = next(n for n, r in s.assignment.items() if r == 0)
        store = obs[master].store if master in obs else None
        if s.master_port is None and store is not None and store[0] == gen:
            s.master_port = store[1]
        both = gen_workers(s, obs)
        fault = _detect_fault(s, obs, now, cfg, both)
        workers = [w for _, w in both]
        if fault is not None:
            s.recovery = Recovery(fault=fault, from_generation=gen)
            events.append(("fault", fault.to_json()))
            _goto(s, Phase.FAULTED, now, events, fault.message.splitlines()[0])
            _goto(s, Phase.STOPPING, now, events, "stop the faulted generation")
        elif len(workers) == world_of(s, cfg) and all(
            w.state == "succeeded" or _stuck_at_exit(w, workers, cfg, events, gen) for w in workers
        ):
            done = s.restore_step or 0  # a generation that restored the last step runs none
            short = [
                w
                for w in workers
                if w.total_steps is not None
                and (w.step if w.step is not None else done) < w.total_steps
            ]
            if short:  # every rank exited 0, but before the end it announced: stopped, not done
                w = min(short, key=lambda x: x.step or 0)
                s.reason = (
                    f"stopped early: every rank exited 0, rank {w.rank} at step {w.step} of "
                    f"{w.total_steps} (an outside SIGTERM or a preemption?); re-run with the same "
                    "--run-dir to resume"
                )
                _goto(s, Phase.FAILED, now, events, s.reason)
            else:
                s.reason = f"all {world_of(s, cfg)} ranks finished"
                if s.recovery is not None and s.recovery.to_generation == gen:
                    # a script without step reports: its restart counts once it finished
                    s.recoveries.append(s.recovery)
                    s.recovery = None
                _goto(s, Phase.SUCCEEDED, now, events, s.reason)
        elif (
            s.phase == Phase.RENDEZVOUS
            and len(workers) == world_of(s, cfg)
            and all(w.state in ("running", "succeeded") for w in workers)
        ):
            _goto(s, Phase.RUNNING, now, events, f"all {world_of(s, cfg)} ranks running")
        elif s.phase == Phase.RUNNING and s.evict:
            s.growing = True  # a planned stop: workers save, no restart budget spent
            nodes = ", ".join(sorted(s.evict))
            _goto(
                s, Phase.STOPPING, now, events, f"replace {nodes}: {next(iter(s.evict.values()))}"
            )
        elif s.phase == Phase.RUNNING and _can_grow(s, obs, now, cfg):
            # Elastic: nodes are back. Stop at a checkpoint boundary (workers get SIGTERM and
            # save a durable step) and restart on the larger world; not a fault, no budget.
            s.growing = True
            _goto(s, Phase.STOPPING, now, events, "grow: standby node(s) available")

    elif s.phase == Phase.STOPPING:
        pending = [
            n
            for n in s.assignment
            if n in obs
            and _alive(obs[n], now, cfg)
            and obs[n].stopped_generation < gen
            and not _rebooted(s, n, obs)
        ]
        if not pending:
            if s.recovery is not None:
                acks = [
                    obs[n] for n in s.assignment if n in obs and obs[n].stopped_generation >= gen
                ]
                s.recovery.t_stopped = max([o.stopped_at or now for o in acks], default=now)
                s.recovery.t_cleaned = max([o.cleaned_at or now for o in acks], default=now)
            _goto(s, Phase.CLEANING, now, events, "every live node stopped its workers")

    planned = s.phase == Phase.CLEANING and (s.growing or s.stop_requested)
    if planned and not _persist_planned_stop(s, obs, now, cfg, events, durable):
        pass  # the nodes' ckptds are persisting the newest memory snapshot
    elif s.phase == Phase.CLEANING and s.growing and not s.stop_requested:
        _planned_restart(s, obs, now, cfg, events, durable)
    elif s.phase == Phase.CLEANING:
        if s.recovery is None or s.stop_requested:  # a stop requested mid-recovery ends the job
            if s.recovery is not None:
                s.recoveries.append(s.recovery)
                s.recovery = None
            s.reason = "stopped by request"
            _goto(s, Phase.STOPPED, now, events, s.reason)
        else:
            _blame_lost_node(s, obs, now, cfg, events)
            _goto(
                s, Phase.REPLACING, now, events, "workers stopped, processes and segments cleaned"
            )
            _apply_policy(s, obs, now, cfg, events, durable)

    if s.phase in (Phase.REPLACING, Phase.WAITING_FOR_NODES):
        _replace_and_restart(s, obs, now, cfg, events, durable)
    return s, events


def _blame_lost_node(
    s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig, events: list[Event]
) -> None:
    """A fault first seen as a victim's peer-loss error was a node loss if a node is gone now."""
    assert s.recovery is not None
    fault = s.recovery.fault
    lost = _lost(s, obs, now, cfg)
    if fault.cause != FaultCause.NODE_LOST and lost and _victim(fault.message):
        fault.cause, fault.node_id, fault.rank = FaultCause.NODE_LOST, lost[0], None
        fault.message = f"node {lost[0]} lost; first seen as: {fault.message}"
        events.append(("fault_refined", fault.to_json()))


def _apply_policy(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    durable: list[tuple[int, int]],
) -> None:
    """Restart policy, checked once per fault: user error, no progress, restart budget."""
    assert s.recovery is not None
    fault = s.recovery.fault
    gen = fault.generation
    # What the guards can see: step reports (the runtime), checkpoints (the Checkpointer). A
    # plain script shows neither, and is judged by its restart budget, except for a failure
    # that repeats word for word (a bug in the script, not a transient fault).
    reports_steps = bool(s.max_step)
    line = _last_line(fault.message) if fault.cause == FaultCause.WORKER_EXIT else ""
    # A rank could not read the agreed point from any tier: an older one is used next. Not
    # the script's failure, and not a generation without progress.
    fallback = [s.restore_step, s.restore_gen] in s.unusable
    if fallback:
        point, _ = restore_point(s, obs, cfg, durable)
        events.append(
            (
                "restore_fallback",
                {
                    "generation": gen,
                    "unusable": [s.restore_step, s.restore_gen],
                    "next": list(point) if point else None,
                },
            )
        )
        if point is None:
            s.reason = (
                f"no restorable checkpoint left: step {s.restore_step} failed to load from "
                "every tier and no older verified copy exists (see ckpt_restore_failed events)"
            )
        else:  # each fallback drops a point, so they are bounded: not charged to the budget
            s.fallback = True
        if s.reason:
            s.recoveries.append(s.recovery)
            s.recovery = None
            _goto(s, Phase.FAILED, now, events, s.reason)
        return
    if fault.cause != FaultCause.WORKER_EXIT:
        s.prestep_failures = 0
    elif reports_steps:
        s.prestep_failures = s.prestep_failures + 1 if gen not in s.max_step else 0
    else:
        s.prestep_failures = s.prestep_failures + 1 if line == s.last_failure else 1
    s.last_failure = line
    point, _ = restore_point(s, obs, cfg, durable)
    ckpt_step = point[0] if point else None
    s.seen_checkpoint = s.seen_checkpoint or ckpt_step is not None
    if s.seen_checkpoint:  # progress = a newer checkpoint than the one this generation restored
        progressed = ckpt_step is not None and (
            s.restore_step is None or ckpt_step > s.restore_step
        )
    elif reports_steps:  # its own checkpoints, if any: a step beyond every earlier generation's
        before = max((v for g, v in s.max_step.items() if g < gen), default=-1)
        progressed = s.max_step.get(gen, -1) > before
    else:
        progressed = True  # nothing to judge progress by: the restart budget decides
    s.no_progress_generations = 0 if progressed else s.no_progress_generations + 1
    if s.prestep_failures >= cfg.user_error_generations:
        s.reason = (
            f"user error: the script failed before its first step in {s.prestep_failures} "
            f"generations in a row; last error: {_last_line(fault.message)}"
            if reports_steps
            else f"user error: the script failed before its first step report, "
            f"{s.prestep_failures} times in a row with the same error: {line}"
        )
    elif s.no_progress_generations >= cfg.no_progress_generations:
        s.reason = (
            f"no progress: {s.no_progress_generations} generations in a row without a new "
            + ("checkpoint" if s.seen_checkpoint else "step beyond the earlier generations'")
        )
    elif s.restarts >= cfg.max_restarts:
        s.reason = f"restart budget spent ({cfg.max_restarts} restarts); last fault: {fault.message.splitlines()[0]}"
    if s.reason:
        s.recoveries.append(s.recovery)
        s.recovery = None
        _goto(s, Phase.FAILED, now, events, s.reason)


def _replace_and_restart(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    durable: list[tuple[int, int]],
) -> None:
    # The restore point comes from the memory index: first let every live node's ckptd verify
    # what its ranks staged before they stopped (bounded by PERSIST_SETTLE_S).
    busy = [
        n for n in s.assignment if n in obs and _alive(obs[n], now, cfg) and not obs[n].ckptd_idle
    ]
    if busy and cfg.memory_tier:
        if s.persist_settle_until is None:
            s.persist_settle_until = now + PERSIST_SETTLE_S
        if now < s.persist_settle_until:
            return
    s.persist_settle_until = None
    lost = sorted(
        set(_lost(s, obs, now, cfg))
        | {n for n in s.assignment if s.pools.get(n) in (Pool.FAULTY, Pool.RETIRED)},
        key=lambda n: s.assignment[n],
    )
    for n in lost:
        if s.pools.get(n) not in (Pool.FAULTY, Pool.STANDBY, Pool.RETIRED):
            mark_faulty(s, n, now, cfg, events, "lost during generation")
    # Prefer standby nodes; a lost node that came back (fresh agent) is the last resort.
    spares = [n for n in _healthy_standby(s, obs, now, cfg) if n not in lost]
    spares += [
        n for n in lost if s.pools.get(n) == Pool.STANDBY and n in obs and _alive(obs[n], now, cfg)
    ]
    shrink = len(lost) - len(spares)
    if shrink > 0 and cfg.elastic and len(s.assignment) - shrink >= (cfg.min_nodes or cfg.nodes):
        gone = lost[len(spares) :]
        lost = lost[: len(spares)]
        for n in gone:
            s.assignment.pop(n)
        events.append(
            (
                "membership_changed",
                {
                    "from_nodes": len(s.assignment) + len(gone),
                    "to_nodes": len(s.assignment),
                    "left": gone,
                    "reason": f"no standby for {', '.join(gone)}; elastic (at least "
                    f"{cfg.min_nodes} nodes): going on with {len(s.assignment)}",
                },
            )
        )
    if len(spares) < len(lost):
        if s.phase != Phase.WAITING_FOR_NODES:
            _goto(
                s,
                Phase.WAITING_FOR_NODES,
                now,
                events,
                f"need {len(lost)} node(s) to replace {', '.join(lost)}; {len(spares)} standby",
            )
        elif now - s.phase_since > cfg.wait_for_nodes_timeout_s:
            s.reason = (
                f"waited {now - s.phase_since:.0f}s for {len(lost) - len(spares)} node(s) to "
                f"replace {', '.join(lost)}; none came (wait_for_nodes_timeout_s = "
                f"{cfg.wait_for_nodes_timeout_s:.0f}); re-run with the same --run-dir to resume"
            )
            if s.recovery is not None:
                s.recoveries.append(s.recovery)
                s.recovery = None
            _goto(s, Phase.FAILED, now, events, s.reason)
        return
    for n, spare in zip(lost, spares, strict=False):
        rank = s.assignment.pop(n)
        s.assignment[spare] = rank
        s.pools[spare] = Pool.RUNNING
        if s.recovery is not None:
            s.recovery.replaced[n] = spare
        events.append(
            (
                "pool_changed",
                {
                    "node": spare,
                    "from": "standby",
                    "to": "running",
                    "reason": f"takes node rank {rank} of {n}",
                },
            )
        )
    # node ranks stay dense (0..n-1) in their old order when the world shrank
    order = sorted(s.assignment, key=lambda n: s.assignment[n])
    s.assignment = {n: i for i, n in enumerate(order)}
    if s.recovery is not None:
        s.recovery.t_replaced = now
    if s.fallback:
        s.fallback = False
        why = f"restart from an older checkpoint (restart {s.restarts} of {cfg.max_restarts})"
    else:
        s.restarts += 1
        why = f"restart {s.restarts} of {cfg.max_restarts}"
    _start_generation(s, obs, cfg, now, events, durable, why)


def world_of(s: JobState, cfg: JobConfig) -> int:
    """Ranks of the current generation (fewer than ``cfg.world_size`` while shrunk)."""
    return (len(s.assignment) or cfg.nodes) * cfg.nproc_per_node


def _can_grow(s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig) -> bool:
    """Elastic and shrunk, a standby is healthy, and this generation has made progress
    (so a node that flaps cannot keep the job restarting)."""
    return (
        cfg.elastic
        and len(s.assignment) < cfg.nodes
        and bool(_healthy_standby(s, obs, now, cfg))
        and s.max_step.get(s.generation, 0) > (s.restore_step or 0)
    )


PERSIST_SETTLE_S = 15.0  # a planned stop waits this long for ckptds to verify their queue


def _persist_planned_stop(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    durable: list[tuple[int, int]],
) -> bool:
    """A planned stop saves what memory holds: when every rank's newest common snapshot is
    newer than the newest durable step, the nodes' ckptds persist it (any script, with or
    without a SIGTERM handler: SIGTERM's default action kills a worker, its snapshots stay in
    ckptd's memory). Returns True once done (persisted, nothing to persist, or past
    ``stop_persist_timeout_s``); records ``planned_stop`` with the steps the stop cost."""
    gen = s.generation
    if s.persist_done >= gen:
        return True
    last = s.max_step.get(gen)
    newest_durable = max((st for st, _ in durable), default=None)
    if s.persist is None:
        # The memory index is whole once every node's ckptd verified what was staged before
        # the workers stopped (bounded: PERSIST_SETTLE_S, then what is indexed counts).
        busy = [n for n in s.assignment if n in obs and not obs[n].ckptd_idle]
        if cfg.memory_tier and busy:
            if s.persist_settle_until is None:
                s.persist_settle_until = now + PERSIST_SETTLE_S
            if now < s.persist_settle_until:
                return False
        point = _held_by_every_rank(s, obs, cfg) if cfg.memory_tier else None
        if point is not None and (newest_durable is None or point[0] > newest_durable):
            s.persist = {"step": point[0], "generation": point[1],
                         "deadline": now + cfg.stop_persist_timeout_s}  # fmt: skip
            events.append(("stop_persist_started", {"step": point[0], "last_step": last}))
            return False
        saved = newest_durable
    elif tuple((s.persist["step"], s.persist["generation"])) in {tuple(d) for d in durable}:
        saved = int(s.persist["step"])
    elif now < float(s.persist["deadline"]):
        return False
    else:
        events.append(("stop_persist_failed", {"step": s.persist["step"],
                       "timeout_s": cfg.stop_persist_timeout_s}))  # fmt: skip
        saved = newest_durable
    events.append(
        (
            "planned_stop",
            {
                "generation": gen,
                "why": "stop requested" if s.stop_requested else "planned restart",
                "last_step": last,
                "saved_step": saved,
                "steps_lost": None if last is None else last - (saved or 0),
            },
        )
    )
    s.persist, s.persist_done, s.persist_settle_until = None, gen, None
    return True


def _held_by_every_rank(
    s: JobState, obs: dict[str, NodeObs], cfg: JobConfig
) -> tuple[int, int] | None:
    """The newest (step, generation) that every rank of the assignment holds in its own node's
    memory (what that node's ckptd can persist), or None."""
    held: list[set[tuple[int, int]]] = []
    for node, node_rank in s.assignment.items():
        mem = obs[node].memory if node in obs else {}
        for i in range(cfg.nproc_per_node):
            rank = node_rank * cfg.nproc_per_node + i
            held.append({(int(p[0]), int(p[1])) for p in mem.get(rank, [])})
    common = set.intersection(*held) if held else set()
    return max(common) if common else None


def _planned_restart(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    durable: list[tuple[int, int]],
) -> None:
    """After a planned stop (workers saved; no fault, no budget): each node in ``s.evict`` is
    quarantined and a healthy standby takes its node rank; otherwise (elastic) standbys join
    up to ``cfg.nodes``."""
    s.growing = False
    spare = _healthy_standby(s, obs, now, cfg)
    if s.evict:
        for node, why in sorted(s.evict.items()):
            if node in s.assignment and spare:
                rank = s.assignment.pop(node)
                mark_faulty(s, node, now, cfg, events, why)
                s.assignment[spare.pop(0)] = rank
        s.evict = {}
        _start_generation(s, obs, cfg, now, events, durable, "replaced a straggler node")
        return
    joining = spare[: cfg.nodes - len(s.assignment)]
    before = len(s.assignment)
    for n in joining:
        s.assignment[n] = len(s.assignment)
        s.pools[n] = Pool.RUNNING
        events.append(
            (
                "pool_changed",
                {"node": n, "from": "standby", "to": "running", "reason": "elastic growth"},
            )
        )
    events.append(
        (
            "membership_changed",
            {"from_nodes": before, "to_nodes": len(s.assignment), "joined": joining},
        )
    )
    _start_generation(s, obs, cfg, now, events, durable, f"grow to {len(s.assignment)} nodes")


def _start_generation(
    s: JobState,
    obs: dict[str, NodeObs],
    cfg: JobConfig,
    now: float,
    events: list[Event],
    durable: list[tuple[int, int]],
    why: str,
) -> None:
    world = world_of(s, cfg)
    # Memory snapshots are per rank of the old world: after a change, every rank reads DCP.
    same_world = s.last_world in (0, world)
    point, tiers = restore_point(s, obs, cfg, durable, memory=same_world)
    s.last_world = world
    ckpt_step = point[0] if point else None
    s.generation += 1
    s.master_port = None
    s.restore_step = ckpt_step
    s.restore_gen = point[1] if point else None
    s.restore_sources = replica_sources(s, obs, cfg) if same_world else {}
    s.restore_memory = same_world
    for n, r in s.assignment.items():
        if s.pools.get(n) != Pool.RUNNING:
            events.append(
                (
                    "pool_changed",
                    {
                        "node": n,
                        "from": s.pools[n].value if n in s.pools else None,
                        "to": "running",
                        "reason": f"node rank {r} of generation {s.generation}",
                    },
                )
            )
        s.pools[n] = Pool.RUNNING
    s.gen_incarnations = {n: s.incarnations.get(n, "") for n in s.assignment}
    if s.recovery is not None:
        s.recovery.to_generation = s.generation
        s.recovery.restore_step = ckpt_step
        s.recovery.restore_tiers = tiers
        gen_lost = s.recovery.fault.generation
        s.recovery.steps_lost = max(0, s.max_step.get(gen_lost, 0) - (ckpt_step or 0))
    events.append(
        (
            "generation_started",
            {
                "generation": s.generation,
                "assignment": s.assignment,
                "restore_step": ckpt_step,
                "restore_generation": s.restore_gen,
                "restore_tiers": tiers,
                "replica_sources": s.restore_sources,
            },
        )
    )
    _goto(s, Phase.RENDEZVOUS, now, events, why)


def desired_for(
    s: JobState,
    node_id: str,
    obs: dict[str, NodeObs],
    cfg: JobConfig,
    ring: list[str] | None = None,
) -> Desired:
    """The state a node's agent must reach (level-triggered; the agent reconciles toward it).
    ``ring``: ``restore.ring_of(s)``; a caller computing every node's desired state passes it
    once (each call is then O(1) in the number of nodes)."""
    if s.phase.terminal:
        return Shutdown(reason=s.reason, phase=s.phase.value)
    rank = s.assignment.get(node_id)
    ckpt = CkptConf(
        dir=cfg.ckpt_dir,
        shm_dir=cfg.shm_dir,
        keep=cfg.keep_checkpoints,
        memory_tier=cfg.memory_tier,
    )
    idle = Idle(nproc_per_node=cfg.nproc_per_node, ckpt=ckpt)
    if rank is None or _rebooted(s, node_id, obs):
        return idle  # a rebooted node never rejoins the generation it was lost from
    if s.phase in (Phase.STOPPING, Phase.CLEANING, Phase.FAULTED):
        faulted = s.recovery is not None and not s.growing  # growth: workers save, then exit
        grace = cfg.fault_stop_grace_s if faulted else cfg.stop_grace_s
        hang = faulted and s.recovery is not None and s.recovery.fault.cause == FaultCause.HANG
        persist = None
        if s.persist is not None:  # persist this snapshot from memory (a planned stop)
            persist = (int(s.persist["step"]), int(s.persist["generation"]))
        return Stop(generation=s.generation, grace_s=grace, dump_stacks=hang, persist=persist)
    if s.phase not in _ACTIVE_GEN:
        return idle
    ring = ring if ring is not None else ring_of(s)
    master = ring[0]
    injects = [i.to_json() for i in cfg.injects if i.id not in s.fired and i.kind != "gemm-wrong"]
    return Run(
        generation=s.generation,
        node_rank=rank,
        nnodes=len(s.assignment),
        nproc_per_node=cfg.nproc_per_node,
        world_size=world_of(s, cfg),
        master_addr=obs[master].addr if master in obs else None,
        master_port=s.master_port,
        host_store=rank == 0,
        restore_step=s.restore_step,
        restore_gen=s.restore_gen,
        restore_memory=s.restore_memory,
        ckpt=ckpt,
        restarts=s.restarts,
        max_restarts=cfg.max_restarts,
        injects=injects,
        script=cfg.script,
        launch=cfg.launch,
        log_dir=cfg.log_dir,
        script_args=list(cfg.script_args),
        hang_timeout_s=cfg.hang_timeout_s,
        hang_timeout_min_s=cfg.hang_timeout_min_s,
        hang_timeout_max_s=cfg.hang_timeout_max_s,
        first_step_timeout_s=cfg.first_step_timeout_s,
        heartbeat_s=cfg.heartbeat_s,
        node_timeout_s=cfg.node_timeout_s,
        replica_peers=replica_peers(s, node_id, obs, cfg, ring),
        replica_sources=s.restore_sources,
    )
