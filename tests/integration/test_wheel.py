"""The package as users get it (issue 32): ``pip wheel .`` builds a wheel holding the page's
assets, ``py.typed`` and the license; installed into a fresh virtual environment (torch from
the local 2.13.0 CPU wheel first, as the README says) it runs the README's main job, a kill
recovered, and writes the HTML report. Nothing of this checkout is imported by that job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


# Without tests/conftest.py's PYTHONPATH (this checkout's src first): the venv's own install.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env=CLEAN_ENV)  # fmt: skip
    assert res.returncode == 0, f"{cmd}: {res.stderr[-3000:]}"
    return res


def test_the_wheel_installs_into_a_fresh_venv_and_runs_the_main_job(tmp_path: Path) -> None:
    dist, venv, work = tmp_path / "dist", tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    try:
        _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", str(dist)],
             tmp_path, 300)  # fmt: skip
        (wheel,) = dist.glob("trainguard-*.whl")
        names = set(zipfile.ZipFile(wheel).namelist())
        assert {"trainguard/py.typed", "trainguard/observe/static/view.html",
                "trainguard/observe/static/charts.js"} <= names  # fmt: skip
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
        _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        _run([*pip, "torch==2.13.0"], tmp_path, 600)  # the README's order: torch first
        _run([*pip, str(wheel)], tmp_path, 600)
        where = _run([str(venv / "bin" / "python"), "-c", "import trainguard, sys; "
                      "print(trainguard.__file__, trainguard.__version__)"], work, 60)  # fmt: skip
        assert where.stdout.startswith(str(venv)), where.stdout
        # The README's main job, from elsewhere, with the installed command.
        job = _run([str(venv / "bin" / "trainguard"), "run", "--run-dir", str(work / "run"),
                    "--nodes", "2", "--inject", "kill:rank=1:step=30",
                    str(ROOT / "examples" / "gpt" / "train.py"), "--steps", "60"], work, 600)  # fmt: skip
        assert "job succeeded after 1 recovery" in job.stderr, job.stderr[-3000:]
        _run([str(venv / "bin" / "trainguard"), "report", "--run-dir", str(work / "run"),
              "--html", str(work / "report.html")], work, 120)  # fmt: skip
        assert "const TG = " in (work / "report.html").read_text()
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # a gigabyte of torch: not left for pytest
