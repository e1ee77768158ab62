"""Job-level Prometheus metrics read from the controller's state at scrape time (a custom
collector: the state owns these numbers, and they survive a controller restart because the
state does), plus the step-derived figures the monitor accumulates.

Names follow Prometheus conventions (base units, ``_total`` for counters, ``_seconds``,
``_bytes``, ``_ratio``):

- ``trainguard_restarts_total``: restarts after faults (the restart budget used);
- ``trainguard_faults_total{cause}``: faults by cause (crash, hang, node_lost, sdc, …);
- ``trainguard_recovery_phase_seconds{phase}``: histogram of each recovery's phases
  (detect, stop, clean, replace, rendezvous, load_checkpoint, first_step, total);
- ``trainguard_goodput_ratio``: productive step time of rank 0 over wall time since the job
  started (the seed's ETTR/goodput: steps computed again after a restore count once);
- ``trainguard_steps_per_second``: rank 0's rate over its newest 20 steps;
- ``trainguard_checkpoint_save_stall_seconds``: rank 0's newest step's time blocked in
  checkpoint saves (the ``checkpoint`` section); ``…_save_stalled_seconds_total`` summed;
- ``trainguard_checkpoint_durable_lag_steps``: newest step minus newest durable step;
- ``trainguard_checkpoint_bytes{tier}``: size of the newest step held in a tier (durable:
  its committed files; archive: the step's bytes and ``archive_sent`` the bytes sent).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from trainguard.checkpoint import storage
from trainguard.protocol import StepRecord, clock

PHASE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class StepFigures:
    """Rank 0's step records folded into goodput, rate and save-stall figures."""

    def __init__(self) -> None:
        self.started = clock.wall()
        self.productive_s = 0.0
        self.newest = -1  # newest step counted (a recomputed step is not counted again)
        self.recent: collections.deque[float] = collections.deque(maxlen=20)
        self.stall_s = 0.0
        self.stall_total_s = 0.0
        self.durable_step: int | None = None
        self.tier_bytes: dict[str, int] = {}
        self.loss: float | None = None
        self.tokens_per_s = 0.0

    def durable(self, root: Path, step: int) -> None:
        """A step became durable: the newest one sets the lag and the tier's bytes."""
        if self.durable_step is None or step > self.durable_step:
            self.durable_step = step
            self.tier_bytes["durable"] = storage.step_bytes(root, step)

    def add(self, items: list[StepRecord]) -> None:
        for it in sorted(items, key=lambda x: x.step):
            dur = it.duration_s
            stall = it.sections.get("checkpoint", 0.0)
            self.recent.append(dur)
            self.stall_s = stall
            self.stall_total_s += stall
            if it.loss is not None:
                self.loss = float(it.loss)
            if it.tokens and dur > 0:
                self.tokens_per_s = float(it.tokens) / dur
            if it.step > self.newest:
                self.newest = it.step
                self.productive_s += max(0.0, dur - stall)


class JobCollector(Collector):
    """Yields the job metrics; ``state()`` returns (restarts, recoveries as JSON dicts)."""

    def __init__(self, state: Callable[[], tuple[int, list[dict[str, Any]]]], steps: StepFigures):
        self._state, self.steps = state, steps

    def collect(self) -> Iterator[Any]:
        restarts, recoveries = self._state()
        yield CounterMetricFamily(
            "trainguard_restarts", "Restarts after faults (restart budget used)", value=restarts
        )
        faults = CounterMetricFamily("trainguard_faults", "Faults by cause", labels=["cause"])
        by_cause = collections.Counter(str(r["fault"]["cause"]) for r in recoveries)
        for cause, n in sorted(by_cause.items()):
            faults.add_metric([cause], n)
        yield faults
        hist = HistogramMetricFamily(
            "trainguard_recovery_phase_seconds",
            "Duration of each phase of a recovery (fault to first resumed step)",
            labels=["phase"],
        )
        phases: dict[str, list[float]] = {}
        for r in recoveries:
            for phase, secs in (r.get("durations_s") or {}).items():
                if secs is not None:
                    phases.setdefault(phase, []).append(float(secs))
        for phase, values in sorted(phases.items()):
            buckets = [(str(b), sum(1 for v in values if v <= b)) for b in PHASE_BUCKETS]
            buckets.append(("+Inf", len(values)))
            hist.add_metric([phase], buckets, sum(values))
        yield hist
        st = self.steps
        wall = max(clock.wall() - st.started, 1e-9)
        yield GaugeMetricFamily(
            "trainguard_goodput_ratio",
            "Rank 0's productive step time over wall time since the job started",
            value=min(1.0, st.productive_s / wall),
        )
        rate = len(st.recent) / sum(st.recent) if st.recent and sum(st.recent) > 0 else 0.0
        yield GaugeMetricFamily(
            "trainguard_steps_per_second", "Rank 0's rate over its newest 20 steps", value=rate
        )
        yield GaugeMetricFamily(
            "trainguard_checkpoint_save_stall_seconds",
            "Rank 0's newest step's time blocked in checkpoint saves",
            value=st.stall_s,
        )
        yield CounterMetricFamily(
            "trainguard_checkpoint_save_stalled_seconds",
            "Rank 0's time blocked in checkpoint saves, summed",
            value=st.stall_total_s,
        )
        lag = st.newest - st.durable_step if st.durable_step is not None and st.newest >= 0 else 0
        yield GaugeMetricFamily(
            "trainguard_checkpoint_durable_lag_steps",
            "Newest step minus newest durable step",
            value=max(0, lag),
        )
        tiers = GaugeMetricFamily(
            "trainguard_checkpoint_bytes", "Size of the newest step held in a tier", labels=["tier"]
        )
        for tier, n in sorted(st.tier_bytes.items()):
            tiers.add_metric([tier], n)
        yield tiers
