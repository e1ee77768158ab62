"""Peer memory replicas: each ckptd copies its newest verified snapshots to another node's
ckptd, so a node whose memory is gone can be replaced without reading the durable tier.

Transport: TCP between ckptds, on the address the node advertises. Every connection
starts with a challenge: the server sends a 16-byte nonce, the client answers
HMAC-SHA256(job token, nonce); a wrong answer closes the connection (and is logged)
before anything else is read. Then one request as a JSON line, and raw bytes:

- ``{"op": "push", "rank", "step", "generation", "sums", "nbytes"}`` + the slot's bytes →
  ``{"ok": true}`` once stored and verified against ``sums`` (else ``{"error": …}``)
- ``{"op": "pull", "rank", "step", "generation"}`` → ``{"sums", "nbytes"}`` + the bytes, or
  ``{"error": …}``

Nothing received is unpickled: requests are JSON, snapshots are bytes checked by CRC-32C.
A replica is a file in the slot format (``<shm>/trainguard-<job>-<node>-replica-r<rank>``,
with its ``.sum``), so the receiving side verifies and restores it like a local slot.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import io
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainguard.checkpoint import snapshot
from trainguard.checkpoint.api import CheckpointError

log = logging.getLogger("trainguard.replica")
NONCE_BYTES = 16
IO_TIMEOUT_S = 60.0  # per socket operation
PROOF_TIMEOUT_S = 5.0  # an unauthenticated client gets this long to prove the token
MAX_CLIENTS = 32  # concurrent connections served; more wait in the listen backlog
_BUF = 8 << 20


def _proof(token: str, nonce: bytes) -> bytes:
    return hmac.new(bytes.fromhex(token), nonce + b"trainguard-replica", hashlib.sha256).digest()


def _recv_exact(r: io.BufferedReader, n: int) -> bytes:
    """``n`` bytes from the connection's buffered reader ``r`` (its socket's timeout applies to
    each read); ConnectionError if the peer closes first."""
    buf = r.read(n)
    if len(buf) < n:
        raise ConnectionError("peer closed the connection")
    return buf


def _recv_line(r: io.BufferedReader, limit: int = 1 << 20) -> dict[str, Any]:
    """One JSON line of at most ``limit`` bytes from the buffered reader ``r``. (A reader, not
    the socket: the line ends where the snapshot's bytes may begin. A push's line carries a
    CRC per piece of every tensor, kilobytes: read a byte per ``recv``, a 7 KB line cost 17 ms
    of CPU on this project's 2-core VM, against 0.16 ms through the reader.)"""
    buf = r.readline(limit + 1)
    if not buf.endswith(b"\n"):
        raise ConnectionError("peer closed the connection or sent an oversized line")
    return dict(json.loads(buf))


def _send_line(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _recv_into_file(r: io.BufferedReader, path: Path, nbytes: int) -> None:
    with open(path, "wb") as f:
        left = nbytes
        buf = bytearray(min(_BUF, max(1, nbytes)))
        view = memoryview(buf)
        while left:
            n = r.readinto(view[: min(left, len(buf))])
            if not n:
                raise ConnectionError("peer closed the connection mid-snapshot")
            f.write(view[:n])
            left -= n


def replica_path(shm_dir: Path, job: str, node: str, rank: int) -> Path:
    return shm_dir / f"trainguard-{job}-{node}-replica-r{rank}"


def store_verified(tmp: Path, final: Path, rank: int, step: int, gen: int, sums: Any) -> str | None:
    """Check a received snapshot file against ``sums``; publish it as ``final`` (with its
    ``.sum``) if it verifies. Returns the problem, or None."""
    h = snapshot.peek_header(tmp)
    if h is None or (h["step"], h["generation"], h["rank"]) != (step, gen, rank):
        tmp.unlink(missing_ok=True)
        return "received snapshot is torn or not the one announced"
    slot = snapshot.Slot(tmp, writable=False)
    try:
        ok = slot.checksums(h) == sums
    finally:
        slot.close()
    if not ok:
        tmp.unlink(missing_ok=True)
        return "received snapshot fails its checksums"
    snapshot.sums_path(final).unlink(missing_ok=True)  # never a stale .sum beside new bytes
    os.replace(tmp, final)
    snapshot.write_sums(final, step, gen, sums, persisted=True)
    return None


class ReplicaServer:
    """Accepts pushes (replicas of peers' snapshots) and serves pulls, token-authenticated.

    Args:
        token: the job token (hex); ``bind``: address to listen on (port 0: any).
        shm_dir, job, node: where replicas live (named per job, receiving node and rank).
        emit: ``emit(kind, **data)`` for events.
    """

    def __init__(
        self,
        *,
        token: str,
        bind: str,
        shm_dir: Path,
        job: str,
        node: str,
        emit: Callable[..., None],
    ) -> None:
        self.token, self.shm_dir, self.job, self.node, self.emit = token, shm_dir, job, node, emit
        self.sock = socket.create_server((bind, 0))
        self.sock.settimeout(0.2)
        self.addr = f"{bind}:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        threading.Thread(target=self._serve, name="replica-server", daemon=True).start()

    def index(self) -> dict[int, list[tuple[int, int]]]:
        """Source rank → (step, generation) of the verified replica held here."""
        out: dict[int, list[tuple[int, int]]] = {}
        for path in self.shm_dir.glob(f"trainguard-{self.job}-{self.node}-replica-r*"):
            if path.name.endswith((".sum", ".tmp")):
                continue
            h = snapshot.peek_header(path)
            if h is not None and snapshot.read_sums(path, h["step"], h["generation"]) is not None:
                out.setdefault(int(h["rank"]), []).append((h["step"], h["generation"]))
        return out

    def close(self) -> None:
        self._stop.set()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            if not self._slots.acquire(timeout=PROOF_TIMEOUT_S):
                conn.close()  # flooded: drop rather than queue unbounded threads
                continue
            threading.Thread(
                target=self._client, args=(conn, peer), name="replica-client", daemon=True
            ).start()
        self.sock.close()

    def _client(self, conn: socket.socket, peer: Any) -> None:
        with conn, conn.makefile("rb") as r:
            try:
                conn.settimeout(PROOF_TIMEOUT_S)
                nonce = os.urandom(NONCE_BYTES)
                conn.sendall(nonce)
                if not hmac.compare_digest(_recv_exact(r, 32), _proof(self.token, nonce)):
                    log.warning("rejected an unauthenticated replica client from %s", peer)
                    self.emit("replica_rejected", peer=str(peer[0]))
                    return
                conn.settimeout(IO_TIMEOUT_S)
                req = _recv_line(r)
                if req.get("op") == "push":
                    _send_line(conn, self._push(r, req))
                elif req.get("op") == "pull":
                    self._pull(conn, req)
                else:
                    _send_line(conn, {"error": f"unknown op {req.get('op')!r}"})
            except (OSError, ValueError, KeyError, ConnectionError) as e:
                log.warning("replica connection from %s failed: %s", peer, e)
            finally:
                self._slots.release()

    def _push(self, r: io.BufferedReader, req: dict[str, Any]) -> dict[str, Any]:
        rank, step, gen = int(req["rank"]), int(req["step"]), int(req["generation"])
        final = replica_path(self.shm_dir, self.job, self.node, rank)
        tmp = final.with_name(final.name + ".tmp")
        with self._lock:  # one push per rank at a time is plenty; keeps the file logic simple
            try:
                _recv_into_file(r, tmp, int(req["nbytes"]))
            except BaseException:
                tmp.unlink(missing_ok=True)  # torn (the sender died or stalled): free its memory
                raise
            problem = store_verified(tmp, final, rank, step, gen, req["sums"])
        if problem:
            return {"error": problem}
        self.emit("replica_stored", rank=rank, step=step, snapshot_generation=gen)
        return {"ok": True}

    def _pull(self, conn: socket.socket, req: dict[str, Any]) -> None:
        rank, step, gen = int(req["rank"]), int(req["step"]), int(req["generation"])
        path = replica_path(self.shm_dir, self.job, self.node, rank)
        with self._lock:
            h = snapshot.peek_header(path)
            sums = snapshot.read_sums(path, step, gen)
            if h is None or (h["step"], h["generation"]) != (step, gen) or sums is None:
                _send_line(conn, {"error": f"no replica of rank {rank} step {step} here"})
                return
            nbytes = path.stat().st_size
            _send_line(conn, {"sums": sums, "nbytes": nbytes})
            with open(path, "rb") as f:
                conn.sendfile(f)


@contextlib.contextmanager
def _connect(addr: str, token: str) -> Iterator[tuple[socket.socket, io.BufferedReader]]:
    """A connection to the replica server at ``addr`` that answered its challenge: (the socket,
    its buffered reader); both closed on leaving. Raises OSError or ConnectionError."""
    host, port = addr.rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=IO_TIMEOUT_S) as sock,
        sock.makefile("rb") as r,
    ):
        sock.sendall(_proof(token, _recv_exact(r, NONCE_BYTES)))
        yield sock, r


