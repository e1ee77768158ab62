"""The detectors, one shape: each watches the reports for one kind of trouble and hands over
findings, facts only (a score, a risk, a wrong result); what to do about them is
``policy.react``'s.

A detector is anything with ``name`` and ``observe(seen) -> list[Finding]``, called by the
intake (``ingest.Intake``) with every report. ``detectors`` is the one registry: adding a
detector is a class here and its line there.

- ``StragglerWatch``: persistent stragglers on the step records (analysis.py);
- ``AnomalyWatch``: loss spikes, non-finite losses, gradient-norm spikes and throughput drops
  on rank 0's step records (analysis.py);
- ``RiskDetector``: failure prediction from the hardware counters (risk.py);
- ``ProbeDetector``: a node's in-job known-answer GEMM probe that came out wrong.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from trainguard.controller.analysis import AnomalyDetector, DetectConfig, StragglerDetector
from trainguard.controller.config import JobConfig
from trainguard.controller.jobstate import JobState, Suspicion
from trainguard.controller.monitor import Monitor
from trainguard.controller.pools import world_of
from trainguard.controller.risk import RiskConfig, RiskWatch
from trainguard.protocol import AgentReport, StepBatch, StepRecord


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Seen:
    """One report as a detector sees it: from ``node``, received at ``now`` (controller wall
    clock), with the job's state ``state`` as of then; its step batches ``steps``. ``report``
    is None for step records that came without a whole report (a relay's alive entry:
    ``protocol/relay.py``): only the detectors over step records have something to see."""

    node: str
    report: AgentReport | None
    steps: list[StepBatch]
    state: JobState
    now: float


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    """A fact a detector drew: ``kind`` names it (the event it is recorded as: ``straggler``,
    ``loss_spike``, ``grad_norm_spike``, ``node_at_risk``, …) and ``data`` its event data;
    ``node`` the node it names, if any. ``record`` / ``alert``: the intake records it as an
    event / raises it as an alert (a finding the policy acts on is recorded with the action
    taken instead). ``suspicion``: a sign of silent data corruption for ``decide``."""

    kind: str
    data: dict[str, Any]
    node: str | None = None
    record: bool = True
    alert: bool = True
    suspicion: Suspicion | None = None


class Detector(Protocol):
    """What every detector is."""

    name: str

    def observe(self, seen: Seen) -> list[Finding]:
        """The findings this report adds (most reports: none)."""
        ...


class _StepDetector:
    """The shape of the detectors over step records: the current generation's batches, each
    rank's in turn (``_batch``); a finding that names a rank names its node too."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.detect = DetectConfig(
            window_steps=cfg.straggler.straggler_window_steps,
            persist_windows=cfg.straggler.straggler_persist_windows,
            grad_ratio=cfg.sdc.sdc_grad_ratio if cfg.sdc.sdc_check else 0.0,
        )

    def observe(self, seen: Seen) -> list[Finding]:
        s, out = seen.state, []
        for b in seen.steps:
            if b.generation != s.generation or not b.items:
                continue
            for kind, data in self._batch(b.generation, world_of(s, self.cfg), b.rank, b.items):
                node = None
                if "rank" in data:
                    node = _node_of(s, self.cfg, int(data["rank"]))
                    data = {**data, "node": node}
                out.append(Finding(kind=kind, data=data, node=node, suspicion=_grad(kind, data)))
        return out

    def _batch(
        self, generation: int, world: int, rank: int, items: list[StepRecord]
    ) -> list[tuple[str, dict[str, Any]]]:
        raise NotImplementedError


class StragglerWatch(_StepDetector):
    """Persistent stragglers (analysis.StragglerDetector); its scores go to the metrics."""

    name = "straggler"

    def __init__(self, cfg: JobConfig, monitor: Monitor) -> None:
        super().__init__(cfg)
        self.monitor = monitor
        self.det = StragglerDetector(self.detect)

    def _batch(
        self, generation: int, world: int, rank: int, items: list[StepRecord]
    ) -> list[tuple[str, dict[str, Any]]]:
        windows = self.det.windows
        events = self.det.add(generation, world, rank, items)
        if self.det.windows != windows:  # a window judged: new scores (once, not per report)
            self.monitor.on_scores(self.det.scores)
        return events


