"""Chaos (issue 13): the GPT example under random faults of every kind, for minutes, then the
losses of a fault-free run for every step.

Faults, one every few seconds, each on a random target: SIGKILL and SIGSTOP of a worker, of
an agent (a lost node), of a ckptd (killed, or frozen for up to 20 s), of the controller
(frozen for up to 6 s); a flipped byte in a memory snapshot, a peer replica and a durable
step; once, SIGKILL of every process of the run and a re-run of its run dir. The seed is
printed (and taken from ``TRAINGUARD_CHAOS_SEED``); ``TRAINGUARD_CHAOS_S`` sets the length.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.conftest import (
    FAST_CONFIG,
    TINY,
    drop_segments,
    events,
    losses,
    report,
    run_job,
    start_job,
)
from tests.integration.test_own_faults import _flip, _flip_snapshot, _job, _kill_everything
from trainguard.checkpoint import snapshot, storage

# Long enough to outlast the faults on an idle machine too (1,000 steps took 75 s alone here:
# 8 faults, not the 10 the test asks for; under CI's second worker they take 3 minutes).
STEPS = 2500
ARGS = [*TINY, "--steps", str(STEPS), "--ckpt-every", "1", "--durable-every", "10"]
PACE = ["--inject", "slow:rank=0:factor=4"]  # ~4x longer steps: minutes of training
# The guards against scripts that never progress judge generations; chaos ends many of
# them early on purpose. Four durable steps kept: corrupt copies leave older good ones.
CONFIG = FAST_CONFIG + (
    "max_restarts = 1000\nno_progress_generations = 50\nuser_error_generations = 50\n"
    "keep_checkpoints = 4\n"
)
RUN = ["--nodes", "2", "--standby", "1", "--hang-timeout", "3", *PACE]


class Chaos:
    def __init__(self, run: Path, seed: int) -> None:
        self.run, self.rng = run, random.Random(seed)
        self.log: list[str] = [f"seed {seed}"]
        self.proc: subprocess.Popen[str] | None = None
        self.reruns = 0
        self.agent_kills = 0

    # ------------------------------------------------------------------ targets
    def _procs(self, needle: str) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if needle in cmd and str(self.run) in cmd:
                out.append(p)
        return out

    def _workers(self) -> list[int]:
        evs = [e for e in events(self.run) if e["kind"] in ("worker_started", "worker_resumed")]
        if not evs:
            return []
        gen = max(e["generation"] for e in evs)
        return [int(e["pid"]) for e in evs if e["generation"] == gen]

    def _signal(self, pid: int, sig: int) -> bool:
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False

    def _later(self, delay: float, fn: Callable[[], object]) -> None:
        def guarded() -> None:
            with contextlib.suppress(Exception):
                fn()

        t = threading.Timer(delay, guarded)
        t.daemon = True
        t.start()

    # ------------------------------------------------------------------ faults
    def worker_kill(self) -> str | None:
        pids = self._workers()
        if pids and self._signal(pid := self.rng.choice(pids), signal.SIGKILL):
            return f"SIGKILL worker {pid}"
        return None

    def worker_stop(self) -> str | None:
        pids = self._workers()
        if pids and self._signal(pid := self.rng.choice(pids), signal.SIGSTOP):
            return f"SIGSTOP worker {pid} (a hang)"
        return None

    def agent_kill(self) -> str | None:
        if self.agent_kills >= 2:
            return None
        agents = self._procs("trainguard agent")
        if not agents:
            return None
        p = self.rng.choice(agents)
        if self._signal(p.pid, signal.SIGKILL):
            self.agent_kills += 1
            return f"SIGKILL agent {p.pid} (a lost node)"
        return None

    def ckptd_kill(self) -> str | None:
        daemons = self._procs("trainguard.checkpoint.ckptd")
        if daemons and self._signal((p := self.rng.choice(daemons)).pid, signal.SIGKILL):
            return f"SIGKILL ckptd {p.pid}"
        return None

    def ckptd_freeze(self) -> str | None:
        daemons = self._procs("trainguard.checkpoint.ckptd")
        if not daemons:
            return None
        p, secs = self.rng.choice(daemons), self.rng.uniform(3.0, 20.0)
        if not self._signal(p.pid, signal.SIGSTOP):
            return None
        self._later(secs, lambda: self._signal(p.pid, signal.SIGCONT))
        return f"SIGSTOP ckptd {p.pid} for {secs:.1f}s"

    def controller_freeze(self) -> str | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        secs = self.rng.uniform(1.0, 6.0)
        pid = self.proc.pid
        self._signal(pid, signal.SIGSTOP)
        time.sleep(secs)
        self._signal(pid, signal.SIGCONT)
        return f"SIGSTOP controller for {secs:.1f}s"

    def _corrupt_snapshot(self, pattern: str) -> str | None:
        files = [
            p
            for p in Path("/dev/shm").glob(f"trainguard-{_job(self.run)}-{pattern}")
            if not p.name.endswith((".sum", ".tmp", ".pull")) and snapshot.peek_header(p)
        ]
        if not files:
            return None
        target = self.rng.choice(files)
        with contextlib.suppress(OSError, AssertionError):  # rewritten meanwhile: harmless
            step, _ = _flip_snapshot(target)
            return f"flipped a byte of {target.name} (step {step})"
        return None

    def corrupt_memory(self) -> str | None:
        return self._corrupt_snapshot("node*-r*-s[0-9]")

    def corrupt_replica(self) -> str | None:
        return self._corrupt_snapshot("node*-replica-r*")

    def corrupt_disk(self) -> str | None:
        root = self.run / "checkpoints"
        steps = storage.list_committed(root)
        if not steps:
            return None
        with contextlib.suppress(OSError, StopIteration):
            part = next(storage.step_dir(root, steps[-1]).rglob("*.distcp"))
            _flip(part, part.stat().st_size // 2)
            return f"flipped a byte of durable step {steps[-1]} ({part.name})"
        return None

    def kill_all_and_rerun(self) -> str | None:
        if self.reruns >= 1 or self.proc is None or self.proc.poll() is not None:
            return None
        _kill_everything(self.run, self.proc)
        self.reruns += 1
        self.proc = start_job(self.run, RUN, ARGS, config=CONFIG)
        return "SIGKILL of every process of the run; re-run of its run dir"

    # ------------------------------------------------------------------ driver
    def go(self, seconds: float) -> None:
        menu = [
            self.worker_kill, self.worker_stop, self.agent_kill, self.ckptd_kill,
            self.ckptd_freeze, self.controller_freeze, self.corrupt_memory,
            self.corrupt_replica, self.corrupt_disk, self.kill_all_and_rerun,
        ]  # fmt: skip
        self.proc = start_job(self.run, RUN, ARGS, config=CONFIG)
        t0 = time.monotonic()
        time.sleep(15.0)  # past start-up: the first checkpoints exist
        # Faults until the job ends (it is sized to outlast ~2 minutes of them) or time is up.
        while time.monotonic() - t0 < seconds and self.proc.poll() is None:
            fault = self.rng.choice(menu)
            what = fault()
            if what:
                self.log.append(f"{time.monotonic() - t0:6.1f}s {what}")
            time.sleep(self.rng.uniform(4.0, 10.0))

    def finish(self, timeout: float = 600.0) -> tuple[int, str]:
        assert self.proc is not None
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # the launcher, its agents, daemons and workers
            _kill_everything(self.run, self.proc)
            _, err = self.proc.communicate()
        return self.proc.returncode, err


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_chaos_of_every_fault_kind_ends_with_the_fault_free_losses(tmp_path: Path) -> None:
    seed = int(os.environ.get("TRAINGUARD_CHAOS_SEED", random.randrange(1 << 30)))
    seconds = float(os.environ.get("TRAINGUARD_CHAOS_S", "180"))
    run = tmp_path / "run"
    chaos = Chaos(run, seed)
    try:
        chaos.go(seconds)
        code, err = chaos.finish()
    finally:  # the launcher may have ended before its agents (a killed one leaves them)
        if chaos.proc is not None:
            _kill_everything(run, chaos.proc)
        drop_segments(f"trainguard-{_job(run)}-*")
    print("\n".join(chaos.log))
    why = "\n".join(chaos.log) + "\n" + err[-3000:]
    assert code == 0, why
    clean = run_job(tmp_path / "clean", ["--nodes", "2"], ARGS, timeout=600)
    assert clean.returncode == 0, clean.stderr[-3000:]
    want, got = losses(tmp_path / "clean"), losses(run)
    assert sorted(got) == list(range(1, STEPS + 1)), why
    bad = [s for s in want if got[s] != want[s]]
    assert not bad, f"steps whose loss differs from the fault-free run: {bad[:20]}\n{why}"
    assert len(chaos.log) > 10, why  # faults really happened: at least ten
    rep = report(run)
    assert rep["phase"] == "SUCCEEDED", why
    root = run / "checkpoints"
    assert storage.list_committed(root)[-1] == STEPS and not storage.verify(root, STEPS)
    kinds = {e["kind"] for e in events(run)}
    assert "generation_started" in kinds and "recovery_completed" in kinds, why
