"""Worker processes of one node: warm spares, live workers, and their kill path.

Every worker runs in its own session (``start_new_session``), so its process group
holds it and the children it forks (data-loader workers); stopping a worker signals
the whole group. The agent is a child subreaper, so orphaned grandchildren are
reparented to it and reaped here, leaving no zombie.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import psutil

from trainguard.agent.spare import TITLE_ROOM
from trainguard.protocol import WorkerReport, clock
from trainguard.protocol.worker import Heartbeat

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make orphaned descendants reparent to this process (Linux; no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


@dataclasses.dataclass(kw_only=True, slots=True)
class Worker:
    """A live worker of the current generation as the agent tracks it (monotonic times)."""

    rank: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    error_file: Path
    started_mono: float
    state: str = "running"
    exit_code: int | None = None
    exited_at: float | None = None
    error: str | None = None
    step: int | None = None
    last_progress_mono: float | None = None
    last_progress_at: float | None = None
    last_hb_mono: float | None = None
    coll: tuple[int, int] | None = None  # collectives (issued, done), from its heartbeats
    fingerprint: int | None = None  # where its main thread was at the last heartbeat
    main_cpu_s: float | None = None  # CPU seconds of its main thread at the last heartbeat
    total_steps: int | None = None  # the step the script said it ends at
    # The outside view (agent/outside.py): process state and its tree's CPU time.
    proc_state: str | None = None  # psutil status; "stopped" for SIGSTOP / ptrace stop
    in_trainguard_mono: float | None = None  # its last keep-alive: waiting on trainguard
    script_started_mono: float | None = None  # its spare opened the rank's log: the script runs
    stopped_since_mono: float | None = None
    tree_cpu_s: float | None = None
    cpu_checked_mono: float | None = None
    cpu_progress_mono: float | None = None  # when its process tree last used CPU
    durations: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=64)
    )
    # In-process recovery (agent/inprocess.py): the script runs under trainguard.run; the
    # address its datagrams come from (Abort and Resume go there); the environment it runs
    # with; the generation its process ran before it was resumed into this one.
    inprocess: bool = False
    addr: tuple[str, int] | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    resumed_from: int | None = None
    parked_at: float | None = None  # wall clock, when it said it parked

    def observe(self, now_mono: float) -> WorkerReport:
        """The worker as the controller receives it (its report's ``workers`` entry)."""
        ref = self.last_progress_mono if self.last_progress_mono is not None else self.started_mono
        return WorkerReport(
            rank=self.rank,
            local_rank=self.local_rank,
            pid=self.proc.pid,
            state=self.state,
            exit_code=self.exit_code,
            error=self.error,
            step=self.step,
            progress_age_s=now_mono - ref,
            heartbeat_age_s=None if self.last_hb_mono is None else now_mono - self.last_hb_mono,
            exited_at=self.exited_at,
            last_progress_at=self.last_progress_at,
            coll=list(self.coll) if self.coll is not None else None,
            total_steps=self.total_steps,
            proc_state=self.proc_state,
            in_trainguard=self.in_trainguard_mono is not None
            and now_mono - self.in_trainguard_mono < IN_TRAINGUARD_S,
            cpu_idle_s=None
            if self.cpu_progress_mono is None
            else max(0.0, now_mono - self.cpu_progress_mono),
            runtime=self.last_hb_mono is not None,
            inprocess=self.inprocess,
            resumed_from=self.resumed_from,
            parked_at=self.parked_at,
        )

    def read_error(self) -> str | None:
        """First failure's exception and traceback from the error file, else the log's tail
        (None for a death by signal: the log says nothing about it)."""
        try:
            msg = json.loads(self.error_file.read_text())["message"]
            return f"{msg['message']}\n{msg.get('extraInfo', {}).get('py_callstack', '')}".strip()
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if self.exit_code is not None and self.exit_code < 0:
            return None
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return None
        tail = [ln for ln in lines[-20:] if ln.strip()]
        return ("no traceback; last lines of its log:\n" + "\n".join(tail)) if tail else None


# A main thread that used at least this share of one core between two heartbeats is working
# (an evaluation loop of short forwards and sleeps uses ~0.05%–1%); one blocked in a
# collective or a lock, or sleeping in a loop, uses ~0.001%.
WORKING_CPU_SHARE = 1e-4
# A rank that sent a keep-alive this recently is waiting inside trainguard (it sends one every
# second while a call to its ckptd is in flight: checkpoint/backend.KEEPALIVE_S).
IN_TRAINGUARD_S = 10.0


def working(w: Worker, beat: Heartbeat, since_s: float) -> bool:
    """Does heartbeat ``beat`` show a rank that is neither stuck nor idle: its main thread
    moved to other code or used CPU since the last beat (``since_s`` ago), and no collective
    it issued is outstanding (the collective sequence numbers)? Updates ``w``'s record."""
    fp, cpu = beat.fingerprint, beat.cpu_s
    moved = fp is not None and w.fingerprint is not None and fp != w.fingerprint
    busy = (
        cpu is not None
        and w.main_cpu_s is not None
        and cpu - w.main_cpu_s >= WORKING_CPU_SHARE * since_s
    )
    w.fingerprint, w.main_cpu_s = fp, cpu
    stuck = w.coll is not None and w.coll[0] > w.coll[1]
    return (moved or busy) and not stuck


class SparePool:
    """Pre-started spare workers (agent/spare.py), handed out in FIFO order."""

    def __init__(self, env: dict[str, str], log: IO[bytes]) -> None:
        self._env = {**env, "TRAINGUARD_AGENT_PID": str(os.getpid())}
        self._log = log
        self._ready: collections.deque[subprocess.Popen[bytes]] = collections.deque()

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "trainguard.agent.spare", TITLE_ROOM],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=self._log,
            env=self._env,
            start_new_session=True,
            close_fds=True,
        )

    def fill(self, n: int) -> None:
        """Start spares until ``n`` are ready (dead ones are dropped first)."""
        alive = [p for p in self._ready if p.poll() is None]
        self._ready = collections.deque(alive)
        while len(self._ready) < n:
            self._ready.append(self._spawn())

    def take(self) -> subprocess.Popen[bytes]:
        while self._ready:
            p = self._ready.popleft()
            if p.poll() is None:
                return p
        return self._spawn()

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self._ready}

    def close(self) -> None:
        """Kill every spare (SIGKILL to its group) and reap it (5 s deadline each)."""
        procs = list(self._ready)
        self._ready.clear()
        kill_groups(procs, grace_s=0.0)


