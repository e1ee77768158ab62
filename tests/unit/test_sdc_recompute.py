"""Issue 15, localization with 2 replicas (controller/recompute.py): a disagreement no
majority decides holds one node out, the recomputation's fingerprints at the same step name
the culprit (quarantined when held out, drained when still in the job), a second
disagreement names it by majority of nodes or as the node in both. Pure: decide on states."""

from __future__ import annotations

from trainguard.controller.api import NodeObs, Phase, Pool, WorkerObs
from trainguard.controller.config import JobConfig
from trainguard.controller.decide import JobState, decide
from trainguard.controller.ingest import FingerprintIndex
from trainguard.controller.jobstate import Inputs
from trainguard.controller.pools import healthy_standby

NOW = 1000.0


def cfg(**kw: object) -> JobConfig:
    base: dict[str, object] = dict(script="t.py", run_dir="/tmp/x", nodes=2, nproc_per_node=1,
                                   standby=1, heartbeat_s=0.5, node_timeout_s=5.0)  # fmt: skip
    return JobConfig.from_fields(**{**base, **kw})


def running(gen: int, assignment: dict[str, int], s: JobState | None = None) -> tuple[
    JobState, dict[str, NodeObs]
]:  # fmt: skip
    """Generation ``gen`` RUNNING on ``assignment`` (one rank a node); node0..node2 alive."""
    if s is None:
        s = JobState(pools={"node0": Pool.RUNNING, "node1": Pool.RUNNING, "node2": Pool.STANDBY},
                     join_order=["node0", "node1", "node2"])  # fmt: skip
    s.phase, s.phase_since, s.generation, s.master_port = Phase.RUNNING, NOW, gen, 1
    s.recovery = None  # the restart's recovery ended with its first step
    s.assignment = dict(assignment)
    for n in assignment:
        s.pools[n] = Pool.RUNNING
    obs = {}
    for n in ("node0", "node1", "node2"):
        rank = assignment.get(n)
        workers = {} if rank is None else {
            rank: WorkerObs(rank=rank, local_rank=0, pid=rank + 10, state="running", step=30)
        }  # fmt: skip
        obs[n] = NodeObs(node_id=n, addr=n, incarnation="i", last_seen=NOW,
                         generation=gen if rank is not None else None, workers=workers)  # fmt: skip
    return s, obs


def points(gen: int, values: dict[int, dict[int, int]]) -> Inputs:
    """step → rank → value (layout 7) of generation ``gen``, as the executor hands them."""
    index = FingerprintIndex()
    for r in (0, 1):
        index.add({str(r): [[st, gen, 7, v[r]] for st, v in values.items()]})
    return Inputs(fingerprints=index.complete(gen, 2))


def disagreed() -> tuple[JobState, list]:
    """Generation 0 on node0 (rank 0) and node1 (rank 1): agree at 20, differ at 25."""
    s, obs = running(0, {"node0": 0, "node1": 1})
    new, events = decide(
        s, obs, NOW, cfg(), [], points(0, {20: {0: 5, 1: 5}, 25: {0: 100, 1: 101}})
    )
    return new, events


def test_two_disagreeing_replicas_roll_back_with_one_node_held_out() -> None:
    s, events = disagreed()
    assert s.phase == Phase.STOPPING and s.recovery is not None
    assert s.recovery.fault.cause == "sdc" and s.recovery.fault.node_id is None
    detected = next(d for k, d in events if k == "sdc_detected")
    assert detected["undecided"] == [0, 1] and detected["held_out"] == "node1"
    assert s.sdc_verify is not None and s.sdc_verify["nodes"] == ["node0", "node1"]
    assert s.pools["node1"] == Pool.STANDBY  # out of the job, not quarantined
    assert not [d for k, d in events if k == "pool_changed" and d["to"] == "faulty"]
    _, obs = running(0, {"node0": 0, "node1": 1})
    assert healthy_standby(s, obs, NOW, cfg()) == ["node2"]  # never its own replacement
    # Without a standby: nothing held out, the rerun on the same nodes may still tell.
    s0, obs0 = running(0, {"node0": 0, "node1": 1})
    s0.pools["node2"] = Pool.FAULTY
    alone, _ = decide(s0, obs0, NOW, cfg(), [], points(0, {20: {0: 5, 1: 5}, 25: {0: 1, 1: 2}}))
    assert alone.sdc_verify is not None and alone.sdc_verify["held_out"] is None
    # Off: rolls back unlocalized, no record.
    s1, obs1 = running(0, {"node0": 0, "node1": 1})
    off, _ = decide(s1, obs1, NOW, cfg(sdc_recompute=False), [],
                    points(0, {20: {0: 5, 1: 5}, 25: {0: 1, 1: 2}}))  # fmt: skip
    assert off.sdc_verify is None and off.recovery is not None


