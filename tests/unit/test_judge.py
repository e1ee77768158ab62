"""Pre-flight verdicts (health/judge.py) on hand-made measurements, and the decide rules
that admit a node only after it passed."""

from __future__ import annotations

import itertools
from typing import Any

from trainguard.controller.api import NodeObs, Pool
from trainguard.controller.config import JobConfig
from trainguard.controller.decide import JobState, decide
from trainguard.controller.jobstate import Inputs
from trainguard.controller.pools import needs_recheck
from trainguard.health.judge import (
    CheckConfig,
    inconclusive,
    judge_net_stage,
    judge_node_stage,
    schedule,
)

CFG = CheckConfig()


def host(**kw: Any) -> dict[str, Any]:
    h = {
        "load_per_core": 0.1, "memory_available": 8 << 30, "disk_free": 50 << 30,
        "disk_path": "/ckpt", "shm_free": 8 << 30, "shm_path": "/dev/shm", "leftovers": [],
        "clock_skew_s": 0.01, "gpus": [],
    }  # fmt: skip
    return {**h, **kw}


def node_result(
    gflops: float = 60.0, checksum: str = "abcd", mismatches: int = 0, **h: Any
) -> dict[str, Any]:
    return {
        "host": host(**h),
        "gemm": {"gflops": gflops},
        "gemm_correctness": {"checksum": checksum, "mismatches": mismatches, "first_bad": None},
    }


def test_schedule_meets_every_partner_once_and_caps_rounds() -> None:
    for n in range(2, 10):
        nodes = [f"n{i}" for i in range(n)]
        rounds = schedule(nodes, None)
        met = [frozenset((a, b)) for r in rounds for a, b in r.items()]
        assert set(met) == {frozenset(p) for p in itertools.combinations(nodes, 2)}
        for r in rounds:  # a pairing: symmetric, nobody twice
            assert all(r[r[a]] == a for a in r)
        assert len(schedule(nodes, 3)) == min(3, len(rounds))


def test_node_stage_flags_only_the_bad_node_with_its_reason() -> None:
    res = {
        "a": node_result(),
        "b": node_result(gflops=55.0),
        "slow": node_result(gflops=20.0),
        "wrong": node_result(checksum="ffff", mismatches=1),
        "shm": node_result(shm_free=50 << 20),
        "old": node_result(leftovers=[{"pid": 7, "cmd": "python train.py"}]),
        "skew": node_result(clock_skew_s=-3.5),
        "gone": None,
    }
    problems, pool = judge_node_stage(res, CFG, {})
    assert pool["gemm_gflops"] == 60.0 and pool["checksum"] == "abcd"
    assert problems["a"] == [] and problems["b"] == []
    assert problems["slow"] == ["GEMM slow: 20.0 GFLOP/s < 0.5 × pool median 60.0"]
    assert len(problems["wrong"]) == 1 and problems["wrong"][0].startswith("GEMM wrong: 1 element")
    assert problems["shm"] == ["shm: 0.05 GiB free at /dev/shm < 0.25 GiB"]
    assert problems["old"][0].startswith("leftover processes of an earlier job: 1 (pid 7")
    assert problems["skew"] == ["clock: -3.50 s from the controller's (max 1.0 s)"]
    assert problems["gone"] == ["node checks did not finish within 120 s"]


def test_a_lone_node_is_judged_against_the_saved_reference() -> None:
    problems, pool = judge_node_stage({"x": node_result(gflops=20.0)}, CFG, {"gemm_gflops": 60.0})
    assert pool["gemm_gflops"] is None and problems["x"][0].startswith("GEMM slow")
    ok, _ = judge_node_stage({"x": node_result(gflops=50.0)}, CFG, {"gemm_gflops": 60.0})
    assert ok["x"] == []


def test_shared_load_is_not_flagged_but_one_busy_node_is() -> None:
    same = {n: node_result(load_per_core=3.0) for n in "abcd"}
    assert all(not p for p in judge_node_stage(same, CFG, {})[0].values())
    busy = {**{n: node_result() for n in "abc"}, "d": node_result(load_per_core=3.0)}
    assert judge_node_stage(busy, CFG, {})[0]["d"][0].startswith("cpu: load 3.00 per core")


