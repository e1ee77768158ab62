"""The job state machine, driven with a fake clock and synthetic agent reports."""

from __future__ import annotations

import json
from typing import Any

from trainguard.controller.api import NodeObs, Phase, Pool, WorkerObs
from trainguard.controller.config import JobConfig
from trainguard.controller.decide import JobState, decide
from trainguard.controller.decide import desired_for as typed_desired_for
from trainguard.controller.jobstate import StateEncoder, state_from_json, state_json
from trainguard.protocol import desired_from_json, desired_to_json


def desired_for(*args: Any) -> dict[str, Any]:
    """The node's desired state as it goes on the wire (and parses back to the same)."""
    wire = desired_to_json(typed_desired_for(*args))
    assert desired_from_json(wire) == typed_desired_for(*args)
    return wire


PEER_LOST = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"


def cfg(**kw: object) -> JobConfig:
    base: dict[str, object] = {
        "script": "train.py",
        "run_dir": "/tmp/x",
        "nodes": 2,
        "heartbeat_s": 0.5,
        "node_timeout_s": 5.0,
        "max_restarts": 3,
    }
    base.update(kw)
    base.setdefault("preflight", "off")
    return JobConfig.from_fields(**base)


class Sim:
    """A job as the controller sees it: node reports and a fake clock."""

    def __init__(self, c: JobConfig, nodes: int) -> None:
        self.c, self.now, self.s = c, 1000.0, JobState(phase_since=1000.0)
        self.obs = {
            f"node{i}": NodeObs(
                node_id=f"node{i}",
                addr=f"127.0.0.{i + 2}",
                incarnation=f"inc{i}",
                last_seen=self.now,
            )
            for i in range(nodes)
        }
        self.events: list[tuple[str, dict[str, object]]] = []
        self.ckpt: list[tuple[int, int]] = []

    def tick(self, dt: float = 0.1, seen: tuple[str, ...] | None = None) -> JobState:
        self.now += dt
        for n, o in self.obs.items():
            if seen is None or n in seen:
                o.last_seen = self.now
        self.s, ev = decide(self.s, self.obs, self.now, self.c, self.ckpt)
        self.events += ev
        return self.s

    def run_generation(self, step: int = 5) -> None:
        gen = self.s.generation
        for n, rank in self.s.assignment.items():
            o = self.obs[n]
            if rank == 0:
                o.store = (gen, 29500 + gen)
            o.generation = gen
            o.workers = {
                rank: WorkerObs(rank=rank, local_rank=0, pid=100 + rank, state="running", step=step)
            }
        self.tick()
        self.tick()

    def ack_stop(self) -> None:
        for n in self.s.assignment:
            self.obs[n].stopped_generation = self.s.generation
            self.obs[n].stopped_at = self.obs[n].cleaned_at = self.now
            self.obs[n].ckptd_at = self.now  # the agent asks its ckptd again after a stop
            self.obs[n].generation = None
            self.obs[n].workers = {}

    def crash_node1(self) -> JobState:
        """Generation 0 running on 2 nodes with step 4 durable; node1's rank killed (-9)."""
        self.tick()
        self.run_generation()
        self.ckpt = [(4, 0)]
        w = self.worker("node1")
        w.state, w.exit_code, w.exited_at = "failed", -9, self.now
        return self.tick()

    def fail_restore(self) -> JobState:
        """The generation starts; node1's rank cannot load the restore point from any tier:
        it reports the point unusable and exits 1; the stop is acknowledged."""
        self.run_generation(step=None)  # type: ignore[arg-type]
        self.s.unusable.append([self.s.restore_step, self.s.restore_gen])  # the rank's report
        w = self.worker("node1")
        w.step, w.state, w.exit_code, w.exited_at, w.error = (
            None, "failed", 1, self.now, "CheckpointCorruptError: step: checksum",
        )  # fmt: skip
        self.tick()
        self.ack_stop()
        return self.tick()

    def worker(self, node: str) -> WorkerObs:
        return next(iter(self.obs[node].workers.values()))


def test_start_assigns_node_ranks_and_standby() -> None:
    sim = Sim(cfg(standby=1), 3)
    s = sim.tick()
    assert s.phase == Phase.RENDEZVOUS and s.generation == 0
    assert s.assignment == {"node0": 0, "node1": 1}
    assert s.pools["node2"] == Pool.STANDBY
    assert desired_for(s, "node2", sim.obs, sim.c)["action"] == "idle"
    d = desired_for(s, "node0", sim.obs, sim.c)
    assert d["action"] == "run" and d["host_store"] and d["master_port"] is None
    sim.run_generation()
    assert sim.s.phase == Phase.RUNNING and sim.s.master_port == 29500
    assert desired_for(sim.s, "node1", sim.obs, sim.c)["master_addr"] == "127.0.0.2"


