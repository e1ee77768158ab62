"""The controller's one intake: from an agent's report to the facts the controller acts on.

``Intake.take`` folds a report into the node's observation (``observe``: the latest report,
with the facts that must outlive a report folded in), records its events and step records,
and hands over what it learned, facts only: the recovery milestones every rank must reach
(``Milestones``), fired drills, unusable restore points, signs of silent corruption, and the
detectors' findings (``detectors.DETECTORS``: stragglers, anomalies, nodes at risk, failed
GEMM probes). It decides nothing: what to do about a finding (evict, drain, quarantine, keep)
is ``policy.react``'s, applied by the executor (server.py), which hands both to ``decide`` as
``Inputs``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.controller.api import STEPS_SEEN_GENERATIONS, NodeObs
from trainguard.controller.config import JobConfig
from trainguard.controller.detectors import Detector, Finding, Seen, detectors
from trainguard.controller.jobstate import Inputs, JobState
from trainguard.controller.monitor import Monitor
from trainguard.controller.pools import world_of
from trainguard.controller.store import Store
from trainguard.controller.summary import Liveness, summarize
from trainguard.health.coordinator import Preflight
from trainguard.protocol import AgentReport, ProtocolError, ReportEvent, StepBatch, StepRecord

log = logging.getLogger("trainguard.controller")


def observe(node_id: str, r: AgentReport, old: NodeObs | None, now: float) -> NodeObs:
    """Node ``node_id``'s observation from its report ``r`` received at ``now`` (controller
    wall clock, s). ``old``: its previous observation; the newest step per generation carries
    over (``fold_steps``). Its workers are summarized (``summary.summarize``)."""
    o = NodeObs(
        node_id=node_id,
        addr=r.addr,
        incarnation=r.incarnation,
        last_seen=now,
        generation=r.generation,
        workers={w.rank: w for w in r.workers},
        hang=r.hang,
        stopped_generation=r.stopped_generation,
        stopped_at=r.stopped_at,
        cleaned_at=r.cleaned_at,
        memory=r.ckptd.memory,
        ckptd_idle=r.ckptd.idle,
        ckptd_at=r.ckptd.at,
        replicas=r.ckptd.replicas,
        replica_addr=r.ckptd.replica_addr,
        fenced_generation=r.fenced_generation,
        health_ok=r.health.ok,
        health_problems=r.health.problems,
        store=r.store,
        leaving=r.leaving,
        clock_skew_s=round(r.time - now, 3) if r.time is not None else None,
        reported_at=r.time,
    )
    o.steps_seen = fold_steps(old, o, r.steps)
    summarize(o)
    return o


def addresses_changed(old: NodeObs | None, new: NodeObs) -> bool:
    """Whether peers' desired states must change: they name this node's addresses."""
    return old is None or (old.addr, old.replica_addr, old.incarnation) != (
        new.addr,
        new.replica_addr,
        new.incarnation,
    )


def fold_steps(old: NodeObs | None, new: NodeObs, batches: list[StepBatch]) -> dict[int, int]:
    """``NodeObs.steps_seen`` after one more report: the old fold, the steps its workers show
    now, and its step records; the newest STEPS_SEEN_GENERATIONS generations kept. (Decisions
    run on a coalesced tick: a report after a stop lists no workers, and without the fold the
    steps of the report before it would never be seen.)"""
    seen = dict(old.steps_seen) if old is not None else {}
    now = [w.step for w in new.workers.values() if w.step is not None]
    if new.generation is not None and now:
        seen[new.generation] = max(seen.get(new.generation, 0), *now)
    for b in batches:
        if b.items:
            seen[b.generation] = max(seen.get(b.generation, 0), *(it.step for it in b.items))
    for g in sorted(seen)[:-STEPS_SEEN_GENERATIONS]:
        del seen[g]
    return seen


def _need(v: int | None, ev: ReportEvent) -> int:
    """A field the event's kind carries (the HTTP layer answers 400 without it)."""
    if v is None:
        raise ProtocolError(f"event {ev.kind}: a field it carries is missing: {ev.fields}")
    return v