def pair(partner: str, bw: float, lat: float = 300.0, **kw: Any) -> dict[str, Any]:
    return {
        "partner": partner,
        "allreduce_busbw_gbps": bw,
        "allgather_busbw_gbps": bw * 0.7,
        "latency_us": lat,
        **kw,
    }


def net(
    nodes: list[str], slow: str | None, fingerprint: dict[str, str] | None = None
) -> dict[str, Any]:
    out = {}
    for n in nodes:
        pairs = [pair(p, 0.01 if slow in (n, p) else 0.6) for p in nodes if p != n]
        fp = (fingerprint or {}).get(n, "cafe")
        out[n] = {
            "pairs": pairs,
            "train": {"fingerprint": fp, "steps": 5, "finite": True, "step_s": 0.1},
        }
    return out


def test_a_node_slow_with_every_partner_is_flagged_and_its_partners_are_not() -> None:
    problems, pool, med = judge_net_stage(net(list("abcd"), "c"), CFG, {})
    assert [n for n, p in problems.items() if p] == ["c"]
    assert problems["c"][0].startswith("collectives slow with 3 partners (a, b, d): all-reduce")
    assert pool["allreduce_busbw_gbps"] == 0.6 and med["c"]["allreduce_busbw_gbps"] == 0.01


def test_one_slow_pair_blames_nobody() -> None:
    res = net(list("abcd"), None)
    for n, p in (("a", "b"), ("b", "a")):
        next(x for x in res[n]["pairs"] if x["partner"] == p)["allreduce_busbw_gbps"] = 0.01
    problems, _, _ = judge_net_stage(res, CFG, {})
    assert all(not p for p in problems.values()), problems


def test_a_replica_whose_parameters_differ_is_flagged() -> None:
    problems, _, _ = judge_net_stage(net(list("abc"), None, {"b": "beef"}), CFG, {})
    assert [n for n, p in problems.items() if p] == ["b"]
    assert "differ from the other replicas (beef vs cafe)" in problems["b"][0]


def test_decide_admits_a_node_only_after_it_passed_preflight() -> None:
    cfg = JobConfig.from_fields(
        script="t.py", run_dir="/tmp/x", nodes=1, standby=1, preflight="quick"
    )
    obs = {n: NodeObs(node_id=n, addr=n, incarnation="i", last_seen=100.0) for n in ("good", "bad")}
    s, _ = decide(JobState(), obs, 100.0, cfg, [])
    assert s.pools == {}  # being checked
    verdicts = {"good": (100.5, ()), "bad": (100.5, ("GEMM wrong: 1 element(s)",))}
    s, ev = decide(s, obs, 101.0, cfg, [], Inputs(verdicts=verdicts))
    assert s.pools["bad"] == Pool.FAULTY and s.assignment == {"good": 0}
    why = [d["reason"] for k, d in ev if k == "pool_changed" and d["node"] == "bad"]
    assert why[0].startswith("failed pre-flight: GEMM wrong")
    # Due for a re-check: it needs a verdict newer than its fault before it can return.
    for o in obs.values():
        o.last_seen = 200.0
    assert needs_recheck(s, obs["bad"], 200.0, cfg)
    s, _ = decide(s, obs, 200.0, cfg, [])
    assert s.pools["bad"] == Pool.FAULTY
    s, ev = decide(s, obs, 201.0, cfg, [], Inputs(verdicts={"bad": (200.5, ())}))
    assert s.pools["bad"] == Pool.STANDBY and not needs_recheck(s, obs["bad"], 201.0, cfg)


