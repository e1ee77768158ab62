"""The job state machine as a pure function: ``decide(state, obs, now, cfg, durable, inputs)``.

No I/O, no clock, no processes: tests drive it with a fake clock. The executor
(server.py) feeds it the agents' latest reports and applies what it returns:
the new state (from which every node's desired state follows, ``desired_for``)
and events to record.

Its parts, by concern: ``pools`` (pools and re-checks), ``detect`` (fault detection; where a
node is declared lost), ``restore`` (restore point and replicas), ``policy`` (restart
policy, replacement, planned stops, the next generation), ``desired`` (desired states);
``jobstate`` holds the state, its inputs and its JSON form; ``summary`` the node summaries
and the nodes' deadlines a tick reads instead of every worker (issue 31).
"""

from __future__ import annotations

from trainguard.controller.api import (
    Fault,
    NodeObs,
    Phase,
    Pool,
    Recovery,
)
from trainguard.controller.config import JobConfig
from trainguard.controller.desired import desired_for
from trainguard.controller.detect import blame_lost_node, detect_fault, finished
from trainguard.controller.inprocess import plan as inprocess_plan
from trainguard.controller.inprocess import refine as inprocess_refine
from trainguard.controller.jobstate import (
    ACTIVE_PHASES,
    Event,
    Inputs,
    JobState,
    copy_state,
    fold_inputs,
    goto,
)
from trainguard.controller.policy import (
    apply_policy,
    can_grow,
    persist_planned_stop,
    planned_restart,
    replace_and_restart,
    start_generation,
)
from trainguard.controller.pools import (
    healthy_standby,
    is_alive,
    mark_faulty,
    rebooted,
    update_pools,
    world_of,
)
from trainguard.controller.sdc import check_fingerprints, check_suspected
from trainguard.controller.summary import NO_STEP, GenView, Liveness, LiveTick, gen_view

__all__ = ["JobState", "decide", "desired_for"]


def decide(
    s0: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    durable: list[tuple[int, int]],
    inputs: Inputs | None = None,
    live: Liveness | None = None,
) -> tuple[JobState, list[Event]]:
    """One step of the state machine, the only writer of the job state. ``durable``: verified
    committed (step, generation) pairs; the memory tier comes from the agents' reports
    (``NodeObs.memory``); ``inputs``: what else happened since the last step (``Inputs``);
    ``live``: the deadlines of ``obs``'s nodes (``summary.Liveness``, kept by the intake), so
    that the nodes not alive are not found by a scan; without it, they are (the same answer).

    Returns the new state (``s0`` is not modified) and the events to record.
    """
    s = copy_state(s0)
    events: list[Event] = []
    if inputs is not None:
        fold_inputs(s, inputs, events)
    tick = live.at(obs, now) if live is not None else None  # who is not alive: once a tick
    update_pools(s, obs, now, cfg, events, tick)
    for node, why in (inputs.quarantine if inputs is not None else {}).items():
        if s.pools.get(node) == Pool.STANDBY:  # at risk: never the replacement of a lost node
            mark_faulty(s, node, now, cfg, events, why)
    view = gen_view(s, obs)  # the generation's workers, read from the node summaries
    _fold_steps(s, view)
    if s.phase == Phase.RUNNING and inputs is not None and inputs.fingerprints:
        standby = bool(healthy_standby(s, obs, now, cfg))
        sdc = check_fingerprints(s, inputs.fingerprints, now, cfg, events, standby)
        if sdc is not None:
            _faulted(s, sdc, now, events, obs, cfg)
    if s.phase == Phase.RUNNING and inputs is not None and inputs.suspected:
        sdc = check_suspected(s, inputs.suspected, now, cfg, events)
        if sdc is not None:
            _faulted(s, sdc, now, events, obs, cfg)
    if (
        s.stop_requested
        and not s.phase.terminal
        and s.phase not in (Phase.STOPPING, Phase.CLEANING, Phase.FAULTED)
    ):
        if s.assignment and s.phase in ACTIVE_PHASES:
            goto(s, Phase.STOPPING, now, events, "stop requested")
        else:
            s.reason = "stopped by request"
            goto(s, Phase.STOPPED, now, events, s.reason)
        return s, events
    # One handler per phase; a phase one handler enters is handled in the same step when
    # its handler comes later (STOPPING → CLEANING → REPLACING: a fast recovery takes one).
    handler = _HANDLERS.get(s.phase)
    if s.phase in ACTIVE_PHASES:
        _active(s, obs, now, cfg, events, tick, view)
    elif handler is not None:
        handler(s, obs, now, cfg, events, durable)
    if s.phase == Phase.CLEANING:
        _cleaning(s, obs, now, cfg, events, durable)
    if s.phase in (Phase.REPLACING, Phase.WAITING_FOR_NODES):
        replace_and_restart(s, obs, now, cfg, events, durable)
    return s, events


