"""The step-overhead, SDC, straggler, controller-scale and node-recovery benchmarks as product
code (issue 29): each ``--smoke`` size runs here (real ``trainguard run`` jobs, a real
controller and its HTTP clients, real network namespaces) and prints the keys a full run
prints, every figure finite, and its ``table_rows`` renders README rows from the result (the
figures themselves are measured by the full sizes, not in CI). Smoke wall times on the 2-core
machine, idle: step_overhead ~20 s, sdc ~40 s, straggler ~40 s, controller_scale ~13 s,
node_recovery ~50 s; each timeout below is about five times that.

Each benchmark runs with ``TMPDIR`` in the test's tmp dir: its temporary run dirs live there,
and its processes carry that path in their environment, which ``no_leaks`` looks for. The
/dev/shm segments of its runs (named after their run dirs, seen while it runs) and the
network namespaces of node_recovery (named after its pid) are checked, and removed, after it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.helpers.bench import checked


def _segments(run_dirs: set[Path]) -> list[Path]:
    tags = {hashlib.sha1(str(d).encode()).hexdigest()[:8] for d in run_dirs}
    return [p for p in Path("/dev/shm").glob("trainguard-*") if p.name.split("-")[1] in tags]


def _hosts_names() -> set[str]:
    """The network namespaces and links ``faults.netns.Hosts`` makes (tgh…, tgb…, tgv…)."""
    if shutil.which("ip") is None:
        return set()
    names = set()
    for args in (["netns", "list"], ["-o", "link", "show"]):
        out = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
        for line in out.stdout.splitlines():
            for word in line.replace(":", " ").split():
                if word.startswith(("tgh", "tgb", "tgv")):
                    names.add(word.split("@")[0])
    return names


def _netns_left(before: set[str], pid: int) -> list[str]:
    """Those made since ``before`` by process ``pid`` (their names start with its pid) and
    still there."""
    tag = str(pid % 100000)
    return sorted(n for n in _hosts_names() - before if n[3:].startswith(tag))


def _drop_netns(names: list[str]) -> None:
    for name in names:
        if name.startswith("tgh"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        else:
            subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)


def _smoke(name: str, tmp_path: Path, *, timeout: float) -> dict[str, Any]:
    """``python benchmarks/NAME.py --smoke --json`` to its end; its JSON result, checked for
    finite figures and README rows. Fails (after removing them) on /dev/shm segments or
    network namespaces it left."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    seen: set[Path] = set()  # every run dir (two levels under TMPDIR) while it ran
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            with contextlib.suppress(OSError):
                seen.update(d.resolve() for d in tmp.glob("*/*") if d.is_dir())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    hosts_before = _hosts_names()
    proc = subprocess.Popen(
        [sys.executable, f"benchmarks/{name}.py", "--smoke", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp)},
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # timed out: SIGTERM first, so that it cleans up
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        done.set()
        watcher.join()
        left = _segments(seen)
        for seg in left:
            shutil.rmtree(seg, ignore_errors=True) if seg.is_dir() else seg.unlink(missing_ok=True)
        netns = _netns_left(hosts_before, proc.pid)
        _drop_netns(netns)
    assert proc.returncode == 0, err[-3000:]
    assert not left, f"/dev/shm segments left behind: {left}"
    assert not netns, f"network namespaces or links left behind: {netns}"
    mine = list(tmp.glob("tg-*"))  # torch's own caches (torchinductor_*) may stay: pytest's
    assert not mine, f"temporary dirs left behind: {mine}"
    return checked(name, json.loads(out))


@pytest.mark.slow  # over 12 s: CI's slow run (the default run stays under 15 min)
def test_the_step_overhead_benchmark_smoke_run_prints_its_keys(tmp_path: Path) -> None:
    r = _smoke("step_overhead", tmp_path, timeout=150)
    for key in ("nodes", "steps", "block", "durable_every", "model_args",
                "median_step_s_every_step", "median_step_s_never", "steps_measured_each",
                "step_time_ratio", "block_ratios"):  # fmt: skip
        assert key in r, key
    assert r["step_time_ratio"] > 0 and r["block_ratios"] and r["steps_measured_each"] > 0
    assert r["median_step_s_every_step"] > 0 and r["median_step_s_never"] > 0


