"""Finding a rank's process (issue 32): each worker's title names its rank, world, local rank,
generation, script and run (``ps`` shows it; its ``/proc/PID/environ`` is the warm spare's,
from before it was handed the rank), and ``trainguard status`` lists every rank's pid. A real
job: the pid status gives for rank 1 is the process whose title says rank 1, and SIGKILLing it
is the fault the job then recovers from."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import psutil

from tests.conftest import (
    TINY,
    events,
    finish_job,
    reached_step,
    start_job,
    trainguard_cmd,
    wait_for,
)

# A job that outlasts the test: many steps, rank 0 slowed (every rank waits for it).
SLOW_RUN = ["--inject", "slow:rank=0:factor=4"]


def _status(run: Path) -> str:
    res = subprocess.run(trainguard_cmd("status", "--run-dir", run), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_status_lists_each_ranks_pid_and_the_pid_is_titled_with_its_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    job = start_job(run, ["--nodes", "1", "--nproc-per-node", "2", *SLOW_RUN],
                    [*TINY, "--steps", "100000"])  # fmt: skip
    try:
        wait_for(lambda: reached_step(run, 3), 180, "step 3")
        pids = wait_for(
            lambda: dict(re.findall(r"r(\d+):running@\d+/pid (\d+)", _status(run))) or None, 60,
            "status listing the ranks' pids",
        )  # fmt: skip
        assert set(pids) == {"0", "1"}, pids
        for rank, pid in pids.items():
            title = " ".join(psutil.Process(int(pid)).cmdline())
            assert title.startswith(f"trainguard rank {rank}/2 (local {rank}, gen 0) "), title
            assert "train.py --n-embd 32" in title and f"[run {run.name}]" in title, title
            # The environment the agent's leftover check reads is whole (the title did not
            # spill into it).
            env = psutil.Process(int(pid)).environ()
            assert env.get("TRAINGUARD_NODE_ID") == "node0" and env.get("TRAINGUARD_AGENT_PID")
        os.kill(int(pids["1"]), signal.SIGKILL)  # the pid a user found: the job recovers
        wait_for(lambda: any(e["kind"] == "recovery_completed" for e in events(run)), 180,
                 "the recovery from rank 1's SIGKILL")  # fmt: skip
        fault = next(e for e in events(run) if e["kind"] == "fault")
        assert fault["rank"] == 1 and fault["cause"] == "worker_crash", fault
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
        code, err = finish_job(job, timeout=120)
    assert code == 128 + signal.SIGTERM, err[-2000:]
