"""A torchrun script that never imports trainguard, shaped like the PyTorch examples' DDP
tutorial (tests/helpers/userscripts/ddp_tutorial.py): it runs under ``trainguard run`` as
under ``torchrun``, a drill by time (``after=SECONDS``) reaches it, a SIGSTOPped rank is
found from outside the process, and it resumes from its own ``snapshot.pt`` each time with
the fault-free run's final weights. The report says what it could not see."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST_CONFIG, ROOT, events, report, trainguard_cmd

SCRIPT = ROOT / "tests" / "helpers" / "userscripts" / "ddp_tutorial.py"
EPOCHS = "240"  # ~15 s of training on 2 ranks here (after ~4 s of import and init): a drill at 6 s lands mid-run


def _printed(log: str) -> list[str]:
    """The script's own lines (torch's warnings and trainguard's notes left out; the ranks'
    lines may run together on torchrun's shared stdout)."""
    return re.findall(
        r"\[CPU\d\] Epoch \d+ \| Steps: \d+|Epoch \d+ \| Training snapshot saved", log
    )


def _tg(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    (cwd / "job.toml").write_text(FAST_CONFIG)
    cmd = trainguard_cmd("run", "--run-dir", cwd / "run", "--config", cwd / "job.toml", *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict]:
    """The script under plain torchrun: its printed lines and final weights."""
    d = tmp_path_factory.mktemp("torchrun")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        + [str(SCRIPT), EPOCHS, "1"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=d,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return _printed(out.stdout), torch.load(d / "snapshot.pt")["MODEL_STATE"]


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resumed_from(run: Path) -> list[int]:
    text = "".join(p.read_text() for p in sorted((run / "logs").glob("rank*.gen1.log")))
    return [int(x) for x in re.findall(r"Resuming training from snapshot at Epoch (\d+)", text)]


@pytest.mark.slow  # in CI's slow run (keeps the default suite under 15 min)
def test_the_ddp_tutorial_runs_as_under_torchrun_and_survives_a_kill(
    tmp_path: Path, under_torchrun: tuple[list[str], dict]
) -> None:
    lines, weights = under_torchrun
    clean = tmp_path / "clean"
    clean.mkdir()
    res = _tg(clean, "--nproc-per-node", "2", str(SCRIPT), EPOCHS, "1")
    assert res.returncode == 0, res.stderr[-2000:]
    logs = "".join(p.read_text() for p in sorted((clean / "run" / "logs").glob("rank*.gen0.log")))
    assert sorted(_printed(logs)) == sorted(lines)  # the same lines as under torchrun
    assert _same_weights(torch.load(clean / "snapshot.pt")["MODEL_STATE"], weights)

    killed = tmp_path / "killed"
    killed.mkdir()
    res = _tg(
        killed, "--nproc-per-node", "2", "--inject", "kill:rank=1:after=6", str(SCRIPT), EPOCHS, "1"
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "job succeeded after 1 recovery" in res.stderr, res.stderr[-1500:]
    resumed = _resumed_from(killed / "run")
    assert len(resumed) == 2 and resumed[0] == resumed[1] > 0, resumed  # its own snapshot
    assert _same_weights(torch.load(killed / "snapshot.pt")["MODEL_STATE"], weights)
    rep = report(killed / "run")
    assert rep["drills"] == [{"inject": "kill:rank=1:after=6", "fired": True}]
    assert [f["cause"] for f in rep["faults"]] == ["worker_crash"] and len(rep["recoveries"]) == 1
    assert rep["goodput"] is None and "reported none" in rep["unseen"][0]


def test_a_step_drill_that_a_plain_script_cannot_reach_is_reported(tmp_path: Path) -> None:
    res = _tg(
        tmp_path, "--nproc-per-node", "2", "--inject", "kill:rank=1:step=50", str(SCRIPT), "3", "1"
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "drill kill:rank=1:step=50: did not fire" in res.stdout
    rep = report(tmp_path / "run")
    assert any("never fired: the script reports no steps" in u for u in rep["unseen"]), rep


@pytest.mark.slow
def test_a_sigstopped_rank_of_a_plain_script_is_a_hang_found_from_outside(
    tmp_path: Path, under_torchrun: tuple[list[str], dict]
) -> None:
    """The agent SIGSTOPs rank 1 (a real stopped process, state T); with no runtime in the
    script the process state alone names it, within hang_timeout_min_s (10 s)."""
    res = _tg(
        tmp_path,
        "--nproc-per-node",
        "2",
        "--inject",
        "hang:rank=1:after=6",
        str(SCRIPT),
        EPOCHS,
        "1",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    hangs = [e for e in events(tmp_path / "run") if e["kind"] == "hang_suspected"]
    assert len(hangs) == 1 and hangs[0]["rank"] == 1 and "stopped" in hangs[0]["how"], hangs
    assert 10.0 <= hangs[0]["stalled_s"] < 30.0
    fault = report(tmp_path / "run")["faults"]
    assert [(f["cause"], f["rank"]) for f in fault] == [("hang", 1)] and "stopped" in fault[0][
        "message"
    ]
    assert _resumed_from(tmp_path / "run")[0] > 0
    assert _same_weights(torch.load(tmp_path / "snapshot.pt")["MODEL_STATE"], under_torchrun[1])


@pytest.mark.parametrize("runtime", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_rank_stuck_at_exit_after_its_peers_finished_is_stopped(
    tmp_path: Path, runtime: bool
) -> None:
    """Rank 0 finished its steps, then blocks with no CPU; rank 1 exited 0. After
    ``exit_grace_s`` it is stopped and the job ends SUCCEEDED (its steps were all done), once:
    no hang verdict, no restart."""
    script = ROOT / "tests" / "helpers" / "userscripts" / "stuck_at_exit.py"
    (tmp_path / "job.toml").write_text(FAST_CONFIG + "exit_grace_s = 4.0\n")
    cmd = trainguard_cmd("run", "--run-dir", tmp_path / "run", "--config", tmp_path / "job.toml")
    cmd += ["--nproc-per-node", "2", str(script), "30", *(["--runtime"] if runtime else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    evs = events(tmp_path / "run")
    stuck = [e for e in evs if e["kind"] == "exit_stuck"]
    assert [e["rank"] for e in stuck] == [0] and stuck[0]["idle_s"] >= 4.0, stuck
    assert not [e for e in evs if e["kind"] in ("fault", "hang_suspected")]
    assert len([e for e in evs if e["kind"] == "generation_started"]) == 1
    assert "rank 0 done" in (tmp_path / "run" / "logs" / "rank0.gen0.log").read_text()