def launch(proc: subprocess.Popen[bytes], spec: dict[str, Any]) -> None:
    """Hand a spare its rank's spec. Raises OSError if the spare died meanwhile."""
    assert proc.stdin is not None
    proc.stdin.write((json.dumps(spec) + "\n").encode())
    proc.stdin.close()


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def kill_groups(procs: list[subprocess.Popen[bytes]], *, grace_s: float) -> None:
    """SIGTERM (+SIGCONT, so stopped processes act on it) each process group, wait up to
    ``grace_s``, then SIGKILL the groups and reap every process (5 s deadline)."""
    live = [p for p in procs if p.poll() is None]
    if grace_s > 0:
        for p in live:
            _signal_group(p.pid, signal.SIGTERM)
            _signal_group(p.pid, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(0.02)
    for p in procs:
        _signal_group(p.pid, signal.SIGKILL)  # the group may hold children even after p exited
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL'd but stuck in D state
            p.wait(timeout=5.0)


def clean_descendants(keep: set[int]) -> list[int]:
    """SIGKILL every descendant of this process not in ``keep`` (and not a child of one
    in ``keep``), then reap zombies. Returns the pids killed."""
    me = psutil.Process()
    killed = []
    kept_children = set()
    for pid in keep:
        with contextlib.suppress(psutil.NoSuchProcess):
            kept_children.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    for child in me.children(recursive=True):
        if child.pid in keep or child.pid in kept_children:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                child.kill()
                killed.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    deadline = time.monotonic() + 5.0
    for child in me.children(recursive=False):
        if child.pid in keep:
            continue
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child.pid, 0 if time.monotonic() < deadline else os.WNOHANG)
    return killed