def test_a_recomputation_that_agrees_quarantines_a_held_out_culprit() -> None:
    held, _ = disagreed()
    s, obs = running(1, {"node0": 0, "node2": 1}, held)  # node2 took node1's rank
    new, events = decide(s, obs, NOW, cfg(), [], points(1, {25: {0: 100, 1: 100}}))
    (loc,) = [d for k, d in events if k == "sdc_localized"]
    assert loc["nodes"] == ["node1"] and loc["step"] == 25 and loc["recomputed_on"] == ["node2"]
    assert new.pools["node1"] == Pool.FAULTY and new.sdc_verify is None
    assert new.phase == Phase.RUNNING and not new.evict and new.fp_agreed == [25, 1]


def test_a_recomputation_that_agrees_drains_a_culprit_still_in_the_job() -> None:
    held, _ = disagreed()
    s, obs = running(1, {"node0": 0, "node2": 1}, held)
    new, events = decide(s, obs, NOW, cfg(), [], points(1, {25: {0: 101, 1: 101}}))
    (loc,) = [d for k, d in events if k == "sdc_localized"]
    assert loc["nodes"] == ["node0"]
    # The innocent held-out node is a standby again; node0 leaves at the next boundary.
    assert new.pools["node1"] == Pool.STANDBY and "node1" in healthy_standby(new, obs, NOW, cfg())
    assert new.phase == Phase.STOPPING and "node0" in new.evict and new.recovery is None


def test_a_second_disagreement_names_the_culprit_by_a_majority_of_nodes() -> None:
    held, _ = disagreed()
    s, obs = running(1, {"node0": 0, "node2": 1}, held)
    new, events = decide(s, obs, NOW, cfg(), [], points(1, {25: {0: 100, 1: 101}}))
    (loc,) = [d for k, d in events if k == "sdc_localized"]
    assert loc["nodes"] == ["node0"]  # 101: node1 and node2 (two machines); 100: node0 only
    assert new.recovery is not None and new.recovery.fault.node_id == "node0"
    assert new.pools["node0"] == Pool.FAULTY and new.pools["node1"] == Pool.STANDBY


def test_a_disagreement_before_the_step_names_the_node_in_both() -> None:
    held, _ = disagreed()
    s, obs = running(1, {"node0": 0, "node2": 1}, held)
    new, events = decide(s, obs, NOW, cfg(), [], points(1, {22: {0: 7, 1: 8}}))
    (loc,) = [d for k, d in events if k == "sdc_localized"]
    assert loc["nodes"] == ["node0"] and loc["at_step"] == 22
    assert new.recovery is not None and new.pools["node0"] == Pool.FAULTY
    assert new.sdc_verify is None  # settled: no second recomputation


def test_no_majority_leaves_it_unlocalized_and_frees_the_held_out_node() -> None:
    held, _ = disagreed()
    s, obs = running(1, {"node0": 0, "node2": 1}, held)
    new, events = decide(s, obs, NOW, cfg(), [], points(1, {25: {0: 102, 1: 103}}))
    assert [k for k, _ in events if k.startswith("sdc_")][:1] == ["sdc_unlocalized"]
    assert new.pools["node1"] == Pool.STANDBY and new.recovery is not None
    assert not [d for k, d in events if k == "pool_changed" and d["to"] == "faulty"]
    # Agreement before the step says nothing yet: the record stays.
    s2, obs2 = running(1, {"node0": 0, "node2": 1}, disagreed()[0])
    kept, _ = decide(s2, obs2, NOW, cfg(), [], points(1, {22: {0: 7, 1: 7}}))
    assert kept.sdc_verify is not None and kept.sdc_verify["held_out"] == "node1"
