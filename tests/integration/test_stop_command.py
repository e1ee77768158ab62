"""``trainguard stop`` (the controller pod's preStop hook in deploy/k8s): a live job's planned
stop from another process, its newest snapshot saved to the durable tier before anything is
killed; then a resume from that step. A real job, a real controller."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import (
    TINY,
    events,
    finish_job,
    reached_step,
    start_job,
    trainguard_cmd,
    wait_for,
)


def test_stop_saves_the_newest_snapshot_ends_the_job_and_a_rerun_resumes_there(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    job = start_job(run, ["--nodes", "1", "--nproc-per-node", "2", "--inject",
                          "slow:rank=0:factor=4"], [*TINY, "--steps", "100000"])  # fmt: skip
    try:
        wait_for(lambda: reached_step(run, 5), 180, "step 5")
        res = subprocess.run(trainguard_cmd("stop", "--run-dir", run, "--wait", "120"),
                             capture_output=True, text=True, timeout=180)  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert "stop requested" in res.stdout and "the job is STOPPED" in res.stdout, res.stdout
    finally:
        code, err = finish_job(job, timeout=120)
    # Not finished: status 1 (cli/run.py finish), saying how to resume.
    assert code == 1 and "job stopped by request; resume from its last checkpoint" in err, err
    (stop,) = [e for e in events(run) if e["kind"] == "planned_stop"]
    saved = stop["saved_step"]
    assert saved is not None and saved >= 5, stop
    durable = [e["step"] for e in events(run) if e["kind"] == "ckpt_durable"]
    assert saved in durable, (saved, durable)
    # The stop lost nothing: the job run again on its run dir starts from the saved step.
    again = start_job(run, ["--nodes", "1", "--nproc-per-node", "2"], [*TINY, "--steps",
                            str(saved + 2)])  # fmt: skip
    code, err = finish_job(again, timeout=240)
    assert code == 0, err[-2000:]
    gens = [e for e in events(run) if e["kind"] == "generation_started"]
    assert gens[-1]["restore_step"] == saved, gens[-1]