def test_crash_stops_cleans_and_restarts_from_checkpoint() -> None:
    sim = Sim(cfg(), 2)
    s = sim.crash_node1()
    assert s.phase == Phase.STOPPING and s.recovery is not None
    assert (s.recovery.fault.cause, s.recovery.fault.rank, s.recovery.fault.node_id) == (
        "worker_crash",
        1,
        "node1",
    )
    assert desired_for(s, "node0", sim.obs, sim.c) == {
        "action": "stop",
        "generation": 0,
        "grace_s": 0.1,
        "dump_stacks": False,
    }
    assert sim.tick().phase == Phase.STOPPING  # waits for every live node to stop
    sim.ack_stop()
    s = sim.tick()
    assert (
        s.phase == Phase.RENDEZVOUS
        and s.generation == 1
        and s.restarts == 1
        and s.restore_step == 4
    )
    assert desired_for(s, "node0", sim.obs, sim.c)["restore_step"] == 4


def test_victim_is_not_blamed_when_the_culprit_reports_late() -> None:
    sim = Sim(cfg(), 2)
    sim.tick()
    sim.run_generation()
    v = sim.worker("node0")
    v.state, v.exit_code, v.exited_at, v.error = "failed", 1, sim.now, PEER_LOST
    assert sim.tick(0.2).phase == Phase.RUNNING  # settling: only a victim so far
    c = sim.worker("node1")
    c.state, c.exit_code, c.exited_at = "failed", -9, sim.now - 0.3
    s = sim.tick(0.2)
    assert s.recovery is not None and s.recovery.fault.rank == 1


def test_lone_victim_is_reported_after_the_settle_window() -> None:
    sim = Sim(cfg(), 2)
    sim.tick()
    sim.run_generation()
    v = sim.worker("node0")
    v.state, v.exit_code, v.exited_at, v.error = "failed", 1, sim.now, PEER_LOST
    sim.tick(0.2)
    s = sim.tick(1.0)
    assert s.recovery is not None and s.recovery.fault.rank == 0


def test_lost_node_is_replaced_by_standby_which_takes_its_rank() -> None:
    sim = Sim(cfg(standby=1), 3)
    sim.tick()
    sim.run_generation()
    sim.ckpt = [(5, 0)]
    s = sim.tick(6.0, seen=("node0", "node2"))  # node1 silent past node_timeout
    assert s.recovery is not None and s.recovery.fault.cause == "node_lost"
    assert s.recovery.fault.node_id == "node1"
    sim.ack_stop()
    s = sim.tick(0.1, seen=("node0", "node2"))
    assert s.phase == Phase.RENDEZVOUS and s.assignment == {"node0": 0, "node2": 1}
    assert s.recovery is not None and s.recovery.replaced == {"node1": "node2"}
    sim.obs["node1"].incarnation = "rebooted"  # the host comes back with a fresh agent
    assert sim.tick().pools["node1"] == Pool.STANDBY


def test_without_standby_the_job_waits_for_the_node_to_return() -> None:
    sim = Sim(cfg(), 2)
    sim.tick()
    sim.run_generation()
    sim.tick(6.0, seen=("node0",))
    sim.ack_stop()
    s = sim.tick(0.1, seen=("node0",))
    assert s.phase == Phase.WAITING_FOR_NODES
    assert sim.tick(5.0, seen=("node0",)).phase == Phase.WAITING_FOR_NODES
    sim.obs["node1"].incarnation = "rebooted"
    s = sim.tick(0.1)
    assert s.phase == Phase.RENDEZVOUS and s.assignment == {"node0": 0, "node1": 1}


def test_waiting_for_a_lost_node_has_a_deadline() -> None:
    """Issue 13, property 6: WAITING_FOR_NODES fails the job after wait_for_nodes_timeout_s,
    naming the node and the time waited (the checkpoint stays for a re-run)."""
    sim = Sim(cfg(wait_for_nodes_timeout_s=60.0), 2)
    sim.tick()
    sim.run_generation()
    sim.tick(6.0, seen=("node0",))
    sim.ack_stop()
    assert sim.tick(0.1, seen=("node0",)).phase == Phase.WAITING_FOR_NODES
    assert sim.tick(59.0, seen=("node0",)).phase == Phase.WAITING_FOR_NODES
    s = sim.tick(2.0, seen=("node0",))
    assert s.phase == Phase.FAILED and "waited 61s for 1 node(s) to replace node1" in s.reason
    assert s.recovery is None and len(s.recoveries) == 1


def test_script_failing_before_first_step_is_a_user_error() -> None:
    sim = Sim(cfg(), 2)
    sim.tick()
    for _ in range(2):
        sim.run_generation(step=None)  # type: ignore[arg-type]
        for n in sim.s.assignment:
            w = sim.worker(n)
            w.step, w.state, w.exit_code, w.exited_at, w.error = (
                None,
                "failed",
                1,
                sim.now,
                "ValueError: bad",
            )
        sim.tick()
        sim.ack_stop()
        sim.tick()
    assert sim.s.phase == Phase.FAILED and sim.s.reason.startswith("user error")
    assert "ValueError: bad" in sim.s.reason
    assert desired_for(sim.s, "node0", sim.obs, sim.c)["action"] == "shutdown"


