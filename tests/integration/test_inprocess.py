"""In-process recovery (``trainguard.run``): after a real fault — kill -9, SIGSTOP, a node that
goes down — the surviving ranks keep their processes (the same pids in the next generation),
only the failed rank is a new process, and the losses equal a fault-free run's, bit for bit.
(Node-down: ``test_fsdp.py``'s standby test, ``test_faults.py``'s lost agent.) Twenty
recoveries in one job leave the survivor's threads, fds and shared-memory maps where they were; a survivor stuck in a call no abort reaches is killed and restarted the old way,
and the job still ends with the exact losses. A script without ``trainguard.run`` keeps the
restart path, and the report says why."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    FAST_CONFIG,
    ROOT,
    TINY,
    events,
    fault_free_losses,
    finish_job,
    losses,
    reached_step,
    report,
    start_job,
    trainguard_cmd,
    wait_for,
    worker_pid,
)

STEPS = 40
ARGS = [*TINY, "--steps", str(STEPS), "--durable-every", "5"]
USER = ROOT / "tests" / "helpers" / "userscripts" / "inprocess_user.py"
CONFIG = FAST_CONFIG + "hang_timeout_min_s = 2.0\ninprocess_abort_s = 3.0\nmax_restarts = 25\n"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)


def _started(run_dir: Path, generation: int) -> dict[int, int]:
    return {e["rank"]: e["pid"] for e in events(run_dir)
            if e["kind"] == "worker_started" and e["generation"] == generation}  # fmt: skip


def _in_process(run_dir: Path, kept: list[int], new: list[int]) -> dict[str, Any]:
    """The one recovery was in process: ``kept`` ranks have their generation-0 pids in
    generation 1, ``new`` ranks new processes."""
    (rec,) = report(run_dir)["recoveries"]
    before = _started(run_dir, 0)
    assert rec["mode"] == "inprocess", rec
    assert rec["kept"] == {str(r): before[r] for r in kept}, (rec, before)
    assert sorted(map(int, rec["new"])) == new
    assert not set(rec["new"].values()) & set(before.values())
    return rec


def test_a_sigstopped_rank_is_replaced_and_its_peer_kept(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2"], ARGS, config=CONFIG)
    pid = worker_pid(run, rank=1)
    wait_for(lambda: reached_step(run, 15), 90, "step 15")
    os.kill(pid, signal.SIGSTOP)  # a hang: rank 0 waits in its next collective
    code, err = finish_job(proc)
    assert code == 0, err[-3000:]
    assert [(f["cause"], f["rank"]) for f in report(run)["faults"]] == [("hang", 1)]
    _in_process(run, kept=[0], new=[1])
    assert losses(run) == reference


def _start_user_job(
    run: Path,
    injects: list[str],
    *args: str,
    config: str = CONFIG,
    layout: tuple[str, ...] = ("--nproc-per-node", "2"),
) -> subprocess.Popen[str]:
    cfg = run.parent / f"{run.name}.toml"
    cfg.write_text(config)
    cmd = trainguard_cmd("run", "--run-dir", run, "--config", cfg, *layout,
                         *(x for i in injects for x in ("--inject", i)), USER, *args)  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)  # fmt: skip


def _user_job(
    run: Path,
    injects: list[str],
    *args: str,
    config: str = CONFIG,
    layout: tuple[str, ...] = ("--nproc-per-node", "2"),
) -> tuple[int, str]:
    return finish_job(_start_user_job(run, injects, *args, config=config, layout=layout), 600)


@pytest.fixture(scope="module")
def user_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("user_reference") / "run"
    code, err = _user_job(run, [], "--steps", "24")
    assert code == 0, err[-3000:]
    return losses(run)


def test_a_survivor_blocked_in_a_system_call_is_kept(
    tmp_path: Path, user_reference: dict[int, float]
) -> None:
    """Rank 0 sleeps in time.sleep(60) when its peer is killed: the abort's signal interrupts
    the call, the exception lands, rank 0 parks within the 3 s abort deadline and is kept."""
    run = tmp_path / "run"
    code, err = _user_job(run, ["kill:rank=1:step=12"], "--steps", "24", "--sleep-at", "12")
    assert code == 0, err[-3000:]
    (rec,) = report(run)["recoveries"]
    assert rec["mode"] == "inprocess" and not rec["escalated"], rec
    assert rec["kept"] == {"0": _started(run, 0)[0]}, rec
    assert losses(run) == user_reference


def test_a_fault_while_the_survivor_forms_the_group_is_recovered_in_process(
    tmp_path: Path, user_reference: dict[int, float]
) -> None:
    """Rank 1 dies at step 12; in the recovery its new process stalls before
    ``init_process_group`` while kept rank 0 waits inside it, and is killed (kill -9) there.
    Rank 0, aborted in a half-made group, is kept again and the world re-forms: the chaos run of
    2026-12-04 hung 300 s at every recovery after such a fault (torch's group number, the key
    prefix, was left at 1 in the survivor and 0 in the new rank)."""
    run = tmp_path / "run"
    proc = _start_user_job(run, ["kill:rank=1:step=12"], "--steps", "24", "--stall-init", "1")
    try:
        stalled = wait_for(lambda: (run / "stalled").is_file() and (run / "stalled").read_text(),
                           120, "rank 1 of generation 1 to stall before its group")  # fmt: skip
        time.sleep(1.0)  # rank 0 (resumed before the new rank 1 started) waits in the group
        with contextlib.suppress(ProcessLookupError):  # the hang detector may have been first
            os.kill(int(stalled), signal.SIGKILL)
        code, err = finish_job(proc, timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert code == 0, err[-3000:]
    rep = report(run)
    assert [(f["cause"], f["rank"], f["generation"]) for f in rep["faults"]] == [
        ("worker_crash", 1, 0), ("worker_crash", 1, 1)], rep["faults"]  # fmt: skip
    (rec,) = rep["recoveries"]  # the one that reached its first step, from generation 1
    first = _started(run, 0)[0]
    assert rec["mode"] == "inprocess" and rec["kept"] == {"0": first}, rec
    resumed = [(e["generation"], e["pid"]) for e in events(run) if e["kind"] == "worker_resumed"]
    assert resumed == [(1, first), (2, first)], resumed  # rank 0 kept through both faults
    assert losses(run) == user_reference


def test_a_fault_at_the_second_step_keeps_the_survivor_on_another_node(
    tmp_path: Path, user_reference: dict[int, float]
) -> None:
    """Two nodes, agents reporting every 4 s. Rank 1 (node 1) dies at step 2, moments after
    both ranks entered trainguard.run, while rank 0 (node 0) sleeps: it has not parked on a
    failed collective when the recovery is planned. Its agent passed on its opt-in to
    in-process recovery at once, not at its next report, so the fault is planned in process
    (the recovery benchmark's smoke run was planned as a restart: 'rank(s) 3 run a script
    without trainguard.run')."""
    run = tmp_path / "run"
    slow_beats = CONFIG.replace("heartbeat_s = 0.2", "heartbeat_s = 4.0").replace(
        "node_timeout_s = 3.0", "node_timeout_s = 12.0")  # fmt: skip
    assert "heartbeat_s = 4.0" in slow_beats
    code, err = _user_job(run, ["kill:rank=1:step=2"], "--steps", "24", "--sleep-at", "2",
                          config=slow_beats, layout=("--nodes", "2"))  # fmt: skip
    assert code == 0, err[-3000:]
    (rec,) = report(run)["recoveries"]
    assert rec["mode"] == "inprocess" and rec["kept"] == {"0": _started(run, 0)[0]}, rec
    assert rec["restore_step"] == 1, rec
    assert losses(run) == user_reference


def test_a_survivor_stuck_where_no_abort_reaches_is_restarted_the_old_way(
    tmp_path: Path, user_reference: dict[int, float]
) -> None:
    run = tmp_path / "run"
    # Rank 0 enters libc sleep(60), signals blocked, after step 12; rank 1 is killed at 12.
    code, err = _user_job(run, ["kill:rank=1:step=12"], "--steps", "24", "--stuck-at", "12")
    assert code == 0, err[-3000:]
    (rec,) = report(run)["recoveries"]
    assert rec["mode"] == "inprocess" and rec["kept"] == {}, rec
    assert [e["rank"] for e in rec["escalated"]] == [0], rec
    assert "within 3s of the abort" in rec["escalated"][0]["reason"]
    assert sorted(map(int, rec["new"])) == [0, 1]
    assert losses(run) == user_reference


@pytest.mark.slow  # CI's slow run (the default run stays under 15 min)
def test_a_fault_before_any_checkpoint_restarts_a_model_made_outside_main(tmp_path: Path) -> None:
    """The model and optimizer are made at module level (kept across in-process recoveries);
    rank 1 dies at step 1, before any checkpoint: nothing would restore the survivor's trained
    state, so every rank restarts, and the losses equal a fault-free run's (they differed at
    every step when the survivor was kept)."""
    script = ROOT / "tests" / "helpers" / "userscripts" / "model_outside_main.py"
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)

    def job(name: str, *inject: str) -> Path:
        cmd = trainguard_cmd("run", "--run-dir", tmp_path / name, "--config", cfg,
                             "--nproc-per-node", "2", *inject, script, "20")  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        return tmp_path / name

    ref = losses(job("ref"))
    run = job("early", "--inject", "kill:rank=1:step=1")
    (rec,) = report(run)["recoveries"]
    assert rec["mode"] == "restart" and rec["kept"] == {}, rec
    assert rec["mode_reason"].startswith("no checkpoint every rank agrees on yet"), rec
    assert losses(run) == ref
    run = job("later", "--inject", "kill:rank=1:step=8")  # a checkpoint to restore: kept
    (rec,) = report(run)["recoveries"]
    assert rec["mode"] == "inprocess" and list(rec["kept"]) == ["0"], rec
    assert losses(run) == ref


