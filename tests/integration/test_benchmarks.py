"""The benchmarks are product code: each ``--smoke`` size runs here (real processes, a real
kill -9) and prints the keys its issue names, every figure finite, and its ``table_rows``
renders the README's "Measured" rows from the result (the figures themselves are measured by
the full sizes, not in CI). The recovery smoke runs in CI's slow run. Smoke wall times on the 2-core machine, idle: recovery ~55 s,
local_recovery ~20 s, preflight ~20 s; each timeout below is three to four times that."""

from __future__ import annotations

import pytest

from tests.helpers.bench import smoke


@pytest.mark.slow  # ~55 s alone, 180 s in CI's loaded slow run (the default suite stays < 15 min)
@pytest.mark.timeout(420)
def test_the_recovery_benchmark_smoke_run_prints_its_keys() -> None:
    # --worlds 4 is the main comparison's own world with the smoke's tiny model: the scaling
    # keys come from its run, without two more launches.
    r = smoke("recovery", "--worlds", "4", timeout=400)
    for key in ("trainguard_s", "torchrun_s", "ratio", "restart_path_s", "survivors_kept",
                "trainguard_phases_s"):  # fmt: skip
        assert key in r, key
    assert r["mode"] == "inprocess" and r["survivors_kept"] is True
    assert r["config"]["world_size"] == 4 and r["leaked_processes_killed"] == 0
    assert 0 < r["trainguard_s"] < 120 and 0 < r["torchrun_s"] < 120 and r["ratio"] > 0
    assert set(r["trainguard_phases_s"]) >= {"detect", "stop", "rendezvous", "first_step"}
    (w,) = r["scaling"]
    assert w["world"] == 4 and w["trainguard_s"] > 0 and w["torchrun_s"] > 0
    assert w["from_main_run"] is True and w["trainguard_s"] == r["trainguard_s"]


@pytest.mark.slow  # CI's slow run (the default run stays under 15 min)
def test_the_local_recovery_benchmark_smoke_run_prints_its_keys() -> None:
    r = smoke("local_recovery", timeout=240)["groups"]["2"]  # 76 s in a loaded slow run
    for key in ("survivor_max_gap_s", "heal_s", "steps_at_reduced_width",
                "state_equal_after_heal", "torchft", "gap_over_step", "heal_ratio"):  # fmt: skip
        assert key in r, key
    assert r["state_equal_after_heal"] is True and r["steps_at_reduced_width"] > 0
    ft = r["torchft"]
    assert "skipped" in ft or set(ft) >= {"survivor_max_gap_s", "heal_s", "state_equal_after_heal"}


@pytest.mark.slow  # CI's slow run (the default run stays under 15 min)
def test_the_preflight_benchmark_smoke_run_prints_its_keys() -> None:
    r = smoke("preflight", timeout=240)  # 46 s in a loaded slow run, 75+ beside more
    for key in ("total_s", "wall_s", "median_total_s", "stage_s", "target_s", "within_target",
                "load_1min", "abnormal"):  # fmt: skip
        assert key in r, key
    assert r["nodes"] == 2 and r["abnormal"] == [[]] and r["target_s"] == 60
    assert 0 < r["median_total_s"] < r["wall_s"][0]
    assert set(r["stage_s"]) >= {"total"}
