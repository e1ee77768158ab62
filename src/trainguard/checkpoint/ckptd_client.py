"""The client side of ckptd (``ckptd.py``): its socket's name, a connection with deadlines,
and ``spawn``. Imports no torch: the agent, which starts and watches ckptd, uses only this.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import psutil

from trainguard.checkpoint.api import CheckpointError
from trainguard.protocol.ckptd import ErrorReply, Request, reply_from_json, request_to_json

R = TypeVar("R")

__all__ = [
    "CheckpointError", "CkptdClient", "address", "node_daemon", "socket_name", "spawn",
]  # fmt: skip


def socket_name(job: str, node: str) -> str:
    """The daemon's socket as ``@name`` (printable, fits in an environment variable)."""
    return f"@trainguard-ckptd-{job}-{node}"


def address(name: str) -> str:
    """``@name`` → Linux abstract-namespace address (leading NUL)."""
    return "\0" + name[1:] if name.startswith("@") else name


def spawn(
    *,
    job: str,
    node: str,
    ckpt_dir: Path,
    shm_dir: Path,
    keep: int,
    log: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 30.0,
    replica_bind: str | None = None,
    idle: Callable[[], None] = lambda: None,
) -> subprocess.Popen[bytes]:
    """Start a ckptd process and wait (``timeout_s``) until it accepts connections, calling
    ``idle`` while it waits (the agent keeps reading its workers' reports meanwhile).

    ``timeout_s`` is the wait for a ckptd that makes no progress; one still starting (using
    CPU, or runnable on a loaded machine) is waited for up to ``START_CAP_S`` seconds.
    Raises CheckpointError, naming why and its log, if it exits or does not listen in time
    (it is killed then).
    """
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainguard.checkpoint.ckptd",
                "--job",
                job,
                "--node",
                node,
                "--ckpt-dir",
                str(ckpt_dir),
                "--shm-dir",
                str(shm_dir),
                "--keep",
                str(keep),
                *(["--replica-bind", replica_bind] if replica_bind else []),
            ],
            stdout=f,
            stderr=f,
            env=env,
        )
    try:
        why = _wait_listening(proc, job, node, timeout_s, START_CAP_S, idle)
    except BaseException:  # ``idle`` raised, or an interrupt: no ckptd left unowned
        _kill(proc)
        raise
    if why is None:
        return proc
    _kill(proc)
    raise CheckpointError(f"ckptd for {node} did not start: {why}; see {log}")


START_CAP_S = 120.0  # a ckptd still starting (using CPU) is waited for this long at most


