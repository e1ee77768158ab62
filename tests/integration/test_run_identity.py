"""A step's parts always come from one run (issue 30, item 1), in every launch mode.

Each test runs a user's two-rank script (tests/helpers/userscripts/crash_between_parts.py)
that dies between the two parts of step 3 for real: rank 1's part is on disk, rank 0 is
SIGKILLed (by itself, or with every process of the job by the test) before it saves. A re-run
with other values, whose rank 1 saves late, commits step 3 again. The committed step must hold
only the re-run's parts: every part's ``.done`` and the manifest name the re-run's identity,
and the values every rank restores are the re-run's. Before run identities, the re-run's rank 0
merged its own part with the dead run's rank 1 part (same step, generation 0) into a step that
verified."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import (
    FAST_CONFIG,
    ROOT,
    drop_segments,
    events,
    run_process,
    trainguard_cmd,
    wait_for,
)
from trainguard.checkpoint import storage

SCRIPT = ROOT / "tests" / "helpers" / "userscripts" / "crash_between_parts.py"
STEP = 3  # the step the first run dies in; the re-run ends there


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_all(tag: str) -> None:
    """SIGKILL every process of the test whose command line or environment names ``tag``
    (a whole job: launcher, controller, agents, ckptds, workers) and reap ours."""
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    for p in psutil.process_iter():
        if p.pid not in mine and run_process(p, tag):
            with contextlib.suppress(psutil.Error):
                p.kill()


@pytest.fixture
def job_teardown(tmp_path: Path) -> Iterator[None]:
    """Whatever a test of a supervised job ends with (a failed assertion, a timeout): every
    process of it killed and its /dev/shm slots removed (a killed job's ckptd leaves them)."""
    yield
    _kill_all(str(tmp_path))
    drop_segments(
        f"trainguard-{hashlib.sha1(str((tmp_path / 'run').resolve()).encode()).hexdigest()[:8]}-*"
    )


def _writer(part: Path) -> dict[str, Any]:
    return dict(json.loads((part / ".done").read_text()).get("writer", {}))


def _leftover_run(root: Path) -> tuple[str, int]:
    """The run id and generation of the dead run's part of STEP (rank 1's, left in its temp
    directory): the identity no part of the committed step may carry."""
    (part,) = root.glob(f".tmp-step_{STEP}-*/rank_1")
    assert not (part.parent / "rank_0" / ".done").exists()  # died between the parts
    w = _writer(part)
    return str(w.get("run_id", "")), int(w.get("generation", -1))


def _check_one_run(root: Path, dead: tuple[str, int], loaded: list[dict[str, Any]]) -> None:
    """Step STEP holds the re-run's parts only, and every rank restores the re-run's values.
    ``dead``: the dead run's (run id, generation); a restarted controller goes on with its run
    id in a new generation, a re-run of ``trainguard run`` or a new launch draws a new id."""
    by_rank = {d["rank"]: d for d in loaded}
    for r in (0, 1):
        d = by_rank[r]
        assert d["step"] == STEP and d["w_uniform"], d
        assert (d["w"], d["v"]) == (2000 + STEP, 2000 + STEP + r / 2), d  # the re-run's
    final = storage.step_dir(root, STEP)
    manifest = json.loads((final / "manifest.json").read_text())
    writers = [_writer(final / f"rank_{r}") for r in (0, 1)]
    ident = (manifest["run_id"], manifest["generation"])
    assert ident != dead, (ident, dead)
    assert [(w["run_id"], w["generation"]) for w in writers] == [ident] * 2, (manifest, writers)
    assert [w["step"] for w in writers] == [STEP, STEP]
    assert not storage.verify(root, STEP)
    assert not list(root.glob(".tmp-step_*")), list(root.iterdir())  # the leftover is gone


def _standalone(tmp: Path, *args: str, root: Path | None = None) -> list[subprocess.Popen[str]]:
    """Two ranks started the way a user's own launcher does: RANK/WORLD_SIZE/MASTER_* set,
    the script joins the process group itself; checkpoints in ``root`` (default tmp/ckpt)."""
    port = str(_port())
    procs = []
    for r in (0, 1):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        cmd = [sys.executable, str(SCRIPT), "--pg", "--root", str(root or tmp / "ckpt"), *args]
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )  # fmt: skip
        )
    return procs


def _outputs(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[str]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-2000:]
        outs.append(out)
    return outs


def _loaded(outs: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for o in outs for line in o.splitlines() if line.startswith("{")]


def test_standalone_ranks_never_merge_a_dead_runs_part(tmp_path: Path) -> None:
    first = _standalone(tmp_path, "--value", "1", "--steps", str(STEP), "--crash-at", str(STEP))
    try:
        assert first[0].wait(timeout=120) == -signal.SIGKILL, first[0].communicate()[1][-2000:]
    finally:
        first[1].kill()  # as a launcher does when a rank dies
        for p in first:
            p.communicate()
    dead = _leftover_run(tmp_path / "ckpt")
    _outputs(_standalone(tmp_path, "--value", "2", "--steps", str(STEP), "--slow-rank", "1"))
    loaded = _loaded(_outputs(_standalone(tmp_path, "--load")))
    _check_one_run(tmp_path / "ckpt", dead, loaded)


