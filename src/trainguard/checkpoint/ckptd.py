"""ckptd: the node's checkpoint daemon (the seed's hyckptd), a child of the agent.

Owns the node's shared-memory snapshot slots (``<shm>/trainguard-<job>-<node>-r<rank>-s<0|1>``),
persists staged snapshots in the background (persister.py) and reports the memory
tier. It outlives worker crashes; when it is restarted it re-adopts the slots that
are still complete and verify.

Protocol: JSON lines over a Unix stream socket in the abstract namespace
(``\\0trainguard-ckptd-<job>-<node>``); only peers with our uid are served (SO_PEERCRED). One
request type per operation and its reply type: ``protocol/ckptd.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, assert_never

from trainguard.checkpoint import replica, snapshot
from trainguard.checkpoint.api import CheckpointError
from trainguard.checkpoint.ckptd_client import CkptdClient, address, socket_name, spawn

__all__ = ["CheckpointError", "Ckptd", "CkptdClient", "socket_name", "spawn"]
from trainguard.checkpoint.persister import Persister
from trainguard.protocol import ckptd as wire
from trainguard.protocol.common import ProtocolError, loads

WAIT_DURABLE_MAX_S = 86_400.0  # the longest wait_durable a client may ask for (a day)

log = logging.getLogger("trainguard.ckptd")


class Ckptd:
    def __init__(
        self,
        *,
        job: str,
        node: str,
        ckpt_dir: Path,
        shm_dir: Path,
        keep: int,
        replica_bind: str | None = None,
        token: str | None = None,
    ) -> None:
        self.job, self.node, self.shm_dir, self.token = job, node, shm_dir, token
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.replicas: replica.ReplicaServer | None = None
        self.replicator: replica.Replicator | None = None
        if replica_bind and token:
            self.replicas = replica.ReplicaServer(
                token=token, bind=replica_bind, shm_dir=shm_dir, job=job, node=node, emit=self._emit
            )
            self.replicator = replica.Replicator(token, self._emit)
        self.persister = Persister(
            ckpt_dir,
            keep=keep,
            emit=self._emit,
            on_verified=self.replicator.offer if self.replicator else None,
        )
        self._stop = threading.Event()
        self._unlink = False
        # (rank, step, generation, for_generation) → the verification, run once
        self._verifications: dict[tuple[int, int, int, int], _Verification] = {}
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(address(socket_name(job, node)))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        adopted: dict[str, list[str]] = {}
        for rank, path in self._rank_slots():
            what = self.persister.adopt(rank, path)
            if what is not None:
                adopted.setdefault(what, []).append(path.name)
        if adopted:  # a restarted ckptd: what the old one left, and what became of it
            self._emit("ckptd_adopted", **adopted)

    def _emit(self, kind: str, **data: Any) -> None:
        with self._lock:
            self._events.append({"kind": kind, "ts": time.time(), "node": self.node, **data})

    def _rank_slots(self) -> list[tuple[int, Path]]:
        """(rank, path) of every snapshot slot of this job and node in shared memory."""
        paths = sorted(self.shm_dir.glob(f"trainguard-{self.job}-{self.node}-r*-s[0-9]"))
        return [(int(p.name.rsplit("-r", 1)[1].split("-")[0]), p) for p in paths]

    def slots(self) -> list[Path]:
        return sorted(self.shm_dir.glob(f"trainguard-{self.job}-{self.node}-*"))

    def serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(
                target=self._client, args=(conn,), name="ckptd-client", daemon=True
            ).start()
        self.sock.close()
        if self.replicas is not None:
            self.replicas.close()
        self.persister.close(timeout_s=60.0)
        if self._unlink:
            for path in self.slots():
                path.unlink(missing_ok=True)

    def _client(self, conn: socket.socket) -> None:
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            log.warning("rejected a client with uid %d", uid)
            conn.close()
            return
        with conn, conn.makefile("rwb") as f:
            for line in f:
                reply = self._answer(line)
                f.write(json.dumps(wire.reply_to_json(reply)).encode() + b"\n")
                f.flush()
                if self._stop.is_set():
                    return

    def _answer(self, line: bytes) -> wire.Reply | wire.ErrorReply:
        """The reply to one request line: a refusal naming the problem if it is not one."""
        try:
            req = wire.request_from_json(loads(line))
        except ProtocolError as e:
            return wire.refused(e)
        except ValueError as e:  # not JSON
            return wire.ErrorReply(error=f"refused: not a JSON line ({e})")
        try:
            return self._handle(req)
        except (KeyError, ValueError, CheckpointError) as e:
            return wire.ErrorReply(error=str(e))

    def _verify(self, rank: int, step: int, gen: int) -> wire.VerifyReply:
        """Re-checksum the rank's slot holding (step, gen) against the sums taken at staging."""
        for path in snapshot.slot_paths(self.shm_dir, self.job, self.node, rank):
            h = snapshot.peek_header(path)
            if h is None or (h["step"], h["generation"]) != (step, gen):
                continue
            sums = snapshot.read_sums(path, step, gen)
            if sums is None:
                return wire.VerifyReply(
                    slot=None, ok=False, problem=f"{path}: never verified at staging"
                )
            slot = snapshot.Slot(path, writable=False)
            try:
                ok = slot.checksums(h) == sums
            finally:
                slot.close()
            if ok:
                return wire.VerifyReply(slot=str(path), ok=True, problem=None)
            self.persister.forget(path)
            problem = f"{path}: step {step} fails its checksum (changed in memory since staging)"
            return wire.VerifyReply(slot=str(path), ok=False, problem=problem)
        problem = f"rank {rank} holds no snapshot of step {step}"
        return wire.VerifyReply(slot=None, ok=False, problem=problem)

    def _own_slot(self, slot: str) -> Path:
        """``slot`` if it names one of this job's and node's slots in ``shm_dir``; raises
        CheckpointError otherwise (a request may name no other file)."""
        path = Path(slot)
        real = Path(os.path.realpath(path))
        prefix = snapshot.slot_prefix(self.job, self.node)
        if real.parent != Path(os.path.realpath(self.shm_dir)) or not real.name.startswith(prefix):
            raise CheckpointError(f"{slot}: not a slot of this node's ({self.shm_dir}/{prefix}*)")
        return path

    def _handle(self, req: wire.CkptdRequest) -> wire.Reply:
        """Carry out one request. Raises CheckpointError (or ValueError) for an error reply."""
        match req:
            case wire.Alloc(rank=rank, nbytes=nbytes):
                if rank < 0 or nbytes < 0:
                    raise CheckpointError(f"alloc: rank {rank} and nbytes {nbytes} must be >= 0")
                paths = snapshot.slot_paths(self.shm_dir, self.job, self.node, rank)
                for p in paths:
                    snapshot.create_slot(p, nbytes)
                return wire.AllocReply(slots=tuple(str(p) for p in paths))
            case wire.Staged():
                self.persister.staged(
                    req.rank, self._own_slot(req.slot), req.step, req.generation, req.durable
                )
                return wire.OkReply()
            case wire.Persist(step=step, generation=gen):
                ranks = self.persister.persist_held(step, gen)
                self._emit("ckpt_persist_held", step=step, ranks=ranks)
                return wire.PersistReply(ranks=tuple(ranks))
            case wire.WaitDurable(step=step, timeout_s=timeout_s):
                if not 0 <= timeout_s <= WAIT_DURABLE_MAX_S:
                    raise CheckpointError(
                        f"wait_durable: timeout_s {timeout_s} must be 0..{WAIT_DURABLE_MAX_S:g}"
                    )
                durable = self.persister.wait_durable(step, float(timeout_s))
                failed = None if durable else self.persister.failure(step)
                return wire.WaitDurableReply(durable=durable, failed=failed)
            case wire.Verify():
                return self._verify_once(req)
            case wire.Forget(slot=slot):
                self.persister.forget(self._own_slot(slot))
                return wire.OkReply()
            case wire.Status(rescan=rescan):
                return self._status(rescan)
            case wire.SetPeers(addrs=addrs):
                if self.replicator is not None:
                    self.replicator.set_peers(list(addrs))
                return wire.OkReply()
            case wire.Fetch():
                return self._fetch(req)
            case wire.Shutdown(unlink=unlink):
                self._unlink = unlink
                self._stop.set()
                return wire.OkReply()
            case _:
                assert_never(req)

    def _verify_once(self, req: wire.Verify) -> wire.VerifyReply:
        key = (req.rank, req.step, req.generation)
        with self._lock:
            for k in [k for k in self._verifications if k[3] < req.for_generation]:
                del self._verifications[k]  # older restarts' results are stale
            v = self._verifications.setdefault((*key, req.for_generation), _Verification())
        result = v.result(lambda: self._verify(*key))
        if result.slot is None:  # nothing here yet (a replica may be fetched): ask again
            with self._lock:
                self._verifications.pop((*key, req.for_generation), None)
        return result

    def _status(self, rescan: bool) -> wire.StatusReply:
        if rescan:  # the node's workers are gone: any snapshot they finished
            for rank, path in self._rank_slots():
                what = self.persister.rescan(rank, path)
                if what is not None:
                    self._emit("ckpt_rescanned", rank=rank, slot=path.name, result=what)
        with self._lock:
            events, self._events = self._events, []
        index = self.persister.memory_index()
        return wire.StatusReply(
            memory={str(r): [list(p) for p in v] for r, v in index.items()},
            fingerprints={str(r): v for r, v in self.persister.fingerprints().items()},
            events=tuple(events),
            idle=self.persister.idle(),
            replica_addr=self.replicas.addr if self.replicas else None,
            replicas={str(r): [list(p) for p in v] for r, v in self.replicas.index().items()}
            if self.replicas
            else {},
        )

    def _fetch(self, req: wire.Fetch) -> wire.FetchReply:
        if self.token is None:
            raise CheckpointError("this ckptd has no job token: replicas are off")
        rank, step, gen = req.rank, req.step, req.generation
        dest = snapshot.slot_paths(self.shm_dir, self.job, self.node, rank)[0]
        try:
            replica.pull(req.source, self.token, dest, rank, step, gen)
        except (OSError, ConnectionError) as e:
            raise CheckpointError(f"fetching rank {rank}'s replica failed: {e}") from e
        self.persister.adopt(rank, dest)
        self._emit("replica_fetched", rank=rank, step=step, source=req.source)
        return wire.FetchReply(slot=str(dest))


