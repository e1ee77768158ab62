"""Where a Checkpointer's snapshots go: its node's ckptd (``CkptdBackend``, under
``trainguard run``) or a persister in the process itself (``LocalBackend``: plain python,
torchrun)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from trainguard.checkpoint import snapshot
from trainguard.checkpoint.api import CheckpointError
from trainguard.checkpoint.ckptd_client import CkptdClient
from trainguard.checkpoint.persister import Persister
from trainguard.protocol import ckptd as wire

R = TypeVar("R")

log = logging.getLogger("trainguard.checkpoint")
VERIFY_WAIT_S = 300.0  # a restore waits this long for ckptd's checksum of its snapshot
# While a call to ckptd is in flight, the rank tells its agent so this often. The agent
# takes a rank that did so in the last IN_TRAINGUARD_S (10 s, agent/workers.py) for one
# waiting inside trainguard, not hung: a period of a tenth of that leaves room for a loaded
# machine's scheduling delays.
KEEPALIVE_S = 1.0


class LocalBackend:
    """Persister in this process, slots owned (and unlinked on close) by this process."""

    def __init__(self, root: Path, shm_dir: Path, keep: int) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.persister = Persister(
            root, keep=keep, emit=lambda kind, **d: self.events.append((kind, d))
        )
        self.job = "local" + hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:8]
        self.node = socket.gethostname().split(".")[0] or "host"
        self.shm_dir = shm_dir
        self.paths: list[Path] = []

    def alloc(self, rank: int, nbytes: int) -> tuple[Path, ...]:
        paths = snapshot.slot_paths(self.shm_dir, self.job, self.node, rank)
        for p in paths:
            if p not in self.paths:  # a dead process's slot (killed before close): not ours
                p.unlink(missing_ok=True)
                snapshot.sums_path(p).unlink(missing_ok=True)
            snapshot.create_slot(p, nbytes)
        self.paths = list(paths)
        return paths

    def staged(self, rank: int, slot: Path, step: int, gen: int, durable: bool) -> None:
        self.persister.staged(rank, slot, step, gen, durable)

    def wait_durable(self, step: int, timeout_s: float) -> bool:
        if self.persister.wait_durable(step, timeout_s):
            return True
        failed = self.persister.failure(step)
        if failed:
            raise CheckpointError(f"step {step} cannot become durable: {failed}")
        return False

    def forget(self, slot: Path) -> None:
        self.persister.forget(slot)

    def idle(self) -> bool:
        """Every staged snapshot is verified (``Persister.idle``)."""
        return self.persister.idle()

    def close(self) -> None:
        self.persister.close()
        for p in self.paths:
            p.unlink(missing_ok=True)
            snapshot.sums_path(p).unlink(missing_ok=True)


class CkptdBackend:
    """The node's ckptd (under ``trainguard run``). If ckptd dies or freezes, the agent
    restarts it (a frozen one after its liveness deadline, 15 s): each call reconnects and
    retries for up to ``RECONNECT_S`` before giving up. While some call has been in flight
    ``KEEPALIVE_S`` or more, whatever it waits in (a reply, a connect, the gap while ckptd is
    down and restarting, another thread's call on the connection), a thread of its own tells
    the agent the rank waits inside trainguard (``keepalive``), so that neither this rank nor
    the peers it holds up in a collective are taken for hung. Quick calls send none.

    Thread-safe: calls from several threads (the stage thread's ``staged``, the training
    thread's) take the one connection in turn. ``close`` while a call is in flight leaves
    that call to end by its own deadline; a call after ``close`` raises CheckpointError."""

    RECONNECT_S = 45.0
    ATTEMPT_S = 3.0  # one attempt's deadline for quick calls (a frozen ckptd answers none)
    # the longest one call may hold the connection: the longest attempt, then reconnecting
    HOLD_S = VERIFY_WAIT_S + RECONNECT_S

    def __init__(self, name: str, keepalive: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self.client: CkptdClient | None = None
        self.keepalive = keepalive
        self._lock = threading.Lock()  # guards the fields below
        self._calls: dict[int, float] = {}  # calls in flight: id -> monotonic start
        self._next_call = 0
        self._busy = threading.Event()  # set while a call is in flight (wakes the ticker)
        self._closed = False
        self._ticker: threading.Thread | None = None
        self._conn = threading.Lock()  # held by the call using (or replacing) ``client``

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        with self._lock:
            if self._closed:
                raise CheckpointError(
                    "the checkpointer was closed; make a new Checkpointer to save or restore"
                )
            call, self._next_call = self._next_call, self._next_call + 1
            self._calls[call] = time.monotonic()
            self._busy.set()
            if self._ticker is None:
                self._ticker = threading.Thread(
                    target=self._tick, name="trainguard-ckptd-keepalive", daemon=True
                )
                self._ticker.start()
        try:
            yield
        finally:
            with self._lock:
                del self._calls[call]
                last = not self._calls
                if last and not self._closed:
                    self._busy.clear()
                closed_now = last and self._closed
            if closed_now:  # ``close`` came during this call: the connection goes now
                self._drop_client()

    def _tick(self) -> None:
        while True:
            with self._lock:
                if self._closed and not self._calls:
                    return
            if not self._busy.wait(60.0):
                continue
            time.sleep(KEEPALIVE_S / 4)
            with self._lock:
                oldest = min(self._calls.values(), default=None)
            if oldest is not None and time.monotonic() - oldest >= KEEPALIVE_S:
                try:
                    self.keepalive()
                except Exception:  # best effort; the next tick tries again
                    log.debug("keep-alive failed", exc_info=True)
                time.sleep(KEEPALIVE_S * 3 / 4)

    def _call(
        self, req: wire.Request[R], timeout_s: float = ATTEMPT_S, reconnect_s: float = RECONNECT_S
    ) -> R:
        with self._waiting():
            if not self._conn.acquire(timeout=self.HOLD_S + reconnect_s):
                raise CheckpointError(
                    f"another call to the node's ckptd held the connection for over "
                    f"{self.HOLD_S + reconnect_s:.0f}s; is the agent alive?"
                )
            try:
                return self._attempts(req, timeout_s, reconnect_s)
            finally:
                self._conn.release()

    def _attempts(self, req: wire.Request[R], timeout_s: float, reconnect_s: float) -> R:
        deadline = time.monotonic() + reconnect_s
        while True:
            try:
                if self.client is None:
                    self.client = CkptdClient(self.name, timeout_s=self.ATTEMPT_S)
                return self.client.call(req, timeout_s=timeout_s)
            except (OSError, CheckpointError) as e:
                if isinstance(e, CheckpointError) and "closed the connection" not in str(e):
                    raise  # ckptd answered with an error: retrying would not help
                if self.client is not None:
                    self.client.close()
                    self.client = None
                if time.monotonic() >= deadline:
                    raise CheckpointError(
                        f"the node's ckptd is unreachable ({e}); is the agent alive?"
                    ) from e
                time.sleep(0.1)

    def _drop_client(self) -> None:
        if self._conn.acquire(timeout=self.HOLD_S):
            try:
                if self.client is not None:
                    self.client.close()
                    self.client = None
            finally:
                self._conn.release()

    def alloc(self, rank: int, nbytes: int) -> tuple[Path, ...]:
        reply = self._call(wire.Alloc(rank=rank, nbytes=nbytes), timeout_s=120.0)
        return tuple(Path(p) for p in reply.slots)

    def staged(self, rank: int, slot: Path, step: int, gen: int, durable: bool) -> None:
        self._call(
            wire.Staged(rank=rank, slot=str(slot), step=step, generation=gen, durable=durable)
        )

    def wait_durable(self, step: int, timeout_s: float) -> bool:
        req = wire.WaitDurable(step=step, timeout_s=timeout_s)
        reply = self._call(req, timeout_s=timeout_s + 10.0)
        if reply.failed:
            raise CheckpointError(f"step {step} cannot become durable: {reply.failed}")
        return reply.durable

    def idle(self) -> bool:
        """ckptd has verified every staged snapshot (its ``Status.idle``)."""
        return bool(self._call(wire.Status()).idle)

    def forget(self, slot: Path) -> None:
        """Best effort: a ckptd that is down re-verifies slots when it restarts anyway."""
        with contextlib.suppress(CheckpointError):
            self._call(wire.Forget(slot=str(slot)), reconnect_s=5.0)

    def fetch(self, rank: int, step: int, gen: int, source: str) -> None:
        """Have ckptd pull this rank's replica of (step, gen) from the peer at ``source`` into
        this node's slot. Raises CheckpointError (peer unreachable, no such replica, corrupt)."""
        req = wire.Fetch(rank=rank, step=step, generation=gen, source=source)
        self._call(req, timeout_s=VERIFY_WAIT_S)

    def verify(
        self, rank: int, step: int, gen: int, for_generation: int
    ) -> wire.VerifyReply | None:
        """ckptd's verdict on the rank's snapshot of (step, gen) for this restart; None when
        ckptd is unreachable for 5 s (the caller then checksums the slot itself)."""
        req = wire.Verify(rank=rank, step=step, generation=gen, for_generation=for_generation)
        try:
            return self._call(req, timeout_s=VERIFY_WAIT_S, reconnect_s=5.0)
        except CheckpointError as e:
            if "unreachable" not in str(e):
                raise
            return None

    def close(self) -> None:
        """Close the connection, now if no call is in flight, else when the last one ends
        (by its own deadline; the ticker keeps the rank alive until then)."""
        with self._lock:
            self._closed = True
            idle = not self._calls
            self._busy.set()  # the ticker sees ``_closed`` and ends once no call is in flight
        if idle:
            self._drop_client()
