"""The controller's job state (``JobState``) and its JSON form: what the controller persists
after each change and what a restarted controller resumes from."""

from __future__ import annotations

import copy
import dataclasses
import json
import secrets
import time
from typing import Any

from trainguard.controller.api import Fault, Phase, Pool, Recovery
from trainguard.protocol import FaultCause


@dataclasses.dataclass(kw_only=True, slots=True)
class JobState:
    """Everything the controller knows about the job; persisted as JSON after each change."""

    # Runs of this run dir before this one (a re-run after a crash, a stop or the end): the
    # generations of every run of one run dir are numbered in one sequence.
    incarnation: int = 0
    # This run's identity in its checkpoint parts (checkpoint/runid.py): drawn anew for every
    # run of the run dir, with the time it was drawn
    run_id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(6))
    run_started: float = dataclasses.field(default_factory=time.time)
    phase: Phase = Phase.PENDING
    phase_since: float = 0.0
    generation: int = -1  # newest generation started; -1 before the first
    assignment: dict[str, int] = dataclasses.field(default_factory=dict)  # node id → node rank
    pools: dict[str, Pool] = dataclasses.field(default_factory=dict)
    join_order: list[str] = dataclasses.field(default_factory=list)
    incarnations: dict[str, str] = dataclasses.field(default_factory=dict)
    gen_incarnations: dict[str, str] = dataclasses.field(
        default_factory=dict
    )  # at generation start
    faulty_incarnations: dict[str, str] = dataclasses.field(
        default_factory=dict
    )  # when marked faulty
    master_port: int | None = None
    restore_step: int | None = None
    restore_gen: int | None = (
        None  # generation that wrote restore_step (the same copy on every rank)
    )
    # the restore point may be read from memory snapshots (False after a world change: they
    # hold the old world's per-rank state; every rank then reads the durable tier)
    restore_memory: bool = True
    growing: bool = False  # elastic: stopping to restart on more nodes (not a fault)
    # node → why: replace it by a standby at the next checkpoint boundary (a straggler)
    evict: dict[str, str] = dataclasses.field(default_factory=dict)
    node_faults: dict[str, int] = dataclasses.field(default_factory=dict)  # times marked faulty
    recheck_at: dict[str, float] = dataclasses.field(default_factory=dict)  # faulty → next check
    faulty_since: dict[str, float] = dataclasses.field(
        default_factory=dict
    )  # readmit: a newer pass
    last_world: int = 0  # ranks of the newest generation (a change: restore from durable)
    # rank → replica server to fetch the restore point from (ranks on replaced nodes)
    restore_sources: dict[str, str] = dataclasses.field(default_factory=dict)
    restarts: int = 0
    fired: list[int] = dataclasses.field(default_factory=list)  # inject ids that fired
    recovery: Recovery | None = None  # in progress
    recoveries: list[Recovery] = dataclasses.field(default_factory=list)
    no_progress_generations: int = 0
    prestep_failures: int = 0
    # A script that never reports steps is judged by what can be seen: consecutive failures
    # with the same last error line (a deterministic bug), not "before its first step".
    last_failure: str = ""
    # [step, generation] points some rank could not restore from any tier (a corrupt or
    # unreadable copy found at load): never chosen again, an older point is used instead.
    unusable: list[list[int]] = dataclasses.field(default_factory=list)
    fallback: bool = False  # the next restart re-tries an older point (no budget spent)
    seen_checkpoint: bool = False  # a trainguard checkpoint existed at some point
    stop_requested: bool = False
    # A planned stop (growth, eviction, user stop): the newest snapshot every rank holds in
    # memory is persisted before the next generation or the end; {"step", "generation",
    # "deadline"} while the nodes' ckptds write it (see _persist_planned_stop).
    persist: dict[str, Any] | None = None
    persist_done: int = -1  # the generation whose planned stop was already persisted
    persist_settle_until: float | None = None  # waiting for ckptds to verify the last snapshots
    reason: str = ""  # why the job ended (terminal phases)
    max_step: dict[int, int] = dataclasses.field(
        default_factory=dict
    )  # generation → newest step seen
    # Each node's newest pre-flight verdict (health/coordinator.py), from ``Inputs.verdicts``:
    # when it was reached (wall clock, s) and its problems (empty: passed).
    checked_at: dict[str, float] = dataclasses.field(default_factory=dict)
    check_problems: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    # Silent data corruption (controller/sdc.py). The newest [step, generation] whose
    # snapshot fingerprints agreed (the last known-good point); ``suspect``: [after_step,
    # up_to_generation, detected_step] ranges of points an SDC may have reached (step >
    # after_step, generation <= up_to_generation), never restored unless known to agree and
    # older than detected_step; ``sdc_off``: the ranks' fingerprints differed at the job's
    # first comparison (not replicas).
    fp_agreed: list[int] | None = None
    # [step, generation] points whose ranks' fingerprints were seen to agree (in memory, or in
    # a durable step's parts): never suspect, whatever range holds them; the newest FP_GOOD_KEPT
    fp_good: list[list[int]] = dataclasses.field(default_factory=list)
    suspect: list[list[int]] = dataclasses.field(default_factory=list)
    sdc_off: bool = False
    # A disagreement no majority decided, being settled by recomputation (controller/sdc.py):
    # {"step", "generation", "values": [[rank, node, layout, value]] of the disagreeing ranks,
    # "nodes": their nodes, "held_out": the node a standby replaced for the recomputation, or
    # None}. The held-out node is nobody's replacement until the verdict.
    sdc_verify: dict[str, Any] | None = None
    # Steps whose gradient-norm spike already had the job roll back and recompute them: a
    # spike that comes back there is the data's, not a corruption (controller/sdc.py).
    recomputed: list[int] = dataclasses.field(default_factory=list)