def push(addr: str, token: str, slot: Path, rank: int, step: int, gen: int, sums: Any) -> None:
    """Send ``slot`` (holding rank's (step, gen)) to the replica server at ``addr``, under a
    shared lock (the writer then stages into the other slot). Raises OSError, ConnectionError
    or CheckpointError (the peer refused it, or the slot changed)."""
    with open(slot, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        h = snapshot.peek_header(slot)
        if h is None or (h["step"], h["generation"]) != (step, gen):
            raise CheckpointError("the snapshot was overwritten before it was replicated")
        nbytes = os.fstat(f.fileno()).st_size
        with _connect(addr, token) as (sock, r):
            req = {"op": "push", "rank": rank, "step": step, "generation": gen}
            _send_line(sock, {**req, "sums": sums, "nbytes": nbytes})
            sock.sendfile(f)
            reply = _recv_line(r)
    if "error" in reply:
        raise CheckpointError(f"replica peer {addr}: {reply['error']}")


def pull(addr: str, token: str, dest: Path, rank: int, step: int, gen: int) -> None:
    """Fetch the replica of rank's (step, gen) from ``addr`` into the slot file ``dest``,
    verified by its checksums before it is published. Raises OSError, ConnectionError or
    CheckpointError."""
    tmp = dest.with_name(dest.name + ".pull")
    with _connect(addr, token) as (sock, r):
        _send_line(sock, {"op": "pull", "rank": rank, "step": step, "generation": gen})
        reply = _recv_line(r)
        if "error" in reply:
            raise CheckpointError(f"replica peer {addr}: {reply['error']}")
        try:
            _recv_into_file(r, tmp, int(reply["nbytes"]))
        except BaseException:
            tmp.unlink(missing_ok=True)  # torn (the server died or stalled): free its memory
            raise
    problem = store_verified(tmp, dest, rank, step, gen, reply["sums"])
    if problem:
        raise CheckpointError(f"replica from {addr}: {problem}")


class Replicator:
    """Sends each newly verified snapshot to the peers, newest per rank only, in the
    background (the training step never waits for it)."""

    def __init__(self, token: str, emit: Callable[..., None]) -> None:
        self.token, self.emit = token, emit
        self.peers: list[str] = []
        self._cv = threading.Condition()
        self._latest: dict[int, tuple[Path, int, int, Any]] = {}
        threading.Thread(target=self._run, name="replicator", daemon=True).start()

    def set_peers(self, addrs: list[str]) -> None:
        with self._cv:
            self.peers = list(addrs)

    def offer(self, rank: int, slot: Path, step: int, gen: int, sums: Any) -> None:
        with self._cv:
            if not self.peers:
                return
            self._latest[rank] = (slot, step, gen, sums)
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._latest:
                    self._cv.wait()
                rank = min(self._latest)
                slot, step, gen, sums = self._latest.pop(rank)
                peers = list(self.peers)
            for peer in peers:
                try:
                    push(peer, self.token, slot, rank, step, gen, sums)
                except (OSError, ConnectionError, CheckpointError) as e:
                    with contextlib.suppress(Exception):
                        self.emit("replica_failed", rank=rank, step=step, peer=peer, reason=str(e))
