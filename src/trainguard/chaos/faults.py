"""Chaos: random faults of a running trainguard job's workers and of trainguard's own parts.

The menu (``FaultMenu``): SIGKILL and SIGSTOP of a worker; SIGKILL of an agent (a lost node,
at most two per run); SIGKILL of a ckptd, or SIGSTOP of one for 3–20 s then SIGCONT; SIGSTOP of
the controller for 1–6 s; a flipped byte in a memory snapshot, in a peer's replica and in the
newest durable step; once, SIGKILL of every process of the run and a re-run of its run dir.
Each fault picks its target with the menu's seeded ``random.Random``, so a seed replays the
same choices (not the same timing: the job's processes race the faults).

Also the process and /dev/shm helpers a chaos run (``chaos/run.py``) and the tests of
trainguard's own faults use: which processes belong to a run dir, kill them all, drop the
run's memory segments, flip a byte of a snapshot or a file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import psutil

SHM = Path("/dev/shm")
MAX_AGENT_KILLS = 2  # lost nodes per run: the pool (2 nodes, 1 standby) refills from reboots
MAX_RERUNS = 1
CKPTD_FREEZE_S = (3.0, 20.0)
CONTROLLER_FREEZE_S = (1.0, 6.0)
KILL_TIMEOUT_S = 60.0


class ChaosError(RuntimeError):
    """A chaos run could not do what it must: processes of a run outlived SIGKILL, a job did
    not end by its deadline."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One fault injected."""

    t_s: float  # seconds since the chaos job first started
    kind: str  # one of FAULT_KINDS
    what: str  # its target, e.g. "SIGKILL worker 4242"


# --------------------------------------------------------------------------- run dir helpers
def job_id(run_dir: Path) -> str:
    """The run's name in /dev/shm: ``trainguard-<job id>-…`` (sha1 of the resolved run dir)."""
    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]


def drop_segments(run_dir: Path) -> list[str]:
    """Remove the run's /dev/shm entries (slots are files, a standby's prefetched step a
    directory): what a killed node leaves in memory. Returns the names removed."""
    gone = []
    for seg in SHM.glob(f"trainguard-{job_id(run_dir)}-*"):
        if seg.is_dir():
            shutil.rmtree(seg, ignore_errors=True)
        else:
            seg.unlink(missing_ok=True)
        gone.append(seg.name)
    return gone


class _Tails:
    """JSON-lines files that only grow, parsed incrementally: each read parses the complete
    lines appended since the last (a poll at 20 Hz re-parsing a whole 0.5 MB events.jsonl
    took 60% of a core beside the job it waited on). A file replaced (another inode, or the
    same inode number reused with other first bytes) or shorter than what was read is parsed
    again from its start; the newest ``KEEP`` files are remembered. Thread-safe."""

    KEEP = 16
    HEAD = 64  # bytes of a file's start kept to know it again

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (path, parse) -> ((device, inode, first bytes), offset read up to, parsed lines)
        self._files: dict[
            tuple[Path, Callable[[Any], Any]], tuple[tuple[int, int, bytes], int, list[Any]]
        ] = {}

    def read(self, path: Path, parse: Callable[[Any], Any]) -> list[Any]:
        """``parse(json.loads(line))`` of every complete line (a line being written, or one
        that ``parse`` rejects with ValueError, KeyError or TypeError, is skipped); [] before
        the file exists."""
        try:
            f = open(path, "rb")  # noqa: SIM115  (closed below, after the lock)
        except FileNotFoundError:
            return []
        with f, self._lock:
            st = os.fstat(f.fileno())
            key = (path, parse)
            ident = (st.st_dev, st.st_ino, os.pread(f.fileno(), self.HEAD, 0))
            was, offset, items = self._files.pop(key, ((-1, -1, b""), 0, []))
            same = was[:2] == ident[:2] and ident[2].startswith(was[2])  # the head may grow
            if not same or st.st_size < offset:
                offset, items = 0, []
            f.seek(offset)
            data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    items.append(parse(json.loads(line)))
            self._files[key] = (ident, offset + end, items)
            while len(self._files) > self.KEEP:
                del self._files[next(iter(self._files))]
            return list(items)


