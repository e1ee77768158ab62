"""Straggler, anomaly and hang-localization logic (controller/analysis.py) on synthetic
step records with realistic noise."""

from __future__ import annotations

import random

from trainguard.controller.analysis import (
    AnomalyDetector,
    DetectConfig,
    StragglerDetector,
    localize_hang,
)
from trainguard.controller.api import WorkerObs
from trainguard.protocol import StepRecord

CFG = DetectConfig()


def recs(items: list[dict]) -> list[StepRecord]:
    """Step records from their wire form (``t_end`` 0 where the test does not need one)."""
    return [StepRecord.from_json({"t_end": 0.0, **d}) for d in items]


def feed(
    det: StragglerDetector, steps: int, slow: dict[int, float], seed: int = 0, world: int = 8
) -> list[tuple[str, dict]]:
    """A synchronous job: every rank's step lasts as long as the slowest rank's compute; the
    others wait that difference in their collectives. Compute noise ±5% per step."""
    rng = random.Random(seed)
    out = []
    t = 1000.0  # wall clock: each rank reaches the collective after its compute
    for step in range(1, steps + 1):
        comp = {r: 0.02 * slow.get(r, 1.0) * rng.uniform(0.95, 1.05) for r in range(world)}
        dur = max(comp.values()) + 0.002
        for r in range(world):
            item = {
                "step": step,
                "dur": dur,
                "sec": {"communication": dur - comp[r]},
                "tc": t + comp[r],
            }
            out += det.add(0, world, r, recs([item]))
        t += dur
    return out


def test_a_rank_slowed_by_a_quarter_is_named_after_three_windows_and_only_it() -> None:
    events = feed(StragglerDetector(CFG), 200, {5: 1.25})
    assert [e[1]["rank"] for e in events] == [5], events  # one alert, not repeated
    first = events[0][1]
    assert first["windows"] == 3 and first["score"] > 0.15  # ~5 ms late in a ~27 ms step
    assert first["steps"][1] - first["steps"][0] + 1 == 60
    assert min(first["waiting_s"].values()) > first["own_wait_s"]  # the others wait for it


def test_clean_noisy_ranks_raise_no_alert() -> None:
    for seed in range(20):
        assert feed(StragglerDetector(CFG), 1000, {}, seed=seed) == []


def test_an_alert_clears_after_clean_windows_and_can_fire_again() -> None:
    ten = DetectConfig(window_steps=10)
    assert len(feed(StragglerDetector(ten), 60, {2: 1.5})) == 1
    det2 = StragglerDetector(ten)
    events = []
    rng = random.Random(1)
    for step in range(1, 181):
        slow = 1.5 if step <= 60 or step > 120 else 1.0
        comp = {r: 0.02 * (slow if r == 2 else 1.0) * rng.uniform(0.97, 1.03) for r in range(4)}
        dur = max(comp.values())
        for r in range(4):
            events += det2.add(
                0, 4, r, recs([{"step": step, "dur": dur, "sec": {"communication": dur - comp[r]}}])
            )
    assert [e[1]["rank"] for e in events] == [2, 2]  # (no arrival times: compute time used)


def test_a_new_generation_starts_afresh() -> None:
    det = StragglerDetector(CFG)
    feed(det, 25, {1: 2.0})
    assert det.add(1, 4, 0, recs([{"step": 30, "dur": 0.1}])) == [] and det.generation == 1
    assert det.add(0, 4, 0, recs([{"step": 31, "dur": 0.1}])) == []  # a late record of the old one


def test_loss_spike_nan_and_throughput_drop_are_reported_at_their_steps() -> None:
    det = AnomalyDetector(CFG)
    rng = random.Random(0)
    events = []
    for step in range(1, 400):
        loss = 3.0 - step / 400 + rng.gauss(0, 0.05)
        if step == 150:
            loss = 5.6
        if step == 220:
            loss = float("nan")
        dur = 0.1 if step < 300 else 0.25  # a 60% drop from step 300
        events += det.add(
            0,
            recs([{"step": step, "loss": loss, "tokens": 128, "dur": dur * rng.uniform(0.9, 1.1)}]),
        )
    kinds = [(k, d["step"]) for k, d in events]
    assert kinds[:2] == [("loss_spike", 150), ("loss_nonfinite", 220)], kinds
    assert len(kinds) == 3 and kinds[2][0] == "throughput_drop" and 300 < kinds[2][1] <= 320


def obs(rank: int, step: int, coll: list[int] | None, hb: float = 0.1) -> WorkerObs:
    return WorkerObs(
        rank=rank,
        local_rank=rank % 2,
        pid=rank,
        state="running",
        step=step,
        coll=coll,
        heartbeat_age_s=hb,
    )