def _torchrun(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(SCRIPT), "--pg", "--root", str(tmp / "ckpt"), *args]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=180)


@pytest.mark.slow  # the default run has the user-launcher case; torchrun's in CI's slow run
def test_torchrun_ranks_never_merge_a_dead_runs_part(tmp_path: Path) -> None:
    res = _torchrun(tmp_path, "--value", "1", "--steps", str(STEP), "--crash-at", str(STEP))
    assert res.returncode != 0 and (tmp_path / "between-parts").exists(), res.stderr[-2000:]
    dead = _leftover_run(tmp_path / "ckpt")
    res = _torchrun(tmp_path, "--value", "2", "--steps", str(STEP), "--slow-rank", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    res = _torchrun(tmp_path, "--load")
    assert res.returncode == 0, res.stderr[-2000:]
    _check_one_run(tmp_path / "ckpt", dead, _loaded([res.stdout]))


def _tg_run(tmp: Path, *args: str) -> subprocess.Popen[str]:
    (tmp / "job.toml").write_text(FAST_CONFIG)
    cmd = trainguard_cmd("run", "--run-dir", tmp / "run", "--config", tmp / "job.toml",
                         "--nproc-per-node", "2", SCRIPT, "--pg", *args)  # fmt: skip
    return subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _killed_between_parts(tmp: Path, proc: subprocess.Popen[str]) -> None:
    """Wait until the job is between the parts of STEP, then SIGKILL every process of it."""
    try:
        wait_for(lambda: (tmp / "between-parts").exists() or proc.poll() is not None, 120,
                 "the job to reach the gap between its parts")  # fmt: skip
        assert proc.poll() is None, proc.communicate()[1][-2000:]
    finally:
        _kill_all(str(tmp))
        proc.communicate(timeout=30)


def _load_both(tmp: Path, root: Path) -> list[dict[str, Any]]:
    """What each of two ranks restores from ``root`` (a user's launcher, a process group)."""
    return _loaded(_outputs(_standalone(tmp, "--load", root=root)))


@pytest.mark.slow  # ~20 s: CI's slow run (the default suite stays under 15 min)
@pytest.mark.usefixtures("job_teardown")
def test_a_rerun_of_a_run_dir_killed_between_parts_commits_only_its_own(tmp_path: Path) -> None:
    args = ["--value", "1", "--steps", str(STEP), "--crash-at", str(STEP), "--crash", "hold"]
    _killed_between_parts(tmp_path, _tg_run(tmp_path, *args))
    root = tmp_path / "run" / "checkpoints"
    dead = _leftover_run(root)
    proc = _tg_run(tmp_path, "--value", "2", "--steps", str(STEP), "--slow-rank", "1")
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-2000:]
    assert len([e for e in events(tmp_path / "run") if e["kind"] == "job_started"]) == 2
    _check_one_run(root, dead, _load_both(tmp_path, root))


def _controller_agent(tmp: Path, **env: str) -> list[subprocess.Popen[str]]:
    """``trainguard controller`` and one ``trainguard agent``, started apart (as on a cluster),
    with the same command each run; ``env`` (the script's CBP_* settings) goes to the agent,
    whose workers inherit it."""
    run = tmp / "run"
    (tmp / "job.toml").write_text(FAST_CONFIG)
    ctl = subprocess.Popen(
        trainguard_cmd("controller", "--bind", "127.0.0.1:0", "--run-dir", run, "--config",
                       tmp / "job.toml", "--nodes", "1", "--nproc-per-node", "2", SCRIPT, "--pg",
                       "--steps", str(STEP)),
        cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def addr() -> str | None:
        assert ctl.poll() is None, ctl.communicate()[1][-2000:]
        try:
            info = json.loads((run / "controller.json").read_text())
            return str(info["addr"]) if info["pid"] == ctl.pid else None
        except (OSError, ValueError, KeyError):
            return None

    agent = subprocess.Popen(
        trainguard_cmd("agent", "--controller", wait_for(addr, 60, "the controller to listen"),
                       "--token-file", run / "token", "--node-id", "n0", "--advertise-addr",
                       "127.0.0.1", "--run-dir", run),
        env={**os.environ, **env}, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return [ctl, agent]


@pytest.mark.slow
@pytest.mark.usefixtures("job_teardown")
def test_controller_and_agent_killed_between_parts_rerun_commits_only_its_own(
    tmp_path: Path,
) -> None:
    ctl, agent = _controller_agent(
        tmp_path, CBP_VALUE="1", CBP_CRASH_AT=str(STEP), CBP_CRASH="hold"
    )
    try:
        _killed_between_parts(tmp_path, ctl)
    finally:
        agent.communicate(timeout=30)
    root = tmp_path / "run" / "checkpoints"
    dead = _leftover_run(root)
    ctl, agent = _controller_agent(tmp_path, CBP_VALUE="2", CBP_SLOW_RANK="1")
    _, err = ctl.communicate(timeout=240)
    agent.communicate(timeout=60)
    assert ctl.returncode == 0, err[-2000:]
    _check_one_run(root, dead, _load_both(tmp_path, root))