_TAILS = _Tails()


def _event(rec: Any) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise TypeError(rec)
    return rec


def _metric(rec: Any) -> tuple[int, float, float]:
    return int(rec["step"]), float(rec["loss"]), float(rec.get("time", 0.0))


def events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events.jsonl (a line being written right now is skipped); [] before any.
    The dicts are shared between calls: copy one before changing it."""
    return _TAILS.read(run_dir / "events.jsonl", _event)


def losses(run_dir: Path) -> dict[int, float]:
    """Per-step loss from metrics.jsonl; after a restart the last line for a step counts.
    {} when the run wrote none."""
    return {s: loss for s, loss, _ in metrics(run_dir)}


def metrics(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, loss, wall time in s since the epoch) of every line of metrics.jsonl, in the
    order written (a step redone after a restart appears again)."""
    return _TAILS.read(run_dir / "metrics.jsonl", _metric)


def _belongs(p: psutil.Process, tag: str) -> bool:
    """Does ``p`` name ``tag`` in its command line or environment? (False for one gone or not
    readable.)"""
    try:
        return tag in " ".join(p.cmdline()) or any(tag in v for v in p.environ().values())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every process of the run in ``run_dir`` (launcher, agents, ckptds, workers, spares),
    not this process nor its ancestors."""
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    tag = str(run_dir)
    return [p for p in psutil.process_iter() if p.pid not in mine and _belongs(p, tag)]


def kill_everything(run_dir: Path, timeout_s: float = KILL_TIMEOUT_S) -> None:
    """SIGKILL every process of the run at once, again until none is left (one that a live
    agent started between the scan and its own death names the run dir too). Raises
    ChaosError when some are still there after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while victims := run_processes(run_dir):
        if time.monotonic() > deadline:
            raise ChaosError(f"processes of {run_dir} outlive SIGKILL: {victims}")
        for p in victims:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(victims, timeout=max(0.1, min(10.0, deadline - time.monotonic())))