class Intake:
    """Takes every report (``take``) into ``obs`` and the ``Inputs`` it is handed, recording
    events and step records in ``store`` and metrics in ``monitor``. ``preflight``: the
    pre-flight coordinator, when one runs (it gets the check results); ``seen``: called with
    (node, now) for each report (the pre-flight driver's liveness). ``liveness``: the nodes'
    deadlines (``summary.Liveness``), kept with ``obs``, for ``decide``."""

    def __init__(
        self,
        cfg: JobConfig,
        store: Store,
        monitor: Monitor,
        preflight: Callable[[], Preflight | None],
        seen: Callable[[str, float], None],
    ) -> None:
        self.cfg, self.store, self.monitor = cfg, store, monitor
        self._preflight, self._seen = preflight, seen
        self.obs: dict[str, NodeObs] = {}
        self.liveness = Liveness(cfg.timeouts.node_timeout_s)
        self.milestones = Milestones()
        self.fingerprints = FingerprintIndex()
        self.detectors: list[Detector] = detectors(cfg, monitor)

    def take(
        self, r: AgentReport, s: JobState, inputs: Inputs, now: float
    ) -> tuple[bool, list[Finding]]:
        """Fold report ``r`` in (state ``s`` as of now); the facts it shows go to ``inputs``.
        Returns whether the node's addresses changed (peers' desired states name them) and the
        detectors' findings, each recorded already (and alerted where it says so)."""
        old = self.obs.get(r.node_id)
        new = self.obs[r.node_id] = observe(r.node_id, r, old, now)
        self.liveness.track(new)
        self.fingerprints.add(r.ckptd.fingerprints)
        self._seen(r.node_id, now)
        pf = self._preflight()
        if pf is not None:
            pf.ingest(r.node_id, r.checks)
        for ev in r.events:
            self._event(r.node_id, ev, s, inputs, now)
        for batch in r.steps:
            self._steps(batch, s, inputs)
        findings = self._detect(
            Seen(node=r.node_id, report=r, steps=r.steps, state=s, now=now), inputs
        )
        return addresses_changed(old, new), findings

    def take_steps(
        self, node: str, batches: list[StepBatch], s: JobState, inputs: Inputs, now: float
    ) -> list[Finding]:
        """Step records of ``node`` that came without a whole report (``protocol/relay.py``:
        a relay's alive entry): stored as a report's are, and the detectors' findings on them
        (those over step records; the others see a ``Seen`` without a report)."""
        for batch in batches:
            self._steps(batch, s, inputs)
        seen = Seen(node=node, report=None, steps=batches, state=s, now=now)
        return self._detect(seen, inputs)

    def _event(self, node: str, ev: ReportEvent, s: JobState, inputs: Inputs, now: float) -> None:
        """Record one event; hand over the facts it carries."""
        self.store.record(ev.kind, {**ev.fields, "node": node}, ts=ev.ts)
        if ev.kind == "inject_fired" and ev.inject is not None:
            inputs.fired.append(ev.inject.id)
            pf = self._preflight()
            if ev.inject.kind == "gemm-wrong" and pf is not None:
                # The node's GEMMs went wrong in training: its re-check fails too.
                got = pf.injects.setdefault(node, [])
                if "gemm-wrong" not in got:
                    got.append("gemm-wrong")
        elif ev.kind == "ckpt_skipped":  # back-pressure from a disk slower than the steps
            self.monitor.c_skipped.labels(str(ev.rank if ev.rank is not None else "")).inc()
        elif ev.kind == "ckpt_durable" and ev.step is not None:  # durable lag, tier bytes
            self.monitor.figures.durable(Path(self.cfg.ckpt_dir), ev.step)
        elif ev.kind == "ckpt_restore_failed":  # a rank cannot read the agreed point anywhere
            inputs.unusable.append((_need(ev.step, ev), _need(ev.point_generation, ev)))
        rec, gen = s.recovery, ev.generation
        if ev.kind in ("ckpt_load_start", "ckpt_load_end") and rec and rec.to_generation == gen:
            world = world_of(s, self.cfg)
            t = ev.ts if ev.ts is not None else now
            inputs.milestones += self.milestones.load(ev.kind, gen, _need(ev.rank, ev), t, world)

    def _steps(self, b: StepBatch, s: JobState, inputs: Inputs) -> None:
        """Store one rank's step records; the first-step milestone once every rank is in."""
        self.store.add_steps(b.generation, b.rank, b.items)
        if b.generation == s.generation and b.items:
            self.monitor.on_steps(b.rank, b.items)
        first, got = self.milestones.steps(b.generation, b.rank, b.items, world_of(s, self.cfg))
        if first is not None:
            self.store.record("first_step", first)
        inputs.milestones += got

    def _detect(self, seen: Seen, inputs: Inputs) -> list[Finding]:
        """Every detector's findings on this report: recorded (and alerted) as they say; a
        sign of silent corruption goes to ``decide``."""
        out: list[Finding] = []
        for d in self.detectors:
            for f in d.observe(seen):
                if f.record:
                    self.store.record(f.kind, f.data)
                if f.alert:
                    self.monitor.alert(f.kind, f.data)
                if f.suspicion is not None:
                    inputs.suspected.append(f.suspicion)
                out.append(f)
        return out


