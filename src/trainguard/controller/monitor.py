"""The controller's view of a running job for people: alerts (events, ``trainguard status``,
an optional webhook) and Prometheus metrics (``GET /metrics``). What raises the alerts is the
detectors' (detectors.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import json
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from trainguard.controller.jobmetrics import StepFigures
from trainguard.protocol import StepRecord

log = logging.getLogger("trainguard.monitor")
ALERT_KINDS = (
    "straggler",
    "loss_spike",
    "loss_nonfinite",
    "grad_norm_spike",
    "throughput_drop",
    "hang_localized",
    "sdc_detected",
    "sdc_localized",
    "sdc_ruled_out",
    "node_at_risk",
)
WEBHOOK_TIMEOUT_S = 5.0


class RankCollector(Collector):
    """The per-rank gauges, made from ``newest`` (rank → its newest step record) and
    ``scores`` (rank → straggler score) when ``/metrics`` is scraped: ``trainguard_step``,
    ``trainguard_step_seconds``, ``trainguard_compute_seconds`` (step minus time in
    collectives), ``trainguard_communication_seconds``, ``trainguard_straggler_score``."""

    def __init__(self) -> None:
        self.newest: dict[int, StepRecord] = {}
        self.scores: dict[int, float] = {}

    def collect(self) -> Iterator[Any]:
        fams = [
            GaugeMetricFamily("trainguard_step", "Newest step a rank finished", labels=["rank"]),
            GaugeMetricFamily("trainguard_step_seconds", "Duration of a rank's newest step",
                              labels=["rank"]),
            GaugeMetricFamily("trainguard_compute_seconds",
                              "A rank's newest step minus its time in collectives",
                              labels=["rank"]),
            GaugeMetricFamily("trainguard_communication_seconds",
                              "A rank's time in collectives in its newest step (waiting for "
                              "peers included)", labels=["rank"]),
        ]  # fmt: skip
        for rank, it in sorted(self.newest.items()):
            comm = it.sections.get("communication", 0.0)
            label = [str(rank)]
            fams[0].add_metric(label, it.step)
            fams[1].add_metric(label, it.duration_s)
            fams[2].add_metric(label, max(0.0, it.duration_s - comm))
            fams[3].add_metric(label, comm)
        yield from fams
        score = GaugeMetricFamily(
            "trainguard_straggler_score",
            "A rank's own work between collectives minus the median rank's, as a fraction of "
            "the step (median over the newest window)",
            labels=["rank"],
        )
        for rank, v in sorted(self.scores.items()):
            score.add_metric([str(rank)], v)
        yield score


class Monitor:
    """Feed it step records with ``on_steps`` and straggler scores with ``on_scores`` (the
    metrics), alerts with ``alert``."""

    def __init__(self, webhook: str | None = None) -> None:
        self.webhook = webhook
        self.alerts: collections.deque[dict[str, Any]] = collections.deque(maxlen=50)
        self._tasks: set[asyncio.Task[None]] = set()
        r = self.registry = CollectorRegistry()
        self.figures = StepFigures()  # goodput, rate, save stall (jobmetrics.JobCollector)
        # Per-rank figures: kept in dicts as reports come (a dict store per batch; 131,072
        # ranks at 16,384 nodes report every heartbeat) and turned into metrics only when
        # scraped (RankCollector).
        self.ranks = RankCollector()
        r.register(self.ranks)
        self.g_loss = Gauge("trainguard_loss", "Newest loss reported by rank 0", registry=r)
        self.c_alerts = Counter("trainguard_alerts", "Alerts raised", ["kind"], registry=r)
        self.c_skipped = Counter(
            "trainguard_snapshots_skipped",
            "Snapshots skipped: every slot still being persisted (back-pressure)",
            ["rank"],
            registry=r,
        )
        self.g_phase = Gauge("trainguard_job_phase", "1 for the job's phase", ["phase"], registry=r)
        self.g_gen = Gauge("trainguard_generation", "Newest generation", registry=r)
        self.g_nodes = Gauge("trainguard_nodes", "Nodes per pool", ["pool"], registry=r)
        self.h_report = Histogram(
            "trainguard_report_handling_seconds",
            "Time the controller spent on one agent report, from its handler's start to the "
            "answer (queueing before the handler not included)",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
            registry=r,
        )
        self.h_uplink = Histogram(
            "trainguard_relay_uplink_seconds",
            "Time the controller spent on one relay uplink (its whole reports and alive "
            "entries), from its handler's start to the answer",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
            registry=r,
        )
        self.h_tick = Histogram(
            "trainguard_tick_seconds",
            "Duration of one coalesced decision tick (decide and desired states)",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )

    def on_steps(self, rank: int, items: list[StepRecord]) -> None:
        """One rank's step records of the current generation (as agents report them)."""
        last = max(items, key=lambda it: it.step) if len(items) > 1 else items[0]
        self.ranks.newest[rank] = last
        if rank == 0:
            self.figures.add(items)
            if last.loss is not None:
                self.g_loss.set(float(last.loss))

    def on_scores(self, scores: dict[int, float]) -> None:
        """The straggler detector's newest score per rank (the dict is read when scraped)."""
        self.ranks.scores = scores

    def alert(self, kind: str, data: dict[str, Any]) -> None:
        """Count and keep an alert (for status), and post it to the webhook if one is set."""
        self.c_alerts.labels(kind).inc()
        self.alerts.append({"kind": kind, **data})
        log.warning("alert %s: %s", kind, _fields(data))
        if self.webhook:
            with contextlib.suppress(RuntimeError):  # no running loop: tests call this directly
                task = asyncio.get_running_loop().create_task(self._post({"kind": kind, **data}))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _post(self, body: dict[str, Any]) -> None:
        assert self.webhook is not None
        try:
            timeout = aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT_S)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(self.webhook, json=body) as resp,
            ):
                if resp.status >= 300:
                    log.warning("alert webhook %s answered %d", self.webhook, resp.status)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.warning("alert webhook %s failed: %s", self.webhook, e)

    def metrics(self, phase: str, generation: int, pools: dict[str, str]) -> bytes:
        """Prometheus text exposition of the job."""
        for p in ("PENDING", "RENDEZVOUS", "RUNNING", "FAULTED", "STOPPING", "CLEANING",
                  "REPLACING", "WAITING_FOR_NODES", "SUCCEEDED", "FAILED", "STOPPED"):  # fmt: skip
            self.g_phase.labels(p).set(1 if p == phase else 0)
        self.g_gen.set(generation)
        for pool in ("running", "standby", "faulty", "retired"):
            self.g_nodes.labels(pool).set(sum(1 for v in pools.values() if v == pool))
        return bytes(generate_latest(self.registry))


def _fields(data: dict[str, Any]) -> str:
    """An alert's data for a log line: ``key=value`` pairs, enums by their value, floats to 4
    significant digits, anything nested as JSON."""

    def one(v: Any) -> str:
        if isinstance(v, enum.Enum):
            return str(v.value)
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, dict | list | tuple):
            return json.dumps(v, default=str, separators=(",", ":"))
        return str(v)

    return " ".join(f"{k}={one(v)}" for k, v in data.items())
