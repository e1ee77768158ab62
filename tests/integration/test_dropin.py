"""A script runs under ``trainguard run`` as under ``python``/``torchrun``: the scripts in
tests/helpers/repros/ (users' shapes, copied verbatim), each with its expected output."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, events, wait_for, worker_pid
from trainguard.checkpoint import storage

REPROS = ROOT / "tests" / "helpers" / "repros"
CONFIG = 'preflight = "off"\nmax_restarts = 10\nheartbeat_s = 0.2\nprobe_every_s = 0\n'


def run_repro(tmp_path: Path, script: str, *args: str, run_args: tuple[str, ...] = ()) -> str:
    """``trainguard run`` a repro to completion (exit 0 asserted); rank 0's log, all gens."""
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG)
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "run", "--run-dir", str(run_dir)]
        + ["--config", str(cfg), *run_args, str(REPROS / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPROS,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank0.gen*.log")))


@pytest.mark.parametrize(
    "mode",
    ["spawn", *(pytest.param(m, marks=pytest.mark.slow) for m in ("forkserver", "pool", "exc"))],
)
def test_script_classes_cross_spawn_workers(tmp_path: Path, mode: str) -> None:
    logs = run_repro(tmp_path, "spawn_dataloader_script_class.py", mode)
    want = {
        "spawn": "OK spawn: 4 batches of __main__.Batch",
        "forkserver": "OK forkserver: 4 batches of __main__.Batch",
        "pool": "OK pool: [Batch(x=tensor([0]), y=tensor([0]))",
        "exc": "OK exc: caught MyError: bad item",
    }[mode]
    assert want in logs, logs[-2000:]


def test_thread_count_set_before_import_torch_is_honoured(tmp_path: Path) -> None:
    logs = run_repro(tmp_path, "env_before_import.py")
    assert "torch threads=2" in logs, logs[-2000:]


def test_outside_text_is_printed_as_text_and_output_can_be_cut_short(tmp_path: Path) -> None:
    """Error text holding rich-markup-like brackets is printed verbatim by every command, and
    a reader that stops early (``| head``) ends a printing command without a traceback."""
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG.replace("max_restarts = 10", "max_restarts = 1"))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainguard"]
    res = subprocess.run(
        [
            *cmd,
            "run",
            "--run-dir",
            str(run_dir),
            "--config",
            str(cfg),
            str(REPROS / "bracket_error.py"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode != 0
    needle = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] [bold]peer[/] closed"
    for sub in (["report"], ["events"], ["status"]):
        out = subprocess.run(
            [*cmd, *sub, "--run-dir", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "400"},
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert "Traceback" not in out.stderr
        if sub == ["report"]:  # (events cut each detail at 100 characters)
            assert needle in out.stdout, out.stdout[-3000:]
        if sub == ["status"]:  # the job failed: no node is said to be running now
            assert "running   - (the job ended; its last generation ran on node0)" in out.stdout
    for sub in (["events", "--json"], ["status", "--json"], ["report", "--json"]):
        pipe = subprocess.run(
            " ".join([*cmd, *sub, "--run-dir", str(run_dir)]) + " | head -c 20",
            shell=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "Traceback" not in pipe.stderr and "BrokenPipe" not in pipe.stderr, pipe.stderr


def test_a_plain_script_gets_its_whole_restart_budget(tmp_path: Path) -> None:
    """No trainguard import: fails (differently) in restarts 0 and 1, finishes in restart 2."""
    logs = run_repro(tmp_path, "restart_budget_plain_script.py")
    assert "restart 2: finished" in logs


@pytest.mark.slow  # in CI's slow run (keeps the default suite under 15 min)
def test_a_long_evaluation_without_step_reports_is_not_a_hang(tmp_path: Path) -> None:
    """20 s of no_grad work every 20 steps on 2 nodes: the ranks are alive and busy (their
    main threads use CPU), so no hang verdict; both evaluations finish."""
    logs = run_repro(tmp_path, "eval_phase.py", "--steps", "45", run_args=("--nodes", "2"))
    assert logs.count("rank 0: eval_end") == 2, logs[-2000:]
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert '"hang_suspected"' not in events and '"kind": "fault"' not in events


@pytest.mark.slow
def test_a_rank_that_exits_0_on_an_outside_sigterm_is_the_fault(tmp_path: Path) -> None:
    """SIGTERM to rank 1's worker (it exits 0) while rank 0 trains: rank 1 is named."""
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard", "run", "--run-dir", str(run_dir), "--config"]
        + [str(cfg), "--nodes", "2", str(REPROS / "sigterm_exit0.py"), "--steps", "24"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPROS,
    )
    try:
        pid = worker_pid(run_dir, 1)
        wait_for(lambda: reached_step_events(run_dir, 8), 120, "step 8")
        os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]  # the fault is recovered and the job finishes
    (fault, *_) = [e for e in events(run_dir) if e["kind"] == "fault"]
    assert fault["rank"] == 1 and "left early" in fault["message"], fault


def reached_step_events(run_dir: Path, step: int) -> bool:
    return any(e["kind"] == "ckpt_staged" and e.get("step", 0) >= step for e in events(run_dir))


def readme_snippet() -> str:
    """The README's training script, as printed there."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## What a training script does") :]
    begin = section.index("```python\n") + len("```python\n")
    code = section[begin : section.index("\n```", begin)]
    assert "ckpt.close()" in code and "steps = 100\n" in code
    return code + "\n"


def test_the_readme_snippet_runs_as_written(tmp_path: Path) -> None:
    """The README's script, taken literally: under trainguard with a kill it resumes from
    memory; run again with plain python it says it resumed from the durable tier."""
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippet())
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG)
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "trainguard", "run", "--run-dir", str(run_dir), "--config"]
        + [str(cfg), "--inject", "kill:rank=0:step=25", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    logs = (run_dir / "logs" / "rank0.gen1.log").read_text()
    got = re.search(r"trainguard: rank 0 restored step (\d+) from the memory tier", logs)
    assert got is not None, logs[-2000:]
    # Step 24 is the newest snapshot before the kill at 25, unless the disk lagged: under
    # back-pressure (another job on the machine) snapshots are skipped, each said by an event
    # (seen: step 20 restored with a second job beside the suite). Every step between the
    # restored one and 24 must then be a skipped one.
    restored, evs = int(got.group(1)), events(run_dir)
    gen1 = min(e["ts"] for e in evs if e["kind"] == "generation_started" and e["generation"] == 1)
    skipped = {e["step"] for e in evs if e["kind"] == "ckpt_skipped" and e["ts"] < gen1}
    assert restored <= 24 and set(range(restored + 1, 25)) <= skipped, (restored, skipped)
    assert [e["step"] for e in events(run_dir) if e["kind"] == "ckpt_durable"][-1] == 100
    plain = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    again = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert "trainguard: rank 0 restored step 100 from the durable tier" in again.stderr


@pytest.mark.slow  # in CI's slow run (keeps the default suite under 15 min)
def test_a_stop_persists_the_newest_snapshot_of_a_script_without_a_sigterm_handler(
    tmp_path: Path,
) -> None:
    """Ctrl-C/SIGTERM to ``trainguard run`` with the README script (no SIGTERM handler: the
    signal's default action kills the worker; disk only every 10th step): the newest
    snapshot in ckptd's memory is persisted on the way out, and a re-run resumes there."""
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippet().replace("steps = 100\n", "steps = 2000\n"))
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainguard", "run", "--run-dir", str(run_dir), "--config"]
    cmd += [str(cfg), str(script)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        wait_for(lambda: reached_step_events(run_dir, 35), 120, "step 35 in memory")
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
        job.wait()
    assert job.returncode == 128 + signal.SIGTERM, err[-2000:]
    stop = [e for e in events(run_dir) if e["kind"] == "planned_stop"]
    saved = stop[0]["saved_step"]
    staged = max(e["step"] for e in events(run_dir) if e["kind"] == "ckpt_staged")
    committed = storage.list_committed(run_dir / "checkpoints")
    assert len(stop) == 1 and saved == staged == committed[-1] >= 35, (stop, staged, committed)
    # The script reports a step (rt.step_end) before it saves it: SIGTERM in between costs
    # that one step, and the report says so. On a loaded machine the disk may also lag
    # (back-pressure, each skip said by an event): then up to max_skipped = 4 snapshots after
    # the saved one were skipped while both slots waited on the disk, and while one slot is
    # still pinned the other is rewritten every step, so a kill mid-copy also loses the
    # snapshot it was overwriting: at most 4 + 2 + 1 steps. Seen at 7 with two tests at once.
    evs = events(run_dir)
    skipped = [e["step"] for e in evs if e["kind"] == "ckpt_skipped" and e["step"] > saved]
    assert len(skipped) <= 4, skipped
    # ckptd verifies snapshots in order, newest first, beside a durable write; on a loaded
    # machine its verification can lag with no snapshot skipped too (seen: 7 steps, two tests
    # at once): the stop persists the newest *verified* one. max_skipped + 3 bounds both.
    lost = stop[0]["last_step"] - saved
    bound = 4 + 3
    assert stop[0]["steps_lost"] == lost and 0 <= lost <= bound, (stop, skipped)
    again = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "TRAINGUARD_CKPT_DIR": str(run_dir / "checkpoints")},
    )  # fmt: skip
    assert f"trainguard: rank 0 restored step {saved} from the durable tier" in again.stderr