def _fold_steps(s: JobState, v: GenView) -> None:
    """``s.max_step`` of the current generation from the assigned nodes' reports: the newest
    step ``v`` saw (their workers' and ``steps_seen``)."""
    if v.max_step != NO_STEP:
        gen = s.generation
        s.max_step[gen] = max(s.max_step.get(gen, 0), v.max_step)


def _pending(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    durable: list[tuple[int, int]],
) -> None:
    """PENDING: start the first generation once the pool joined (FAILED if too few passed
    pre-flight)."""
    # Start once the whole pool joined (or, after join_timeout_s, with enough nodes);
    # node ranks follow node names, so node0 is node rank 0 when it is there.
    healthy = sorted(healthy_standby(s, obs, now, cfg), key=lambda n: (len(n), n))
    everyone = len(healthy) >= cfg.nodes + cfg.standby
    enough = len(healthy) >= (cfg.min_nodes or cfg.nodes)  # elastic: MIN will do
    failed = sorted(n for n, p in s.pools.items() if p in (Pool.FAULTY, Pool.RETIRED))
    # Every expected node joined, some failed pre-flight: start on the ones that passed.
    settled = enough and len(healthy) + len(failed) >= cfg.nodes + cfg.standby
    waited = now - s.phase_since > cfg.timeouts.join_timeout_s
    # A node whose pre-flight is still running is waited for: the check has deadlines
    # of its own (stage deadlines; inconclusive runs are retried a bounded number of times).
    checking = [
        n for n, o in obs.items()
        if n not in s.pools and cfg.preflight.level != "off" and n not in s.checked_at
        and is_alive(o, now, cfg)
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
            f"{n}: {(s.check_problems.get(n) or obs[n].health_problems or ('lost',))[0]}"
            if n in obs
            else f"{n}: lost"
            for n in failed
        )
        s.reason = (
            f"only {len(healthy)} of the {need} nodes needed passed pre-flight in "
            f"{now - s.phase_since:.0f}s; failed: {why}"
        )
        goto(s, Phase.FAILED, now, events, s.reason)
        return
    if everyone or settled or (enough and waited):
        s.assignment = {n: i for i, n in enumerate(healthy[: cfg.nodes])}
        why = (
            "all nodes joined"
            if everyone
            else f"{len(healthy)} nodes passed pre-flight; left out: {', '.join(failed)}"
            if settled
            else f"{len(healthy)} nodes joined in {now - s.phase_since:.0f}s"
        )
        start_generation(s, obs, cfg, now, events, durable, why)


def _active(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    live: LiveTick | None,
    v: GenView,
) -> None:
    """RENDEZVOUS and RUNNING: take the store's port, detect a fault (→ FAULTED, STOPPING),
    the end (SUCCEEDED, or FAILED when ranks exited 0 early), every rank up (→ RUNNING), or a
    planned stop (a straggler's eviction, elastic growth). ``v``: ``gen_view(s, obs)``."""
    gen = s.generation
    master = next(n for n, r in s.assignment.items() if r == 0)
    store = obs[master].store if master in obs else None
    if s.master_port is None and store is not None and store[0] == gen:
        s.master_port = store[1]
    fault = detect_fault(s, obs, now, cfg, live=live, view=v)
    if fault is not None:
        _faulted(s, fault, now, events, obs, cfg)
    elif (workers := finished(s, obs, cfg, events, v)) is not None:
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
            goto(s, Phase.FAILED, now, events, s.reason)
        else:
            s.reason = f"all {world_of(s, cfg)} ranks finished"
            if s.recovery is not None and s.recovery.to_generation == gen:
                # a script without step reports: its restart counts once it finished
                s.recoveries.append(s.recovery)
                s.recovery = None
            goto(s, Phase.SUCCEEDED, now, events, s.reason)
    elif (
        s.phase == Phase.RENDEZVOUS
        and v.count == world_of(s, cfg)
        and v.running + v.succeeded == v.count
    ):
        goto(s, Phase.RUNNING, now, events, f"all {world_of(s, cfg)} ranks running")
    elif s.phase == Phase.RUNNING and s.evict:
        s.growing = True  # a planned stop: workers save, no restart budget spent
        nodes = ", ".join(sorted(s.evict))
        goto(s, Phase.STOPPING, now, events, f"replace {nodes}: {next(iter(s.evict.values()))}")
    elif s.phase == Phase.RUNNING and can_grow(s, obs, now, cfg):
        # Elastic: nodes are back. Stop at a checkpoint boundary (workers get SIGTERM and
        # save a durable step) and restart on the larger world; not a fault, no budget.
        s.growing = True
        goto(s, Phase.STOPPING, now, events, "grow: standby node(s) available")


