"""The controller's decision tick at scale (issue 31): ``decide`` on a running job of
``--nodes`` nodes (default 16,384) × 8 workers, in this process, no network.

The job is brought to RUNNING the way the controller does it: each node's report
(``AgentReport``, 8 running workers with the runtime) made into its observation by
``observe`` (the controller's intake), ``decide`` ticks from PENDING through RENDEZVOUS. Then
``--ticks`` (50) ticks are timed, ``decide`` alone: between two ticks the nodes whose
heartbeat fell due report again (steps advancing), as agents at the job's scaled heartbeat
(``scaled_timing``) would, at the executor's tick period (a tenth of the heartbeat, between
0.1 s and 1 s: server.py), with the controller's garbage collector thresholds. The node
liveness index (``Liveness``) is kept as the intake keeps
it and handed to ``decide`` as the executor does.

Prints ``{"nodes", "workers", "ticks", "tick_ms_p50", "tick_ms_p99", "tick_ms_max"}``. Target
(issue 31): tick p50 well under 20 ms at 16,384 nodes. ``--smoke``: 64 nodes (CI). Run:
``python benchmarks/decide_scale.py [--nodes N] [--json] [--record]``. Needs no GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import common

from trainguard.controller.api import NodeObs, Phase
from trainguard.controller.config import JobConfig, scaled_timing
from trainguard.controller.decide import JobState, decide
from trainguard.controller.ingest import observe
from trainguard.controller.jobstate import Inputs
from trainguard.controller.server import GC_THRESHOLDS
from trainguard.controller.summary import Liveness
from trainguard.protocol import AgentReport
from trainguard.protocol.report import WorkerReport

NPROC = 8
TARGET_MS = 20.0


def _report(node: int, gen: int | None, step: int, now: float) -> AgentReport:
    """Node ``node``'s heartbeat: its 8 workers running generation ``gen`` at ``step``."""
    workers = (
        []
        if gen is None
        else [
            WorkerReport(
                rank=node * NPROC + i, local_rank=i, pid=1000 + i, state="running", step=step,
                progress_age_s=0.05, heartbeat_age_s=0.05, last_progress_at=now - 0.05,
                coll=[4 * step, 4 * step], runtime=True, cpu_idle_s=0.0,
            )
            for i in range(NPROC)
        ]
    )  # fmt: skip
    return AgentReport(
        node_id=f"node{node}", addr=f"10.{node >> 16}.{(node >> 8) & 255}.{node & 255}:7000",
        incarnation=f"inc{node}", generation=gen, workers=workers,
        store=(gen, 29500) if gen is not None and node == 0 else None, time=now,
    )  # fmt: skip


class Job:
    """The controller's view of a job of ``nodes`` nodes: observations, state, fake clock."""

    def __init__(self, nodes: int, run_dir: str) -> None:
        hb, timeout = scaled_timing(nodes)
        self.cfg = JobConfig.from_fields(
            script="train.py", run_dir=run_dir, nodes=nodes, nproc_per_node=NPROC,
            heartbeat_s=hb, node_timeout_s=timeout, preflight="off",
        )  # fmt: skip
        self.nodes, self.now, self.step = nodes, 1_000_000.0, 1
        self.tick_s = min(1.0, max(0.1, hb / 10))  # the executor's tick period (server.py)
        self.s = JobState(phase_since=self.now)
        self.obs: dict[str, NodeObs] = {}
        self.live = Liveness(self.cfg.timeouts.node_timeout_s)
        self._next = 0  # the next node to report (round robin: every node once a heartbeat)

    def report(self, node: int, gen: int | None) -> None:
        """One report of ``node`` taken as the intake takes it."""
        name = f"node{node}"
        o = self.obs[name] = observe(
            name, _report(node, gen, self.step, self.now), self.obs.get(name), self.now
        )
        self.live.track(o)  # as the intake does (Intake.take)

    def decide(self) -> list[tuple[str, dict[str, Any]]]:
        """One tick's ``decide``, as the executor calls it."""
        self.s, events = decide(self.s, self.obs, self.now, self.cfg, [], Inputs(), self.live)
        return events

    def advance(self) -> None:
        """One tick period: the nodes whose heartbeat fell due report (steps advance)."""
        self.now += self.tick_s
        self.step += 1
        due = max(1, round(self.nodes * self.tick_s / self.cfg.timeouts.heartbeat_s))
        for _ in range(min(due, self.nodes)):
            self.report(self._next, self.s.generation)
            self._next = (self._next + 1) % self.nodes

    def start(self) -> None:
        """PENDING → RENDEZVOUS → RUNNING through the controller's own decisions."""
        for i in range(self.nodes):
            self.report(i, None)
        self.decide()
        assert self.s.phase == Phase.RENDEZVOUS, self.s.phase
        for i in range(self.nodes):
            self.report(i, self.s.generation)
        self.decide()
        assert self.s.phase == Phase.RUNNING, (self.s.phase, self.s.reason)


def measure(nodes: int, ticks: int) -> dict[str, Any]:
    """Time ``ticks`` decisions of a running job of ``nodes`` nodes (ms per tick)."""
    gc.set_threshold(*GC_THRESHOLDS)  # the controller's collector thresholds (server.py)
    with tempfile.TemporaryDirectory() as run_dir:
        job = Job(nodes, run_dir)
        job.start()
        times: list[float] = []
        for _ in range(ticks):
            job.advance()
            t0 = time.perf_counter()
            job.decide()
            times.append((time.perf_counter() - t0) * 1000)
            assert job.s.phase == Phase.RUNNING, (job.s.phase, job.s.reason)
    times.sort()
    return {
        "nodes": nodes,
        "workers": nodes * NPROC,
        "ticks": ticks,
        "tick_ms_p50": round(statistics.median(times), 3),
        "tick_ms_p99": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3),
        "tick_ms_max": round(times[-1], 3),
    }


def table_rows(result: dict[str, Any]) -> list[common.Row]:
    """The README's row: the decision tick's p50/p99 against issue 31's target."""
    return [
        {
            "what": (
                f"controller decision tick (``decide``) at {result['nodes']:,} nodes "
                f"({result['workers']:,} workers), running, in process"
            ),
            "result": f"p50 {result['tick_ms_p50']:.2f} ms, p99 {result['tick_ms_p99']:.2f} ms",
            "target": common.verdict(result["tick_ms_p50"], TARGET_MS, " ms"),
        }
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=16384, help="nodes of the job (8 workers each)")
    p.add_argument("--ticks", type=int, default=50, help="decisions timed")
    common.add_common(p, smoke="64 nodes (CI)")
    args = p.parse_args(argv)
    result = measure(64 if args.smoke else args.nodes, args.ticks)
    if not args.json:
        print(json.dumps(result))
    common.finish("decide_scale", args, result, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
