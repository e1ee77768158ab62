"""Faults of the replica server (a thread of ckptd) and of its clients, for real: each ckptd is
a process of its own, SIGKILLed or SIGSTOPped in the middle of a transfer of a slot larger than
every socket buffer between the two ends; a pusher, or a client that never answers the
challenge, is a process of its own too. Each test checks that the replica that was whole before
the fault is whole after it, byte for byte, and that a torn transfer is never published
(docs/self-faults.md §9, "Replica server"). No job runs, so no rank is blamed: the fault is
trainguard's own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.conftest import ROOT, private_tmpfs, wait_for
from trainguard.checkpoint import replica, snapshot
from trainguard.checkpoint.api import CheckpointError
from trainguard.checkpoint.ckptd import CkptdClient, socket_name, spawn
from trainguard.protocol.ckptd import Fetch, Shutdown, Status, StatusReply

HELPER = ROOT / "tests" / "helpers" / "replica_proc.py"
# ckptd listens on an abstract socket named after job and node: one job per test process.
JOB = f"replfault{os.getpid()}"
TOKEN = "5a" * 16


def _tcp_max(name: str) -> int:
    return int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])


# The most bytes of a transfer between two local processes that can be past the sender and
# not yet in the receiver's file: the sender's send buffer, the receiver's receive buffer, each
# at its largest, the receiving loop's own buffer and its socket reader's. A receiver stopped
# with fewer than nbytes - INFLIGHT in its file has a sender that is still sending.
INFLIGHT = _tcp_max("tcp_rmem") + _tcp_max("tcp_wmem") + replica._BUF + io.DEFAULT_BUFFER_SIZE
BIG = INFLIGHT + (64 << 20)  # a slot whose transfer outlasts every buffer
SMALL = 1 << 20


# --- processes ------------------------------------------------------------------------


class Daemon:
    """A ckptd serving replicas on 127.0.0.1, port 0, from ``shm_dir``."""

    def __init__(self, tmp: Path, shm_dir: Path, node: str) -> None:
        self.node, self.shm_dir, self.log = node, shm_dir, tmp / f"ckptd-{node}.log"
        self.events: list[dict[str, Any]] = []
        env = {k: v for k, v in os.environ.items() if k != "TRAINGUARD_AGENT_PID"}
        env.update({"TRAINGUARD_TOKEN": TOKEN, "TRAINGUARD_RUN_DIR": str(tmp)})
        self.proc = spawn(
            job=JOB,
            node=node,
            ckpt_dir=tmp / f"ckpt-{node}",
            shm_dir=shm_dir,
            keep=2,
            log=self.log,
            env=env,
            timeout_s=90.0,
            replica_bind="127.0.0.1",
        )
        addr = self.status().replica_addr
        assert addr is not None
        self.addr: str = addr

    def call(self, req: Any, timeout_s: float = 30.0) -> Any:
        c = CkptdClient(socket_name(JOB, self.node), timeout_s=timeout_s)
        try:
            return c.call(req, timeout_s=timeout_s)
        finally:
            c.close()

    def status(self) -> StatusReply:
        reply: StatusReply = self.call(Status())
        self.events.extend(reply.events)
        return reply

    def replicas(self) -> dict[str, list[list[int]]]:
        return dict(self.status().replicas)

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL, stopped or not
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            with contextlib.suppress(OSError, CheckpointError):
                self.call(Shutdown(unlink=True), timeout_s=5.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            self.kill()


class Helper:
    """tests/helpers/replica_proc.py in a process of its own; its stdout lines collected."""

    def __init__(self, tmp: Path, *args: str) -> None:
        with open(tmp / "helpers.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HELPER), *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, "TRAINGUARD_TOKEN": TOKEN, "TRAINGUARD_RUN_DIR": str(tmp)},
            )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def line(self, timeout: float) -> str:
        return str(wait_for(lambda: self.lines[:1], timeout, f"a line from {HELPER.name}")[0])

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f and f.close()


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A private tmpfs: the pusher's slots in ``src/``, each ckptd's memory in ``<node>/``."""
    with private_tmpfs(tmp_path / "shm", "2g") as d:
        for sub in ("src", "a", "b", "check"):
            (d / sub).mkdir()
        yield d