class _Verification:
    """One verification, computed by the first asker; later askers wait for its result."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._result: wire.VerifyReply | None = None

    def result(self, compute: Callable[[], wire.VerifyReply]) -> wire.VerifyReply:
        with self._lock:  # held while computing: concurrent askers wait for the one result
            if self._result is None:
                self._result = compute()
            return self._result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainguard-ckptd")
    p.add_argument("--job", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--replica-bind", default=None, help="serve peer replicas on this address")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s ckptd[{args.node}] %(levelname)s %(message)s",
    )
    parent = int(os.environ.get("TRAINGUARD_AGENT_PID", "0"))
    if parent:  # a power loss takes the node's memory with it: die with the agent
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            return 1
    # torch and DCP (the durable part's writer) load before ckptd listens: an agent starts its
    # workers once its ckptd listens, and a first durable part that waited for this import
    # (seconds on a loaded host) held up the indexing of every snapshot queued behind it (an
    # in-process recovery then found no checkpoint every rank agreed on). ckptd's own modules
    # import no torch; this is the one place.
    importlib.import_module("trainguard.checkpoint.dcp_part")
    d = Ckptd(
        job=args.job,
        node=args.node,
        ckpt_dir=args.ckpt_dir,
        shm_dir=args.shm_dir,
        keep=args.keep,
        replica_bind=args.replica_bind,
        token=os.environ.get("TRAINGUARD_TOKEN"),
    )
    signal.signal(signal.SIGTERM, lambda *_: d._stop.set())
    log.info(
        "serving %s; %d slot(s) adopted",
        args.node,
        sum(len(v) for v in d.persister.memory_index().values()),
    )
    d.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