def test_the_rank_that_did_not_issue_the_collective_holds_the_others() -> None:
    ws = [("n0", obs(0, 19, [41, 40])), ("n0", obs(1, 19, [41, 40])),
          ("n1", obs(2, 19, [40, 40])), ("n1", obs(3, 19, [41, 40]))]  # fmt: skip
    node, w, how, waiting = localize_hang(ws, stale_s=1.0)
    assert (node, w.rank) == ("n1", 2) and "did not issue collective #41" in how
    assert waiting == {0: 41, 1: 41, 3: 41}
    frozen = [*ws[:3], ("n1", obs(3, 19, [41, 40], hb=9.0))]
    assert localize_hang(frozen, stale_s=1.0)[1].rank == 3  # a frozen process comes first
    plain = [("n0", obs(0, 12, None)), ("n1", obs(1, 11, None))]
    assert localize_hang(plain, stale_s=1.0)[1].rank == 1  # no counters: furthest behind
    stopped = [*ws[:3], ("n1", obs(3, 19, [41, 40], hb=9.0))]
    stopped[1][1].proc_state = "stopped"  # a SIGSTOPped process beats a stale heartbeat
    assert localize_hang(stopped, stale_s=1.0)[1:3] == (
        stopped[1][1],
        localize_hang(stopped, 1.0)[2],
    )
    assert "stopped process" in localize_hang(stopped, stale_s=1.0)[2]


def test_decide_replaces_an_evicted_node_at_a_checkpoint_boundary() -> None:
    from trainguard.controller.api import NodeObs, Phase, Pool
    from trainguard.controller.config import JobConfig
    from trainguard.controller.decide import JobState, decide

    cfg = JobConfig.from_fields(
        script="t.py", run_dir="/tmp/x", nodes=2, standby=1, preflight="off"
    )
    obs = {n: NodeObs(node_id=n, addr=n, incarnation="i", last_seen=0.0) for n in ("a", "b", "c")}
    s = JobState(
        phase=Phase.RUNNING, generation=0, assignment={"a": 0, "b": 1},
        pools={"a": Pool.RUNNING, "b": Pool.RUNNING, "c": Pool.STANDBY}, evict={"b": "straggler"},
        join_order=["a", "b", "c"],
    )  # fmt: skip
    s, ev = decide(s, obs, 1.0, cfg, [])
    assert s.phase == Phase.STOPPING and s.growing  # workers get SIGTERM and save
    for o in obs.values():
        o.stopped_generation, o.last_seen = 0, 2.0
    s, ev = decide(s, obs, 2.0, cfg, [(10, 0)])
    assert s.assignment == {"a": 0, "c": 1} and s.pools["b"] == Pool.FAULTY
    assert s.generation == 1 and s.restarts == 0 and not s.evict
    assert any(
        k == "pool_changed" and d["node"] == "b" and d["reason"].startswith("straggler")
        for k, d in ev
    )


def test_leave_one_out_mean_and_deviation_match_the_others_computed_directly() -> None:
    """The straggler rule's mean and deviation of the *other* ranks, in O(n) (one pass of
    sums), equal statistics.fmean/pstdev over the others, for spread values, values near a
    large offset (cancellation) and equal values (deviation exactly 0)."""
    import math
    import statistics

    from trainguard.controller.analysis import _leave_one_out

    rng = random.Random(7)
    cases = [
        {r: rng.gauss(0.0, 0.01) for r in range(50)},
        {r: 1e4 + rng.uniform(0, 1e-3) for r in range(30)},
        {r: 0.005 for r in range(10)},
        {0: 0.5, 1: 0.0, 2: 0.0},
    ]
    for values in cases:
        for r, x, mean, sd in _leave_one_out(values):
            others = [v for q, v in values.items() if q != r]
            assert x == values[r]
            assert math.isclose(mean, statistics.fmean(others), rel_tol=1e-12, abs_tol=1e-12)
            assert math.isclose(sd, statistics.pstdev(others), rel_tol=1e-6, abs_tol=1e-9)
    assert all(sd == 0.0 for *_, sd in _leave_one_out(cases[2]))


def test_windows_close_when_the_last_rank_arrives_whatever_the_order_of_reports() -> None:
    """Ranks report in batches of several steps, in shuffled order; a window is judged once
    every rank has passed its last step (not before, not later), as a report-by-report
    rescan of every rank's newest step would judge it."""
    world, w = 16, CFG.window_steps
    det = StragglerDetector(CFG)
    rng = random.Random(3)
    pending = {r: list(range(1, 5 * w + 1)) for r in range(world)}
    while any(pending.values()):
        r = rng.choice([q for q in pending if pending[q]])
        k = rng.randint(1, 7)
        take, pending[r] = pending[r][:k], pending[r][k:]
        windows = det.windows
        det.add(0, world, r, recs([{"step": s, "dur": 0.02, "gap": 0.01} for s in take]))
        # windows 1..k are complete when every rank reached (k + 1) * w (step 1 is skipped)
        low = min(det._newest.values()) if len(det._newest) == world else 0
        expect = max(0, low // w - 1) if len(det._newest) == world else 0
        assert det.windows == expect, (det.windows, expect, windows)
