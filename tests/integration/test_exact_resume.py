"""The example resumes exactly: with a worker SIGKILLed mid-run, every step's loss
equals the fault-free run's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY, events, fault_free_losses, losses, report, run_job
from trainguard.controller.api import RECOVERY_PHASES

STEPS = 40


def test_kill_mid_run_gives_the_same_losses_as_no_fault(tmp_path: Path) -> None:
    args = [*TINY, "--steps", str(STEPS), "--ckpt-every", "1", "--durable-every", "5"]
    clean = run_job(tmp_path / "clean", ["--nodes", "2"], args)
    assert clean.returncode == 0, clean.stderr[-3000:]
    faulty = run_job(tmp_path / "faulty", ["--nodes", "2", "--inject", "kill:rank=1:step=23"], args)
    assert faulty.returncode == 0, faulty.stderr[-3000:]

    want, got = losses(tmp_path / "clean"), losses(tmp_path / "faulty")
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    assert got == want  # exact float equality, step for step

    rep = report(tmp_path / "faulty")
    assert rep["phase"] == "SUCCEEDED" and rep["last_step"] == STEPS
    assert [(f["cause"], f["rank"], f["step"]) for f in rep["faults"]] == [("worker_crash", 1, 23)]
    (rec,) = rep["recoveries"]
    # In process (the example runs under trainguard.run): rank 0 kept its process.
    first = {e["rank"]: e["pid"] for e in events(tmp_path / "faulty")
             if e["kind"] == "worker_started" and e["generation"] == 0}  # fmt: skip
    assert rec["mode"] == "inprocess" and rec["kept"] == {"0": first[0]}, rec
    assert list(rec["new"]) == ["1"] and rec["new"]["1"] != first[1]
    resumed = [e for e in events(tmp_path / "faulty") if e["kind"] == "inprocess_resumed"]
    assert [e["rank"] for e in resumed] == [0] and resumed[0]["released_s"] < 10
    # Rank 1 dies at the end of step 23, before snapshotting it: the newest step every rank
    # holds is 22 in memory (or, if the persister had not verified it yet, 21 or 20 on disk).
    assert 20 <= rec["restore_step"] <= 22 and rec["steps_lost"] == 23 - rec["restore_step"]
    phases = rec["phases_s"]
    for name in RECOVERY_PHASES:
        assert phases[name] is not None and phases[name] >= 0, phases
    assert phases["total"] < 60
    assert 0 < rep["goodput"] < 1


def test_reference_losses_are_a_prefix_of_a_longer_run(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The premise of ``fault_free_losses``' one-run-per-session cache: a fault-free run of 15
    steps has exactly the first 15 losses of a run of 25 with the same flags (otherwise a
    cached longer reference would be wrong for a shorter test; the GPT example's learning rate
    does not depend on ``--steps``)."""
    args = [*TINY, "--ckpt-every", "3", "--durable-every", "7"]
    longer = fault_free_losses(tmp_path_factory, ["--nodes", "2"], [*args, "--steps", "25"])
    assert sorted(longer) == list(range(1, 26))
    res = run_job(tmp_path / "short", ["--nodes", "2"], [*args, "--steps", "15"])
    assert res.returncode == 0, res.stderr[-3000:]
    short = losses(tmp_path / "short")
    assert sorted(short) == list(range(1, 16))
    assert short == {k: v for k, v in longer.items() if k <= 15}  # exact floats
    again = fault_free_losses(tmp_path_factory, ["--nodes", "2"], [*args, "--steps", "15"])
    assert again == short  # served from the cached 25-step run