def flip(path: Path, offset: int) -> None:
    """Invert the byte at ``offset`` of the file ``path``. Raises OSError."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def flip_snapshot(path: Path) -> tuple[int, int]:
    """Flip a byte in the middle of the largest tensor of a snapshot file; returns its (step,
    generation). Raises OSError, or ChaosError when ``path`` holds no snapshot."""
    from trainguard.checkpoint import snapshot

    h = snapshot.peek_header(path)
    if h is None:
        raise ChaosError(f"{path}: no snapshot header")
    t = max(h["layout"]["tensors"], key=lambda e: e["nbytes"])
    flip(path, t["offset"] + t["nbytes"] // 2)
    return int(h["step"]), int(h["generation"])


# --------------------------------------------------------------------------- the menu
class Job(Protocol):
    """What the menu needs of the job under chaos."""

    run_dir: Path

    def launcher_pid(self) -> int | None:
        """The pid of the running ``trainguard run`` (its controller), or None once it ended."""
        ...

    def rerun(self) -> None:
        """Start ``trainguard run`` again on the same run dir (after ``kill_everything``)."""
        ...


FAULT_KINDS = (
    "worker_kill", "worker_stop", "agent_kill", "ckptd_kill", "ckptd_freeze",
    "controller_freeze", "corrupt_memory", "corrupt_replica", "corrupt_disk", "kill_all_rerun",
)  # fmt: skip


class FaultMenu:
    """The faults, each a method named as in FAULT_KINDS returning what it did, or None when
    it found no target (that kind's processes or files are not there right now)."""

    def __init__(self, job: Job, rng: random.Random) -> None:
        self.job, self.rng = job, rng
        self.agent_kills = 0
        self.reruns = 0
        self._timers: list[threading.Timer] = []

    def close(self) -> None:
        """Cancel pending SIGCONTs (the caller kills the run's processes anyway)."""
        for t in self._timers:
            t.cancel()
            t.join(timeout=5.0)

    def inject(self) -> tuple[str, str] | None:
        """One fault of a random kind: (kind, what), or None when it found no target."""
        kind = self.rng.choice(FAULT_KINDS)
        what: str | None = getattr(self, kind)()
        return None if what is None else (kind, what)

    # ------------------------------------------------------------------ targets
    def _procs(self, needle: str) -> list[psutil.Process]:
        tag = str(self.job.run_dir)
        out = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if needle in cmd and tag in cmd:
                out.append(p)
        return out

    def _workers(self) -> list[int]:
        evs = [
            e for e in events(self.job.run_dir) if e["kind"] in ("worker_started", "worker_resumed")
        ]
        if not evs:
            return []
        gen = max(e["generation"] for e in evs)
        return [int(e["pid"]) for e in evs if e["generation"] == gen]

    @staticmethod
    def _signal(pid: int, sig: int) -> bool:
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False

    def _later(self, delay_s: float, fn: Callable[[], object]) -> None:
        t = threading.Timer(delay_s, fn)
        t.name, t.daemon = "chaos-later", True
        t.start()
        self._timers.append(t)

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
        if self.agent_kills >= MAX_AGENT_KILLS:
            return None
        agents = self._procs("trainguard agent")
        if agents and self._signal((p := self.rng.choice(agents)).pid, signal.SIGKILL):
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
        p, secs = self.rng.choice(daemons), self.rng.uniform(*CKPTD_FREEZE_S)
        if not self._signal(p.pid, signal.SIGSTOP):
            return None
        self._later(secs, lambda: self._signal(p.pid, signal.SIGCONT))
        return f"SIGSTOP ckptd {p.pid} for {secs:.1f}s"

    def controller_freeze(self) -> str | None:
        pid = self.job.launcher_pid()
        if pid is None:
            return None
        secs = self.rng.uniform(*CONTROLLER_FREEZE_S)
        if not self._signal(pid, signal.SIGSTOP):
            return None
        try:
            time.sleep(secs)
        finally:  # Ctrl-C meanwhile: the controller is not left frozen
            self._signal(pid, signal.SIGCONT)
        return f"SIGSTOP controller {pid} for {secs:.1f}s"

    def _corrupt_snapshot(self, pattern: str) -> str | None:
        from trainguard.checkpoint import snapshot

        files = [
            p
            for p in SHM.glob(f"trainguard-{job_id(self.job.run_dir)}-{pattern}")
            if not p.name.endswith((".sum", ".tmp", ".pull")) and snapshot.peek_header(p)
        ]
        if not files:
            return None
        target = self.rng.choice(files)
        with contextlib.suppress(OSError, ChaosError):  # rewritten meanwhile: harmless
            step, _ = flip_snapshot(target)
            return f"flipped a byte of {target.name} (step {step})"
        return None

    def corrupt_memory(self) -> str | None:
        return self._corrupt_snapshot("node*-r*-s[0-9]")

    def corrupt_replica(self) -> str | None:
        return self._corrupt_snapshot("node*-replica-r*")

    def corrupt_disk(self) -> str | None:
        from trainguard.checkpoint import storage

        root = self.job.run_dir / "checkpoints"
        steps = storage.list_committed(root)
        if not steps:
            return None
        with contextlib.suppress(OSError, StopIteration):  # deleted meanwhile: harmless
            part = next(storage.step_dir(root, steps[-1]).rglob("*.distcp"))
            flip(part, part.stat().st_size // 2)
            return f"flipped a byte of durable step {steps[-1]} ({part.name})"
        return None

    def kill_all_rerun(self) -> str | None:
        if self.reruns >= MAX_RERUNS or self.job.launcher_pid() is None:
            return None
        kill_everything(self.job.run_dir)
        self.reruns += 1
        self.job.rerun()
        return "SIGKILL of every process of the run; re-run of its run dir"
