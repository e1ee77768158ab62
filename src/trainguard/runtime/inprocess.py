"""In-process recovery: ``trainguard.run(main)`` re-enters a training function after a fault,
in the same process, as the job's next generation.

What a script does::

    def main() -> None:
        dist.init_process_group("gloo")       # inside: the world is re-formed each time
        model, optim = build()                # or built outside, and kept
        ckpt = trainguard.Checkpointer()
        start = ckpt.load(state) or 0         # in place, from this node's memory tier
        for step in range(start + 1, steps + 1):
            ...
        ckpt.close()
        dist.destroy_process_group()

    trainguard.run(main)

As NVIDIA's resiliency extension (``nvidia_resiliency_ext.inprocess.Wrapper``) does, the
function is the unit of restart: what the script made before calling ``run`` (imports,
datasets, tokenizers, a compiled model) is kept; what the function made is released. When a
rank of the job fails, its node agent sends every surviving rank an ``Abort``
(``protocol/control.py``). Here, on the thread ``trainguard-control``:

1. the training function's pending collectives end: its process group is aborted where the
   backend can (``ProcessGroup.abort``; NCCL's ``_abort_process_group``), and every TCP
   connection it opened since it was entered is shut down (gloo has no abort that wakes a
   pending receive; a shut-down socket does: the collective raises at once). Connections made
   before ``run`` was called are not touched: make long-lived clients (experiment trackers,
   metrics) there;
2. ``InProcessAbort`` is raised into the training thread (``PyThreadState_SetAsyncExc``) for
   when it is not in a collective: it arrives at its next Python instruction. A thread blocked
   in a system call (a DataLoader's ``queue.get``, ``time.sleep``, a lock, ``select``) runs no
   instruction until the call returns, so the training thread is also sent ``KICK_SIGNAL``
   (``SIGRTMIN+2``, handled by a no-op while ``run`` runs; not installed when the script
   handles that signal itself): the call is interrupted, the handler runs, and the
   exception lands in it.

A survivor may also see the failure first: the collective it waits in raises (gloo's
"Connection closed by peer"). Either way the function unwinds; ``run`` catches a
``InProcessAbort`` or a communication error (``comm_error``), destroys the process group,
releases the function's Checkpointers (slots, ckptd connection, optimizer hooks), frees the
function's frames, and *parks*: it tells the agent (an ``inprocess_parked`` event, and every
heartbeat) and waits for ``Resume`` with the next generation's environment (``RANK``,
``MASTER_PORT``, the restore point, …). Then it calls the function again; ``ckpt.load``
restores the step every rank agrees on from this node's memory tier. Any other exception is
the script's own failure and propagates (the process exits; this rank is then the failed one).

Deadlines: the agent kills a survivor that has not parked within ``inprocess_abort_s`` of the
abort (stuck in a call no abort reaches): that rank is restarted the old way (an
``inprocess_escalated`` event). A parked rank that hears nothing for ``PARK_TIMEOUT_S``
re-raises its error and exits.

Outside ``trainguard run`` (plain python, torchrun) ``run(fn)`` is ``fn()``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import os
import select
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import psutil

from trainguard.protocol import control
from trainguard.runtime import wire
from trainguard.runtime.core import Runtime, init

KICK_SIGNAL = signal.SIGRTMIN + 2  # wakes the training thread from a blocking call on Abort
T = TypeVar("T")

# A parked rank waits this long for its agent's Resume before it gives up and exits with the
# fault's error (the job's recovery takes seconds; a lost node is declared after
# node_timeout_s, 10 s by default, and the memory index settles within 15 s).
PARK_TIMEOUT_S = float(os.environ.get("TRAINGUARD_PARK_TIMEOUT_S", "300"))
REPARK_S = 1.0  # the parked event is sent again this often (UDP), until the Resume comes

# What a collective raises when its peer died, its connection was shut down, or it timed out
# (gloo, NCCL, the TCPStore). The same markers as the controller's victim test, and gloo's
# and NCCL's own words for a failed or aborted operation.
_COMM_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "NCCL communicator was aborted",
    "remote process exited",
    "/gloo/",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "Timed out waiting",
    "Socket Timeout",
    "TCPStore",
    "has been aborted",
)


class InProcessAbort(BaseException):  # noqa: N818 (like KeyboardInterrupt: not an error)
    """Raised into the training thread when its agent aborts the generation: a BaseException,
    so that a script's ``except Exception`` does not swallow it."""


def comm_error(exc: BaseException) -> bool:
    """Is ``exc`` (or an exception it was raised from) a failed collective or store call:
    torch.distributed's ``DistError`` family, or a RuntimeError in gloo's or NCCL's words?"""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ in ("DistError", "DistBackendError", "DistNetworkError",
                                "DistStoreError"):  # fmt: skip
            return True
        # RuntimeError only: gloo and NCCL raise that; a user's own ConnectionError (a tracker,
        # a data service) is the script's failure, not a failed collective.
        if type(e) is RuntimeError and any(m in str(e) for m in _COMM_MARKERS):
            return True
        e = e.__cause__ or e.__context__
    return False


