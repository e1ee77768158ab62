"""What to do after the workers stopped: the restart policy (budget, user errors, fallback
to an older restore point), replacing lost or faulty nodes by standbys (or shrinking when
elastic), planned stops that persist memory snapshots (growth, evictions, a user's stop),
and starting the next generation from the restore point; and what to do about a detector's
finding (``react``: evict, drain, quarantine or keep). Pure."""

from __future__ import annotations

import dataclasses

from trainguard.controller.api import NodeObs, Phase, Pool
from trainguard.controller.config import JobConfig
from trainguard.controller.detect import last_line, lost_nodes
from trainguard.controller.detectors import Finding
from trainguard.controller.jobstate import (
    Event,
    JobState,
    goto,
    held_out,
)
from trainguard.controller.pools import healthy_standby, is_alive, mark_faulty, world_of
from trainguard.controller.restore import replica_sources, restore_point
from trainguard.protocol import FaultCause

PERSIST_SETTLE_S = 15.0  # a planned stop waits this long for ckptds to verify their queue


def apply_policy(
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
    # A rank could not read the agreed point from any tier: an older one is used next. Not
    # the script's failure, and not a generation without progress.
    if [s.restore_step, s.restore_gen] in s.unusable:
        _fall_back(s, obs, cfg, events, durable)
    else:
        # What the guards can see: step reports (the runtime), checkpoints (the
        # Checkpointer). A plain script shows neither, and is judged by its restart budget,
        # except for a failure that repeats word for word (a bug in the script, not a
        # transient fault).
        reports_steps = bool(s.max_step)
        line = last_line(fault.message) if fault.cause == FaultCause.WORKER_EXIT else ""
        _count_prestep_failures(s, reports_steps, line)
        _count_progress(s, obs, cfg, durable, reports_steps)
        s.reason = _give_up_reason(s, cfg, reports_steps, line) or s.reason
    if s.reason:
        s.recoveries.append(s.recovery)
        s.recovery = None
        goto(s, Phase.FAILED, now, events, s.reason)


def _fall_back(
    s: JobState,
    obs: dict[str, NodeObs],
    cfg: JobConfig,
    events: list[Event],
    durable: list[tuple[int, int]],
) -> None:
    """The restore point is unusable: the next older one; the script's own start when no
    step was ever made durable (only memory or replica copies existed, and the newest of them
    failed: at most the steps since the start are redone, the losses are the same); the end
    when a durable step was committed and no copy of any is left (a loss the user must see)."""
    assert s.recovery is not None
    point, _ = restore_point(s, obs, cfg, durable)
    from_start = point is None and not durable
    events.append(
        (
            "restore_fallback",
            {
                "generation": s.recovery.fault.generation,
                "unusable": [s.restore_step, s.restore_gen],
                "next": list(point) if point else None,
                "from_start": from_start,
            },
        )
    )
    if point is None and not from_start:
        s.reason = (
            f"no restorable checkpoint left: step {s.restore_step} failed to load from "
            "every tier and no older verified copy exists (see ckpt_restore_failed events)"
        )
    else:  # each fallback drops a point, so they are bounded: not charged to the budget
        s.fallback = True


def _count_prestep_failures(s: JobState, reports_steps: bool, line: str) -> None:
    """Generations in a row whose script failed before its first step (a user error)."""
    assert s.recovery is not None
    fault = s.recovery.fault
    if fault.cause != FaultCause.WORKER_EXIT:
        s.prestep_failures = 0
    elif reports_steps:
        s.prestep_failures = s.prestep_failures + 1 if fault.generation not in s.max_step else 0
    else:
        s.prestep_failures = s.prestep_failures + 1 if line == s.last_failure else 1
    s.last_failure = line


def _count_progress(
    s: JobState,
    obs: dict[str, NodeObs],
    cfg: JobConfig,
    durable: list[tuple[int, int]],
    reports_steps: bool,
) -> None:
    """Generations in a row without progress: a newer checkpoint than the one the generation
    restored, or (no checkpoint seen yet) a step beyond every earlier generation's."""
    assert s.recovery is not None
    gen = s.recovery.fault.generation
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


def _give_up_reason(s: JobState, cfg: JobConfig, reports_steps: bool, line: str) -> str:
    """Why the job fails now (user error, no progress, budget spent), or "" to go on."""
    assert s.recovery is not None
    fault = s.recovery.fault
    if s.prestep_failures >= cfg.restart.user_error_generations:
        return (
            f"user error: the script failed before its first step in {s.prestep_failures} "
            f"generations in a row; last error: {last_line(fault.message)}"
            if reports_steps
            else f"user error: the script failed before its first step report, "
            f"{s.prestep_failures} times in a row with the same error: {line}"
        )
    if s.no_progress_generations >= cfg.restart.no_progress_generations:
        return f"no progress: {s.no_progress_generations} generations in a row without a new " + (
            "checkpoint" if s.seen_checkpoint else "step beyond the earlier generations'"
        )
    if s.restarts >= cfg.restart.max_restarts:
        return f"restart budget spent ({cfg.restart.max_restarts} restarts); last fault: {fault.message.splitlines()[0]}"
    return ""


def _stale(o: NodeObs) -> bool:
    """The node's memory index was asked of its ckptd before its workers stopped: a snapshot
    staged just before the stop may be missing from it (the agent reads ckptd in its own
    thread, never in the heartbeat; it asks again right after a stop)."""
    return o.stopped_at is not None and (o.ckptd_at is None or o.ckptd_at < o.stopped_at)


def replace_and_restart(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    durable: list[tuple[int, int]],
) -> None:
    """Once the memory index settled: the lost nodes replaced by standbys (or the world shrunk
    when elastic), or a wait for nodes; then the next generation."""
    if not _settled(s, obs, now, cfg):
        return
    lost = _lost(s, obs, now, cfg, events)
    # Prefer standby nodes; a lost node that came back (fresh agent) is the last resort.
    spares = [n for n in healthy_standby(s, obs, now, cfg) if n not in lost]
    spares += [
        n
        for n in lost
        if s.pools.get(n) == Pool.STANDBY
        and n in obs
        and is_alive(obs[n], now, cfg)
        and n != held_out(s)
    ]
    lost = _shrink(s, cfg, events, lost, spares)
    if len(spares) < len(lost):
        _wait_for_nodes(s, now, cfg, events, lost, spares)
        return
    _replace(s, events, lost, spares)
    if s.recovery is not None:
        s.recovery.t_replaced = now
    if s.fallback:
        s.fallback = False
        why = (
            f"restart from an older checkpoint (restart {s.restarts} of {cfg.restart.max_restarts})"
        )
    else:
        s.restarts += 1
        inproc = s.recovery is not None and s.recovery.mode == "inprocess"
        kind = "in-process recovery" if inproc else "restart"  # both spend the restart budget
        why = f"{kind} {s.restarts} of {cfg.restart.max_restarts}"
    start_generation(s, obs, cfg, now, events, durable, why)


def _settled(s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig) -> bool:
    """The restore point comes from the memory index: first let every live node's ckptd
    verify what its ranks staged before they stopped (bounded by PERSIST_SETTLE_S)."""
    busy = [
        n
        for n in s.assignment
        if n in obs and is_alive(obs[n], now, cfg) and (not obs[n].ckptd_idle or _stale(obs[n]))
    ]
    if busy and cfg.checkpoint.memory_tier:
        if s.persist_settle_until is None:
            s.persist_settle_until = now + PERSIST_SETTLE_S
        if now < s.persist_settle_until:
            return False
    s.persist_settle_until = None
    return True


def _lost(
    s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig, events: list[Event]
) -> list[str]:
    """The nodes that leave the job, in node-rank order, each quarantined unless it is
    already out of the running pool."""
    lost = sorted(
        set(lost_nodes(s, obs, now, cfg))
        # Quarantined during this generation or its recovery, even if its re-check has
        # passed since (back in standby): it leaves the job; it may come back as a spare.
        | {n for n in s.assignment if s.pools.get(n) != Pool.RUNNING}
        | {n for n in s.assignment if n == held_out(s)},  # an SDC recomputation's
        key=lambda n: s.assignment[n],
    )
    for n in lost:
        if s.pools.get(n) not in (Pool.FAULTY, Pool.STANDBY, Pool.RETIRED):
            mark_faulty(s, n, now, cfg, events, "lost during generation")
    return lost


def _shrink(
    s: JobState, cfg: JobConfig, events: list[Event], lost: list[str], spares: list[str]
) -> list[str]:
    """Elastic, with fewer spares than lost nodes but at least ``min_nodes`` left: the lost
    nodes without a spare leave the world. Returns the lost nodes still to replace."""
    shrink = len(lost) - len(spares)
    if not (
        shrink > 0 and cfg.elastic and len(s.assignment) - shrink >= (cfg.min_nodes or cfg.nodes)
    ):
        return lost
    gone = lost[len(spares) :]
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
    return lost[: len(spares)]


def _wait_for_nodes(
    s: JobState,
    now: float,
    cfg: JobConfig,
    events: list[Event],
    lost: list[str],
    spares: list[str],
) -> None:
    """Too few spares: wait for nodes, and fail past ``wait_for_nodes_timeout_s``."""
    if s.phase != Phase.WAITING_FOR_NODES:
        goto(
            s,
            Phase.WAITING_FOR_NODES,
            now,
            events,
            f"need {len(lost)} node(s) to replace {', '.join(lost)}; {len(spares)} standby",
        )
    elif now - s.phase_since > cfg.timeouts.wait_for_nodes_timeout_s:
        s.reason = (
            f"waited {now - s.phase_since:.0f}s for {len(lost) - len(spares)} node(s) to "
            f"replace {', '.join(lost)}; none came (wait_for_nodes_timeout_s = "
            f"{cfg.timeouts.wait_for_nodes_timeout_s:.0f}); re-run with the same --run-dir to resume"
        )
        if s.recovery is not None:
            s.recoveries.append(s.recovery)
            s.recovery = None
        goto(s, Phase.FAILED, now, events, s.reason)


def _replace(s: JobState, events: list[Event], lost: list[str], spares: list[str]) -> None:
    """Each lost node's node rank to a spare; node ranks dense again (0..n-1, old order)."""
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


def can_grow(s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig) -> bool:
    """Elastic and shrunk, a standby is healthy, and this generation has made progress
    (so a node that flaps cannot keep the job restarting)."""
    return (
        cfg.elastic
        and len(s.assignment) < cfg.nodes
        and bool(healthy_standby(s, obs, now, cfg))
        and s.max_step.get(s.generation, 0) > (s.restore_step or 0)
    )


def persist_planned_stop(
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
        busy = [
            n for n in s.assignment if n in obs and (not obs[n].ckptd_idle or _stale(obs[n]))
        ]  # an index asked before the stop may lack the last snapshot
        if cfg.checkpoint.memory_tier and busy:
            if s.persist_settle_until is None:
                s.persist_settle_until = now + PERSIST_SETTLE_S
            if now < s.persist_settle_until:
                return False
        point = _held_by_every_rank(s, obs, cfg) if cfg.checkpoint.memory_tier else None
        if point is not None and (newest_durable is None or point[0] > newest_durable):
            s.persist = {"step": point[0], "generation": point[1],
                         "deadline": now + cfg.timeouts.stop_persist_timeout_s}  # fmt: skip
            events.append(("stop_persist_started", {"step": point[0], "last_step": last}))
            return False
        saved = newest_durable
    elif tuple((s.persist["step"], s.persist["generation"])) in {tuple(d) for d in durable}:
        saved = int(s.persist["step"])
    elif now < float(s.persist["deadline"]) and _any_reporting(s, obs, now, cfg):
        return False
    else:  # past the deadline, or no node of the assignment left to persist it
        events.append(("stop_persist_failed", {"step": s.persist["step"],
                       "timeout_s": cfg.timeouts.stop_persist_timeout_s,
                       "nodes_gone": not _any_reporting(s, obs, now, cfg)}))  # fmt: skip
        saved = newest_durable
    events.append(
        (
            "planned_stop",
            {
                "generation": gen,
                "why": "stop requested" if s.stop_requested else "planned restart",
                # a step's report may trail its snapshot: the saved step then counts as done
                "last_step": last if last is None else max(last, saved or 0),
                "saved_step": saved,
                "steps_lost": None if last is None else max(0, last - (saved or 0)),
            },
        )
    )
    s.persist, s.persist_done, s.persist_settle_until = None, gen, None
    return True


def _any_reporting(s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig) -> bool:
    """Does some node of the assignment still report (within the node timeout)? When none
    does (``pools.is_alive``: the whole job's hosts stopped or left), nothing can persist the
    point any more, and a planned stop does not wait out ``stop_persist_timeout_s``."""
    return any(n in obs and is_alive(obs[n], now, cfg) for n in s.assignment)


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


def planned_restart(
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
    spare = healthy_standby(s, obs, now, cfg)
    if s.evict:
        replaced = []
        for node, why in sorted(s.evict.items()):
            if node in s.assignment and spare:
                rank = s.assignment.pop(node)
                mark_faulty(s, node, now, cfg, events, why)
                s.assignment[spare.pop(0)] = rank
                replaced.append(f"{node} ({why})")
        s.evict = {}
        why = "replaced " + "; ".join(replaced) if replaced else "no standby to replace with"
        start_generation(s, obs, cfg, now, events, durable, why)
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
    start_generation(s, obs, cfg, now, events, durable, f"grow to {len(s.assignment)} nodes")


def start_generation(
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
        if s.recovery.kept and ckpt_step is None:
            _no_restore_no_keep(s, events)
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
    goto(s, Phase.RENDEZVOUS, now, events, why)


def _no_restore_no_keep(s: JobState, events: list[Event]) -> None:
    """No checkpoint to restore: a kept process would carry the state it trained (a model made
    outside ``trainguard.run``'s function) into a generation that starts again from step 0, so
    every rank restarts (the agents resume no parked process into a Run without a restore
    point)."""
    assert s.recovery is not None
    rec = s.recovery
    rec.mode, rec.kept = "restart", []
    rec.mode_reason = (
        "no checkpoint every rank agrees on yet: a kept process would keep the state it "
        "trained past step 0, which nothing restores"
    )
    events.append(("recovery_mode", {"generation": rec.from_generation, "mode": rec.mode,
                                     "kept": [], "reason": rec.mode_reason}))  # fmt: skip


@dataclasses.dataclass(kw_only=True, slots=True)
class Reaction:
    """What the policy does about a finding: ``evict`` node → why (replaced by a standby at
    the next checkpoint boundary: a planned stop, no step lost, no restart charged);
    ``quarantine`` node → why (a standby moved to the faulty pool, re-checked before it may
    take a rank); ``record``: events to record; ``alert``: events to record and alert."""

    evict: dict[str, str] = dataclasses.field(default_factory=dict)
    quarantine: dict[str, str] = dataclasses.field(default_factory=dict)
    record: list[Event] = dataclasses.field(default_factory=list)
    alert: list[Event] = dataclasses.field(default_factory=list)


def react(f: Finding, s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig) -> Reaction:
    """Evict, drain, quarantine or keep, for one detector's finding (``detectors.Finding``),
    with the standby rule of ``pools.healthy_standby``:

    - a persistent straggler (``straggler``) under ``straggler_action = "replace"``: its node
      is evicted when a healthy standby can take its place, else kept (``straggler_kept``);
    - a node at risk (``node_at_risk``): a running node is drained to a standby at the next
      checkpoint boundary, or kept without one; a standby is quarantined; a node not in the
      job is only watched. Recorded and alerted with the action taken.
    """
    out = Reaction()
    node = f.node
    if node is None:
        return out
    standby = bool(healthy_standby(s, obs, now, cfg))
    if f.kind == "straggler" and cfg.straggler.straggler_action == "replace":
        if not standby:
            out.record.append(("straggler_kept", {"node": node, "reason": "no healthy standby"}))
        else:
            why = f"straggler: rank {f.data['rank']} computes {f.data['score']}x the median"
            out.evict[node] = why
    elif f.kind == "node_at_risk":
        why = str(f.data["reason"])
        running = node in s.assignment and not s.phase.terminal
        if running and standby:
            action = "drain to a standby at the next checkpoint boundary"
            out.evict[node] = f"at risk: {why}"
        elif running:
            action = "kept: no healthy standby to take its place"
        elif s.pools.get(node) == Pool.STANDBY:
            action = "quarantined: re-checked before it may take a rank"
            out.quarantine[node] = f"at risk: {why}"
        else:
            action = "not training: watched"
        out.alert.append(("node_at_risk", {"node": node, "reason": why, "action": action}))
    return out
