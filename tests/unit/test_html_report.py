"""``trainguard report --html`` of a long job (issue 32): one self-contained file of at most
1 MB for 10,000 steps, the charts drawn by the page's own script (no plotly.js, nothing
fetched). That it renders in a browser: tests/integration/test_observe.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.rundir import html_report, synthetic_run

MAX_BYTES = 1_000_000  # issue 32: mailed, attached to tickets, kept per run


def test_the_html_report_of_a_10000_step_job_is_one_file_under_1_mb(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", steps=10_000)
    text = html_report(run, tmp_path / "report.html")
    size = len(text.encode())
    assert size <= MAX_BYTES, f"{size} bytes"
    # Offline: nothing is fetched when it opens, and no charting library is inside it.
    offline = text.replace('"http://www.w3.org/2000/svg"', "")  # the SVG namespace's name
    assert "<script src=" not in text and "<link" not in text and "http" not in offline
    assert "Plotly" not in text and text.count("const TG = ") == 1
    view = json.loads(text.split("const EMBEDDED = ", 1)[1].split(";\n", 1)[0])
    # The same charts as before, from the whole run: loss and throughput thinned to 2,000
    # points spanning every step, the recovery's phases, a straggler score per rank.
    assert len(view["loss"]) <= 2001 and view["loss"][0][0] == 1 and view["loss"][-1][0] == 10_000
    assert view["job"]["last_step"] == 10_000 and len(view["throughput"]) <= 2001
    (rec,) = view["recoveries"]
    assert [p[0] for p in rec["phases"]][:2] == ["detect", "stop"], rec["phases"]
    assert set(view["stragglers"]) == {str(r) for r in range(8)}
    assert 0 < view["goodput"]["ratio"] < 1


def test_the_text_report_and_the_page_of_one_run_give_the_same_figures(tmp_path: Path) -> None:
    """One computation (observe/goodput.py) for both: a run with a recovery that ran 20
    steps twice and checkpoint stalls, its text report (JSON and printed) against the page's
    view, every figure they share."""
    from trainguard.observe.report import build_report
    from trainguard.observe.view import build_view

    run = synthetic_run(tmp_path / "run", steps=600)
    rep, view = build_report(run), build_view(run)
    g = view["goodput"]
    assert g["recomputation_s"] > 4.0 and g["checkpoint_s"] > 0.2  # the run exercises both
    assert rep["goodput"] == g["ratio"] and 0 < g["ratio"] < 1
    assert rep["wall_time_s"] == g["wall_s"] and rep["preflight_s"] == g["preflight_s"]
    assert rep["productive_step_time_s"] == g["productive_s"]
    assert rep["last_step"] == view["job"]["last_step"] == 600
    assert rep["generations"] == 2 and len(rep["recoveries"]) == len(view["recoveries"]) == 1
    assert rep["recoveries"][0]["restore_step"] == view["recoveries"][0]["restore_step"] == 280
    assert rep["phase"] == view["job"]["phase"] and rep["alerts"] and view["alerts"]
    # What each prints: the same goodput, to one decimal (view.html's toFixed(1)).
    res = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", "--run-dir", str(run)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"goodput (ETTR) {g['ratio']:.1%}" in res.stdout, res.stdout[:600]
