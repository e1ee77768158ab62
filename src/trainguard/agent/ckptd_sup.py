"""The agent's supervision of its node's ckptd (the daemon that owns the memory tier):
start it, restart it when it dies (it re-adopts the intact slots), kill it when it stops
answering (CKPTD_DEADLINE_S), relay what it holds into the agent's reports, hand it the
controller's orders (persist a snapshot on a planned stop, the replica peers), and shut it
down with the node's slots unlinked."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from trainguard.checkpoint import ckptd_client as ckptd_mod
from trainguard.protocol import CkptConf, Desired, Run, Stop, clock
from trainguard.protocol import ckptd as wire

R = TypeVar("R")

log = logging.getLogger("trainguard.agent")
# A live ckptd that has not answered its agent's status call for this long is killed and
# restarted (liveness with a deadline: a frozen daemon holds the node's snapshots hostage).
CKPTD_DEADLINE_S = 15.0
STOP_DEADLINE_S = 70.0  # for ckptd to finish pending persistence on shutdown


def clear_memory(paths: list[Path]) -> None:
    """Remove a node's leftover shared-memory segments (its slots, replicas, checksums) as a
    (re)started agent finds them. A directory among them is the prefetched step
    (``checkpoint/prefetch.py``): its Prefetcher's, checked against the step's manifest before
    any use, so it is left (unlinking it raised IsADirectoryError, and an agent restarted after
    a SIGKILL crashed on it at every start)."""
    for path in paths:
        if not path.is_dir():
            path.unlink(missing_ok=True)


class CkptdSupervisor:
    """One node's ckptd. ``on_event(kind, **data)`` records an event for the next report;
    ``idle`` is called while waiting for a new ckptd to come up (the agent drains its
    workers' heartbeats meanwhile)."""

    def __init__(
        self,
        *,
        job_id: str,
        node_id: str,
        token: str,
        bind: str,
        run_dir: Path,
        on_event: Callable[..., None],
        idle: Callable[[], None],
    ) -> None:
        self.job_id, self.node_id, self._token, self._bind = job_id, node_id, token, bind
        self._run_dir, self._on_event, self._idle = run_dir, on_event, idle
        self.ckpt: CkptConf | None = None  # the configuration it was started with
        self.proc: subprocess.Popen[bytes] | None = None
        self._client: ckptd_mod.CkptdClient | None = None
        self._silent_since: float | None = None  # alive but not answering since (monotonic)
        self._persisted: tuple[int, int] | None = None  # (step, gen) persisted on a planned stop
        self._peers: list[str] | None = None  # where it replicates (as told to it)
        # What it holds, for the agent's reports:
        self.memory: dict[str, Any] = {}  # rank → verified [(step, gen)] snapshots
        self.idle = True  # it verified everything staged (the memory index is whole)
        self.replicas: dict[str, Any] = {}  # source rank → [(step, gen)] held for peers
        self.replica_addr: str | None = None  # its replica server
        # rank → [step, gen, layout, value] of its verified snapshots (checkpoint/fingerprint.py)
        self.fingerprints: dict[str, Any] = {}
        # Wall clock at which the status behind ``memory``/``idle`` was asked for: the
        # controller trusts a memory index for a restore only if asked after the workers
        # stopped (NodeObs.ckptd_at, policy.replace_and_restart).
        self.refreshed_at: float | None = None
        self.stopping = False  # the agent is shutting it down: never killed for silence then
        self._refresh_lock = threading.Lock()  # one status conversation at a time

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _slots(self, shm_dir: str) -> list[Path]:
        return sorted(Path(shm_dir).glob(f"trainguard-{self.job_id}-{self.node_id}-*"))

    def ensure(self, ckpt: CkptConf) -> None:
        """Start the node's ckptd, or restart it if it died (it re-adopts intact slots).
        A ckptd that cannot start is logged; workers fail on their first save and report it,
        and the next call tries again."""
        if not ckpt.memory_tier:
            return
        if self.proc is not None and self.proc.poll() is None:
            return
        if self.proc is None:  # a (re)booted node's memory is empty
            clear_memory(self._slots(ckpt.shm_dir))
        else:
            self._on_event("ckptd_restarted", exit_code=self.proc.returncode)
        self.ckpt = ckpt
        try:
            self.proc = ckptd_mod.spawn(
                job=self.job_id,
                node=self.node_id,
                ckpt_dir=Path(ckpt.dir),
                shm_dir=Path(ckpt.shm_dir),
                keep=ckpt.keep,
                log=self._run_dir / "logs" / f"ckptd.{self.node_id}.log",
                env={
                    **os.environ,
                    "TRAINGUARD_AGENT_PID": str(os.getpid()),
                    "TRAINGUARD_TOKEN": self._token,
                },
                replica_bind=self._bind,
                idle=self._idle,
            )
            self._peers = None  # a new ckptd must be told its peers again
            # ... and a planned stop's Persist order: the old one may have died before it
            # wrote the parts (the new one adopts a memory-only snapshot as indexed only)
            self._persisted = None
        except ckptd_mod.CheckpointError as e:
            log.error("%s", e)

    def _call(self, req: wire.Request[R], timeout_s: float) -> R:
        if self._client is None:
            self._client = ckptd_mod.CkptdClient(ckptd_mod.socket_name(self.job_id, self.node_id))
        return self._client.call(req, timeout_s=timeout_s)

    def refresh(self, desired: Desired, *, rescan: bool = False) -> list[dict[str, Any]]:
        """Refresh what it holds (2 s deadline), carry out ``desired``'s orders for it, and
        return the events it queued. Called by the agent's ckptd thread, never by its report
        thread: a frozen or busy ckptd delays these calls by their deadlines (2 s + 5 s +
        2 s), which must not delay the node's heartbeat (the controller declares a node
        lost after ``node_timeout_s`` without one). ``rescan``: no worker of this node runs,
        so ckptd takes in any complete snapshot whose writer died before telling it."""
        with self._refresh_lock:
            return self._refresh(desired, rescan)

    def _refresh(self, desired: Desired, rescan: bool) -> list[dict[str, Any]]:
        asked = clock.wall()
        if self.proc is None or self.proc.poll() is not None:
            self.memory, self.fingerprints = {}, {}
            self.refreshed_at = asked  # no daemon: nothing in memory, known now
            return []
        try:
            st = self._call(wire.Status(rescan=rescan), timeout_s=2.0)
        except (OSError, ValueError, ckptd_mod.CheckpointError):
            self._unanswered(self.proc)
            return []
        self._silent_since = None
        self.refreshed_at = asked
        self.memory = st.memory
        self.fingerprints = st.fingerprints
        self.idle = st.idle
        self.replicas = st.replicas
        self.replica_addr = st.replica_addr
        persist = desired.persist if isinstance(desired, Stop) else None
        if persist is not None and persist != self._persisted:
            try:  # a planned stop: write the newest snapshot held in memory to the durable tier
                step, gen = persist
                reply = self._call(wire.Persist(step=step, generation=gen), 5.0)
                self._persisted = persist
                log.info("persisting step %d from memory (ranks %s)", step, list(reply.ranks))
            except (OSError, ValueError, ckptd_mod.CheckpointError) as e:
                log.warning("asking ckptd to persist step %s failed: %s", persist[0], e)
        want = list(desired.replica_peers) if isinstance(desired, Run) else []
        # Stopping: ckptd is about to be shut down; a new peer list is of no use to it, and the
        # exit path makes no call but the last status and the shutdown order.
        if want != self._peers and not self.stopping:
            try:
                self._call(wire.SetPeers(addrs=tuple(want)), timeout_s=2.0)
                self._peers = want
            except (OSError, ValueError, ckptd_mod.CheckpointError) as e:
                log.warning("telling ckptd its replica peer failed: %s", e)
        return list(st.events)

    def _unanswered(self, proc: subprocess.Popen[bytes]) -> None:
        """A status call failed: after CKPTD_DEADLINE_S of that, kill it (frozen, stopped,
        deadlocked); ``ensure`` then restarts it and the new one re-adopts the slots."""
        if self._client is not None:
            self._client.close()
        self._client = None
        now = time.monotonic()
        if self._silent_since is None:
            self._silent_since = now
            return
        silent = now - self._silent_since
        if silent <= CKPTD_DEADLINE_S or self.stopping:  # stopping: it finishes its writes
            return
        self._on_event("ckptd_unresponsive", silent_s=round(silent, 1), pid=proc.pid)
        log.error("ckptd (pid %d) has not answered for %.0fs: killing it", proc.pid, silent)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        self._silent_since = None

    def stop(self) -> None:
        """Ask it to finish pending persistence and unlink the node's slots (deadline
        STOP_DEADLINE_S, then SIGKILL); the slots are unlinked in any case."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError, ValueError, ckptd_mod.CheckpointError):
            client = ckptd_mod.CkptdClient(
                ckptd_mod.socket_name(self.job_id, self.node_id), timeout_s=2.0
            )
            client.call(wire.Shutdown(unlink=True))
            client.close()
        try:
            self.proc.wait(timeout=STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5.0)
        if self.ckpt is not None:
            for path in self._slots(self.ckpt.shm_dir):
                if path.is_dir():  # a prefetched step (unlink raised IsADirectoryError)
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
