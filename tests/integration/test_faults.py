"""Faults injected from outside by pid (SIGKILL, SIGSTOP, agent SIGKILL), a script that
fails before its first step, and SIGTERM to ``trainguard run``. Each test ends with the
job in the right state and (fixture ``no_leaks``) nothing of it left running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.conftest import (
    TINY,
    agent_pid,
    events,
    finish_job,
    losses,
    reached_step,
    report,
    run_job,
    start_job,
    trainguard_cmd,
    wait_for,
    worker_pid,
)

STEPS = 150
ARGS = [*TINY, "--steps", str(STEPS), "--durable-every", "10"]


def test_sigkill_of_a_worker(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2"], ARGS)
    pid = worker_pid(run, rank=1)
    wait_for(lambda: reached_step(run, 25), 90, "step 25")
    os.kill(pid, signal.SIGKILL)
    code, err = finish_job(proc)
    assert code == 0, err[-3000:]
    rep = report(run)
    assert [(f["cause"], f["rank"]) for f in rep["faults"]] == [("worker_crash", 1)]
    assert rep["recoveries"][0]["restore_step"] >= 20
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    # The printed report fits a piped, 80-column terminal: the recovery's phases down the side.
    text = subprocess.run(
        [*trainguard_cmd(), "report", "--run-dir", str(run)], capture_output=True, text=True,
        timeout=60, env={**os.environ, "COLUMNS": "80"},
    ).stdout  # fmt: skip
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert re.search(r"│ rendezvous +│ +\d+\.\d\d │", text), text


def test_sigstop_of_a_worker_is_a_hang(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2", "--hang-timeout", "3"], ARGS)
    pid = worker_pid(run, rank=1)
    wait_for(lambda: reached_step(run, 25), 90, "step 25")
    os.kill(pid, signal.SIGSTOP)
    code, err = finish_job(proc)
    assert code == 0, err[-3000:]
    rep = report(run)
    assert [(f["cause"], f["rank"]) for f in rep["faults"]] == [("hang", 1)]
    assert rep["recoveries"][0]["phases_s"]["detect"] >= 3.0
    stacks = {
        r: t
        for e in events(run)
        if e["kind"] in ("hang_suspected", "stacks")
        for r, t in e["stacks"].items()
    }
    # py-spy dumps of every rank ride on the events: the victim's (waiting in a collective,
    # in backward's DDP all-reduce or the loss all-reduce) and the frozen culprit's.
    assert "train.py" in stacks["0"] and "train.py" in stacks["1"]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_sigkill_of_an_agent_is_a_lost_node_replaced_by_standby(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2", "--standby", "1"], ARGS)
    worker_pid(run, rank=1)
    survivor = worker_pid(run, rank=0)
    wait_for(lambda: reached_step(run, 25), 90, "step 25")
    os.kill(agent_pid(run, "node1"), signal.SIGKILL)
    code, err = finish_job(proc)
    assert code == 0, err[-3000:]
    rep = report(run)
    assert [(f["cause"], f["node_id"]) for f in rep["faults"]] == [("node_lost", "node1")]
    (rec,) = rep["recoveries"]
    assert rec["replaced"] == {"node1": "node2"}
    # In process: the survivor on node0 kept its process; only the lost node's rank is new.
    assert rec["mode"] == "inprocess" and rec["kept"] == {"0": survivor}, rec
    gen1 = [e for e in events(run) if e.get("generation") == 1]
    started = [e["node"] for e in gen1 if e["kind"] == "worker_started"]
    resumed = [(e["node"], e["pid"]) for e in gen1 if e["kind"] == "worker_resumed"]
    assert started == ["node2"] and resumed == [("node0", survivor)]


def test_script_failing_before_step_one_fails_fast_with_its_traceback(tmp_path: Path) -> None:
    res = run_job(
        tmp_path / "run",
        ["--nodes", "2", "--max-restarts", "5"],
        [*ARGS, "--data", "/no/such/corpus"],
    )
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "trainguard: job failed: user error: the script failed before its first step"
    )
    assert "FileNotFoundError: --data /no/such/corpus: no such file or directory" in last
    assert "Traceback (most recent call last)" in res.stderr
    gens = {e["generation"] for e in events(tmp_path / "run") if e["kind"] == "generation_started"}
    assert gens == {0, 1}  # failed fast: two generations, not the restart budget of five


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_sigterm_to_run_stops_cleanly_and_a_rerun_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2"], ARGS)
    worker_pid(run, rank=1)
    wait_for(lambda: reached_step(run, 25), 90, "step 25")
    proc.send_signal(signal.SIGTERM)
    code, err = finish_job(proc, timeout=60)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "trainguard: job stopped by SIGTERM" in err.strip().splitlines()[-1]
    stopped_at = max(losses(run))
    assert stopped_at < STEPS
    assert (run / "checkpoints" / f"step_{stopped_at}").is_dir()  # the workers saved on SIGTERM
    res = run_job(run, ["--nodes", "2"], ARGS)  # same run dir: resumes from that checkpoint
    assert res.returncode == 0, res.stderr[-3000:]
    first_gen = [e for e in events(run) if e["kind"] == "generation_started"][-1]
    assert first_gen["restore_step"] == stopped_at
    assert sorted(losses(run)) == list(range(1, STEPS + 1))


@pytest.mark.chaos
@pytest.mark.slow  # in CI's slow run (keeps the default suite under 15 min)
def test_injected_node_down_without_standby_waits_for_the_node(tmp_path: Path) -> None:
    res = run_job(tmp_path / "run", ["--nodes", "2", "--inject", "node-down:node=1:step=30"], ARGS)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = report(tmp_path / "run")
    assert [(f["cause"], f["node_id"]) for f in rep["faults"]] == [("node_lost", "node1")]
    kinds = [e["kind"] for e in events(tmp_path / "run")]
    assert "node_rebooted" in kinds
    assert sorted(losses(tmp_path / "run")) == list(range(1, STEPS + 1))
