"""Silent data corruption, the pure parts: fingerprints of a snapshot, the majority vote,
the decision (fault, quarantine, suspect range, check off), restore points, retention and
the drill's bit flip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import fingerprint, storage
from trainguard.checkpoint.api import DCP_METADATA
from trainguard.checkpoint.sdc_drill import flip_bit
from trainguard.controller.api import NodeObs, Phase, Pool, WorkerObs
from trainguard.controller.config import JobConfig
from trainguard.controller.decide import JobState, decide
from trainguard.controller.ingest import FingerprintIndex
from trainguard.controller.jobstate import Inputs, suspect
from trainguard.controller.restore import restore_point
from trainguard.faults.inject import parse_inject


def header(keys: dict[str, tuple[int, ...]], shards: dict[str, list[int]] | None = None) -> dict:
    tensors = [{"key": k, "dtype": "float32", "shape": list(s)} for k, s in keys.items()]
    return {
        "layout": {"tensors": tensors},
        "shards": {k: {"offset": off} for k, off in (shards or {}).items()},
    }


def test_fingerprints_cover_replicated_chunks_only() -> None:
    h = header({"model.w": (4,), "per_rank.0.rng": (8,), "per_shard.3.pos": (1,)})
    a = fingerprint.fingerprint(
        h, {"model.w": [1], "per_rank.0.rng": [7], "per_shard.3.pos": [9]}, 0
    )
    b = fingerprint.fingerprint(
        h, {"model.w": [1], "per_rank.0.rng": [8], "per_shard.3.pos": [5]}, 0
    )
    c = fingerprint.fingerprint(
        h, {"model.w": [2], "per_rank.0.rng": [7], "per_shard.3.pos": [9]}, 0
    )
    assert a == b and a is not None and c is not None  # per-rank state is not compared
    assert a[0] == c[0] and a[1] != c[1]  # same chunks, other bytes
    # A shard of a DTensor: its offset is part of the layout (other shards never compare).
    s0 = fingerprint.fingerprint(header({"w": (2,)}, {"w": [0]}), {"w": [1]}, 0)
    s1 = fingerprint.fingerprint(header({"w": (2,)}, {"w": [2]}), {"w": [1]}, 1)
    assert s0 is not None and s1 is not None and s0[0] != s1[0]
    assert fingerprint.fingerprint(header({"per_rank.1.x": (1,)}), {"per_rank.1.x": [1]}, 1) is None


def test_the_majority_names_the_culprit_and_two_replicas_cannot() -> None:
    same = {r: (1, 10) for r in range(4)}
    assert fingerprint.compare(same) == ([], [])
    assert fingerprint.compare({**same, 2: (1, 11)}) == ([2], [])
    assert fingerprint.compare({0: (1, 10), 1: (1, 11)}) == ([], [0, 1])
    assert fingerprint.compare({0: (1, 10), 1: (1, 11), 2: (1, 12)}) == ([], [0, 1, 2])
    # Groups by layout (other chunks): each group on its own.
    assert fingerprint.compare({0: (1, 10), 1: (1, 10), 2: (2, 5), 3: (2, 5)}) == ([], [])


def cfg(**kw: object) -> JobConfig:
    base: dict[str, object] = dict(script="t.py", run_dir="/tmp/x", nodes=2, nproc_per_node=2,
                                   standby=1, heartbeat_s=0.5, node_timeout_s=5.0)  # fmt: skip
    return JobConfig.from_fields(**{**base, **kw})


def running(now: float) -> tuple[JobState, dict[str, NodeObs]]:
    """A RUNNING generation 0 on node0 (ranks 0, 1) and node1 (ranks 2, 3), node2 standby."""
    s = JobState(phase=Phase.RUNNING, phase_since=now, generation=0, master_port=1,
                 assignment={"node0": 0, "node1": 1},
                 pools={"node0": Pool.RUNNING, "node1": Pool.RUNNING, "node2": Pool.STANDBY})  # fmt: skip
    obs = {}
    for i, n in enumerate(("node0", "node1", "node2")):
        ranks = (2 * i, 2 * i + 1) if i < 2 else ()
        obs[n] = NodeObs(node_id=n, addr=n, incarnation="i", last_seen=now,
                         generation=0 if ranks else None,
                         workers={r: WorkerObs(rank=r, local_rank=r % 2, pid=r + 10,
                                               state="running", step=30) for r in ranks})  # fmt: skip
    return s, obs


def reported(values: dict[int, dict[int, int]]) -> Inputs:
    """What the executor's index hands decide: step → rank → value (layout 7), every step
    that all ranks reported (``FingerprintIndex``, fed as the agents' reports would)."""
    index = FingerprintIndex()
    for node_ranks in ((0, 1), (2, 3)):
        index.add({str(r): [[st, 0, 7, v[r]] for st, v in values.items() if r in v]
                   for r in node_ranks})  # fmt: skip
    return Inputs(fingerprints=index.complete(0, 4))


def test_a_minority_replica_is_a_fault_its_node_quarantined_and_newer_points_suspect() -> None:
    good = {r: 100 for r in range(4)}
    s, obs = running(1000.0)
    points = reported({15: good, 20: good, 25: {**good, 1: 101}})
    new, events = decide(s, obs, 1000.0, cfg(), [], points)
    assert new.phase == Phase.STOPPING and new.recovery is not None
    fault = new.recovery.fault
    assert (fault.cause, fault.rank, fault.node_id, fault.step) == ("sdc", 1, "node0", 25)
    assert new.pools["node0"] == Pool.FAULTY and new.fp_agreed == [20, 0]
    detected = next(d for k, d in events if k == "sdc_detected")
    assert detected["culprits"] == [1] and detected["last_agreed"] == [20, 0]
    assert new.suspect == [[20, 0, 25]]
    assert suspect(new, (25, 0)) and suspect(new, (21, 0)) and not suspect(new, (20, 0))
    assert not suspect(new, (25, 1))  # a later generation re-ran from a good point
    assert not decide(s, obs, 1000.0, cfg(sdc_check=False), [], points)[0].recovery


def test_a_point_is_compared_once_every_rank_reported_it() -> None:
    index = FingerprintIndex()
    index.add({"0": [[25, 0, 7, 100]], "1": [[25, 0, 7, 100]], "2": [[25, 0, 7, 101]]})
    assert index.complete(0, 4) == []  # rank 3's snapshot missing
    index.add({"3": [[25, 0, 7, 100]], "2": [[25, 0, 7, 101]]})
    (point,) = index.complete(0, 4)
    assert point[:2] == (25, 0) and index.complete(0, 4) == []  # handed once
    index.add({"0": [[25, 0, 7, 100]]})  # ckptd still holds it: not gathered again
    assert index.complete(0, 4) == []


@pytest.mark.parametrize("first", [{0: 1, 1: 2, 2: 3, 3: 4}, {0: 1, 1: 1, 2: 1, 3: 2}])
def test_ranks_that_differ_at_the_first_comparison_turn_the_check_off(first: dict) -> None:
    s, obs = running(1000.0)
    new, events = decide(
        s, obs, 1000.0, cfg(), [], reported({5: first, 10: {r: 9 for r in range(4)}})
    )
    assert new.phase == Phase.RUNNING and new.sdc_off and new.recovery is None
    assert [k for k, _ in events] == ["sdc_check_off"]


def test_restore_skips_suspect_points_but_not_ones_known_to_agree() -> None:
    # last agreed in memory 15, the disagreement seen at 30
    s = JobState(assignment={"n": 0}, suspect=[[15, 0, 30]])
    c = cfg(nodes=1, nproc_per_node=1, standby=0)
    durable = [(15, 0), (20, 0), (25, 0), (30, 0), (35, 0)]
    assert restore_point(s, {}, c, durable)[0] == (15, 0)
    # durable 25's parts agree (its fingerprints had not reached the controller in memory)
    s2, _ = decide(s, {}, 1.0, c, [], Inputs(agreed=[(25, 0)]))
    assert restore_point(s2, {}, c, durable)[0] == (25, 0)
    # 35 agrees again (the flipped bit rounded away) but comes after the disagreement: the
    # corruption may have reached every replica through the gradients, so it stays suspect
    s3, _ = decide(s2, {}, 1.0, c, [], Inputs(agreed=[(35, 0)]))
    assert restore_point(s3, {}, c, durable)[0] == (25, 0)


def _durable_step(root: Path, step: int, values: list[int], gen: int = 0) -> None:
    tmp = storage.tmp_dir(root, step, gen)
    for rank, v in enumerate(values):
        (tmp / f"rank_{rank}").mkdir(parents=True)
        fingerprint.write_part(tmp / f"rank_{rank}", [7, v])
    (tmp / DCP_METADATA).write_bytes(b"x")
    storage.commit(tmp, root, step, generation=gen)


def test_retention_keeps_the_newest_agreeing_step_while_newer_ones_differ(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    for step, vals in ((10, [1, 1, 1]), (20, [2, 2, 2]), (30, [3, 9, 3]), (40, [4, 9, 4])):
        _durable_step(root, step, vals)
        storage.prune(root, 2)
    assert storage.list_committed(root) == [20, 30, 40]  # 20 is the rollback target
    assert fingerprint.durable_verdict(storage.step_dir(root, 30)) is False
    _durable_step(root, 50, [5, 5, 5])  # agrees again (a low bit rounded away): still after
    storage.prune(root, 2)  # the first differing step, 20 stays the target
    assert storage.list_committed(root) == [20, 40, 50]
    _durable_step(root, 60, [6, 6, 6])  # the differing steps leave the newest two: 20 stays
    storage.prune(root, 2)
    assert storage.list_committed(root) == [20, 50, 60]
    # A later generation re-commits the corrupt steps (a rollback re-ran them): normal again.
    for step in (30, 40):
        _durable_step(root, step, [step] * 3, gen=1)
    storage.prune(root, 2)
    assert storage.list_committed(root) == [50, 60]
    assert not (root / storage.SDC_HOLD).exists()


def test_the_drill_flips_one_bit_of_a_live_parameter() -> None:
    spec = parse_inject("sdc:rank=1:step=20:bit=3", 0)
    assert (spec.kind, spec.rank, spec.step, spec.bit) == ("sdc", 1, 20, 3)
    assert parse_inject("sdc:rank=1:step=20", 0).bit == 22
    with pytest.raises(ValueError, match="bit must be 0..63"):
        parse_inject("sdc:rank=1:step=20:bit=64", 0)
    m = torch.nn.Linear(2, 2)
    before = m.weight.detach().clone()
    got = flip_bit({"model": m, "per_rank": {"rng": torch.ones(3)}}, 0, 3)
    assert got["key"] == "model.weight"
    flipped = (m.weight.detach().view(torch.int32) ^ before.view(torch.int32)).flatten()
    assert flipped.tolist() == [8, 0, 0, 0]  # exactly bit 3 of element 0, in the live tensor
    json.dumps(got)


def test_counters_that_predict_a_failure_flag_a_node_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainguard.controller.risk import RiskConfig, RiskWatch
    from trainguard.health.signals import read_signals

    mc = tmp_path / "n1/sys/devices/system/edac/mc"
    for i, (ce, ue) in enumerate(((3, 0), (4, 0))):
        (mc / f"mc{i}").mkdir(parents=True)
        (mc / f"mc{i}/ce_count").write_text(f"{ce}\n")
        (mc / f"mc{i}/ue_count").write_text(f"{ue}\n")
    monkeypatch.setenv("TRAINGUARD_SIGNALS_ROOT", str(tmp_path / "{node}"))
    assert read_signals("n1") == {"edac_ce": 7.0, "edac_ue": 0.0}  # summed over controllers
    assert read_signals("absent") == {}  # no source: nothing, no error
    w = RiskWatch(RiskConfig(ce_delta=10, window_s=600))
    assert w.observe("n1", 0.0, {"edac_ce": 7, "edac_ue": 0}) is None
    assert w.observe("n1", 100.0, {"edac_ce": 16, "edac_ue": 0}) is None  # +9: under 10
    why = w.observe("n1", 200.0, {"edac_ce": 17, "edac_ue": 0})
    assert why is not None and why.startswith("edac_ce: 10 corrected errors in 200s")
    assert w.observe("n1", 210.0, {"edac_ce": 17, "edac_ue": 0}) is None  # flagged once
    assert w.observe("n1", 220.0, {"edac_ce": 17, "edac_ue": 1}) == "edac_ue rose from 0 to 1"
    # Old corrected errors leave the window: a slow trickle is not a trend.
    slow = RiskWatch(RiskConfig(ce_delta=10, window_s=600))
    flagged = [slow.observe("n", t * 120.0, {"edac_ce": t}) for t in range(40)]
    assert flagged == [None] * 40
    hot = RiskWatch(RiskConfig(temp_margin_c=5))
    assert hot.observe("g", 0.0, {"gpu_temp_c": 80, "gpu_temp_slowdown_c": 90}) is None
    assert hot.observe("g", 1.0, {"gpu_temp_c": 86, "gpu_temp_slowdown_c": 90}) is not None


def test_a_culprit_whose_recheck_passes_during_the_recovery_is_still_replaced() -> None:
    """The culprit's node is quarantined at the fault; with a short ``recheck_s`` its host
    checks pass again (back to standby) while the restart still waits for the memory index.
    It must not keep its rank: a standby takes it (a clean-clone run restarted on node0)."""
    c = cfg(recheck_s=1.0, preflight="off")
    s, obs = running(1000.0)
    s.join_order = ["node0", "node1", "node2"]
    good = {r: 100 for r in range(4)}
    s, _ = decide(s, obs, 1000.0, c, [], reported({15: good, 20: good, 25: {**good, 1: 101}}))
    assert s.phase == Phase.STOPPING and s.pools["node0"] == Pool.FAULTY
    now, events = 1000.0, []
    for n in ("node0", "node1"):  # both stopped; node1's ckptd index was asked before the stop
        o = obs[n]
        o.stopped_generation, o.stopped_at, o.cleaned_at = 0, now, now
        o.generation, o.workers, o.ckptd_at = None, {}, (now if n == "node0" else now - 1)
    for _ in range(30):  # 3 s: the restart waits for node1's index, the recheck comes due
        now += 0.1
        for o in obs.values():
            o.last_seen = now
        s, ev = decide(s, obs, now, c, [])
        events += ev
    assert s.generation == 0 and s.pools["node0"] == Pool.STANDBY, [k for k, _ in events]
    obs["node1"].ckptd_at = now  # asked again after the stop
    s, _ = decide(s, obs, now + 0.1, c, [])
    assert s.generation == 1 and s.assignment == {"node2": 0, "node1": 1}, s.assignment