def test_restart_budget_and_no_progress() -> None:
    sim = Sim(cfg(max_restarts=1), 2)
    sim.tick()
    for step in (3, 6):
        sim.run_generation(step=step)
        sim.ckpt = [(step, 0)]
        w = sim.worker("node0")
        w.state, w.exit_code, w.exited_at = "failed", -9, sim.now
        sim.tick()
        sim.ack_stop()
        sim.tick()
    assert sim.s.phase == Phase.FAILED and "restart budget" in sim.s.reason
    # Step reports but no checkpoint: the first generation progressed (it ran steps); later
    # ones that never get past step 5 do not.
    sim2 = Sim(cfg(max_restarts=10, no_progress_generations=2), 2)
    sim2.tick()
    for _ in range(3):
        sim2.run_generation()
        w = sim2.worker("node1")
        w.state, w.exit_code, w.exited_at = "failed", -9, sim2.now
        sim2.tick()
        sim2.ack_stop()
        sim2.tick()
    assert sim2.s.phase == Phase.FAILED and sim2.s.reason.startswith("no progress")


def _fail_plain(sim: Sim, message: str) -> None:
    """A generation of a script that reports no steps, ending in a worker exit."""
    gen = sim.s.generation
    for n, rank in sim.s.assignment.items():
        o = sim.obs[n]
        if rank == 0:
            o.store = (gen, 29500 + gen)
        o.generation = gen
        o.workers = {rank: WorkerObs(rank=rank, local_rank=0, pid=100 + rank, state="running")}
    sim.tick()
    sim.tick()
    w = sim.worker("node0")
    w.state, w.exit_code, w.exited_at, w.error = "failed", 1, sim.now, message
    sim.tick()
    sim.ack_stop()
    sim.tick()


def test_a_plain_script_is_judged_by_its_restart_budget() -> None:
    """No step reports, no checkpoints: different transient errors are retried up to the
    budget (never "user error" or "no progress"); the same error twice is a user error."""
    sim = Sim(cfg(max_restarts=10), 2)
    sim.tick()
    for r in range(5):
        _fail_plain(sim, f"RuntimeError: transient failure in restart {r}")
        assert sim.s.phase != Phase.FAILED, sim.s.reason
    assert sim.s.restarts == 5
    sim = Sim(cfg(max_restarts=10), 2)
    sim.tick()
    for _ in range(2):
        _fail_plain(sim, "ModuleNotFoundError: No module named 'tranformers'")
    assert sim.s.phase == Phase.FAILED and sim.s.reason.startswith("user error"), sim.s.reason
    assert "same error: " in sim.s.reason and "ModuleNotFoundError" in sim.s.reason


def test_a_rank_that_left_early_with_status_0_is_the_culprit() -> None:
    """Rank 1 exits 0 mid-run; rank 0 then fails on the lost connection: the fault is rank 1's."""
    sim = Sim(cfg(), 2)
    sim.tick()
    sim.run_generation(step=20)
    w1 = sim.worker("node1")
    w1.state, w1.exit_code, w1.exited_at = "succeeded", 0, sim.now
    sim.tick()
    w0 = sim.worker("node0")
    w0.state, w0.exit_code, w0.exited_at = "failed", 1, sim.now
    w0.error = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    sim.tick(1.0)
    (fault,) = [d for k, d in sim.events if k == "fault"]
    assert fault["rank"] == 1 and "left early" in fault["message"], fault


def test_ranks_that_all_exit_0_before_their_last_step_did_not_finish() -> None:
    for step, phase in ((21, Phase.FAILED), (60, Phase.SUCCEEDED)):
        sim = Sim(cfg(), 2)
        sim.tick()
        sim.run_generation(step=step)
        for n in sim.s.assignment:
            w = sim.worker(n)
            w.state, w.exit_code, w.exited_at, w.total_steps = "succeeded", 0, sim.now, 60
        sim.tick()
        assert sim.s.phase == phase, sim.s.reason
    sim = Sim(cfg(), 2)  # a script that never said where it ends: exit 0 is a finish
    sim.tick()
    sim.run_generation(step=21)
    for n in sim.s.assignment:
        w = sim.worker(n)
        w.state, w.exit_code, w.exited_at = "succeeded", 0, sim.now
    assert sim.tick().phase == Phase.SUCCEEDED


def test_hang_names_the_frozen_rank() -> None:
    sim = Sim(cfg(), 2)
    sim.tick()
    sim.run_generation()
    sim.worker("node0").heartbeat_age_s = 0.1
    sim.worker("node1").heartbeat_age_s = 30.0  # SIGSTOPped: no heartbeats
    sim.obs["node0"].hang = True
    s = sim.tick()
    assert (
        s.recovery is not None and s.recovery.fault.cause == "hang" and s.recovery.fault.rank == 1
    )