Connection = tuple[int, tuple[Any, ...], tuple[Any, ...]]  # (fd, local, remote address)


def _connected() -> list[Connection]:
    """This process's TCP sockets that have a peer (psutil; listeners left out)."""
    try:
        conns = psutil.Process().net_connections("tcp")
    except psutil.Error:
        return []
    return [(c.fd, tuple(c.laddr), tuple(c.raddr)) for c in conns if c.raddr and c.fd >= 0]


def tcp_connections() -> set[Connection]:
    """This process's connected TCP sockets now (``cut_connections``'s ``keep``)."""
    return set(_connected())


def cut_connections(keep: set[Connection]) -> int:
    """Shut down (both ways) every connected TCP socket of this process not in ``keep``: a
    receive pending on one (a gloo collective) returns an error at once. Returns how many
    were shut down."""
    return sum(_shutdown(conn) for conn in _connected() if conn not in keep)


def cut_only(conns: set[Connection]) -> int:
    """Shut down the sockets of ``conns`` that are still connected (a process group's own,
    told by ``tcp_connections()`` before and after it was made). Returns how many."""
    return sum(_shutdown(conn) for conn in _connected() if conn in conns)


def _shutdown(conn: Connection) -> int:
    try:
        s = socket.socket(fileno=os.dup(conn[0]))
    except OSError:
        return 0
    try:
        s.shutdown(socket.SHUT_RDWR)
        return 1
    except OSError:
        return 0
    finally:
        s.close()


def _abort_backends() -> None:
    """``ProcessGroup.abort()`` of the default group, and NCCL's abort of every group where it
    runs (a pending NCCL kernel returns); nothing where torch.distributed is not initialized."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    with contextlib.suppress(Exception):
        if "nccl" in str(dist.get_backend()).lower():
            dist.distributed_c10d._abort_process_group()
            return
    with contextlib.suppress(Exception):
        pg = dist.group.WORLD
        if pg is not None:
            pg.abort()


def _destroy_process_group() -> None:
    """Destroy the default process group, and forget a half-made one: an
    ``init_process_group`` that a fault interrupted (its peer died or was stopped before the
    group formed) has taken the next unnamed group number (``_world.group_count``, the prefix of
    the group's keys in the store: ``default_pg/<n>/``) but left nothing to destroy, and
    ``destroy_process_group`` is what resets that number. Left at 1, the next generation's
    group waited for keys under ``default_pg/1/`` that the new ranks wrote under
    ``default_pg/0/``: every recovery after it hung until the store's timeout (a chaos run's
    hang during start-up, 2026-12-04)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    with contextlib.suppress(AttributeError):  # a private counter: named, not relied on
        dist.distributed_c10d._world.group_count = 0