@pytest.fixture
def procs(tmp_path: Path, shm: Path) -> Iterator[list[Daemon | Helper]]:
    """Everything a test starts; stopped (woken first, if frozen) at its end."""
    started: list[Daemon | Helper] = []
    yield started
    for p in reversed(started):
        p.close()


def _ckptd(procs: list[Daemon | Helper], tmp: Path, shm_dir: Path, node: str) -> Daemon:
    d = Daemon(tmp, shm_dir, node)
    procs.append(d)
    return d


def _helper(procs: list[Daemon | Helper], tmp: Path, *args: str) -> Helper:
    h = Helper(tmp, *args)
    procs.append(h)
    return h


# --- slots and checks -----------------------------------------------------------------


def _slot(src: Path, rank: int, step: int, nbytes: int) -> tuple[Path, dict[str, list[int]]]:
    """A complete snapshot slot of ``rank``'s ``step`` (every float == step * 10 + rank)."""
    tensors = {"w": torch.full((nbytes // 4,), float(step * 10 + rank))}
    layout = snapshot.Layout.plan(tensors, 64)
    path = src / f"trainguard-{JOB}-src-r{rank}-s{step}"
    snapshot.create_slot(path, layout.total_bytes)
    s = snapshot.Slot(path, writable=True)
    s.begin()
    s.write_tensors(layout, tensors)
    s.commit(layout, b"\x80\x04}\x94.", {"step": step, "generation": 0, "rank": rank})
    h = s.header()
    assert h is not None
    sums = s.checksums(h)
    s.close()
    return path, sums


class _Slots(dict[int, tuple[Path, dict[str, list[int]]]]):
    """Step → rank 0's slot of that step and its sums, made when first asked for."""

    def __init__(self, src: Path, nbytes: int) -> None:
        super().__init__()
        self.src, self.nbytes = src, nbytes

    def __missing__(self, step: int) -> tuple[Path, dict[str, list[int]]]:
        self[step] = made = _slot(self.src, 0, step, self.nbytes)
        return made


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return path.stat().st_size, h.hexdigest()


def _pulled_whole(
    shm: Path, addr: str, slot: Path, rank: int, step: int, sums: dict[str, list[int]]
) -> int:
    """Pull rank's ``step`` from ``addr`` and check it equals ``slot`` byte for byte, with
    its checksums. Returns the bytes checked."""
    dest = shm / "check" / f"trainguard-{JOB}-check-r{rank}-s0"
    replica.pull(addr, TOKEN, dest, rank, step, 0)
    try:
        assert _digest(dest) == _digest(slot), f"rank {rank} step {step} pulled != pushed"
        assert snapshot.read_sums(dest, step, 0) == sums
        return dest.stat().st_size
    finally:
        dest.unlink(missing_ok=True)
        snapshot.sums_path(dest).unlink(missing_ok=True)


def _replica_whole(d: Daemon, slot: Path, rank: int, step: int) -> int:
    """The replica file ``d`` holds for ``rank`` is ``slot``'s bytes, its .sum ``step``'s."""
    path = replica.replica_path(d.shm_dir, JOB, d.node, rank)
    assert _digest(path) == _digest(slot), f"rank {rank}'s replica is not step {step}'s bytes"
    assert snapshot.read_sums(path, step, 0) is not None
    return path.stat().st_size


def _tmp_of(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")  # where the server receives a push


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (a SIGSTOP reaches threads one by one)."""
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            stat = Path(f"/proc/{pid}/task/{t}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                return False
    except FileNotFoundError:
        return False
    return True


class Missed(Exception):
    """The transfer finished before it could be frozen in its middle."""


def _freeze_mid_transfer(
    pid: int, growing: Path, nbytes: int, finished: Callable[[], bool], timeout: float = 120.0
) -> int:
    """Leave ``pid`` SIGSTOPped while ``growing`` holds part of an ``nbytes`` transfer and
    the process at the other end is still sending: stepped with SIGCONT/SIGSTOP and looked at
    only while stopped. Returns the size seen. Raises Missed if ``finished()`` first."""
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline:
        n += 1
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: _stopped(pid), 30, f"pid {pid} to stop")
        size = growing.stat().st_size if growing.exists() else 0
        if 0 < size < nbytes - INFLIGHT:
            print(f"frozen after {n} steps at {size}")
            return size
        os.kill(pid, signal.SIGCONT)
        if finished():
            print(f"missed after {n} steps at {size}")
            raise Missed
        time.sleep(0.001)  # a step: the process runs this long, then is stopped again
    raise AssertionError(f"{growing.name} never caught mid-transfer in {timeout}s")


def _locked(path: Path) -> bool:
    """Does another open file hold a lock on ``path`` (an exclusive one cannot be had)?"""
    with open(path, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def _log_count(d: Daemon, pattern: str) -> int:
    return len(re.findall(pattern, d.log.read_text()))


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a thread; its result or exception and seconds land in the dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["result"] = fn()
        except Exception as e:
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# --- tests ----------------------------------------------------------------------------


def test_a_restarted_server_is_on_a_new_port_and_serves_the_replicas_it_finds(
    tmp_path: Path, shm: Path, procs: list[Daemon | Helper]
) -> None:
    """Rows "TCP listener … port 0" and "Replica files across a ckptd restart"."""
    src = shm / "src"
    a = _ckptd(procs, tmp_path, shm / "a", "nodeA")
    failed: list[dict[str, Any]] = []
    repl = replica.Replicator(TOKEN, lambda kind, **d: failed.append({"kind": kind, **d}))
    repl.set_peers([a.addr])
    slots = {r: _slot(src, r, 1, 4 * SMALL) for r in range(3)}
    for r, (path, sums) in slots.items():
        repl.offer(r, path, 1, 0, sums)
    wait_for(lambda: len(a.replicas()) == 3, 60, "three replicas stored")
    assert not failed
    # SIGKILL. Left in memory as a kill can leave them: rank 2's .sum gone (killed between the
    # .sum unlink and its write), and a torn .tmp of rank 1 (killed mid-push).
    old = a.addr
    a.kill()
    snapshot.sums_path(replica.replica_path(a.shm_dir, JOB, "nodeA", 2)).unlink()
    torn = _tmp_of(replica.replica_path(a.shm_dir, JOB, "nodeA", 1))
    torn.write_bytes(slots[1][0].read_bytes()[: SMALL // 2])
    a2 = _ckptd(procs, tmp_path, shm / "a", "nodeA")
    assert a2.addr != old  # port 0 again: a new port, the peers still name the old one
    assert a2.replicas() == {"0": [[1, 0]], "1": [[1, 0]]}  # read again; rank 2: none
    checked = sum(_pulled_whole(shm, a2.addr, slots[r][0], r, 1, slots[r][1]) for r in (0, 1))
    with pytest.raises(CheckpointError, match="no replica of rank 2"):
        replica.pull(a2.addr, TOKEN, shm / "check" / "x-r2-s0", 2, 1, 0)
    # Pushes to the old address fail, said as replica_failed, until the peers are told.
    slots2 = {r: _slot(src, r, 2, 4 * SMALL) for r in (0, 2)}
    for r in (0, 2):
        repl.offer(r, slots2[r][0], 2, 0, slots2[r][1])
    wait_for(lambda: len(failed) == 2, 60, "both pushes to the old port to fail")
    for e in failed:
        assert e["kind"] == "replica_failed" and e["peer"] == old, e
        assert "refused" in e["reason"].lower(), e
    assert a2.replicas() == {"0": [[1, 0]], "1": [[1, 0]]}
    repl.set_peers([a2.addr])
    for r in (0, 2):
        repl.offer(r, slots2[r][0], 2, 0, slots2[r][1])
    wait_for(lambda: a2.replicas() == {"0": [[2, 0]], "1": [[1, 0]], "2": [[2, 0]]}, 60, "pushed")
    assert len(failed) == 2  # nothing failed once the new address was given
    checked += sum(_pulled_whole(shm, a2.addr, slots2[r][0], r, 2, slots2[r][1]) for r in (0, 2))
    checked += _pulled_whole(shm, a2.addr, slots[1][0], 1, 1, slots[1][1])
    print(f"bytes checked: {checked}")


def _push_frozen(
    a: Daemon, slots: dict[int, tuple[Path, dict[str, list[int]]]], push: Callable[..., Any]
) -> tuple[int, int, Any]:
    """Push steps 2, 3, … of rank 0 to ``a`` (``push(step)`` starts one and returns a handle
    and a "finished" test) until ``a`` is frozen in the middle of receiving one. Returns
    (the step whose replica is whole, the step caught mid-push, the push's handle)."""
    tmp = _tmp_of(replica.replica_path(a.shm_dir, JOB, a.node, 0))
    prev = 1
    for step in range(2, 7):
        handle, finished = push(step)
        try:
            _freeze_mid_transfer(a.proc.pid, tmp, os.path.getsize(slots[step][0]), finished)
        except Missed:
            wait_for(lambda s=step: a.replicas() == {"0": [[s, 0]]}, 60, f"step {step} stored")
            prev = step
            continue
        return prev, step, handle
    raise AssertionError("five pushes in a row finished before they could be frozen")


def test_a_receiver_killed_mid_push_keeps_the_previous_replica(
    tmp_path: Path, shm: Path, procs: list[Daemon | Helper]
) -> None:
    """Row "Push into <shm>/…-replica-r<rank>.tmp": receiver SIGKILLed mid-push."""
    a = _ckptd(procs, tmp_path, shm / "a", "nodeA")
    slots = _Slots(shm / "src", BIG)
    replica.push(a.addr, TOKEN, slots[1][0], 0, 1, 0, slots[1][1])

    def push(step: int) -> tuple[dict[str, Any], Callable[[], bool]]:
        _, out = _in_thread(lambda: replica.push(a.addr, TOKEN, *_args(slots, step)))
        return out, lambda: "seconds" in out

    prev, step, out = _push_frozen(a, slots, push)
    tmp = _tmp_of(replica.replica_path(a.shm_dir, JOB, "nodeA", 0))
    torn = tmp.stat().st_size
    t0 = time.monotonic()
    a.kill()
    wait_for(lambda: "seconds" in out, 60, "the push to fail")
    assert isinstance(out.get("error"), OSError), out  # reset or broken pipe, not a hang
    assert tmp.stat().st_size == torn < os.path.getsize(slots[step][0])  # left, torn
    checked = _replica_whole(a, slots[prev][0], 0, prev)  # never published; previous whole
    a2 = _ckptd(procs, tmp_path, shm / "a", "nodeA")
    assert a2.replicas() == {"0": [[prev, 0]]}
    checked += _pulled_whole(shm, a2.addr, slots[prev][0], 0, prev, slots[prev][1])
    print(
        f"push failed {out['seconds']:.2f}s into it, {time.monotonic() - t0:.2f}s after the kill;"
        f" torn .tmp {torn} of {os.path.getsize(slots[step][0])} bytes; bytes checked {checked}"
    )


def _args(
    slots: dict[int, tuple[Path, dict[str, list[int]]]], step: int
) -> tuple[Path, int, int, int, dict[str, list[int]]]:
    return slots[step][0], 0, step, 0, slots[step][1]


def test_a_sender_killed_mid_push_publishes_nothing(
    tmp_path: Path, shm: Path, procs: list[Daemon | Helper]
) -> None:
    """Row "Sender killed mid-push": the receiver sees the connection close, drops the torn
    ``.tmp`` and keeps the previous replica."""
    a = _ckptd(procs, tmp_path, shm / "a", "nodeA")
    slots = _Slots(shm / "src", BIG)
    replica.push(a.addr, TOKEN, slots[1][0], 0, 1, 0, slots[1][1])

    def push(step: int) -> tuple[Helper, Callable[[], bool]]:
        path, rank, _, gen, sums = _args(slots, step)
        h = _helper(
            procs, tmp_path, "push", a.addr, str(path), "0", str(step), "0", json.dumps(sums)
        )
        return h, lambda: bool(h.lines)

    before = _log_count(a, "peer closed the connection mid-snapshot")
    prev, step, sender = _push_frozen(a, slots, push)
    os.kill(sender.proc.pid, signal.SIGKILL)  # mid-sendfile: it has more to send
    sender.proc.wait(timeout=30)
    os.kill(a.proc.pid, signal.SIGCONT)
    wait_for(
        lambda: _log_count(a, "peer closed the connection mid-snapshot") > before,
        60,
        "the receiver to see the connection close",
    )
    tmp = _tmp_of(replica.replica_path(a.shm_dir, JOB, "nodeA", 0))
    assert not tmp.exists()  # the torn bytes are dropped, not left in memory
    assert a.replicas() == {"0": [[prev, 0]]}
    assert not [e for e in a.events if e["kind"] == "replica_stored" and e["step"] == step]
    checked = _replica_whole(a, slots[prev][0], 0, prev)
    checked += _pulled_whole(shm, a.addr, slots[prev][0], 0, prev, slots[prev][1])
    # The server's lock is free again: the next push is stored.
    nxt = step + 1
    replica.push(a.addr, TOKEN, *_args(slots, nxt))
    assert a.replicas() == {"0": [[nxt, 0]]}
    print(f"bytes checked {checked}")


@pytest.mark.slow
def test_a_frozen_receiver_blocks_a_push_for_its_socket_deadline_then_frees_the_slot(
    tmp_path: Path, shm: Path, procs: list[Daemon | Helper]
) -> None:
    """Row "Replicator's push holds a shared flock on the source slot": receiver SIGSTOPped
    mid-push. The deadline is replica.IO_TIMEOUT_S (60 s a socket operation), a module
    constant no caller can lower: hence slow."""
    a = _ckptd(procs, tmp_path, shm / "a", "nodeA")
    slots = _Slots(shm / "src", BIG)
    replica.push(a.addr, TOKEN, *_args(slots, 1))

    def push(step: int) -> tuple[dict[str, Any], Callable[[], bool]]:
        _, out = _in_thread(lambda: replica.push(a.addr, TOKEN, *_args(slots, step)))
        return out, lambda: "seconds" in out

    prev, step, out = _push_frozen(a, slots, push)
    frozen_at = time.monotonic()
    source = slots[step][0]
    assert _locked(source)  # the writer cannot reuse the slot while the push waits
    wait_for(lambda: "seconds" in out, replica.IO_TIMEOUT_S + 120, "the push to give up")
    waited = time.monotonic() - frozen_at
    assert isinstance(out.get("error"), TimeoutError), out
    assert out["seconds"] >= replica.IO_TIMEOUT_S  # its deadline, not sooner
    assert not _locked(source)  # released with the failure: the writer may use it again
    assert _tmp_of(replica.replica_path(a.shm_dir, JOB, "nodeA", 0)).exists()  # frozen: as was
    before = _log_count(a, "peer closed the connection mid-snapshot")
    os.kill(a.proc.pid, signal.SIGCONT)  # woken: the rest of the bytes, then the close
    wait_for(
        lambda: _log_count(a, "peer closed the connection mid-snapshot") > before,
        60,
        "the woken receiver to see the connection closed",
    )
    assert not _tmp_of(replica.replica_path(a.shm_dir, JOB, "nodeA", 0)).exists()
    assert a.replicas() == {"0": [[prev, 0]]}
    checked = _replica_whole(a, slots[prev][0], 0, prev)
    checked += _pulled_whole(shm, a.addr, slots[prev][0], 0, prev, slots[prev][1])
    replica.push(a.addr, TOKEN, *_args(slots, step))  # the same snapshot, once it is awake
    assert a.replicas() == {"0": [[step, 0]]}
    checked += _pulled_whole(shm, a.addr, source, 0, step, slots[step][1])
    print(
        f"push gave up {waited:.1f}s after the freeze ({out['seconds']:.1f}s in all); "
        f"bytes checked {checked}"
    )


def _pull_frozen(
    a: Daemon, b: Daemon, shm: Path
) -> tuple[int, dict[int, tuple[Path, dict[str, list[int]]]], dict[str, Any]]:
    """Have ``b`` fetch rank 0's replica from ``a`` (steps 1, 2, … pushed first) until ``a``
    is frozen in the middle of serving it. Returns (that step, the slots, the fetch's
    outcome)."""
    pulling = snapshot.slot_paths(b.shm_dir, JOB, b.node, 0)[0]
    pulling = pulling.with_name(pulling.name + ".pull")
    slots = _Slots(shm / "src", BIG)
    for step in range(1, 6):
        replica.push(a.addr, TOKEN, *_args(slots, step))
        _, out = _in_thread(
            lambda s=step: b.call(Fetch(rank=0, step=s, generation=0, source=a.addr), 240.0)
        )
        try:
            _freeze_mid_transfer(
                a.proc.pid, pulling, os.path.getsize(slots[step][0]), lambda o=out: "seconds" in o
            )
        except Missed:
            wait_for(lambda o=out: "seconds" in o, 60, "the fetch")
            assert "result" in out, out
            continue
        return step, slots, out
    raise AssertionError("five fetches in a row finished before they could be frozen")


def _fetch_failed_cleanly(b: Daemon, step: int, out: dict[str, Any]) -> None:
    """``b``'s fetch of ``step`` failed with a CheckpointError, left no ``.pull`` and
    published nothing."""
    assert isinstance(out.get("error"), CheckpointError), out
    assert "fetching rank 0's replica failed" in str(out["error"]), out
    dest = snapshot.slot_paths(b.shm_dir, JOB, b.node, 0)[0]
    assert not dest.with_name(dest.name + ".pull").exists()  # torn bytes not left in memory
    assert [step, 0] not in b.status().memory.get("0", [])
    h = snapshot.peek_header(dest)
    assert h is None or h["step"] != step
    assert not [e for e in b.events if e["kind"] == "replica_fetched" and e["step"] == step]


def test_a_server_killed_mid_pull_fails_the_fetch_and_publishes_nothing(
    tmp_path: Path, shm: Path, procs: list[Daemon | Helper]
) -> None:
    """Row "Pull served by sendfile": server SIGKILLed mid-pull. The fetching ckptd answers
    an error (its rank falls back to the durable tier); a restarted server still has it."""
    a = _ckptd(procs, tmp_path, shm / "a", "nodeA")
    b = _ckptd(procs, tmp_path, shm / "b", "nodeB")
    step, slots, out = _pull_frozen(a, b, shm)
    t0 = time.monotonic()
    a.kill()
    wait_for(lambda: "seconds" in out, 60, "the fetch to fail")
    failed_after = time.monotonic() - t0
    _fetch_failed_cleanly(b, step, out)
    a2 = _ckptd(procs, tmp_path, shm / "a", "nodeA")
    assert a2.replicas() == {"0": [[step, 0]]}
    b.call(Fetch(rank=0, step=step, generation=0, source=a2.addr), 240.0)
    dest = snapshot.slot_paths(b.shm_dir, JOB, b.node, 0)[0]
    assert _digest(dest) == _digest(slots[step][0])
    assert [step, 0] in b.status().memory["0"]
    print(f"fetch failed {failed_after:.2f}s after the kill; bytes checked {dest.stat().st_size}")


@pytest.mark.slow
def test_a_server_frozen_mid_pull_fails_the_fetch_at_its_deadline(
    tmp_path: Path, shm: Path, procs: list[Daemon | Helper]
) -> None:
    """Row "Pull served by sendfile": server SIGSTOPped mid-pull; the fetch gives up after
    replica.IO_TIMEOUT_S (60 s) and publishes nothing; the woken server serves again."""
    a = _ckptd(procs, tmp_path, shm / "a", "nodeA")
    b = _ckptd(procs, tmp_path, shm / "b", "nodeB")
    step, slots, out = _pull_frozen(a, b, shm)
    t0 = time.monotonic()
    wait_for(lambda: "seconds" in out, replica.IO_TIMEOUT_S + 120, "the fetch to give up")
    waited = time.monotonic() - t0
    _fetch_failed_cleanly(b, step, out)
    assert "timed out" in str(out["error"]), out
    assert out["seconds"] >= replica.IO_TIMEOUT_S
    os.kill(a.proc.pid, signal.SIGCONT)  # its sendfile fails; its lock is released
    b.call(Fetch(rank=0, step=step, generation=0, source=a.addr), 240.0)
    dest = snapshot.slot_paths(b.shm_dir, JOB, b.node, 0)[0]
    assert _digest(dest) == _digest(slots[step][0])
    print(f"fetch gave up {waited:.1f}s after the freeze; bytes checked {dest.stat().st_size}")


def _conn_states(pid: int, port: int) -> list[str]:
    """TCP states of ``pid``'s connections to ``port``."""
    return sorted(
        c.status
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port
    )


def _hold(procs: list[Daemon | Helper], tmp: Path, a: Daemon, n: int) -> Helper:
    """A process that opens ``n`` connections to ``a``, reads each challenge, and is frozen."""
    h = _helper(procs, tmp, "hold", a.addr, str(n), str(replica.NONCE_BYTES))
    assert h.line(60) == f"held {n}", h.lines
    os.kill(h.proc.pid, signal.SIGSTOP)
    wait_for(lambda: _stopped(h.proc.pid), 30, "the holder to stop")
    return h


@pytest.mark.slow  # over 12 s: CI's slow run (the default run stays under 15 min)
def test_a_client_that_never_answers_holds_a_place_for_at_most_the_proof_timeout(
    tmp_path: Path, shm: Path, procs: list[Daemon | Helper]
) -> None:
    """Row "HMAC challenge, 5 s to answer, 32 clients at most": frozen clients that never
    answer the challenge hold their places PROOF_TIMEOUT_S at most; others are served beside
    them, and with every place held a newcomer waits for one instead of failing."""
    a = _ckptd(procs, tmp_path, shm / "a", "nodeA")
    port = int(a.addr.rsplit(":", 1)[1])
    slots = {s: _slot(shm / "src", 0, s, SMALL) for s in (1, 2)}
    held = _hold(procs, tmp_path, a, replica.MAX_CLIENTS - 1)
    t0 = time.monotonic()
    replica.push(a.addr, TOKEN, *_args(slots, 1))  # the last free place
    # Served while they still held theirs (the push takes well under the 5 s they have).
    assert _conn_states(held.proc.pid, port) == ["ESTABLISHED"] * (replica.MAX_CLIENTS - 1)
    wait_for(
        lambda: _conn_states(held.proc.pid, port) == ["CLOSE_WAIT"] * (replica.MAX_CLIENTS - 1),
        60,
        "the server to drop the clients that never answered",
    )
    dropped_after = time.monotonic() - t0
    assert _log_count(a, r"failed: timed out") == replica.MAX_CLIENTS - 1
    assert a.replicas() == {"0": [[1, 0]]}
    # Every place held: the next client waits for one, then is served.
    full = _hold(procs, tmp_path, a, replica.MAX_CLIENTS)
    # The newcomer comes a second after them: its own wait for a place (PROOF_TIMEOUT_S, then
    # it is dropped as a flood) must end after theirs, not within the timers' wake-up jitter.
    time.sleep(1.0)
    t1 = time.monotonic()
    replica.push(a.addr, TOKEN, *_args(slots, 2))
    waited = time.monotonic() - t1
    assert "CLOSE_WAIT" in _conn_states(full.proc.pid, port)  # it got a freed place
    assert waited < replica.IO_TIMEOUT_S
    assert a.replicas() == {"0": [[2, 0]]}
    checked = _pulled_whole(shm, a.addr, slots[2][0], 0, 2, slots[2][1])
    print(
        f"31 frozen clients dropped {dropped_after:.1f}s after the push beside them; "
        f"with 32 held the next push waited {waited:.1f}s; bytes checked {checked}"
    )