def test_user_stop_and_success() -> None:
    sim = Sim(cfg(), 2)
    sim.tick()
    sim.run_generation()
    sim.s.stop_requested = True
    s = sim.tick()
    assert s.phase == Phase.STOPPING and desired_for(s, "node0", sim.obs, sim.c)["grace_s"] == 15.0
    sim.ack_stop()
    assert sim.tick().phase == Phase.STOPPED
    ok = Sim(cfg(), 2)
    ok.tick()
    ok.run_generation()
    for n in ok.s.assignment:
        ok.worker(n).state = "succeeded"
    assert ok.tick().phase == Phase.SUCCEEDED


def test_config_rejects_bad_values_with_the_fix() -> None:
    import pytest

    with pytest.raises(ValueError, match="--nodes 0"):
        cfg(nodes=0)
    with pytest.raises(ValueError, match="--hang-timeout"):
        cfg(hang_timeout_s=float("inf"))


def test_restore_point_prefers_a_memory_copy_every_rank_holds() -> None:
    from trainguard.controller.restore import restore_point

    sim = Sim(cfg(), 2)
    sim.tick()
    sim.obs["node0"].memory = {0: [(21, 0), (22, 0)]}
    sim.obs["node1"].memory = {1: [(20, 0), (21, 0)]}
    assert restore_point(sim.s, sim.obs, sim.c, [(20, 0)]) == (
        (21, 0),
        {"memory": 2, "replica": 0, "durable": 0},
    )
    sim.obs["node1"].memory = {}  # node1 replaced: its memory is gone, the durable copy serves
    assert restore_point(sim.s, sim.obs, sim.c, [(20, 0)]) == (
        (20, 0),
        {"memory": 0, "replica": 0, "durable": 2},
    )
    sim.obs["node1"].memory = {
        1: [(22, 1)]
    }  # same step from another generation is not the same copy
    assert restore_point(sim.s, sim.obs, sim.c, []) == (None, {})


def test_stop_requested_during_a_recovery_ends_the_job() -> None:
    sim = Sim(cfg(), 2)
    sim.tick()
    sim.run_generation()
    w = sim.worker("node1")
    w.state, w.exit_code, w.exited_at = "failed", -9, sim.now
    assert sim.tick().phase == Phase.STOPPING
    sim.s.stop_requested = True  # SIGTERM arrives mid-recovery
    sim.ack_stop()
    s = sim.tick()
    assert s.phase == Phase.STOPPED and s.restarts == 0


def test_state_survives_the_store_round_trip() -> None:
    """A restarted controller reads back exactly the state its predecessor persisted."""
    sim = Sim(cfg(standby=1), 3)
    sim.tick()
    sim.run_generation()
    for _ in range(60):  # node1 stops reporting: lost, replaced by the standby
        sim.tick(seen=("node0", "node2"))
    s = sim.s
    assert s.recovery is not None or s.recoveries, s.phase
    back = state_from_json(json.loads(json.dumps(state_json(s))))
    assert back == s


def test_restore_point_counts_replicas_on_healthy_nodes_only() -> None:
    """A replaced node's rank restores from the replica its ring peer holds; replicas on a
    node that is not healthy (lost, faulty) do not count."""
    from trainguard.controller.restore import replica_sources, restore_point

    c = cfg(nodes=2)
    s = JobState(
        assignment={"new": 0, "peer": 1}, pools={"new": Pool.RUNNING, "peer": Pool.RUNNING}
    )
    obs = {
        "new": NodeObs(node_id="new", addr="a", incarnation="i", last_seen=0.0),
        "peer": NodeObs(
            node_id="peer",
            addr="b",
            incarnation="i",
            last_seen=0.0,
            memory={1: [(14, 0), (15, 0)]},
            replicas={0: [(15, 0)]},
            replica_addr="b:7000",
        ),
    }
    point, tiers = restore_point(s, obs, c, [(10, 0)])
    assert point == (15, 0) and tiers == {"memory": 1, "replica": 1, "durable": 0}
    s.restore_step, s.restore_gen = 15, 0
    assert replica_sources(s, obs, c) == {"0": "b:7000"}
    s.pools["peer"] = Pool.FAULTY
    assert restore_point(s, obs, c, [(10, 0)])[0] == (10, 0)
    off = cfg(nodes=2, replicas=False)
    s.pools["peer"] = Pool.RUNNING
    assert restore_point(s, obs, off, [(10, 0)])[0] == (10, 0)


