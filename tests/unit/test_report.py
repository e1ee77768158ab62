"""``trainguard report`` on a store written here: every section of the report, in its order,
from the events and state the controller records (observe/report.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainguard.controller.store import Store
from trainguard.faults.inject import parse_inject
from trainguard.observe.report import build_report, print_report
from trainguard.protocol import StepRecord


def _fault(
    cause: str, rank: int | None, node: str, step: int, gen: int, msg: str
) -> dict[str, Any]:
    return {"cause": cause, "rank": rank, "node_id": node, "step": step, "generation": gen,
            "message": msg}  # fmt: skip


def _recovery(fault: dict[str, Any], gen: int, restore: int, lost: int) -> dict[str, Any]:
    return {"fault": fault, "from_generation": gen, "to_generation": gen + 1,
            "restore_step": restore, "steps_lost": lost, "restore_tiers": {"memory": 2},
            "durations_s": {"detect": 0.5, "total": 2.25}, "t_first_step": 1.0}  # fmt: skip


def _run_dir(tmp_path: Path) -> Path:
    s = Store(tmp_path)
    injects = ["kill:rank=1:step=20", "hang:rank=0:step=500"]
    s.put("config", {"injects": [parse_inject(x, i).to_json() for i, x in enumerate(injects)]})
    s.record("job_started", {}, ts=1.0)  # an earlier run of the run dir
    s.record("job_started", {}, ts=10.0)
    s.record("preflight_finished", {"run": 1, "level": "quick", "reason": "start",
             "nodes": ["n0", "n1"], "stage_s": {"total": 2.0}, "verdicts": {
             "n0": {"ok": True, "problems": []}, "n1": {"ok": False, "problems": ["slow"]}}},
             ts=11.0)  # fmt: skip
    s.record("generation_started", {"generation": 0}, ts=12.0)
    s.add_steps(0, 0, [StepRecord(step=i, t_end=12.0 + i, duration_s=0.5) for i in range(1, 31)])
    s.record("ckpt_skipped", {"generation": 0, "skipped_in_a_row": 2}, ts=13.0)
    s.record("stacks", {"generation": 0, "stacks": {"0": "Thread 1\n  File train.py"}}, ts=14.0)
    s.record("straggler", {"generation": 0, "rank": 1, "node": "n0", "steps": [5, 9]}, ts=15.0)
    s.record("sdc_detected", {"generation": 0, "step": 25, "signal": "gemm_probe",
             "culprits": [], "nodes": ["n1"], "last_agreed": [20]}, ts=16.0)  # fmt: skip
    s.record("node_at_risk", {"node": "n1", "reason": "ecc", "action": "drain"}, ts=17.0)
    s.record("pool_changed", {"node": "n1", "to": "faulty", "reason": "sdc"}, ts=18.0)
    s.record("generation_started", {"generation": 1, "restore_step": 20}, ts=20.0)
    s.add_steps(1, 0, [StepRecord(step=i, t_end=20.0 + i, duration_s=0.25) for i in range(21, 41)])
    s.record("job_ended", {}, ts=42.0)
    s.put("state", {"phase": "SUCCEEDED", "reason": "done", "incarnation": 1, "generation": 2,
                    "fired": [0], "pools": {"n0": "running", "n1": "faulty"},
                    "recoveries": [_recovery(_fault("kill", 1, "n0", 30, 0, "SIGKILL\nmore"), 0,
                                             20, 10),
                                   _recovery(_fault("hang", 0, "n0", 40, 0, "no step"), 1, 40,
                                             0)]})  # fmt: skip
    s.close()
    return tmp_path


def test_the_report_counts_steps_goodput_drills_faults_and_recoveries(tmp_path: Path) -> None:
    rep = build_report(_run_dir(tmp_path))
    assert list(rep) == [
        "run_dir", "kind", "incarnation", "earlier_runs", "phase", "reason", "generations",
        "steps_completed", "last_step", "wall_time_s", "productive_step_time_s", "preflight_s",
        "goodput", "drills", "unseen", "faults", "preflight", "left_out", "hangs",
        "snapshots_skipped", "max_skipped_in_a_row", "planned_stops", "alerts", "archive", "sdc",
        "at_risk", "recoveries", "local",
    ]  # fmt: skip
    assert rep["kind"] == "job" and rep["earlier_runs"] == 1 and rep["generations"] == 2
    assert rep["steps_completed"] == list(range(1, 41)) and rep["last_step"] == 40
    # Steps 21-30 of generation 0 were redone: only generation 1's run of them counts.
    assert rep["productive_step_time_s"] == pytest.approx(20 * 0.5 + 20 * 0.25)
    assert rep["wall_time_s"] == 32.0 and rep["preflight_s"] == 2.0
    assert rep["goodput"] == pytest.approx(15.0 / 30.0)
    assert rep["drills"] == [
        {"inject": "kill:rank=1:step=20", "fired": True},
        {"inject": "hang:rank=0:step=500", "fired": False},
    ]
    assert rep["unseen"] == [] and rep["left_out"] == {"n1": "sdc"}
    assert [h["stack"] for h in rep["hangs"]] == ["Thread 1\n  File train.py"]
    assert rep["preflight"][0]["failed"] == {"n1": ["slow"]}
    assert rep["sdc"][0]["rollback_to"] == 20 and rep["sdc"][0]["steps_recomputed"] == 5
    assert [r["to_generation"] for r in rep["recoveries"]] == [1, 2]


def test_the_report_text_has_each_section_in_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert print_report(_run_dir(tmp_path), as_json=False) == 0
    out = capsys.readouterr().out
    expected = [
        "job: SUCCEEDED  done",
        "run 2 of this run dir: the report covers this run; 1 earlier run(s) are in its events",
        "steps completed: 40 (last 40) in 2 generation(s); wall time 32.0s (pre-flight 2.0s, not "
        "counted); productive step time 15.0s; goodput (ETTR) 50.0%",
        "back-pressure: 1 snapshot(s) skipped, at most 2 in a row",
        "drill kill:rank=1:step=20: fired",
        "drill hang:rank=0:step=500: did not fire",
        "silent data corruption: generation 0, detected at step 25 by GEMM probe (on n1); last "
        "agreeing step 20, rolled back to 20, 5 step(s) recomputed",
        "at risk: n1: ecc (drain)",
        "pre-flight runs: 1",
        "left out: n1: sdc",
        "faults: 2",
        "SIGKILL ",
        "hang in generation 0: no step",
        "  stack of rank 0 (n0), the rank that held the others:",
        "      File train.py",
        "alerts: 1",
        "straggler",
        "recoveries: 2 (seconds per phase)",
        "mem 2/disk 0",
    ]
    at = 0
    for want in expected:
        found = out.find(want, at)
        assert found >= 0, f"{want!r} not after position {at} in:\n{out}"
        at = found + len(want)


def test_a_fault_without_a_message_is_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fault recorded with an empty (or null) message prints an empty cell, not IndexError."""
    s = Store(tmp_path)
    s.record("job_started", {}, ts=1.0)
    faults = [_fault("worker_exit", 1, "n0", 5, 0, ""), {**_fault("hang", 0, "n0", 6, 1, ""),
              "message": None}]  # fmt: skip
    s.put("state", {"phase": "FAILED", "reason": "budget", "incarnation": 1, "generation": 2,
                    "fired": [], "pools": {}, "recoveries": [_recovery(f, i, 0, 5)
                                                             for i, f in enumerate(faults)]})  # fmt: skip
    s.close()
    assert print_report(tmp_path, as_json=False) == 0
    assert "faults: 2" in capsys.readouterr().out