@pytest.mark.slow  # over 12 s: CI's slow run (the default run stays under 15 min)
def test_the_sdc_benchmark_smoke_run_prints_its_keys(tmp_path: Path) -> None:
    r = _smoke("sdc", tmp_path, timeout=240)
    assert set(r) == {"steps", "every", "at", "detection", "overhead", "signal_costs"}
    assert r["detection"]["reference_step_s"] > 0
    (case,) = r["detection"]["cases"]
    for key in ("case", "tag", "inject", "flipped_at_step", "before", "after", "detected",
                "signal", "detected_at_step", "steps_to_detect", "seconds_to_detect",
                "culprits", "rollback_to", "steps_recomputed", "losses_equal_fault_free"):  # fmt: skip
        assert key in case, key
    # A parameter's flipped mantissa bit is found by the fingerprints, and the rollback
    # recomputes the fault-free losses (what the case is there to show).
    assert case["detected"] is True and case["losses_equal_fault_free"] is True, case
    (over,) = r["overhead"]
    assert set(over) == {"snapshot_every", "median_step_ms_with", "median_step_ms_without",
                         "ratio_median", "blocks"}  # fmt: skip
    assert over["ratio_median"] > 0 and over["blocks"] >= 1
    assert set(r["signal_costs"]) == {"probe_ms", "probe_every_s", "probe_duty_cycle",
                                      "grad_norm_ms", "step_ms", "grad_norm_share"}  # fmt: skip


@pytest.mark.slow  # over 12 s: CI's slow run (the default run stays under 15 min)
def test_the_straggler_benchmark_smoke_run_prints_its_keys(tmp_path: Path) -> None:
    r = _smoke("straggler", tmp_path, timeout=240)
    for key in ("nodes", "nproc_per_node", "world", "window_steps", "steps", "slow_from",
                "detection", "right_ranks_every_case", "overhead"):  # fmt: skip
        assert key in r, key
    (case,) = r["detection"]
    for key in ("case", "alerted_ranks", "expected_ranks", "right_ranks", "first_alert_step",
                "windows_to_flag", "score", "node"):  # fmt: skip
        assert key in case, key
    o = r["overhead"]
    for key in ("timing_ratio", "block_ratios", "median_step_s_timing_on",
                "median_step_s_timing_off", "median_step_s_ddp_hook",
                "median_step_s_ddp_builtin", "hook_ratio_whole_runs"):  # fmt: skip
        assert key in o, key
    assert o["timing_ratio"] > 0 and o["hook_ratio_whole_runs"] > 0


def test_the_controller_scale_benchmark_smoke_run_prints_its_keys(tmp_path: Path) -> None:
    r = _smoke("controller_scale", tmp_path, timeout=150)
    (size,) = r["sizes"]
    for key in ("nodes", "workers", "heartbeat_s", "node_timeout_s", "join_s",
                "controller_cores", "controller_rss_mb", "report_p50_ms", "report_p99_ms",
                "reports", "steady_report_p50_ms", "steady_report_p99_ms", "controller_side",
                "fault", "fault_node", "detect_after_last_heartbeat_s",
                "replacement_decided_s", "replaced_by"):  # fmt: skip
        assert key in size, key
    # The timing is the controller's own, as its run orders carried it (the smoke's config).
    assert size["heartbeat_s"] == 0.2 and size["node_timeout_s"] == 2.0
    assert size["fault"] == "node_lost" and size["reports"] > 0
    assert size["steady_report_p99_ms"] is not None and size["detect_after_last_heartbeat_s"] > 0
    # Two real relays in front of it; the last one SIGKILLed mid-run: no node lost, and each of
    # its nodes reported directly within the node timeout (issue 31).
    assert size["relays"] == 2 and size["relay_cores"] > 0
    rk = size["relay_kill"]
    assert rk["false_node_loss"] is False and rk["nodes"] == 16
    assert rk["nodes_back_last_s"] is not None and rk["nodes_back_last_s"] <= 2.0
    assert size["fault_node"] == "n7"  # the node killed after it, not one of the relay's


def test_the_decide_scale_benchmark_smoke_run_prints_its_keys() -> None:
    """``benchmarks/decide_scale.py --smoke``: the controller's tick over 64 nodes."""
    out = subprocess.run(
        [sys.executable, "benchmarks/decide_scale.py", "--smoke", "--ticks", "10", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    r = json.loads(out.stdout)
    assert r["nodes"] == 64 and r["workers"] == 64 * 8 and r["ticks"] == 10
    assert 0 < r["tick_ms_p50"] <= r["tick_ms_p99"]


@pytest.mark.timeout(420)
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="node_recovery needs root and iproute2's ip (network namespaces)",
)
@pytest.mark.slow  # over 12 s: CI's slow run (the default run stays under 15 min)
def test_the_node_recovery_benchmark_smoke_run_prints_its_keys(tmp_path: Path) -> None:
    r = _smoke("node_recovery", tmp_path, timeout=300)
    for key in ("steps", "kill_step", "durable_every", "model_args", "replica", "durable"):
        assert key in r, key
    for side in ("replica", "durable"):
        assert set(r[side]) == {
            "phases_s", "restore_step", "restore_tiers", "steps_lost", "later_faults"
        }  # fmt: skip
        assert r[side]["phases_s"]["total"] > 0, r[side]