def test_elastic_shrinks_without_standby_and_grows_back_without_spending_the_budget() -> None:
    sim = Sim(cfg(nodes=3, min_nodes=2), 3)
    sim.tick()
    sim.run_generation(step=5)
    assert sim.s.phase == Phase.RUNNING and len(sim.s.assignment) == 3
    sim.ckpt = [(4, 0)]
    for _ in range(60):  # node1 (node rank 1) goes silent: lost, and no standby
        sim.tick(seen=("node0", "node2"))
        if sim.s.phase == Phase.STOPPING:
            sim.ack_stop()
    s = sim.s
    assert s.phase == Phase.RENDEZVOUS and s.generation == 1, s.phase
    assert s.assignment == {"node0": 0, "node2": 1}  # dense node ranks, old order kept
    assert desired_for(s, "node2", sim.obs, sim.c)["world_size"] == 2
    assert s.restore_step == 4  # the world changed: every rank reads the durable tier
    assert s.restarts == 1
    shrink = [d for k, d in sim.events if k == "membership_changed"]
    assert shrink and shrink[0]["to_nodes"] == 2 and shrink[0]["left"] == ["node1"]

    sim.obs["node1"].incarnation = "rebooted"  # the lost node comes back, a fresh agent
    sim.obs["node1"].memory = {}
    sim.run_generation(step=9)
    assert s is not sim.s and sim.s.pools["node1"] == Pool.STANDBY
    for _ in range(5):
        sim.tick()
        if sim.s.phase == Phase.STOPPING:
            assert (
                desired_for(sim.s, "node0", sim.obs, sim.c)["grace_s"]
                == sim.c.timeouts.stop_grace_s
            )
            sim.ckpt = [(4, 0), (9, 1)]  # the workers saved at SIGTERM
            sim.ack_stop()
    s = sim.s
    assert s.phase == Phase.RENDEZVOUS and s.generation == 2
    assert s.assignment == {"node0": 0, "node2": 1, "node1": 2}
    assert s.restore_step == 9 and s.restarts == 1  # growth is not a restart
    assert desired_for(s, "node1", sim.obs, sim.c)["world_size"] == 3


def test_a_faulty_node_is_rechecked_with_backoff_and_retired_after_repeated_losses() -> None:
    c = cfg(nodes=1, standby=1, recheck_s=10.0, retire_after=2)
    sim = Sim(c, 2)
    sim.tick()
    sim.run_generation()
    for _ in range(60):  # node0 silent: lost, node1 takes over
        sim.tick(seen=("node1",))
        if sim.s.phase == Phase.STOPPING:
            sim.ack_stop()
    assert sim.s.pools["node0"] == Pool.FAULTY and sim.s.assignment == {"node1": 0}
    sim.obs["node0"].health_ok, sim.obs["node0"].health_problems = False, ("disk: full",)
    sim.tick(dt=11.0)  # reachable again (same agent) but its disk is full: not readmitted
    assert sim.s.pools["node0"] == Pool.FAULTY
    failed = [d for k, d in sim.events if k == "recheck_failed"]
    assert failed and failed[-1]["problems"] == ["disk: full"] and failed[-1]["next_in_s"] == 20.0
    sim.obs["node0"].health_ok = True
    sim.tick(dt=10.0)
    assert sim.s.pools["node0"] == Pool.FAULTY  # not due yet (back-off)
    sim.tick(dt=11.0)
    assert sim.s.pools["node0"] == Pool.STANDBY
    sim.s = _lose_again(sim.s, "node0")
    assert sim.s.pools["node0"] == Pool.RETIRED


def test_a_node_silent_for_a_moment_while_the_job_joins_is_back_at_once_not_a_failed_job() -> None:
    """At start, a node that goes silent past the node timeout is quarantined; when it reports
    again while the job still waits for its nodes it is back in standby at once (no back-off:
    there is no generation yet), and the job starts on it at the join timeout. Before: it
    waited out ``recheck_s`` in quarantine and the job failed at the join timeout as if it
    had failed pre-flight (16,384 simulated nodes: 2,624 of them)."""
    c = cfg(nodes=3, standby=1, recheck_s=30.0, node_timeout_s=5.0, join_timeout_s=30.0)
    sim = Sim(c, 3)  # the standby never comes: the job starts on 3 at the join timeout
    sim.tick()
    assert sim.s.phase == Phase.PENDING and len(sim.s.pools) == 3
    for _ in range(7):
        sim.tick(dt=1.0, seen=("node0", "node1"))
    assert sim.s.pools["node2"] == Pool.FAULTY and sim.s.phase == Phase.PENDING
    sim.tick(dt=1.0)  # node2 reports again, 23 s before its re-check would be due
    assert sim.s.pools["node2"] == Pool.STANDBY, sim.events[-3:]
    while sim.now < 1000.0 + 31.0:
        sim.tick(dt=1.0)
    assert sim.s.phase != Phase.FAILED, sim.s.reason
    assert sorted(sim.s.assignment) == ["node0", "node1", "node2"]
    assert sim.s.node_faults["node2"] == 1  # the loss still counts toward retirement