def test_the_recoveries_table_names_every_tier_that_served_a_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost host's ranks restored from their peers' replicas: the "from" cell says so."""
    monkeypatch.setenv("COLUMNS", "200")
    s = Store(tmp_path)
    s.record("job_started", {}, ts=1.0)
    rec = {**_recovery(_fault("node_lost", None, "n1", 39, 0, "no heartbeat"), 0, 39, 1),
           "restore_tiers": {"memory": 2, "replica": 2, "durable": 0}}  # fmt: skip
    s.put("state", {"phase": "SUCCEEDED", "reason": "done", "incarnation": 1, "generation": 1,
                    "fired": [], "pools": {}, "recoveries": [rec]})  # fmt: skip
    s.close()
    assert print_report(tmp_path, as_json=False) == 0
    assert "mem 2/replica 2/disk 0" in capsys.readouterr().out


def test_a_job_without_faults_says_so_and_a_job_that_failed_early_names_no_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No empty faults table; no Python ``None`` for a last step that never came."""
    s = Store(tmp_path)
    s.record("job_started", {}, ts=1.0)
    s.put("state", {"phase": "FAILED", "reason": "user error", "incarnation": 1,
                    "generation": 1, "fired": [], "pools": {}, "recoveries": []})  # fmt: skip
    s.close()
    assert print_report(tmp_path, as_json=False) == 0
    out = capsys.readouterr().out
    assert "faults: none" in out and "faults: 0" not in out
    assert "(last —)" in out and "None" not in out