class _Recovering:
    """One process's in-process recovery: the control thread and the re-entry loop."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._lock = threading.Lock()  # guards _inside: the async raise lands only inside fn
        self._inside = False
        self._aborted: int | None = None  # the generation an Abort came for
        self._resume: control.Resume | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._keep_fds: set[Connection] = set()  # TCP connections from before the function ran
        self._kick = False  # KICK_SIGNAL is ours to send (run installed its handler)
        self._thread = threading.Thread(target=self._listen, name="trainguard-control",
                                        daemon=True)  # fmt: skip

    # ------------------------------------------------------------ training thread
    def run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        self.rt.inprocess = True
        # Said at once, not at the next heartbeat: a fault in the first moments of the job
        # (a benchmark's kill at step 5, a rank that dies in init_process_group) is planned by
        # what every rank said; a rank not heard from yet counted as a plain script's.
        self.rt.beat_now()
        with _kick_handler() as self._kick:
            self._thread.start()
            try:
                while True:
                    self._keep_fds = tcp_connections()
                    ok, value = self._attempt(fn, args, kwargs)
                    if ok:
                        return value  # type: ignore[no-any-return]
                    exc: BaseException = value
                    if not self._recoverable(exc):
                        raise exc
                    why = _one_line(exc)
                    del value
                    self._park(exc, why)
                    del exc
            finally:
                self._stop.set()
                self._thread.join(timeout=2.0)
                self._kick = False
                self.rt.inprocess = False

    def _attempt(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, Any]:
        """(True, result) or (False, the exception), and no async raise pending after."""
        try:
            with self._lock:
                self._inside = True
            try:
                return True, fn(*args, **kwargs)
            finally:
                self._leave()
        except BaseException as e:  # noqa: BLE001 (sorted by the caller)
            err: BaseException = e
        while True:  # an InProcessAbort may land here, before _leave took the lock
            try:
                self._leave()
                return False, err
            except InProcessAbort as late:
                if not isinstance(err, InProcessAbort):
                    late.__context__ = err
                err = late

    def _leave(self) -> None:
        with self._lock:
            self._inside = False
            tid = ctypes.c_ulong(self.rt._main_ident or 0)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(tid, None)  # none pending from here on

    def _recoverable(self, exc: BaseException) -> bool:
        if isinstance(exc, InProcessAbort):
            return True
        if isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit):
            return False
        return self._aborted == self.rt.generation or comm_error(exc)

    def _park(self, exc: BaseException, why: str) -> None:
        """Tell the agent this rank parked, release what the failed generation made, wait for
        ``Resume``; then the environment is the new generation's. Raises ``exc`` past
        ``PARK_TIMEOUT_S``. The release runs while the job moves on (the agent and the
        controller need only know that this process left the generation's collectives)."""
        rt = self.rt
        gen = rt.generation
        t0 = time.monotonic()
        cut_connections(self._keep_fds)  # its peers' collectives with it end too
        rt.event_now("inprocess_parked", reason=why)
        rt.parked = True  # heartbeats say so too (after the event: it has the reason)
        parts = self._release(exc)
        deadline = time.monotonic() + PARK_TIMEOUT_S
        next_say = time.monotonic() + REPARK_S
        while (r := self._resume) is None or r.generation <= gen:
            now = time.monotonic()
            if now >= deadline:
                rt.parked = False
                raise exc
            if now >= next_say:  # UDP: said again until the Resume comes
                rt.event_now("inprocess_parked", reason=why)
                next_say = now + REPARK_S
            self._wake.wait(min(REPARK_S, max(0.0, deadline - now)))
            self._wake.clear()
        for key in r.unset:
            os.environ.pop(key, None)
        os.environ.update(r.env)
        rt.reset(dict(os.environ))
        rt.parked = False
        self._aborted = None
        rt.event("inprocess_resumed", from_generation=gen,
                 parked_s=round(time.monotonic() - t0, 4), **parts)  # fmt: skip

    def _release(self, exc: BaseException) -> dict[str, float]:
        """Free the failed generation: the function's frames (its model, loader iterators),
        the process group, the Checkpointers, then objects in cycles. Seconds of each part,
        and ``released_s`` in all."""
        marks = [time.monotonic()]
        tb = exc.__traceback__
        if tb is not None:
            with contextlib.suppress(Exception):
                traceback.clear_frames(tb)
        marks.append(time.monotonic())
        _abort_backends()
        _destroy_process_group()
        marks.append(time.monotonic())
        for owned in list(self.rt.owned):
            with contextlib.suppress(Exception):
                owned.abandon()
        marks.append(time.monotonic())
        gc.collect()  # the function's objects in cycles (a DataLoader's workers shut down here)
        marks.append(time.monotonic())
        names = ("frames_s", "group_s", "checkpointers_s", "gc_s")
        spans = [round(b - a, 4) for a, b in itertools.pairwise(marks)]
        return {
            **dict(zip(names, spans, strict=True)),
            "released_s": round(marks[-1] - marks[0], 4),
        }

    # ------------------------------------------------------------ control thread
    def _listen(self) -> None:
        sock = self.rt._sock
        if sock is None:
            return
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([sock], [], [], 0.5)
                if not ready:
                    continue
                data = sock.recv(65536)
                msg = control.control_from_json(wire.decode(self.rt._token, data))
            except (OSError, ValueError):  # closed, unauthenticated or malformed: dropped
                if sock.fileno() < 0:
                    return
                continue
            if isinstance(msg, control.Abort):
                self._on_abort(msg)
            elif msg.generation > self.rt.generation:
                self._resume = msg
                self._wake.set()

    def _on_abort(self, msg: control.Abort) -> None:
        if msg.generation != self.rt.generation or self._aborted == msg.generation:
            return  # stale, or a repeat: the first one is being acted on
        self._aborted = msg.generation
        cut_connections(self._keep_fds)
        with contextlib.suppress(Exception):
            _abort_backends()
        with self._lock:
            if self._inside:
                tid = ctypes.c_ulong(self.rt._main_ident or 0)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(tid, ctypes.py_object(InProcessAbort))
                if self._kick and tid.value:
                    with contextlib.suppress(OSError):  # gone: nothing to wake
                        signal.pthread_kill(tid.value, KICK_SIGNAL)


def _on_kick(signum: int, frame: Any) -> None:
    """``KICK_SIGNAL``'s handler: nothing to do; running it lets a pending ``InProcessAbort``
    land in a thread blocked in a system call."""


@contextlib.contextmanager
def _kick_handler() -> Any:
    """``KICK_SIGNAL`` handled by ``_on_kick`` inside the block (main thread only); yields
    whether it is (False when the script handles that signal itself)."""
    if signal.getsignal(KICK_SIGNAL) not in (signal.SIG_DFL, None):
        yield False
        return
    prev = signal.signal(KICK_SIGNAL, _on_kick)
    try:
        yield True
    finally:
        signal.signal(KICK_SIGNAL, prev)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` and return its result; under ``trainguard run``, call it
    again after each in-process recovery (module docstring). Raises what ``fn`` raises, other
    than a communication error or ``InProcessAbort`` during a recovery; re-raises the fault's
    error when no resume comes within ``PARK_TIMEOUT_S`` seconds. Call it from the main
    thread, once per process."""
    rt = init()
    if not rt.supervised:
        return fn(*args, **kwargs)
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("trainguard.run: call it from the main thread")
    return _Recovering(rt).run(fn, args, kwargs)
