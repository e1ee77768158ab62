"""The benchmarks are product code: each ``--smoke`` size runs here and prints the keys its
issue names (the figures themselves are measured by the full sizes, not in CI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_the_recovery_benchmark_smoke_run_prints_its_keys() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/recovery.py", "--smoke", "--json", "--worlds", "2"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    for key in ("trainguard_s", "torchrun_s", "ratio", "restart_path_s", "survivors_kept",
                "trainguard_phases_s"):  # fmt: skip
        assert key in r, key
    assert r["mode"] == "inprocess" and r["survivors_kept"] is True
    assert r["config"]["world_size"] == 4 and r["leaked_processes_killed"] == 0
    assert 0 < r["trainguard_s"] < 120 and 0 < r["torchrun_s"] < 120 and r["ratio"] > 0
    assert set(r["trainguard_phases_s"]) >= {"detect", "stop", "rendezvous", "first_step"}
    (w,) = r["scaling"]
    assert w["world"] == 2 and w["trainguard_s"] > 0 and w["torchrun_s"] > 0


@pytest.mark.slow
def test_the_local_recovery_benchmark_smoke_run_prints_its_keys() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/local_recovery.py", "--smoke", "--json"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)["groups"]["2"]
    for key in ("survivor_max_gap_s", "heal_s", "steps_at_reduced_width",
                "state_equal_after_heal", "torchft"):  # fmt: skip
        assert key in r, key
    assert r["state_equal_after_heal"] is True and r["steps_at_reduced_width"] > 0
    ft = r["torchft"]
    assert "skipped" in ft or set(ft) >= {"survivor_max_gap_s", "heal_s", "state_equal_after_heal"}


@pytest.mark.slow
def test_the_preflight_benchmark_smoke_run_prints_its_keys() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/preflight.py", "--smoke", "--json"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    for key in ("total_s", "wall_s", "median_total_s", "stage_s", "target_s", "within_target",
                "load_1min", "abnormal"):  # fmt: skip
        assert key in r, key
    assert r["nodes"] == 2 and r["abnormal"] == [[]] and r["target_s"] == 60
    assert 0 < r["median_total_s"] < r["wall_s"][0]
    assert set(r["stage_s"]) >= {"total"}