# Kills of rank 1 in one job: 20 by default; CI's slow run (.ci/run) sets 10 to hold its 90
# minutes (a leak of one thread, fd or mapping a recovery still shows as 9 more by the last).
RECOVERIES = int(os.environ.get("TRAINGUARD_REPEATED_RECOVERIES", "20"))


@pytest.mark.slow
@pytest.mark.timeout(600)  # 20 respawns of a rank (a torch import each); CI's loaded run: > 300 s
def test_repeated_recoveries_leave_threads_fds_and_shm_where_they_were(tmp_path: Path) -> None:
    """A user's script (DataLoader with a spawn worker, lazily created Adam state) survives
    ``RECOVERIES`` (20) kills of its peer in one job, one every 5 steps; each entry of its
    training function records its resources."""
    assert RECOVERIES >= 3, "the first entry and two recoveries at least"
    probe = tmp_path / "probe.jsonl"
    kills = [f"kill:rank=1:step={5 * k}" for k in range(1, RECOVERIES + 1)]
    steps = 5 * RECOVERIES + 4
    run = tmp_path / "run"
    # The default 10 s abort/resume deadline, not the module's 3 s (made for the tests of a
    # stuck survivor): beside a second test, a survivor once took over 3 s to answer its
    # resume, and this test is about every one of the recoveries being kept.
    config = CONFIG.replace("inprocess_abort_s = 3.0", "inprocess_abort_s = 10.0")
    assert config != CONFIG
    code, err = _user_job(run, kills, "--steps", str(steps), "--workers", "1", "--probe",
                          str(probe), config=config)  # fmt: skip
    assert code == 0, err[-3000:]
    recs = report(run)["recoveries"]
    assert len(recs) == RECOVERIES and all(r["mode"] == "inprocess" for r in recs)
    pid0 = _started(run, 0)[0]
    assert all(r["kept"] == {"0": pid0} for r in recs), [(r["kept"], r["escalated"]) for r in recs]
    entries = [json.loads(x) for x in probe.read_text().splitlines()]
    assert [e["generation"] for e in entries] == list(range(RECOVERIES + 1))
    # The first entry precedes what the first recovery starts once for good (the spawn
    # context's resource tracker, gloo's and ckptd's first use); from the second on: flat.
    first, last = entries[1], entries[-1]
    for key in ("fds", "shm_maps", "children"):
        assert last[key] == first[key], (key, entries)
    for key in ("threads", "os_threads"):  # a helper thread of the loader's queues may be
        # between its start and its exit at an entry (seen: 3 or 4, and 3 for six entries,
        # then 4 for the other fourteen): at most one more than at the first, never growing
        # with the recoveries (a leak of one a recovery would be RECOVERIES - 1 more by the last)
        assert max(e[key] for e in entries[1:]) <= first[key] + 1, (key, entries)
    assert last["rss"] - first["rss"] < 64 << 20, entries  # bounded: no model kept per entry
    assert sorted(losses(run)) == list(range(1, steps + 1))  # exactness: the stuck-survivor test


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_a_script_without_trainguard_run_takes_the_restart_path(tmp_path: Path) -> None:
    script = ROOT / "tests" / "helpers" / "userscripts" / "ddp_tutorial.py"
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    cmd = trainguard_cmd("run", "--run-dir", tmp_path / "run", "--config", cfg,
                         "--nproc-per-node", "2", "--inject", "kill:rank=1:after=6",
                         script, "120", "1")  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = report(tmp_path / "run")["recoveries"]
    assert rec["mode"] == "restart" and "without trainguard.run" in rec["mode_reason"], rec
    assert sorted(map(int, rec["new"])) == [0, 1] and rec["kept"] == {}


def test_the_docs_script_runs_as_written_and_recovers_in_process(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "inprocess.md").read_text()
    script = tmp_path / "train.py"
    script.write_text(doc.split("```python\n", 1)[1].split("```", 1)[0])
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    cmd = trainguard_cmd("run", "--run-dir", tmp_path / "run", "--config", cfg,
                         "--nproc-per-node", "2", "--inject", "kill:rank=1:step=12", script)  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "in-process recovery 1 of" in res.stderr and "keep their processes" in res.stderr
    rep = report(tmp_path / "run")
    assert rep["phase"] == "SUCCEEDED" and rep["last_step"] == 30
    (rec,) = rep["recoveries"]
    assert rec["mode"] == "inprocess" and rec["kept"] == {"0": _started(tmp_path / "run", 0)[0]}
