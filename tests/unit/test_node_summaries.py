"""Node summaries and the node liveness index (issue 31): a decision tick reads nodes, not
workers, and finds the nodes not alive from their deadlines; the answers are those of the
scans they replace."""

from __future__ import annotations

import dataclasses
import random

from trainguard.controller.api import NO_STEP, NodeObs, Phase
from trainguard.controller.config import JobConfig
from trainguard.controller.decide import JobState, decide
from trainguard.controller.detect import lost_nodes
from trainguard.controller.ingest import observe
from trainguard.controller.jobstate import Inputs, copy_state
from trainguard.controller.pools import is_alive, update_pools
from trainguard.controller.summary import Liveness, summarize
from trainguard.protocol import AgentReport
from trainguard.protocol.report import WorkerReport

NPROC = 8


def cfg(nodes: int, **kw: object) -> JobConfig:
    return JobConfig.from_fields(
        script="train.py", run_dir="/tmp/x", nodes=nodes, nproc_per_node=NPROC,
        heartbeat_s=0.5, node_timeout_s=5.0, preflight="off", **kw,
    )  # fmt: skip


def report(i: int, gen: int | None, step: int = 3, now: float = 1000.0) -> AgentReport:
    workers = [
        WorkerReport(rank=i * NPROC + k, local_rank=k, pid=100 + k, state="running", step=step,
                     progress_age_s=0.1, cpu_idle_s=0.0, runtime=True)
        for k in range(NPROC if gen is not None else 0)
    ]  # fmt: skip
    return AgentReport(
        node_id=f"n{i}", addr=f"10.0.0.{i}:1", incarnation=f"inc{i}", generation=gen,
        workers=workers, store=(gen, 29500) if gen is not None and i == 0 else None,
    )  # fmt: skip


class Job:
    """``nodes`` nodes brought to RUNNING through observe and decide, with a liveness index."""

    def __init__(self, nodes: int) -> None:
        self.c, self.now = cfg(nodes), 1000.0
        self.s = JobState(phase_since=self.now)
        self.obs: dict[str, NodeObs] = {}
        self.live = Liveness(self.c.timeouts.node_timeout_s)
        self.events: list[tuple[str, dict[str, object]]] = []
        for i in range(nodes):
            self.take(i, None)
        self.tick()
        for i in range(nodes):
            self.take(i, self.s.generation)
        self.tick()
        assert self.s.phase == Phase.RUNNING

    def take(self, i: int, gen: int | None, step: int = 3) -> NodeObs:
        o = observe(f"n{i}", report(i, gen, step, self.now), self.obs.get(f"n{i}"), self.now)
        self.obs[o.node_id] = o
        self.live.track(o)
        return o

    def tick(self, dt: float = 0.1) -> JobState:
        self.now += dt
        self.s, ev = decide(self.s, self.obs, self.now, self.c, [], Inputs(), self.live)
        self.events += ev
        return self.s


def test_a_summary_is_made_again_after_the_workers_change_in_place() -> None:
    o = observe("n0", report(0, 2, step=7), None, 1000.0)
    assert o.summary is not None
    assert (o.summary.workers, o.summary.running, o.summary.max_step, o.summary.quiet) == (
        NPROC, NPROC, 7, True,
    )  # fmt: skip
    assert not o.summary.in_trainguard and o.summary.calm == (2, NPROC, 7)
    w = o.workers[3]
    w.step, w.in_trainguard, w.progress_age_s, w.cpu_idle_s = 9, True, 0.02, None
    o.last_seen = 1005.0
    summarize(o)
    assert o.summary.max_step == 9 and o.summary.in_trainguard
    assert o.summary.idle_min_s == 0.02 and o.summary.cpu_idle_min_s == float("-inf")
    o.workers[5].state = "failed"
    o.hang = True
    summarize(o)
    assert (o.summary.running, o.summary.failed, o.summary.quiet, o.summary.calm[0]) == (
        NPROC - 1, 1, False, None,
    )  # fmt: skip
    o.workers = {}
    summarize(o)
    assert o.summary.workers == 0 and o.summary.max_step == 7  # steps_seen of generation 2
    o.generation = None
    summarize(o)
    assert o.summary.max_step == NO_STEP


def test_the_heap_finds_exactly_the_nodes_the_scan_finds() -> None:
    rng = random.Random(31)
    c = cfg(40, standby=10)
    t = c.timeouts.node_timeout_s
    obs: dict[str, NodeObs] = {}
    live = Liveness(t)
    now = 1000.0
    for i in range(50):
        o = obs[f"n{i}"] = observe(f"n{i}", report(i, None), None, now - rng.uniform(0, 2 * t))
        live.track(o)
    s = JobState(phase_since=now, assignment={f"n{i}": i for i in range(40)})
    s.gen_incarnations = {n: obs[n].incarnation for n in s.assignment}
    for _ in range(200):
        now += rng.uniform(0, 2.0)
        for n in rng.sample(sorted(obs), 10):  # in place (a relay's alive entry) or a report
            if rng.random() < 0.5:
                obs[n].last_seen = max(obs[n].last_seen, now - rng.uniform(0, 1.5 * t))
            else:
                r = report(int(n[1:]), None)
                if rng.random() < 0.15:  # the agent's last report: gone at once
                    r = dataclasses.replace(r, leaving=True)
                o = observe(n, r, obs[n], now - rng.uniform(0, t))
                obs[n] = o
                live.track(o)
        tick = live.at(obs, now)
        assert tick.dead == {n for n, o in obs.items() if not is_alive(o, now, c)}
        assert lost_nodes(s, obs, now, c, tick) == lost_nodes(s, obs, now, c)
        a, b = copy_state(s), copy_state(s)
        ea: list[tuple[str, dict[str, object]]] = []
        eb: list[tuple[str, dict[str, object]]] = []
        update_pools(a, obs, now, c, ea, tick)
        update_pools(b, obs, now, c, eb)
        assert (a, ea) == (b, eb)
        s = a


def test_a_failed_worker_on_one_node_among_many_is_the_culprit() -> None:
    job = Job(64)
    for _ in range(3):
        assert job.tick().phase == Phase.RUNNING
    o = job.take(37, job.s.generation)
    w = o.workers[37 * NPROC + 5]
    victim = job.obs["n12"].workers[12 * NPROC]
    victim.state, victim.exited_at = "failed", job.now - 0.5
    victim.error = "RuntimeError: Connection closed by peer"
    summarize(job.obs["n12"])
    w.state, w.exit_code, w.exited_at = "failed", -9, job.now
    summarize(o)
    s = job.tick()
    assert s.recovery is not None and s.phase == Phase.STOPPING
    f = s.recovery.fault
    assert (f.cause, f.node_id, f.rank) == ("worker_crash", "n37", 37 * NPROC + 5)


def test_decide_with_the_index_decides_as_without_it() -> None:
    """A node gone silent, then a rebooted one: the same states and events either way."""
    job = Job(8)
    for step in range(4, 40):
        job.now += 0.5
        for i in range(8):
            if i != 3 or step < 10:  # n3 falls silent
                job.take(i, job.s.generation, step)
        before = job.s
        new, ev = decide(before, job.obs, job.now, job.c, [], Inputs(), job.live)
        ref, ref_ev = decide(before, job.obs, job.now, job.c, [], Inputs())
        assert (new, ev) == (ref, ref_ev)
        job.s = new
    assert job.s.recovery is not None and job.s.recovery.fault.node_id == "n3"