def drop_orphan_semaphores(shm: Path = Path("/dev/shm"), min_age_s: float = 5.0) -> list[str]:
    """Unlink Python multiprocessing's named semaphores (``sem.mp-*``) that no live process
    maps: those of SIGKILLed workers, whose resource tracker died with them (a spawn
    DataLoader leaves a few per killed rank). A semaphore in use is mapped by its users, so an
    unmapped one is no one's. Matched by inode, not by name: glibc's ``sem_open`` maps a
    temporary file and links it to the name after, so the creator's ``/proc/PID/maps`` names
    ``sem.XXXXXX (deleted)`` (matching names removed live semaphores of other jobs on the
    host). One younger than ``min_age_s`` seconds is left (made a moment ago). Returns the
    names removed."""
    now = clock.wall()
    inodes: dict[str, int] = {}
    for f in shm.glob("sem.mp-*"):
        with contextlib.suppress(OSError):
            st = f.stat()
            if now - st.st_mtime >= min_age_s:
                inodes[f.name] = st.st_ino
    if not inodes:
        return []
    mapped: set[int] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                if "/sem." in line:  # address perms offset dev inode path
                    fields = line.split()
                    if len(fields) >= 6 and fields[4].isdigit():
                        mapped.add(int(fields[4]))
    gone = sorted(n for n, ino in inodes.items() if ino not in mapped)
    for n in gone:
        with contextlib.suppress(OSError):
            (shm / n).unlink()
    return gone


def _short_native(line: str) -> str:
    """A native frame's C++ template arguments folded to ``<…>`` (a bernoulli kernel's frame
    is 1,500 characters of them); Python frames (``<module>``, ``<lambda>``) are left as
    they are, and a line stays under 300 characters."""
    out: list[str] = []
    depth = 0
    for i, ch in enumerate(line):
        if ch == "<" and (depth or (i and (line[i - 1].isalnum() or line[i - 1] in "_:"))):
            depth += 1
            if depth == 1:
                out.append("<…")
            continue
        if ch == ">" and depth:
            depth -= 1
            if depth == 0:
                out.append(">")
            continue
        if not depth:
            out.append(ch)
    text = "".join(out)
    return text if len(text) <= 300 else text[:299] + "…"


def _py_spy(exe: str, pid: int, deadline: float) -> str:
    """One process's stack: with native frames first (what a thread blocked in C++ waits for:
    a mutex, the GIL, a socket), else Python frames only (a normal dump suspends the process
    briefly and is consistent), else — for a stopped process, which py-spy cannot suspend —
    non-blocking reads, retried because a read can race with the running interpreter. The
    native try gets at most half the time left, so the others still have theirs."""
    text = "no stack: py-spy did not answer in time"
    tries = (["--native"], [], ["--nonblocking"], ["--nonblocking"], ["--nonblocking"])
    for flags in tries:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            res = subprocess.run(
                [exe, "dump", *flags, "--pid", str(pid)],
                capture_output=True,
                timeout=left / 2 if flags == ["--native"] else left,
            )
        except subprocess.TimeoutExpired:
            if flags == ["--native"]:
                continue
            break
        text = (res.stdout + res.stderr).decode(errors="replace")
        if res.returncode == 0 and "Thread" in text:
            return "\n".join(_short_native(line) for line in text.splitlines())
    return text


def dump_stacks(pids: dict[int, int], *, timeout_s: float = 10.0) -> dict[int, str]:
    """py-spy stack dumps of each process (rank → pid), in parallel, within one deadline.

    Returns rank → stack text (or why there is none: py-spy missing, timeout, process
    gone). Never raises.
    """
    import concurrent.futures
    import shutil

    exe = shutil.which("py-spy")
    if exe is None:
        return {r: "no stack: py-spy is not installed (pip install py-spy)" for r in pids}
    deadline = time.monotonic() + timeout_s
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, len(pids)), thread_name_prefix="py-spy"
    ) as ex:
        futures = {r: ex.submit(_py_spy, exe, pid, deadline) for r, pid in pids.items()}
        return {r: f.result() for r, f in futures.items()}