Event = tuple[str, dict[str, Any]]  # (kind, data): what the store records
ACTIVE_PHASES = (Phase.RENDEZVOUS, Phase.RUNNING)
FP_GOOD_KEPT = 16


def known_good(s: JobState, point: tuple[int, int]) -> None:
    """Record that ``point``'s fingerprints agreed (``JobState.fp_good``, bounded)."""
    p = [int(point[0]), int(point[1])]
    if p not in s.fp_good:
        s.fp_good = sorted([*s.fp_good, p], key=lambda q: (q[1], q[0]))[-FP_GOOD_KEPT:]


def held_out(s: JobState) -> str | None:
    """The node an SDC recomputation holds out of the job until its verdict (never a
    replacement meanwhile), or None."""
    return None if s.sdc_verify is None else s.sdc_verify.get("held_out")


def suspect(s: JobState, point: tuple[int, int]) -> bool:
    """Whether a silent data corruption may have reached ``point`` (step, generation)
    (``JobState.suspect``, controller/sdc.py): such a point is never restored."""
    step, gen = point
    good = [step, gen] in s.fp_good
    for after, upto, *bad in s.suspect:
        # A point that agrees counts as good only before the step the disagreement was seen
        # at: after it, replicas can agree again (the flipped bit rounded away) while the
        # corruption already reached every replica through the all-reduced gradients.
        if step > after and gen <= upto and not (good and bad and step < bad[0]):
            return True
    return False


def goto(s: JobState, phase: Phase, now: float, events: list[Event], reason: str) -> None:
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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Suspicion:
    """A sign of silent data corruption in generation ``generation`` at step ``step``:

    - ``signal="gemm_probe"``: ``node``'s in-job known-answer GEMM probe came out wrong; its
      last passing probe ran after step ``after`` of generation ``after_generation`` (None:
      none passed since its agent started);
    - ``signal="grad_norm"``: rank 0 reported a gradient norm far out of line at ``step``
      (analysis.py), ``after = step - 2``: the step's gradients are corrupt, or the state it
      started from (a parameter flipped after the step before: its checkpoint holds it).
    ``detail``: what was seen, for the event."""

    signal: str
    generation: int
    step: int
    node: str | None
    after: int | None
    detail: str
    after_generation: int | None = None


