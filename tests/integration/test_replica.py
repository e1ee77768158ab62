"""Peer replicas over real sockets: only a client holding the job token can push or pull;
a replica that does not match its checksums is never published."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import replica, snapshot
from trainguard.checkpoint.api import CheckpointError

TOKEN = "ab" * 16
JOB = "repltest"


def _slot(shm: Path, step: int) -> tuple[Path, dict[str, list[int]]]:
    tensors = {"w": torch.arange(1000, dtype=torch.float32) * step}
    layout = snapshot.Layout.plan(tensors, 64)
    path = shm / f"trainguard-{JOB}-src-r0-s0"
    snapshot.create_slot(path, layout.total_bytes)
    s = snapshot.Slot(path, writable=True)
    s.begin()
    s.write_tensors(layout, tensors)
    s.commit(layout, b"\x80\x04}\x94.", {"step": step, "generation": 0, "rank": 0})
    h = s.header()
    assert h is not None
    sums = s.checksums(h)
    s.close()
    return path, sums


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[replica.ReplicaServer, list[tuple[str, dict]]]]:
    events: list[tuple[str, dict]] = []
    srv = replica.ReplicaServer(
        token=TOKEN,
        bind="127.0.0.1",
        shm_dir=tmp_path,
        job=JOB,
        node="dst",
        emit=lambda kind, **d: events.append((kind, d)),
    )
    yield srv, events
    srv.close()


def test_push_and_pull_with_the_token(tmp_path: Path, server: tuple) -> None:
    srv, events = server
    slot, sums = _slot(tmp_path, 7)
    replica.push(srv.addr, TOKEN, slot, 0, 7, 0, sums)
    assert srv.index() == {0: [(7, 0)]}
    dest = tmp_path / f"trainguard-{JOB}-new-r0-s0"
    replica.pull(srv.addr, TOKEN, dest, 0, 7, 0)
    assert dest.read_bytes() == slot.read_bytes()
    assert snapshot.read_sums(dest, 7, 0) == sums
    with pytest.raises(CheckpointError, match="no replica"):
        replica.pull(srv.addr, TOKEN, dest, 0, 8, 0)


def test_wrong_or_missing_token_is_refused(tmp_path: Path, server: tuple) -> None:
    srv, events = server
    slot, sums = _slot(tmp_path, 3)
    with pytest.raises((ConnectionError, OSError, CheckpointError)):
        replica.push(srv.addr, "cd" * 16, slot, 0, 3, 0, sums)
    with pytest.raises((ConnectionError, OSError, CheckpointError)):
        replica.pull(srv.addr, "cd" * 16, tmp_path / "x-r0-s0", 0, 3, 0)
    host, port = srv.addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:  # no proof at all
        raw.recv(replica.NONCE_BYTES)
        raw.sendall(b'{"op": "pull", "rank": 0, "step": 3, "generation": 0}\n' + b"\0" * 32)
        try:
            answer = raw.recv(100)
        except ConnectionResetError:
            answer = b""
        assert answer == b""  # closed without an answer
    assert srv.index() == {}
    assert [k for k, _ in events].count("replica_rejected") == 3


def test_a_corrupted_push_is_not_published(tmp_path: Path, server: tuple) -> None:
    srv, events = server
    slot, sums = _slot(tmp_path, 5)
    bad = {**sums, "w": [x ^ 1 for x in sums["w"]]}
    with pytest.raises(CheckpointError, match="checksum"):
        replica.push(srv.addr, TOKEN, slot, 0, 5, 0, bad)
    assert srv.index() == {}
    assert not list(tmp_path.glob("*replica*"))