def test_a_node_back_while_the_job_joins_with_failing_host_checks_keeps_its_back_off() -> None:
    """The same node back with a full disk keeps the back-off: re-checked when ``recheck_s``
    is up (one ``recheck_failed``), not on every tick, and it stays quarantined."""
    c = cfg(nodes=3, standby=1, recheck_s=30.0, node_timeout_s=5.0, join_timeout_s=60.0)
    sim = Sim(c, 3)
    sim.tick()
    for _ in range(7):
        sim.tick(dt=1.0, seen=("node0", "node1"))
    assert sim.s.pools["node2"] == Pool.FAULTY
    sim.obs["node2"].health_ok, sim.obs["node2"].health_problems = False, ("disk: full",)
    for _ in range(100):
        sim.tick(dt=0.1)
    assert not [d for k, d in sim.events if k == "recheck_failed"]  # 10 s: not due yet
    for _ in range(25):
        sim.tick(dt=1.0)
    failed = [d for k, d in sim.events if k == "recheck_failed"]
    assert len(failed) == 1 and failed[0]["problems"] == ["disk: full"], failed
    assert sim.s.pools["node2"] == Pool.FAULTY and sim.s.phase == Phase.PENDING


def test_a_standby_silent_for_a_moment_while_the_job_runs_waits_out_its_recheck() -> None:
    """The same silence once a generation runs: the standby waits out ``recheck_s`` in
    quarantine before it is taken back (a flapping node is kept out of the next one)."""
    c = cfg(nodes=1, standby=1, recheck_s=30.0, node_timeout_s=5.0)
    sim = Sim(c, 2)
    sim.tick()
    sim.run_generation()
    standby = next(n for n in sim.obs if n not in sim.s.assignment)
    busy = next(iter(sim.s.assignment))
    for _ in range(7):
        sim.tick(dt=1.0, seen=(busy,))
    assert sim.s.pools[standby] == Pool.FAULTY
    sim.tick(dt=1.0)
    assert sim.s.pools[standby] == Pool.FAULTY  # reporting again, re-check not due
    for _ in range(20):
        sim.tick(dt=1.0)
    assert sim.s.pools[standby] == Pool.FAULTY  # 28 s after its loss
    for _ in range(10):
        sim.tick(dt=1.0)
    assert sim.s.pools[standby] == Pool.STANDBY  # its re-check came (30 s)


def test_an_agents_last_report_loses_its_node_at_once_and_never_brings_it_back() -> None:
    """An agent stopped by SIGTERM stops its workers and sends a last report saying it is
    leaving: its node is lost at once (not after the node timeout), named as exited, and
    that report never returns it from quarantine as "reachable again" (trying to break
    ``--rdzv-endpoint`` found it taken into the next generation, then lost again)."""
    c = cfg(nodes=1, standby=1, recheck_s=1.0)
    sim = Sim(c, 2)
    sim.tick()
    sim.run_generation()
    sim.obs["node0"].leaving = True
    sim.tick()
    fault = next(d for k, d in sim.events if k == "fault")
    assert fault["node_id"] == "node0" and "agent exited" in fault["message"], fault
    for _ in range(20):
        sim.tick(dt=1.0)
        if sim.s.phase == Phase.STOPPING:
            sim.ack_stop()
    assert sim.s.pools["node0"] == Pool.FAULTY and sim.s.assignment == {"node1": 0}
    assert not [d for k, d in sim.events if k == "pool_changed" and d["to"] == "standby"]


def _lose_again(s: JobState, node: str) -> JobState:
    """Mark ``node`` faulty once more (its second loss): retired, since retire_after = 2."""
    from trainguard.controller.pools import mark_faulty

    events: list[tuple[str, dict[str, object]]] = []
    mark_faulty(s, node, 0.0, cfg(nodes=1, standby=1, recheck_s=10.0, retire_after=2), events, "x")
    assert events[-1][1]["to"] == "retired" and "lost 2 times" in str(events[-1][1]["reason"])
    return s


def test_replica_peers_form_a_ring_of_the_configured_size() -> None:
    from trainguard.controller.restore import replica_peers

    def ob(n: str) -> NodeObs:
        return NodeObs(node_id=n, addr=n, incarnation="i", last_seen=0.0, replica_addr=f"{n}:1")

    obs = {n: ob(n) for n in ("a", "b", "c", "s")}
    s = JobState(
        assignment={"a": 0, "b": 1, "c": 2},
        pools={"a": Pool.RUNNING, "b": Pool.RUNNING, "c": Pool.RUNNING, "s": Pool.STANDBY},
    )
    assert replica_peers(s, "c", obs, cfg(nodes=3)) == ["a:1"]
    assert replica_peers(s, "b", obs, cfg(nodes=3, replica_copies=2)) == ["c:1", "a:1"]
    assert replica_peers(s, "a", obs, cfg(nodes=3, replica_copies=5)) == ["b:1", "c:1"]
    assert replica_peers(s, "s", obs, cfg(nodes=3)) == []  # standby nodes do not replicate
    assert replica_peers(s, "a", obs, cfg(nodes=3, replicas=False)) == []
    one = JobState(assignment={"a": 0}, pools={"a": Pool.RUNNING, "s": Pool.STANDBY})
    assert replica_peers(one, "a", obs, cfg(nodes=1)) == ["s:1"]