@dataclasses.dataclass(kw_only=True, slots=True)
class Inputs:
    """What the executor learned since the last tick that is not an agent's latest report:
    ``decide`` folds these into the state (it is the only writer of ``JobState``; the
    executor collects inputs and applies decisions, it never edits the state itself).

    - ``stop_requested``: a user asked the job to stop (``POST /v1/stop``, SIGTERM/SIGINT).
    - ``fired``: ids of injections whose ``inject_fired`` event arrived.
    - ``unusable``: (step, generation) points a rank could not restore from any tier
      (``ckpt_restore_failed``).
    - ``evict``: node → why: replace it by a standby at the next checkpoint boundary
      (``policy.react``: a persistent straggler under ``straggler_action = "replace"``, a
      running node at risk).
    - ``milestones``: (generation, name, wall time) of a recovery's last phases, each once
      every rank reached it: ``t_rendezvous``, ``t_loaded``, ``t_first_step_start`` (stands
      for both when nothing was restored) and ``t_first_step`` (completes the recovery of
      that generation).
    - ``fingerprints``: (step, generation, rank → (layout, value)) of snapshot points every
      rank reported (``ingest.FingerprintIndex``), for the SDC check (controller/sdc.py).
    - ``agreed``: (step, generation) durable points whose parts' fingerprints agree
      (``fingerprint.durable_verdict``): known good, never suspect of an SDC.
    - ``verdicts``: node → (wall time, problems) of pre-flight verdicts reached since the
      last tick (an empty tuple: passed; ``checking.PreflightDriver`` makes repeated
      inconclusive runs a failed verdict).
    - ``suspected``: signs of a silent data corruption that fingerprints cannot see
      (``Suspicion``: a failed in-job GEMM probe, a gradient-norm spike).
    - ``quarantine``: standby node → why: failure prediction flagged it (``policy.react``);
      it goes to the faulty pool and is re-checked before it may take a rank.
    """

    stop_requested: bool = False
    fired: list[int] = dataclasses.field(default_factory=list)
    unusable: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    evict: dict[str, str] = dataclasses.field(default_factory=dict)
    milestones: list[tuple[int, str, float]] = dataclasses.field(default_factory=list)
    verdicts: dict[str, tuple[float, tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    agreed: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    fingerprints: list[tuple[int, int, dict[int, tuple[int, int]]]] = dataclasses.field(
        default_factory=list
    )
    suspected: list[Suspicion] = dataclasses.field(default_factory=list)
    quarantine: dict[str, str] = dataclasses.field(default_factory=dict)

    def empty(self) -> bool:
        return not (
            self.stop_requested
            or self.fired
            or self.unusable
            or self.evict
            or self.milestones
            or self.verdicts
            or self.agreed
            or self.fingerprints
            or self.suspected
            or self.quarantine
        )


def merge_inputs(a: Inputs, b: Inputs) -> Inputs:
    """``a`` then ``b`` in one (inputs a failed tick took back, and those since)."""
    return Inputs(
        stop_requested=a.stop_requested or b.stop_requested,
        fired=a.fired + b.fired,
        unusable=a.unusable + b.unusable,
        evict={**a.evict, **b.evict},
        milestones=a.milestones + b.milestones,
        verdicts={**a.verdicts, **b.verdicts},
        agreed=a.agreed + b.agreed,
        fingerprints=a.fingerprints + b.fingerprints,
        suspected=a.suspected + b.suspected,
        quarantine={**a.quarantine, **b.quarantine},
    )


MILESTONES = ("t_rendezvous", "t_loaded", "t_first_step_start", "t_first_step")


def fold_inputs(s: JobState, inputs: Inputs, events: list[tuple[str, dict[str, Any]]]) -> None:
    """Fold ``inputs`` into ``s`` (a copy ``decide`` owns); a completed recovery is moved to
    ``s.recoveries`` with a ``recovery_completed`` event."""
    s.stop_requested = s.stop_requested or inputs.stop_requested
    s.fired += [i for i in inputs.fired if i not in s.fired]
    for step, gen in inputs.unusable:
        if [step, gen] not in s.unusable:
            s.unusable.append([step, gen])
    s.evict.update(inputs.evict)
    for point in inputs.agreed:
        known_good(s, point)
    for node, (at, problems) in inputs.verdicts.items():
        s.checked_at[node], s.check_problems[node] = at, list(problems)
    for gen, name, t in inputs.milestones:
        rec = s.recovery
        if rec is None or rec.to_generation != gen or name not in MILESTONES:
            continue
        if name == "t_first_step_start":
            if rec.t_rendezvous is None:  # nothing restored: rendezvous ends as a step starts
                rec.t_rendezvous = rec.t_loaded = t
            continue
        setattr(rec, name, t)
        if name == "t_first_step":
            events.append(("recovery_completed", {"generation": gen, **rec.to_json()}))
            s.recoveries.append(rec)
            s.recovery = None


def _recovery_from_json(d: dict[str, Any]) -> Recovery:
    d = {k: v for k, v in d.items() if k != "durations_s"}
    fault = {**d["fault"], "cause": FaultCause(d["fault"]["cause"])}
    return Recovery(**{**d, "fault": Fault(**fault)})


def state_from_json(d: dict[str, Any]) -> JobState:
    """The inverse of the controller's ``state_json`` (what it persists as ``state``).

    Raises KeyError/TypeError/ValueError on a state this version cannot read.
    """
    fields = {f.name for f in dataclasses.fields(JobState)}
    d = {k: v for k, v in d.items() if k in fields}
    d["phase"] = Phase(d["phase"])
    d["pools"] = {n: Pool(p) for n, p in d.get("pools", {}).items()}
    d["max_step"] = {int(g): int(v) for g, v in d.get("max_step", {}).items()}
    d["checked_at"] = {n: float(at) for n, at in d.get("checked_at", {}).items()}
    d["check_problems"] = {n: list(p) for n, p in d.get("check_problems", {}).items()}
    d["recovery"] = _recovery_from_json(d["recovery"]) if d.get("recovery") else None
    d["recoveries"] = [_recovery_from_json(r) for r in d.get("recoveries", [])]
    return JobState(**d)


def next_incarnation(prev: JobState, now: float) -> JobState:
    """The state a new run of a run dir starts from, after ``prev`` (the last state its
    previous run persisted): generation numbers continue after ``prev``'s (no step directory,
    snapshot or store row of the new run can take an old run's generation number), and copies
    found unreadable stay excluded. Everything else starts fresh (restart budget included)."""
    return JobState(
        phase_since=now,
        incarnation=prev.incarnation + 1,
        generation=prev.generation,
        last_world=prev.last_world,
        unusable=[list(p) for p in prev.unusable],
        suspect=[list(p) for p in prev.suspect],  # an SDC's reach outlives the run that saw it
        seen_checkpoint=prev.seen_checkpoint,
    )


def copy_state(s: JobState) -> JobState:
    """A copy of ``s`` that ``decide`` may change without touching ``s``: every container
    field copied one level deep (their values are immutable: enums, numbers, strings, tuples,
    or lists only ever appended to), the in-progress recovery and planned-stop record deeply.
    O(fields + entries), without ``copy.deepcopy``'s per-object bookkeeping (a tick at
    thousands of nodes)."""
    new = copy.copy(s)
    for f in dataclasses.fields(s):
        v = getattr(s, f.name)
        if isinstance(v, dict):
            setattr(new, f.name, dict(v))
        elif isinstance(v, list):
            setattr(new, f.name, list(v))
    new.recovery = copy.deepcopy(s.recovery)
    new.persist = copy.deepcopy(s.persist)
    return new


def state_json(s: JobState) -> dict[str, Any]:
    """``s`` as plain JSON values (what the store persists; ``state_from_json`` inverts it)."""
    d: dict[str, Any] = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    if s.recovery is not None:
        d["recovery"] = s.recovery.to_json()
    d["recoveries"] = [r.to_json() for r in s.recoveries]
    return json.loads(json.dumps(d, default=str))


def _field_json(name: str, v: Any) -> str:
    if name == "recovery" and v is not None:
        v = v.to_json()
    elif name == "recoveries":
        v = [r.to_json() for r in v]
    return json.dumps(v, default=str, sort_keys=True)


class StateEncoder:
    """The JSON text of successive job states (``state_json``'s content, keys sorted),
    re-encoding only the fields that changed since the last call: at thousands of nodes the
    node maps (pools, assignment, incarnations) are most of the text and change rarely,
    while step counters change every tick. Equality is checked on the values the previous
    state held (``decide`` never changes a state it returned: it works on a copy)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[Any, str]] = {}

    def encode(self, s: JobState) -> str:
        parts = []
        for name in sorted(f.name for f in dataclasses.fields(s)):
            v = getattr(s, name)
            seen = self._last.get(name)
            if seen is not None and seen[0] is v:
                text = seen[1]  # the very same object: unchanged (a field decide did not copy)
            elif seen is not None and type(seen[0]) is type(v) and seen[0] == v:
                text = seen[1]
                self._last[name] = (v, text)
            else:
                text = _field_json(name, v)
                self._last[name] = (v, text)
            parts.append(f"{json.dumps(name)}: {text}")
        return "{" + ", ".join(parts) + "}"


def pool_lists(pools: dict[str, str]) -> dict[str, list[str]]:
    """The seed's five node lists from the pools: all, normal (healthy: running or standby),
    abnormal (faulty or retired), standby, running."""
    by = {p.value: sorted(n for n, q in pools.items() if q == p.value) for p in Pool}
    return {
        "all": sorted(pools),
        "normal": sorted(by["running"] + by["standby"]),
        "abnormal": sorted(by["faulty"] + by["retired"]),
        "standby": by["standby"],
        "running": by["running"],
    }