class AnomalyWatch(_StepDetector):
    """Loss spikes, non-finite losses, gradient-norm spikes (also a sign of silent corruption)
    and throughput drops on rank 0's step records (analysis.AnomalyDetector)."""

    name = "anomaly"

    def __init__(self, cfg: JobConfig) -> None:
        super().__init__(cfg)
        self.det = AnomalyDetector(self.detect)

    def _batch(
        self, generation: int, world: int, rank: int, items: list[StepRecord]
    ) -> list[tuple[str, dict[str, Any]]]:
        if rank != 0:
            return []
        return self.det.add(generation, sorted(items, key=lambda it: it.step))


def _node_of(s: JobState, cfg: JobConfig, rank: int) -> str | None:
    node_rank = rank // cfg.nproc_per_node
    return next((n for n, r in s.assignment.items() if r == node_rank), None)


def _grad(kind: str, data: dict[str, Any]) -> Suspicion | None:
    if kind != "grad_norm_spike":
        return None
    ratio = f"{data['ratio']:g}× its median" if data.get("ratio") else "not finite"
    return Suspicion(
        signal="grad_norm",
        generation=int(data["generation"]),
        step=int(data["step"]),
        node=None,
        # The step's gradient, or the state it started from (a parameter flipped after the
        # previous step: that step's checkpoint holds it) is corrupt.
        after=int(data["step"]) - 2,
        detail=f"gradient norm {data['grad_norm']} ({ratio})",
    )


class RiskDetector:
    """Failure prediction (risk.py): a node whose hardware counters climb is at risk, once per
    climb. The finding is not recorded here: the policy's action goes with it."""

    name = "risk"

    def __init__(self, cfg: JobConfig) -> None:
        self.watch = RiskWatch(
            RiskConfig(
                ce_delta=cfg.risk.risk_ce_delta,
                window_s=cfg.risk.risk_window_s,
                temp_margin_c=cfg.risk.risk_temp_margin_c,
                temp_horizon_s=cfg.risk.risk_temp_horizon_s,
            )
        )

    def observe(self, seen: Seen) -> list[Finding]:
        if seen.report is None:
            return []
        why = self.watch.observe(seen.node, seen.now, seen.report.health.signals)
        if why is None:
            return []
        data = {"node": seen.node, "reason": why}
        return [Finding(kind="node_at_risk", data=data, node=seen.node, record=False, alert=False)]


class ProbeDetector:
    """A node's newest in-job GEMM probe (agent/probe.py), once: a wrong result is a sign of
    silent corruption for ``decide`` (controller/sdc.py), which records what it concludes."""

    name = "gemm_probe"

    def __init__(self) -> None:
        self._seen: dict[str, Any] = {}  # node → time of its newest probe seen

    def observe(self, seen: Seen) -> list[Finding]:
        if seen.report is None:
            return []
        probe = seen.report.health.probe
        if probe is None or probe.t == self._seen.get(seen.node):
            return []
        self._seen[seen.node] = probe.t
        if probe.ok is not False or probe.generation is None or probe.step is None:
            return []
        where = ", ".join(f"{r.device}: {r.mismatches} wrong element(s), first at {r.first_bad}"
                          for r in probe.results if r.mismatches)  # fmt: skip
        last_ok = probe.last_ok
        why = Suspicion(
            signal="gemm_probe",
            generation=probe.generation,
            step=probe.step,
            node=seen.node,
            after=last_ok[1] if last_ok else None,
            after_generation=last_ok[0] if last_ok else None,
            detail=f"its known-answer GEMM probe came out wrong ({where})",
        )
        data = {"node": seen.node, "generation": probe.generation, "step": probe.step}
        return [Finding(kind="gemm_probe_wrong", data=data, node=seen.node, record=False,
                        alert=False, suspicion=why)]  # fmt: skip


def detectors(cfg: JobConfig, monitor: Monitor) -> list[Detector]:
    """The registry: every detector, in the order each sees a report."""
    return [StragglerWatch(cfg, monitor), AnomalyWatch(cfg), RiskDetector(cfg), ProbeDetector()]