def test_a_plain_job_is_wedged_only_when_every_rank_idles() -> None:
    """No runtime: one idle rank may wait for a busy peer; all idle past the limit is a hang."""
    from trainguard.controller.api import NodeObs, Phase, Pool, WorkerObs
    from trainguard.controller.config import JobConfig
    from trainguard.controller.decide import JobState
    from trainguard.controller.detect import detect_fault as _detect_fault

    cfg = JobConfig.from_fields(
        script="t.py", run_dir="/tmp/x", nodes=2, preflight="off", hang_timeout_max_s=60
    )
    s = JobState(phase=Phase.RUNNING, generation=0, assignment={"a": 0, "b": 1},
                 pools={"a": Pool.RUNNING, "b": Pool.RUNNING}, join_order=["a", "b"])  # fmt: skip

    def node(n: str, rank: int, idle: float, runtime: bool = False) -> NodeObs:
        w = WorkerObs(rank=rank, local_rank=0, pid=rank + 1, state="running", cpu_idle_s=idle,
                      runtime=runtime)  # fmt: skip
        return NodeObs(node_id=n, addr=n, incarnation="i", last_seen=100.0, generation=0,
                       workers={rank: w})  # fmt: skip

    assert _detect_fault(s, {"a": node("a", 0, 90.0), "b": node("b", 1, 5.0)}, 100.0, cfg) is None
    f = _detect_fault(s, {"a": node("a", 0, 61.0), "b": node("b", 1, 70.0)}, 100.0, cfg)
    assert f is not None and (f.cause, f.rank, f.node_id) == ("hang", 1, "b")
    assert "no rank used CPU for 60s" in f.message
    ran = {"a": node("a", 0, 61.0, runtime=True), "b": node("b", 1, 70.0)}
    assert _detect_fault(s, ran, 100.0, cfg) is None  # the runtime's heartbeats judge it


def test_a_planned_stop_persists_the_newest_memory_snapshot_before_the_restart() -> None:
    """Growth: the workers are stopped (SIGTERM, no handler of their own); every rank's step
    23 is in its node's memory, step 20 on disk. The nodes' ckptds persist step 23 first and
    the bigger world restores it: the stop costs no step."""
    from trainguard.controller.api import NodeObs, Phase, Pool
    from trainguard.controller.config import JobConfig
    from trainguard.controller.decide import JobState, decide

    cfg = JobConfig.from_fields(
        script="t.py", run_dir="/tmp/x", nodes=2, min_nodes=1, preflight="off"
    )
    obs = {n: NodeObs(node_id=n, addr=n, incarnation="i", last_seen=0.0) for n in ("a", "b")}
    obs["a"].memory = {0: [(22, 0), (23, 0)]}
    s = JobState(phase=Phase.RUNNING, generation=0, assignment={"a": 0}, max_step={0: 23},
                 pools={"a": Pool.RUNNING, "b": Pool.STANDBY}, join_order=["a", "b"],
                 growing=True, last_world=1)  # fmt: skip
    s.phase = Phase.CLEANING
    s, ev = decide(s, obs, 1.0, cfg, [(20, 0)])
    assert s.phase == Phase.CLEANING and s.persist is not None and s.persist["step"] == 23
    assert desired_for(s, "a", obs, cfg)["persist"] == {"step": 23, "generation": 0}
    s, ev = decide(s, obs, 2.0, cfg, [(20, 0)])
    assert s.phase == Phase.CLEANING  # waits for the commit (bounded by stop_persist_timeout_s)
    s, ev = decide(s, obs, 3.0, cfg, [(20, 0), (23, 0)])
    stop = next(d for k, d in ev if k == "planned_stop")
    assert (stop["saved_step"], stop["steps_lost"]) == (23, 0)
    assert s.assignment == {"a": 0, "b": 1} and s.restore_step == 23 and s.persist is None


def test_a_stop_whose_nodes_all_went_away_does_not_wait_out_the_persist_timeout() -> None:
    """A stop requested (the launcher killed, its controller SIGTERMed): the persist of step
    23 waits while the node reports; once no node of the assignment has reported for the
    node timeout (its agent exited with the launcher), the stop ends at once with the
    newest durable step, not after ``stop_persist_timeout_s`` (120 s)."""
    from trainguard.controller.api import NodeObs, Phase, Pool
    from trainguard.controller.config import JobConfig
    from trainguard.controller.decide import JobState, decide

    cfg = JobConfig.from_fields(script="t.py", run_dir="/tmp/x", nodes=1, preflight="off")
    obs = {"a": NodeObs(node_id="a", addr="a", incarnation="i", last_seen=0.0)}
    obs["a"].memory = {0: [(23, 0)]}
    s = JobState(phase=Phase.CLEANING, generation=0, assignment={"a": 0}, max_step={0: 23},
                 pools={"a": Pool.RUNNING}, join_order=["a"], stop_requested=True)  # fmt: skip
    s, ev = decide(s, obs, 1.0, cfg, [(20, 0)])
    assert s.persist is not None and s.persist["step"] == 23
    timeout = cfg.timeouts.node_timeout_s
    s, ev = decide(s, obs, timeout - 0.5, cfg, [(20, 0)])
    assert s.phase == Phase.CLEANING and not [k for k, _ in ev if k == "planned_stop"]
    s, ev = decide(s, obs, timeout + 0.5, cfg, [(20, 0)])
    failed = next(d for k, d in ev if k == "stop_persist_failed")
    stop = next(d for k, d in ev if k == "planned_stop")
    assert failed["nodes_gone"] and (stop["saved_step"], stop["steps_lost"]) == (20, 3)
    assert s.phase == Phase.STOPPED
    assert timeout + 0.5 < cfg.timeouts.stop_persist_timeout_s


