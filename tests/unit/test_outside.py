"""The agent's outside view of a worker (agent/outside.py) on real processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from trainguard.agent import outside
from trainguard.agent.workers import Worker

DESIRED = {"hang_timeout_min_s": 0.5, "hang_timeout_max_s": 1.0, "hang_timeout_s": None}


@pytest.fixture
def worker(tmp_path) -> Iterator[Worker]:
    """A real child that idles in ``time.sleep`` (no CPU), in its own process group."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    w = Worker(
        rank=0, local_rank=0, proc=proc, log_path=tmp_path / "log",
        error_file=tmp_path / "err", started_mono=time.monotonic(),
    )  # fmt: skip
    yield w
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_a_sigstopped_worker_is_hung_after_the_floor(worker: Worker) -> None:
    time.sleep(0.3)  # let the interpreter start
    outside.sample(worker, time.monotonic())
    assert worker.proc_state != "stopped" and worker.stopped_since_mono is None
    os.killpg(worker.proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while worker.proc_state != "stopped" and time.monotonic() < deadline:
        outside.sample(worker, time.monotonic())
        time.sleep(0.05)
    assert worker.proc_state == "stopped"
    worker.last_hb_mono = time.monotonic()  # a runtime script too: stopped is stopped
    assert (
        outside.stalled(worker, DESIRED["hang_timeout_min_s"], time.monotonic()) is None
    )  # not yet 0.5 s
    time.sleep(0.6)
    seen = outside.stalled(worker, DESIRED["hang_timeout_min_s"], time.monotonic())
    assert seen is not None and "stopped" in seen[2] and seen[0] > 0.5
    os.killpg(worker.proc.pid, signal.SIGCONT)
    outside.sample(worker, time.monotonic())
    assert worker.stopped_since_mono is None


def test_cpu_idle_seconds_count_from_the_last_cpu_use(worker: Worker) -> None:
    time.sleep(0.5)
    t0 = time.monotonic()
    outside.sample(worker, t0)
    outside.sample(worker, t0 + 0.01)
    time.sleep(1.2)
    now = time.monotonic()
    outside.sample(worker, now)  # slept: no CPU since the first sample
    idle = worker.observe(now).cpu_idle_s
    assert idle is not None and idle >= 1.2
    assert (
        outside.stalled(worker, DESIRED["hang_timeout_min_s"], now) is None
    )  # idle alone is the controller's call


def test_timed_drills_come_due_after_their_seconds(worker: Worker) -> None:
    from trainguard.faults.inject import parse_inject

    specs = [parse_inject("kill:rank=0:after=0.2", 0), parse_inject("node-down:node=1:after=0", 1)]
    now = worker.started_mono
    assert outside.due_drills(specs, set(), {0: worker}, 0, now + 9) == []  # script not begun
    worker.log_path.write_text("")  # the spare opened the rank's log: its script runs
    outside.sample(worker, now)
    assert worker.script_started_mono == now
    assert outside.due_drills(specs, set(), {0: worker}, 0, now) == []
    due = outside.due_drills(specs, set(), {0: worker}, 0, now + 0.3)
    assert [s.id for s, _ in due] == [0]  # node 1's drill is not this node's
    assert outside.due_drills(specs, {0}, {0: worker}, 0, now + 0.3) == []  # fires once
    outside.fire(due[0][0], worker, lambda: None)
    assert worker.proc.wait(timeout=10) == -signal.SIGKILL