def _faulted(
    s: JobState,
    fault: Fault,
    now: float,
    events: list[Event],
    obs: dict[str, NodeObs],
    cfg: JobConfig,
) -> None:
    """The running generation has a fault: FAULTED, then STOPPING at once, in process or as a
    restart of every rank (``inprocess.plan``)."""
    keep, why = inprocess_plan(s, fault, obs, now, cfg)
    if s.recovery is not None:  # a fault during a recovery: the first is kept, never reached
        s.recoveries.append(s.recovery)  # its first step (the report lists its fault)
    s.recovery = Recovery(
        fault=fault, from_generation=s.generation, mode="inprocess" if keep else "restart",
        mode_reason=why, kept=keep,
    )  # fmt: skip
    events.append(("fault", fault.to_json()))
    events.append(("recovery_mode", {"generation": s.generation, "mode": s.recovery.mode,
                                     "kept": keep, "reason": why}))  # fmt: skip
    goto(s, Phase.FAULTED, now, events, fault.message.splitlines()[0])
    how = (
        f"in process, rank(s) {', '.join(map(str, keep[:8]))}{', …' if len(keep) > 8 else ''} "
        "keep their processes"
        if keep
        else f"restart of every rank: {why}"
    )
    goto(s, Phase.STOPPING, now, events, f"stop the faulted generation ({how})")


def _stopping(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    durable: list[tuple[int, int]],
) -> None:
    """STOPPING: once every live node stopped its workers, CLEANING."""
    gen = s.generation
    pending = [
        n
        for n in s.assignment
        if n in obs
        and is_alive(obs[n], now, cfg)
        and obs[n].stopped_generation < gen
        and not rebooted(s, n, obs)
    ]
    if not pending:
        if s.recovery is not None:
            acks = [obs[n] for n in s.assignment if n in obs and obs[n].stopped_generation >= gen]
            s.recovery.t_stopped = max([o.stopped_at or now for o in acks], default=now)
            s.recovery.t_cleaned = max([o.cleaned_at or now for o in acks], default=now)
        goto(s, Phase.CLEANING, now, events, "every live node stopped its workers")


def _cleaning(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    durable: list[tuple[int, int]],
) -> None:
    """CLEANING: a planned stop persists memory and restarts (growth, eviction) or ends (a
    stop request); a fault is attributed and the restart policy applied (→ REPLACING)."""
    planned = s.growing or s.stop_requested
    if planned and not persist_planned_stop(s, obs, now, cfg, events, durable):
        pass  # the nodes' ckptds are persisting the newest memory snapshot
    elif s.growing and not s.stop_requested:
        planned_restart(s, obs, now, cfg, events, durable)
    else:
        if s.recovery is None or s.stop_requested:  # a stop requested mid-recovery ends the job
            if s.recovery is not None:
                s.recoveries.append(s.recovery)
                s.recovery = None
            s.reason = "stopped by request"
            goto(s, Phase.STOPPED, now, events, s.reason)
        else:
            blame_lost_node(s, obs, now, cfg, events)
            inprocess_refine(s, obs, now, cfg)
            goto(s, Phase.REPLACING, now, events, "workers stopped, processes and segments cleaned")
            apply_policy(s, obs, now, cfg, events, durable)


# RENDEZVOUS and RUNNING: ``_active`` (it reads the generation's view as well).
_HANDLERS = {
    Phase.PENDING: _pending,
    Phase.STOPPING: _stopping,
}