def test_a_point_no_rank_could_restore_falls_back_to_an_older_one_not_a_user_error() -> None:
    sim = Sim(cfg(max_restarts=1), 2)  # fallbacks are not charged to the restart budget
    sim.ckpt = [(4, 0), (8, 0), (12, 0)]
    sim.tick()
    assert sim.s.restore_step == 12
    for expect_next in (8, 4, None):  # every copy turns out unreadable at load, newest first
        sim.fail_restore()
        if expect_next is None:
            break
        assert sim.s.phase == Phase.RENDEZVOUS and sim.s.restore_step == expect_next
    assert sim.s.phase == Phase.FAILED and "no restorable checkpoint left" in sim.s.reason
    kinds = [d.get("next") for k, d in sim.events if k == "restore_fallback"]
    assert kinds == [[8, 0], [4, 0], None] and sim.s.restarts == 0


def test_a_lost_memory_point_with_nothing_ever_durable_restarts_from_the_scripts_start() -> None:
    """Seen in CI's chaos run: step 1, held only in memory and a replica (the first durable
    step is 10), was corrupted in every copy; the job failed with "no restorable checkpoint
    left". Nothing durable was ever committed, so the script's own start is the oldest verified
    point: the job goes on from there (the same losses), not to FAILED."""
    sim = Sim(cfg(max_restarts=1), 2)
    sim.tick()
    sim.run_generation(step=1)
    for n, rank in sim.s.assignment.items():
        sim.obs[n].memory = {rank: [(1, 0)]}
    w = sim.worker("node1")
    w.state, w.exit_code, w.exited_at = "failed", -9, sim.now
    sim.tick()
    sim.ack_stop()
    sim.tick()
    assert sim.s.phase == Phase.RENDEZVOUS and sim.s.restore_step == 1, sim.s.reason
    sim.fail_restore()  # step 1 fails to load from every tier
    assert sim.s.phase == Phase.RENDEZVOUS and sim.s.restore_step is None, sim.s.reason
    (fallback,) = [d for k, d in sim.events if k == "restore_fallback"]
    assert fallback["next"] is None and fallback["from_start"] is True
    assert sim.s.restarts == 1  # the fallback itself is not charged to the budget


def test_decide_never_changes_the_state_it_was_given() -> None:
    """decide copies the state one level deep (copy_state, not deepcopy): check that every
    step of a crash, restart and node loss leaves the input state as it was."""
    sim = Sim(cfg(standby=1), 3)
    originals = []
    real = decide

    encoder = StateEncoder()

    def checked(s: JobState, *a: object) -> tuple[JobState, list[object]]:
        before = json.dumps(state_json(s), sort_keys=True)
        out = real(s, *a)  # type: ignore[arg-type]
        assert json.dumps(state_json(s), sort_keys=True) == before
        # what the controller persists, re-encoding changed fields only, is the whole state
        assert json.loads(encoder.encode(out[0])) == state_json(out[0])
        originals.append(before)
        return out  # type: ignore[return-value]

    import tests.unit.test_decide as me

    me.decide = checked  # type: ignore[assignment]
    try:
        sim.tick()
        sim.run_generation()
        sim.ckpt = [(4, 0)]
        w = sim.worker("node1")
        w.state, w.exit_code, w.exited_at = "failed", -9, sim.now
        sim.tick()
        sim.ack_stop()
        sim.tick()
        sim.run_generation()
        sim.tick(10.0, seen=("node0", "node2"))  # node1 is lost
        sim.ack_stop()
        sim.tick()
    finally:
        me.decide = real  # type: ignore[assignment]
    assert len(originals) >= 8 and sim.s.generation >= 1


def test_a_memory_index_asked_before_the_stop_is_not_trusted_for_the_restore() -> None:
    """The agent reads its ckptd in its own thread (the heartbeat never waits on it): a
    report after the stop may carry an index asked for before it, without the snapshot staged
    just before the stop. The restore waits (bounded) for an index asked after the stop."""
    sim = Sim(cfg(), 2)
    assert sim.crash_node1().phase == Phase.STOPPING
    sim.ack_stop()
    sim.obs["node0"].ckptd_at = sim.now - 1.0  # stale: asked before the stop
    s = sim.tick()
    assert s.phase == Phase.REPLACING and s.persist_settle_until is not None
    sim.obs["node0"].ckptd_at = sim.now  # asked again after it
    s = sim.tick()
    assert s.phase == Phase.RENDEZVOUS and s.generation == 1