class FingerprintIndex:
    """The ranks' snapshot fingerprints by point, gathered from the reports as they arrive
    (work per report, not per tick), until every rank of the generation's world reported a
    point: ``complete`` then hands it to ``decide`` (``Inputs.fingerprints``) once. A report
    carries what its ckptd holds now, so a point stays gathered after its slot is reused.
    Bounded: the newest KEPT points gathered, the newest KEPT handed."""

    KEPT = 16

    def __init__(self) -> None:
        self._points: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        self._handed: set[tuple[int, int]] = set()

    def add(self, reported: dict[Any, Any]) -> None:
        """One report's fingerprints (rank → [(step, gen, layout, value)])."""
        for r, items in reported.items():
            for step, gen, layout, value in items:
                point = (int(gen), int(step))
                if point not in self._handed:
                    self._points.setdefault(point, {})[int(r)] = (int(layout), int(value))
        for point in sorted(self._points)[: -self.KEPT]:
            del self._points[point]

    def complete(
        self, generation: int, world: int
    ) -> list[tuple[int, int, dict[int, tuple[int, int]]]]:
        """(step, generation, rank → (layout, value)) of each point of ``generation`` that all
        ``world`` ranks reported, in step order; each once."""
        out = []
        for gen, step in sorted(self._points):
            fps = self._points[(gen, step)]
            if gen == generation and len(fps) >= world:
                out.append((step, gen, fps))
                del self._points[(gen, step)]
                self._handed.add((gen, step))
        if len(self._handed) > self.KEPT:
            self._handed = set(sorted(self._handed)[-self.KEPT :])
        return out


class Milestones:
    """When every rank of a generation reached a recovery's last phases, from the ranks'
    ``ckpt_load_start`` / ``ckpt_load_end`` events and their first step records: each
    milestone once, as ``(generation, name, wall time)`` for ``Inputs.milestones``
    (``jobstate.MILESTONES``). The time is the last rank's."""

    def __init__(self) -> None:
        self._marks: dict[str, dict[int, float]] = {}
        self._first_step: set[int] = set()  # generations whose first step was seen

    def clear(self) -> None:
        """A new recovery: its milestones are counted afresh."""
        self._marks.clear()

    def load(
        self, kind: str, gen: int, rank: int, ts: float, world: int
    ) -> list[tuple[int, str, float]]:
        """A rank's ``ckpt_load_start`` or ``ckpt_load_end`` at ``ts`` in generation ``gen``
        (the recovering one) of ``world`` ranks."""
        marks = self._marks.setdefault(f"{gen}:{kind}", {})
        marks[rank] = ts
        if len(marks) != world:
            return []
        name = "t_rendezvous" if kind == "ckpt_load_start" else "t_loaded"
        return [(gen, name, max(marks.values()))]

    def steps(
        self, gen: int, rank: int, items: list[StepRecord], world: int
    ) -> tuple[dict[str, Any] | None, list[tuple[int, str, float]]]:
        """A rank's step records. Returns the ``first_step`` event's data once every rank's
        first step of ``gen`` is in, and the first-step milestones then."""
        if gen in self._first_step or not items:
            return None, []
        first = min(items, key=lambda it: it.step)
        ends = self._marks.setdefault(f"{gen}:first_step", {})
        ends.setdefault(rank, first.t_end)
        starts = self._marks.setdefault(f"{gen}:first_step_start", {})
        starts.setdefault(rank, first.t_end - first.duration_s)
        if len(ends) < world:
            return None, []
        self._first_step.add(gen)
        t = max(ends.values())
        event = {"generation": gen, "step": first.step, "t": t}
        return event, [(gen, "t_first_step_start", max(starts.values())), (gen, "t_first_step", t)]