def test_a_dead_check_process_or_lost_node_fails_only_that_node() -> None:
    res = {n: node_result() for n in "abc"}
    res["d"] = {"error": "check process exited with status -9: "}
    problems, _ = judge_node_stage(res, CFG, {})
    assert problems["d"] == ["node checks failed: check process exited with status -9: "]
    assert not any(problems[n] for n in "abc")
    # A node lost in the net stage: its partners' failed pairs and training are not theirs.
    net_res = net(list("abcd"), None)
    net_res["d"] = {"error": "node lost: its agent stopped reporting"}
    for n in "abc":
        net_res[n]["pairs"] = [p for p in net_res[n]["pairs"] if p["partner"] != "d"] + [
            {"partner": "d", "error": "DistStoreError: wait timeout"}
        ]
        net_res[n]["train"] = {"error": "DistStoreError: wait timeout after 30000ms"}
    problems, _, _ = judge_net_stage(net_res, CFG, {})
    assert [n for n, p in problems.items() if p] == ["d"], problems


def test_config_values_of_the_wrong_type_are_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="node_stage_timeout_s = 'x': must be a number"):
        CheckConfig(node_stage_timeout_s="x")  # type: ignore[arg-type]


def test_a_job_whose_nodes_all_fail_preflight_fails_with_their_reasons() -> None:
    cfg = JobConfig.from_fields(
        script="t.py", run_dir="/tmp/x", nodes=2, preflight="quick", join_timeout_s=30.0
    )
    obs = {n: NodeObs(node_id=n, addr=n, incarnation="i", last_seen=1.0) for n in ("a", "b")}
    wrong = Inputs(verdicts={n: (1.0, ("GEMM wrong: 1 element(s)",)) for n in ("a", "b")})
    s, _ = decide(JobState(phase_since=0.0), obs, 1.0, cfg, [], wrong)
    assert s.phase.value == "PENDING" and s.pools == {"a": Pool.FAULTY, "b": Pool.FAULTY}
    # Issue 13, property 5: a third node still being checked when the join timeout passes
    # is waited for (its check has its own deadlines); the reason gives the real time.
    obs["c"] = NodeObs(node_id="c", addr="c", incarnation="i", last_seen=31.0)
    for o in obs.values():
        o.last_seen = 31.0
    s, _ = decide(s, obs, 31.0, cfg, [])
    assert s.phase.value == "PENDING"
    for o in obs.values():
        o.last_seen = 45.0
    s, _ = decide(
        s, obs, 45.0, cfg, [], Inputs(verdicts={"c": (44.0, ("GEMM wrong: 2 element(s)",))})
    )
    assert s.phase.value == "FAILED"
    assert s.reason.startswith(
        "only 0 of the 2 nodes needed passed pre-flight in 45s; failed: a: GEMM"
    ), s.reason


def test_errors_of_the_checks_own_machinery_are_inconclusive_not_failures() -> None:
    """Issue 12 case 6: store time-outs and gloo set-up errors under load say nothing about
    the node; a run that condemns most of the pool is more likely broken than the pool; a
    wrong GEMM answer or a full disk is a measurement whatever the others show."""
    got = inconclusive({
        "a": ["collective and training checks failed: DistStoreError: wait timeout after 30000ms"],
        "b": ["collectives slow with 2 partners (a, c): failed (Gloo connectFullMesh failed)"],
        "c": ["node checks did not finish within 120 s"],
        "d": [],
    })  # fmt: skip
    assert sorted(got) == ["a", "b", "c"]
    measured = {"a": ["GEMM slow: 3.0 GFLOP/s < 0.5 × pool median 9.0"], "b": [], "c": [], "d": []}
    assert inconclusive(measured) == {}  # one slow node: a measurement
    most = {"a": ["GEMM slow: 1 < 0.5 × 9"], "b": ["latency 9000 µs vs pool 100 µs"],
            "c": ["GEMM wrong: 1 element(s) of C = A·B differ"], "d": []}  # fmt: skip
    assert sorted(inconclusive(most)) == ["a", "b"]  # c's wrong answer stands
    lost = {"a": ["collective and training checks failed: node lost: its agent stopped reporting"]}
    assert inconclusive({**lost, "b": [], "c": []}) == {}