def _wait_listening(
    proc: subprocess.Popen[bytes],
    job: str,
    node: str,
    timeout_s: float,
    cap_s: float,
    idle: Callable[[], None],
) -> str | None:
    """None once ``proc`` accepts connections; else why it never will: it exited, it made no
    progress by ``timeout_s`` (no CPU time used in the last ``timeout_s / 4`` seconds and not
    runnable: SIGSTOPped, frozen, blocked), or it still did not listen after ``cap_s``. A
    start slowed by a loaded machine (its imports take CPU it gets little of) is waited for
    while it progresses: killing it would start the same imports again from nothing."""
    t0 = time.monotonic()
    window = max(timeout_s / 4.0, 0.5)
    seen_cpu, progressed = -1.0, t0
    try:
        ps = psutil.Process(proc.pid)
    except psutil.Error:
        ps = None
    while proc.poll() is None:
        try:
            CkptdClient(socket_name(job, node), timeout_s=1.0).close()
            return None
        except OSError:
            pass
        now = time.monotonic()
        if ps is not None:
            with contextlib.suppress(psutil.Error):
                cpu = sum(ps.cpu_times()[:2])
                if cpu > seen_cpu or ps.status() == psutil.STATUS_RUNNING:
                    seen_cpu, progressed = cpu, now
        if now - t0 >= max(cap_s, timeout_s):
            return f"not listening after {now - t0:.0f}s while still starting"
        if now - t0 >= timeout_s and now - progressed >= window:
            return (
                f"not listening after {now - t0:.0f}s, no progress for the last "
                f"{now - progressed:.1f}s (stopped, frozen or blocked)"
            )
        idle()
        time.sleep(0.02)
    return f"it exited with code {proc.returncode} before listening"


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` if it still runs and reap it (5 s deadline: a frozen one dies too)."""
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)


class CkptdClient:
    """A connection to the node's ckptd. Every call has a deadline (``timeout_s``)."""

    def __init__(self, name: str, *, timeout_s: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(address(name))
        self.f = self.sock.makefile("rwb")
        self._lock = threading.Lock()

    def call(self, req: Request[R], *, timeout_s: float = 10.0) -> R:
        """Send one request (``protocol/ckptd.py``), wait for its reply (``req.reply``).
        Raises CheckpointError on an error reply, a malformed one or a dead daemon,
        OSError/TimeoutError past the deadline."""
        with self._lock:
            self.sock.settimeout(timeout_s)
            self.f.write(json.dumps(request_to_json(req)).encode() + b"\n")
            self.f.flush()
            line = self.f.readline()
        if not line:
            raise CheckpointError("ckptd closed the connection (it died or is restarting)")
        try:
            reply = reply_from_json(req, json.loads(line))
        except ValueError as e:  # ProtocolError, or not JSON
            raise CheckpointError(f"ckptd's reply to {req.op} is malformed: {e}") from e
        if isinstance(reply, ErrorReply):
            raise CheckpointError(reply.error)
        return reply

    def close(self) -> None:
        """Close the connection; a daemon that died already is not an error here."""
        with contextlib.suppress(OSError):
            self.f.close()
        self.sock.close()


@contextlib.contextmanager
def node_daemon(
    ckpt_dir: str | os.PathLike[str],
    *,
    shm_dir: str | os.PathLike[str] = "/dev/shm",
    job: str | None = None,
    node: str | None = None,
    keep: int = 2,
    log: str | os.PathLike[str] | None = None,
    timeout_s: float = 30.0,
) -> Iterator[str]:
    """Run a node's checkpoint daemon (ckptd) for this process and its children, as
    ``trainguard run`` runs one per node: every ``Checkpointer`` made inside the block (here or
    in a child started inside it, e.g. torchrun's ranks) stages its snapshots into slots that
    ckptd owns in ``shm_dir``; ckptd checksums them and writes durable steps to ``ckpt_dir``
    (DCP layout), so a snapshot outlives a crash of the rank that wrote it. For scripts that
    want the node daemon without ``trainguard run``, and for ``benchmarks/checkpoint.py``.

    Sets ``TRAINGUARD_CKPTD``, ``TRAINGUARD_SHM_DIR``, ``TRAINGUARD_JOB_ID``,
    ``TRAINGUARD_NODE_ID`` and ``TRAINGUARD_CKPT_DIR`` in ``os.environ`` for the block and
    restores them after. Yields the daemon's socket name (``@trainguard-ckptd-JOB-NODE``).
    ``job`` defaults to ``standalone<pid>``, ``node`` to ``host<pid>``; ``log`` (ckptd's stderr)
    to ``ckpt_dir/ckptd-NODE.log``. On exit ckptd is asked to shut down (its slots unlinked)
    and killed if it has not exited 60 s later.

    Raises CheckpointError, naming the log, when ckptd does not listen within ``timeout_s``.
    """
    from trainguard.protocol.ckptd import Shutdown

    job = job or f"standalone{os.getpid()}"
    node = node or f"host{os.getpid()}"  # not an agent's node id (node0, ...)
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    log_path = Path(log) if log is not None else root / f"ckptd-{node}.log"
    proc = spawn(
        job=job, node=node, ckpt_dir=root, shm_dir=Path(shm_dir), keep=keep, log=log_path,
        timeout_s=timeout_s,
    )  # fmt: skip
    name = socket_name(job, node)
    env = {
        "TRAINGUARD_CKPTD": name, "TRAINGUARD_SHM_DIR": str(shm_dir), "TRAINGUARD_JOB_ID": job,
        "TRAINGUARD_NODE_ID": node, "TRAINGUARD_CKPT_DIR": str(root),
    }  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield name
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        with contextlib.suppress(OSError, ValueError, CheckpointError):
            c = CkptdClient(name, timeout_s=5.0)
            try:
                c.call(Shutdown(unlink=True), timeout_s=60.0)
            finally:
                c.close()
        try:
            proc.wait(timeout=60.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10.0)
