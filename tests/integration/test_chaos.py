"""Chaos: ``trainguard chaos``, the GPT example under random faults of every kind for minutes,
then the losses of a fault-free run for every step (the command: ``chaos/run.py``).

Faults, one every 4–10 s (2–4 s while the job is ahead of schedule, so that it outlasts the
minutes; none before the job made a step since the last, at most 30 s), each on a random
target: SIGKILL and SIGSTOP of a worker, SIGKILL of
an agent (a lost node), of a ckptd (killed, or frozen for up to 20 s), SIGSTOP of the
controller (up to 6 s); a flipped byte in a memory snapshot, a peer replica and a durable
step; once, SIGKILL of every process of the run and a re-run of its run dir. The seed is
printed (and taken from ``TRAINGUARD_CHAOS_SEED``); ``TRAINGUARD_CHAOS_MINUTES`` sets the
length (default 10; CI's slow run, ``.ci/run``, 5: its 90 minutes hold every slow test).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, trainguard_cmd

MINUTES = float(os.environ.get("TRAINGUARD_CHAOS_MINUTES", "10"))


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(1260)  # 10 min of faults, the job's tail (<= 5 min), the reference
def test_chaos_of_every_fault_kind_ends_with_the_fault_free_losses(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    proc = subprocess.Popen(
        trainguard_cmd("chaos", "--minutes", str(MINUTES), "--json", "--run-dir", out),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        stdout, stderr = proc.communicate(timeout=1140)
    except subprocess.TimeoutExpired:  # SIGTERM: the command tears both runs down
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=120)
    print(stderr[-20000:])  # the seed and every fault, as they happened
    assert stdout.strip(), f"exit {proc.returncode}, no summary:\n{stderr[-3000:]}"
    s = json.loads(stdout)
    why = json.dumps({k: v for k, v in s.items() if k != "faults"}, indent=1)
    assert s["job"]["exit_code"] == 0 and s["job"]["phase"] == "SUCCEEDED", why
    assert s["steps_lost"] == 0, why
    assert s["steps_redone"]["beyond_bound"] == 0, why
    assert s["steps_redone"]["max"] <= s["steps_redone"]["bound"], why
    assert s["losses_equal"] and s["steps_differing"] == 0, why
    assert s["recoveries"] >= 1, why
    if MINUTES >= 5:  # CI's slow run: 5 minutes (.ci/run), 10 by default
        assert s["faults"]["total"] >= 2 * MINUTES, s["faults"]  # a fault every 4-10 s
        assert len(s["faults"]["kinds"]) >= 6, s["faults"]
        # faults for (nearly) the minutes asked: the job did not end first
        assert s["faults"]["seconds"] >= 0.8 * MINUTES * 60, s["faults"]
    assert s["ok"] and proc.returncode == 0, why


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--minutes", "0"], "--minutes 0.0: must be > 0"),
        (["--minutes", "-1.5"], "must be > 0"),
        (["--steps", "0"], "--steps 0: must be >= 1"),
        (["--script", "{tmp}/nope.py"], "the GPT example is missing; pass --script"),
        (["--run-dir", "{tmp}/full"], "exists and is not empty; pass a new directory"),
    ],
)
def test_chaos_refuses_bad_input_in_one_line_before_starting_anything(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "something").write_text("")
    flags = [f.format(tmp=tmp_path) for f in flags]
    if "--run-dir" not in flags:
        flags += ["--run-dir", str(tmp_path / "new")]
    res = subprocess.run(
        trainguard_cmd("chaos", *flags), capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: error: "), res.stderr
    assert says in lines[0], lines[0]
    assert not (tmp_path / "new").exists()  # nothing started, nothing written
    assert res.stdout == ""
