"""A step of the wall clock by an hour, forward and back, while a job trains (issue 30, item 3).

The machine's real clock (CLOCK_REALTIME, ``clock_settime``: we are root; a Firecracker VM of
our own here and in CI) is stepped +1 h, back, -1 h and back, as NTP does to a host whose clock
was wrong, each step while two nodes train the GPT example. Every deadline, timeout and
duration trainguard judges by must be on the monotonic clock: no fault, no hang, no straggler,
no node lost, every checkpoint committed as usual, and the fault-free losses for every step.
The test restores the true time (kept on the monotonic clock) whatever happens. It runs with
no test beside it (``alone``): the other tests' processes would see the steps too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    TINY,
    events,
    fault_free_losses,
    finish_job,
    losses,
    reached_step,
    report,
    start_job,
    wait_for,
)
from trainguard.checkpoint import storage

STEPS = 120
PACE = ["--inject", "slow:rank=0:factor=5"]  # minutes of training: time for four steps
ARGS = [*TINY, "--steps", str(STEPS), "--ckpt-every", "5", "--durable-every", "10"]
HOUR = 3600.0


@pytest.fixture
def clock() -> Iterator[list[float]]:
    """Steps of the real clock: append seconds to the returned list with ``_step``; the true
    time (the start's wall time plus the monotonic time since) is restored at the end."""
    wall0, mono0 = time.time(), time.monotonic()
    steps: list[float] = []
    try:
        yield steps
    finally:
        time.clock_settime(time.CLOCK_REALTIME, wall0 + (time.monotonic() - mono0))


def _step(steps: list[float], seconds: float) -> None:
    time.clock_settime(time.CLOCK_REALTIME, time.time() + seconds)
    steps.append(seconds)


@pytest.mark.slow
@pytest.mark.alone  # the clock is the machine's: nothing else runs beside it in CI
def test_clock_steps_of_an_hour_during_a_job_change_nothing(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, clock: list[float]
) -> None:
    reference = fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2", *PACE], ARGS)
    try:
        for at, seconds in ((20, HOUR), (40, -HOUR), (60, -HOUR), (80, HOUR)):
            wait_for(lambda at=at: reached_step(run, at), 180, f"step {at}")
            _step(clock, seconds)
            time.sleep(3.0)  # node_timeout_s = 3 in FAST_CONFIG: a wall-clock judge would fire
        code, err = finish_job(proc, timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert clock == [HOUR, -HOUR, -HOUR, HOUR]
    assert code == 0, err[-3000:]
    evs = events(run)
    judged = ("fault", "hang_suspected", "straggler", "loss_spike", "throughput_drop",
              "controller_paused")  # fmt: skip
    bad = [e for e in evs if e["kind"] in judged
           or (e["kind"] == "generation_started" and e["generation"] > 0)]  # fmt: skip
    assert not bad, bad
    assert losses(run) == reference
    rep = report(run)
    assert rep["phase"] == "SUCCEEDED" and rep["recoveries"] == []
    root = run / "checkpoints"
    assert storage.list_committed(root)[-1] == STEPS and not storage.verify(root, STEPS)
