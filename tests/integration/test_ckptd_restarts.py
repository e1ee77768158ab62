"""ckptd killed or frozen at each point where it shares a wait, a file or a socket with a rank
or its agent (docs/self-faults.md §9, "### ckptd"): its start-up, a rank's ``Alloc``, a
restore's ``Verify``, a replica ``Fetch``, a planned stop's ``Persist`` order, its shutdown,
and its agent's death. Real processes: ckptds spawned by the test (or by a real
``CkptdSupervisor`` in the test process, where the row is the agent's), ranks run by
tests/helpers/ckpt_worker.py. A fault at one precise system call is injected by ``strace``
(``inject=SYSCALL:signal=KILL|STOP`` or ``delay_enter``): a real SIGKILL or SIGSTOP of the
real daemon at that point, not a guess at a moment. Every test ends with a restore whose
bytes equal the saved step's (the worker checks every element)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import ROOT, strace_attached, wait_for
from trainguard.agent import ckptd_sup
from trainguard.agent.ckptd_sup import CkptdSupervisor
from trainguard.checkpoint import snapshot, storage
from trainguard.checkpoint.api import CheckpointError
from trainguard.checkpoint.ckptd_client import (
    START_CAP_S,
    CkptdClient,
    address,
    socket_name,
    spawn,
)
from trainguard.protocol import CkptConf, Idle, Stop
from trainguard.protocol.ckptd import SetPeers, Shutdown, Status, StatusReply
from trainguard.runtime import api as rt_api

WORKER = ROOT / "tests" / "helpers" / "ckpt_worker.py"
# One socket name per test process (tests run two at a time): ckptd listens on
# @trainguard-ckptd-<job>-<node>.
JOB, NODE = f"tgrestarts{os.getpid()}", "nodeA"
TOKEN = "00" * 16  # the job token of the replica tests (ckptds and ranks share it)


# ------------------------------------------------------------------ helpers
def _env(
    tmp: Path,
    shm: Path,
    *,
    node: str = NODE,
    restore: tuple[int, int] | None = None,
    ckptd: bool = True,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    env = {
        **os.environ,
        "TRAINGUARD_RUN_DIR": str(tmp),
        "TRAINGUARD_JOB_ID": JOB,
        "TRAINGUARD_NODE_ID": node,
        "TRAINGUARD_SHM_DIR": str(shm),
        "TRAINGUARD_CKPTD": socket_name(JOB, node) if ckptd else "",
    }
    if restore is not None:  # supervised: the agreed point (the agent's UDP port is a sink)
        env.update(
            {
                "TRAINGUARD_AGENT_ADDR": "127.0.0.1:9",
                "TRAINGUARD_TOKEN": TOKEN,
                "TRAINGUARD_RESTORE_STEP": str(restore[0]),
                "TRAINGUARD_RESTORE_GEN": str(restore[1]),
            }
        )
    return {**env, **(extra or {})}


def _worker(tmp: Path, shm: Path, *args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args, "--root", str(tmp / "checkpoints")],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(tmp, shm, **kw),
    )


def _finish(p: subprocess.Popen[str], timeout: float = 180.0) -> tuple[str, str]:
    """Wait for a worker; its (stdout, stderr). Killed, and an AssertionError, if it fails."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"worker did not finish in {timeout}s:\n{err[-3000:]}") from None
    assert p.returncode == 0, err[-3000:]
    return out, err


def _result(out: str) -> dict[str, Any]:
    return dict(json.loads(out.strip().splitlines()[-1]))


def _load(tmp: Path, shm: Path, restore: tuple[int, int] | None, size_mb: str, **kw: Any) -> str:
    """Restore in a fresh rank; asserts the bytes equal the step's. Returns the tier's line."""
    out, err = _finish(_worker(tmp, shm, "load", "--size-mb", size_mb, restore=restore, **kw))
    step = restore[0] if restore else _result(out)["step"]
    assert _result(out) == {"step": step, "bytes_ok": True, "pos": step * 10}, (out, err[-2000:])
    said = [x for x in err.splitlines() if "restored step" in x]
    return said[-1] if said else ""


def _save(tmp: Path, shm: Path, first: int, last: int, size_mb: str, durable_every: int) -> None:
    p = _worker(tmp, shm, "save", "--first", str(first), "--last", str(last),
                "--size-mb", size_mb, "--durable-every", str(durable_every))  # fmt: skip
    _finish(p)


def _start_ckptd(
    tmp: Path, shm: Path, node: str = NODE, *, replicas: bool = False
) -> subprocess.Popen[bytes]:
    return spawn(
        job=JOB, node=node, ckpt_dir=tmp / "checkpoints", shm_dir=shm, keep=2,
        log=tmp / f"ckptd-{node}.log", timeout_s=120.0,
        env={**os.environ, "TRAINGUARD_TOKEN": TOKEN} if replicas else None,
        replica_bind="127.0.0.1" if replicas else None,
    )  # fmt: skip


def _call(node: str, req: Any, timeout_s: float = 10.0) -> Any:
    c = CkptdClient(socket_name(JOB, node), timeout_s=timeout_s)
    try:
        return c.call(req, timeout_s=timeout_s)
    finally:
        c.close()


def _status(node: str = NODE) -> StatusReply:
    reply: StatusReply = _call(node, Status())
    return reply


def _shutdown(proc: subprocess.Popen[bytes], node: str = NODE) -> None:
    """Ask a test's ckptd to exit with its slots unlinked; kill it if it does not."""
    if proc.poll() is None:
        with contextlib.suppress(OSError, ValueError, CheckpointError):
            _call(node, Shutdown(unlink=True), timeout_s=5.0)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(timeout=30)


def _gone(pid: int) -> bool:
    """The process has exited, every thread of it (a zombie not yet reaped by its new parent
    counts; its leader is one while other threads still exit, holding its files)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE and tasks == [str(pid)]
    except (psutil.NoSuchProcess, FileNotFoundError):
        return True


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (SIGSTOP, or held stopped by its tracer)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(s in "Tt" for s in states)


def _listening(node: str = NODE) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(address(socket_name(JOB, node)))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _allocated(path: Path) -> int:
    """Bytes of ``path`` backed by pages (a tmpfs file's ``st_blocks``)."""
    return path.stat().st_blocks * 512


def _untrace(tracer: subprocess.Popen[bytes]) -> None:
    """End strace at once after its tracee was SIGKILLed inside a delayed system call: strace
    can lose track of such a tracee ("delayed wait data set already") and never reap it,
    and a traced zombie is not handed to its parent while its tracer lives."""
    tracer.kill()
    tracer.wait(timeout=30)


class _Agent:
    """A real ``CkptdSupervisor`` in the test process, playing its agent's part: the events
    it records, and ``idle`` (called while a new ckptd starts) for a test to act in."""

    def __init__(self, tmp: Path, shm: Path) -> None:
        (tmp / "logs").mkdir(exist_ok=True)
        self.conf = CkptConf(dir=str(tmp / "checkpoints"), shm_dir=str(shm), keep=2,
                             memory_tier=True)  # fmt: skip
        self.events: list[dict[str, Any]] = []
        self.on_idle: Callable[[], None] = lambda: None
        self.sup = CkptdSupervisor(
            job_id=JOB, node_id=NODE, token=TOKEN, bind="", run_dir=tmp,
            on_event=lambda kind, **d: self.events.append({"kind": kind, **d}),
            idle=lambda: self.on_idle(),
        )  # fmt: skip

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.sup.proc is not None, "no ckptd was started"
        return self.sup.proc

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events]

    def memory(self) -> list[list[int]]:
        """The ranks' verified snapshots (rank 0's), as its status call just read them."""
        self.sup.refresh(Idle(ckpt=self.conf))
        return list(self.sup.memory.get("0", []))

    def close(self) -> None:
        proc = self.sup.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        self.sup.stop()


@pytest.fixture
def agent(tmp_path: Path, shm: Path) -> Iterator[_Agent]:
    a = _Agent(tmp_path, shm)
    yield a
    a.close()


# ------------------------------------------------------------------ start-up
def _ckptd_children(exclude: set[int]) -> list[int]:
    """This test process's ckptd children of this job (newest last), but ``exclude``."""
    out = []
    for p in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            cmd = p.cmdline()
            if "trainguard.checkpoint.ckptd" in cmd and JOB in cmd and p.pid not in exclude:
                out.append(p.pid)
    return out


def test_a_ckptd_killed_while_starting_is_an_error_and_the_next_ensure_starts_one(
    tmp_path: Path, shm: Path, agent: _Agent, caplog: pytest.LogCaptureFixture
) -> None:
    """Row "Start-up wait until it listens", killed: the node's ckptd dies (SIGKILL) and
    the restart the agent makes is SIGKILLed too, before it listens. ``ensure`` logs the
    CheckpointError at once (no 30 s wait), keeps no half-started daemon, and its next call
    starts one that adopts the slots: the memory snapshot restores exactly."""
    agent.sup.ensure(agent.conf)
    first = agent.sup.pid
    assert first is not None
    _save(tmp_path, shm, 1, 2, "8", durable_every=0)  # memory only: the slots are all there is
    wait_for(lambda: [2, 0] in agent.memory(), 60, "step 2 verified in memory")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: agent.proc.poll() is not None, 30, "the first ckptd to die")
    victims: list[int] = []

    def kill_the_new_one() -> None:  # spawn's wait: it is not listening yet
        if not victims:
            new = _ckptd_children({first})
            assert new, "no new ckptd while ensure waits for one"
            os.kill(new[-1], signal.SIGKILL)
            victims.append(new[-1])

    agent.on_idle = kill_the_new_one
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="trainguard.agent"):
        agent.sup.ensure(agent.conf)
    took = time.monotonic() - t0
    assert victims and _gone(victims[0]), victims
    assert any("did not start" in r.getMessage() for r in caplog.records), caplog.text
    assert took < 25.0, f"a dead start-up was waited on for {took:.1f}s"
    assert agent.sup.pid == first  # nothing half-started is kept as the node's ckptd
    assert agent.kinds() == ["ckptd_restarted"]
    agent.on_idle = lambda: None
    agent.sup.ensure(agent.conf)  # the next reconcile
    third = agent.sup.pid
    assert third not in (None, first, victims[0]) and agent.proc.poll() is None
    assert agent.kinds() == ["ckptd_restarted", "ckptd_restarted"]
    # adopted from the slots, each in the index once re-verified (in the background)
    wait_for(lambda: sorted(agent.memory()) == [[1, 0], [2, 0]], 30, "both slots adopted")
    assert "memory tier" in _load(tmp_path, shm, (2, 0), "8")


@pytest.mark.slow  # the frozen variants: CI's slow run keeps the default one short
def test_a_ckptd_frozen_while_starting_is_killed_at_its_deadline_and_the_next_one_starts(
    tmp_path: Path, shm: Path
) -> None:
    """Row "Start-up wait until it listens", frozen: a ckptd SIGSTOPped right after it was
    started (before it can listen) is waited for up to spawn's deadline (``timeout_s``, the
    agent's is 30 s: the slow test below), then SIGKILLed and reaped: a CheckpointError. The
    next one starts and serves what the node had (slots from before restore exactly)."""
    d = _start_ckptd(tmp_path, shm)
    try:
        _save(tmp_path, shm, 1, 2, "8", durable_every=0)
        wait_for(lambda: [2, 0] in _status().memory.get("0", []), 60, "step 2 verified")
        d.kill()
        d.wait(timeout=30)
    finally:
        if d.poll() is None:
            _shutdown(d)
    frozen: list[int] = []

    def freeze() -> None:  # the first wait after Popen: far from listening yet
        if not frozen:
            pid = _ckptd_children({d.pid})[-1]
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)

    deadline_s = 8.0
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="did not start"):
        spawn(job=JOB, node=NODE, ckpt_dir=tmp_path / "checkpoints", shm_dir=shm, keep=2,
              log=tmp_path / "ckptd-frozen.log", timeout_s=deadline_s, idle=freeze)  # fmt: skip
    took = time.monotonic() - t0
    assert frozen and _gone(frozen[0]), frozen  # killed and reaped, not left frozen
    assert deadline_s <= took < deadline_s + 20.0, took
    d2 = _start_ckptd(tmp_path, shm)
    try:
        assert sorted(_status().memory["0"]) == [[1, 0], [2, 0]]
        assert "memory tier" in _load(tmp_path, shm, (2, 0), "8")
    finally:
        _shutdown(d2)


def test_a_ckptd_still_starting_past_its_deadline_is_waited_for_not_killed(
    tmp_path: Path, shm: Path
) -> None:
    """Row "Start-up wait until it listens", slow: a ckptd that takes longer than spawn's
    ``timeout_s`` to listen but keeps using CPU (its imports, on a loaded machine) is waited
    for (up to ``START_CAP_S``), not killed and started again from nothing. A deadline of
    0.1 s is far below any real start here (imports alone take ~0.3 s)."""
    t0 = time.monotonic()
    d = spawn(job=JOB, node=NODE, ckpt_dir=tmp_path / "checkpoints", shm_dir=shm, keep=2,
              log=tmp_path / "ckptd-slow.log", timeout_s=0.1)  # fmt: skip
    took = time.monotonic() - t0
    try:
        assert 0.1 < took < START_CAP_S, took
        assert _status().memory == {}, "a fresh ckptd"
    finally:
        _shutdown(d)


@pytest.mark.slow  # the agent's own 30 s start-up deadline
def test_the_agent_kills_a_ckptd_frozen_while_starting_at_30s_and_starts_the_next(
    tmp_path: Path, shm: Path, agent: _Agent, caplog: pytest.LogCaptureFixture
) -> None:
    """The same through the agent's ``ensure`` and its own deadline (spawn's 30 s)."""
    agent.sup.ensure(agent.conf)
    first = agent.sup.pid
    assert first is not None
    _save(tmp_path, shm, 1, 1, "8", durable_every=0)
    wait_for(lambda: [1, 0] in agent.memory(), 60, "step 1 verified in memory")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: agent.proc.poll() is not None, 30, "the first ckptd to die")
    frozen: list[int] = []

    def freeze() -> None:
        new = _ckptd_children({first})
        if not frozen and new:  # none: it died before listening (its log says why below)
            os.kill(new[-1], signal.SIGSTOP)
            frozen.append(new[-1])

    agent.on_idle = freeze
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="trainguard.agent"):
        agent.sup.ensure(agent.conf)
    took = time.monotonic() - t0
    ckptd_log = (tmp_path / "logs" / f"ckptd.{NODE}.log").read_text()
    assert frozen and _gone(frozen[0]), f"no new ckptd to freeze; its log:\n{ckptd_log}"
    assert any("did not start" in r.getMessage() for r in caplog.records), caplog.text
    assert 30.0 <= took < 60.0, took
    agent.on_idle = lambda: None
    agent.sup.ensure(agent.conf)
    assert agent.sup.pid not in (first, frozen[0]) and agent.memory() == [[1, 0]]
    assert "memory tier" in _load(tmp_path, shm, (1, 0), "8")


# ------------------------------------------------------------------ Alloc
def _kill_at_second_fallocate(d: subprocess.Popen[bytes], alloc: Callable[[], object]) -> None:
    """Start ``alloc`` (a rank's first Alloc) and SIGKILL ckptd ``d`` as it allocates the
    second slot; returns once it is dead."""
    with strace_attached(
        d.pid, "-e", "trace=fallocate", "-e", "inject=fallocate:signal=KILL:when=2"
    ):
        alloc()
        d.wait(timeout=180)
    assert d.returncode == -signal.SIGKILL, d.returncode


def _torn_alloc(slots: tuple[Path, ...]) -> int:
    """Assert the slots are as a kill at the second one's allocation left them: the first
    made, the second at full size without its pages (tmpfs undoes a fallocate cut short),
    the third never made. Returns the slot size."""
    nbytes = slots[0].stat().st_size
    assert _allocated(slots[0]) >= nbytes
    assert slots[1].stat().st_size == nbytes and _allocated(slots[1]) < nbytes
    assert not slots[2].exists()
    return nbytes


def test_ckptd_killed_mid_alloc_the_rank_retries_on_the_new_one_and_every_slot_is_allocated(
    tmp_path: Path, shm: Path
) -> None:
    """Row "`Alloc`": ckptd SIGKILLed inside a rank's Alloc, at its second slot's fallocate.
    The rank's call reconnects to the restarted ckptd and its save is committed and restores
    exactly from memory and from disk. Then the same for rank 1's Alloc from the rank's own
    client class (``CkptdBackend``) in this process, to look at the slots between the reply
    and the first write: the retried Alloc allocated every slot's pages. (Before, a slot
    whose size was right was taken as allocated: the kill's page-less slot was handed out,
    and a write into it on a full /dev/shm was a SIGBUS, not the clear "needs N MiB".)"""
    from trainguard.checkpoint.backend import CkptdBackend

    root = tmp_path / "checkpoints"
    daemons = [_start_ckptd(tmp_path, shm)]
    p: subprocess.Popen[str] | None = None
    backend = CkptdBackend(socket_name(JOB, NODE))
    try:
        slots = snapshot.slot_paths(shm, JOB, NODE, 0)
        args = ("save", "--first", "1", "--last", "1", "--size-mb", "16")
        started: list[subprocess.Popen[str]] = []
        _kill_at_second_fallocate(daemons[0], lambda: started.append(_worker(tmp_path, shm, *args)))
        p = started[0]
        assert p.poll() is None  # the rank waits: its Alloc is retried
        nbytes = _torn_alloc(slots)
        t0 = time.monotonic()
        daemons.append(_start_ckptd(tmp_path, shm))
        _finish(p)  # saved (durable: the worker's close waited for the commit)
        p = None
        print(f"rank 0's Alloc retried and its save done {time.monotonic() - t0:.1f}s after "
              f"the restart began")  # fmt: skip
        assert storage.list_committed(root) == [1] and storage.verify(root, 1) == []
        assert _status().memory["0"] == [[1, 0]]
        assert "memory tier" in _load(tmp_path, shm, (1, 0), "16")
        assert "durable tier" in _load(tmp_path, shm, None, "16")
        # rank 1: the reply's slots, before anything maps them
        slots1 = snapshot.slot_paths(shm, JOB, NODE, 1)
        got: list[object] = []

        def alloc() -> None:
            try:
                got.append(backend.alloc(1, nbytes))
            except Exception as e:  # noqa: BLE001 - the finding
                got.append(e)

        caller = threading.Thread(target=alloc)
        _kill_at_second_fallocate(daemons[1], caller.start)
        _torn_alloc(slots1)
        daemons.append(_start_ckptd(tmp_path, shm))
        caller.join(timeout=120)
        assert got == [slots1], got
        for s in slots1:  # every page of every slot allocated by the retried Alloc
            assert s.stat().st_size == nbytes and _allocated(s) >= nbytes, (s, _allocated(s))
        print(f"slots of {nbytes} bytes whole after the retried Alloc")
    finally:
        backend.close()
        if p is not None:
            p.kill()
            p.communicate()
        for d in daemons:
            if d.poll() is None:
                _shutdown(d)


# ------------------------------------------------------------------ Verify
def _sums(shm: Path, node: str = NODE) -> list[str]:
    """strace's path filters: rank 0's slots' checksum files (ckptd opens one to verify)."""
    out: list[str] = []
    for s in snapshot.slot_paths(shm, JOB, node, 0):
        out += ["-P", str(snapshot.sums_path(s))]
    return out


@pytest.mark.slow  # over 12 s: CI's slow run (the default run stays under 15 min)
def test_ckptd_killed_mid_verify_the_rank_checksums_the_slot_itself(
    tmp_path: Path, shm: Path
) -> None:
    """Row "`Verify` at a restore", killed: ckptd SIGKILLed inside a restoring rank's Verify
    (at the open of the slot's checksums) and not restarted. The rank's call reconnects for
    5 s, then the rank checksums the slot itself against its staging sums: the memory
    snapshot (there is no durable copy) restores exactly."""
    root = tmp_path / "checkpoints"
    d = _start_ckptd(tmp_path, shm)
    try:
        _save(tmp_path, shm, 1, 2, "16", durable_every=0)
        wait_for(lambda: [2, 0] in _status().memory.get("0", []), 60, "step 2 verified")
        assert storage.list_committed(root) == []
        with strace_attached(d.pid, "-e", "trace=openat", *_sums(shm), "-e",
                     "inject=openat:signal=KILL"):  # fmt: skip
            p = _worker(tmp_path, shm, "load", "--size-mb", "16", restore=(2, 0))
            d.wait(timeout=180)
        assert d.returncode == -signal.SIGKILL
        t0 = time.monotonic()
        out, err = _finish(p)
        assert _result(out) == {"step": 2, "bytes_ok": True, "pos": 20}, err[-2000:]
        assert "restored step 2 from the memory tier" in err
        print(f"rank restored {time.monotonic() - t0:.1f}s after ckptd died mid-verify")
    finally:
        if d.poll() is None:
            _shutdown(d)


@pytest.mark.slow  # the frozen variants: CI's slow run keeps the default one short
def test_ckptd_frozen_mid_verify_is_killed_by_its_agent_and_the_restore_is_exact(
    tmp_path: Path, shm: Path, agent: _Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row "`Verify` at a restore", frozen: ckptd stopped inside a restoring rank's Verify
    (the rank's call waits up to 300 s). The agent's status calls go unanswered; at its
    liveness deadline (15 s; 4 s here) it SIGKILLs ckptd (``ckptd_unresponsive``) and
    restarts it (``ckptd_restarted``); the rank's call ends with the connection and the rank
    checksums the slot itself (or asks the new ckptd): the restore is exact."""
    monkeypatch.setattr(ckptd_sup, "CKPTD_DEADLINE_S", 4.0)
    agent.sup.ensure(agent.conf)
    frozen = agent.sup.pid
    assert frozen is not None
    _save(tmp_path, shm, 1, 2, "16", durable_every=0)
    wait_for(lambda: [2, 0] in agent.memory(), 60, "step 2 verified in memory")
    with strace_attached(
        frozen, "-e", "trace=openat", *_sums(shm), "-e", "inject=openat:signal=STOP"
    ):
        p = _worker(tmp_path, shm, "load", "--size-mb", "16", restore=(2, 0))
        try:
            wait_for(lambda: _stopped(frozen) or p.poll() is not None, 180, "ckptd frozen")
            assert p.poll() is None, p.communicate()
            t0 = time.monotonic()
            while p.poll() is None and time.monotonic() - t0 < 180:  # the agent's two loops
                agent.sup.ensure(agent.conf)
                agent.sup.refresh(Idle(ckpt=agent.conf))
                time.sleep(0.2)
        finally:
            if p.poll() is None:
                p.kill()
    out, err = _finish(p)
    assert _result(out) == {"step": 2, "bytes_ok": True, "pos": 20}, err[-2000:]
    assert "restored step 2 from the memory tier" in err
    kinds = agent.kinds()
    assert kinds[:2] == ["ckptd_unresponsive", "ckptd_restarted"], kinds
    assert _gone(frozen) and agent.sup.pid != frozen
    silent = next(e for e in agent.events if e["kind"] == "ckptd_unresponsive")["silent_s"]
    print(f"frozen ckptd killed after {silent}s silent; restore exact")
    wait_for(lambda: sorted(agent.memory()) == [[1, 0], [2, 0]], 30, "both adopted")


# ------------------------------------------------------------------ Fetch
@pytest.mark.slow  # over 12 s: CI's slow run (the default run stays under 15 min)
def test_ckptd_killed_mid_fetch_never_publishes_the_torn_pull_and_the_retry_restores(
    tmp_path: Path, shm: Path
) -> None:
    """Row "`Fetch` of a peer's replica": node A's rank saves step 1 (memory only) and A's
    ckptd replicates it to node B. A replaced node C's rank restores it from B's replica:
    C's ckptd is SIGKILLed after its second write of the incoming bytes into ``<slot>.pull``.
    The torn ``.pull`` is never published as the slot (nor adopted by the next ckptd); the
    rank's Fetch is retried on C's restarted ckptd, which pulls it whole: exact bytes (there
    is no durable copy, and A is gone)."""
    daemons: dict[str, subprocess.Popen[bytes]] = {}
    p: subprocess.Popen[str] | None = None
    try:
        for node in ("nodeA", "nodeB", "nodeC"):
            daemons[node] = _start_ckptd(tmp_path, shm, node, replicas=True)
        holder = _status("nodeB").replica_addr
        assert holder
        _call("nodeA", SetPeers(addrs=(holder,)))
        _save(tmp_path, shm, 1, 1, "16", durable_every=0)
        wait_for(lambda: [1, 0] in _status("nodeB").replicas.get("0", []), 60, "B's replica")
        _shutdown(daemons.pop("nodeA"), "nodeA")  # node A is gone, with its memory
        assert storage.list_committed(tmp_path / "checkpoints") == []
        dest = snapshot.slot_paths(shm, JOB, "nodeC", 0)[0]
        pull = dest.with_name(dest.name + ".pull")
        nbytes = next(shm.glob(f"trainguard-{JOB}-nodeB-replica-r0")).stat().st_size
        c = daemons["nodeC"]
        with strace_attached(c.pid, "-e", "trace=write", "-P", str(pull), "-e",
                     "inject=write:signal=KILL:when=2"):  # fmt: skip
            p = _worker(tmp_path, shm, "load", "--size-mb", "16", node="nodeC", restore=(1, 0),
                        extra={rt_api.ENV_REPLICA_SOURCE: holder})  # fmt: skip
            c.wait(timeout=180)
        assert c.returncode == -signal.SIGKILL
        torn = pull.stat().st_size
        assert 0 < torn < nbytes, (torn, nbytes)
        assert not dest.exists() and not snapshot.sums_path(dest).exists()  # never published
        assert p.poll() is None  # the rank's Fetch is being retried
        daemons["nodeC"] = _start_ckptd(tmp_path, shm, "nodeC", replicas=True)
        out, err = _finish(p)
        p = None
        assert _result(out) == {"step": 1, "bytes_ok": True, "pos": 10}, err[-2000:]
        assert "restored step 1 from the replica tier" in err
        assert not pull.exists() and (snapshot.peek_header(dest) or {}).get("step") == 1
        st = _status("nodeC")
        assert not [e for e in st.events if e["kind"] == "ckptd_adopted"], st.events
        assert [e["kind"] for e in st.events].count("replica_fetched") == 1, st.events
        assert st.memory == {"0": [[1, 0]]}
        print(f"torn .pull {torn} of {nbytes} bytes never published; the retry fetched all")
    finally:
        if p is not None:
            p.kill()
            p.communicate()
        for node, d in daemons.items():
            _shutdown(d, node)


# ------------------------------------------------------------------ Persist
@pytest.mark.slow  # over 12 s: CI's slow run (the default run stays under 15 min)
def test_a_persist_order_taken_by_a_ckptd_killed_before_writing_is_sent_to_the_next_one(
    tmp_path: Path, shm: Path, agent: _Agent
) -> None:
    """Row "`Persist` order on a planned stop": step 2 is durable, step 3 only in memory when
    the workers stop. The agent orders ckptd to persist step 3; ckptd replies (it took the
    order) but its persister is held at the first directory of the part (strace) and ckptd is
    SIGKILLed there. The agent restarts it and sends the order again (``ensure`` forgets it
    was sent; before, the new one only indexed the memory-only snapshot and step 3 never
    became durable). Step 3 is committed; with the memory tier emptied (the agent's stop
    unlinks the slots), steps 3 and 2 restore exactly from disk."""
    root = tmp_path / "checkpoints"
    agent.sup.ensure(agent.conf)
    first = agent.sup.pid
    assert first is not None
    _save(tmp_path, shm, 1, 3, "16", durable_every=2)  # its close waited for step 2's commit
    wait_for(lambda: [3, 0] in agent.memory(), 60, "step 3 verified in memory")
    assert storage.list_committed(root) == [2]
    stop = Stop(generation=0, grace_s=1.0, persist=(3, 0))
    with strace_attached(first, "-e", "trace=mkdir,mkdirat", "-e",
                 "inject=mkdir,mkdirat:delay_enter=600s") as tracer:  # fmt: skip
        agent.sup.refresh(stop)  # the order, answered
        took = [e for e in _status().events if e["kind"] == "ckpt_persist_held"]
        assert took and took[0]["ranks"] == [0], took
        assert not list(root.glob(".tmp-step_3-*"))  # no part begun
        os.kill(first, signal.SIGKILL)
        _untrace(tracer)
        agent.proc.wait(timeout=30)
    assert storage.list_committed(root) == [2]
    t0 = time.monotonic()

    def durable() -> bool:  # the agent's loops, as long as the stop is desired
        agent.sup.ensure(agent.conf)
        agent.sup.refresh(stop)
        return 3 in storage.list_committed(root)

    wait_for(durable, 120, "step 3 to become durable from the restarted ckptd")
    print(f"step 3 durable {time.monotonic() - t0:.1f}s after the kill")
    assert agent.kinds() == ["ckptd_restarted"] and agent.sup.pid != first
    assert storage.list_committed(root) == [2, 3]
    assert storage.verify(root, 3) == [] and storage.verify(root, 2) == []
    agent.sup.stop()
    assert not list(shm.iterdir())  # the memory tier is empty now
    assert "durable tier" in _load(tmp_path, shm, (3, 0), "16", ckptd=False)
    assert "durable tier" in _load(tmp_path, shm, (2, 0), "16", ckptd=False)


# ------------------------------------------------------------------ Shutdown
def _go(p: subprocess.Popen[str], step: int) -> None:
    """Let a ``--stepwise`` worker save ``step``; wait until the save returned."""
    assert p.stdin is not None and p.stdout is not None
    out = p.stdout
    p.stdin.write("go\n")
    p.stdin.flush()
    wait_for(lambda: out.readline().strip() == f"saved {step}", 120, f"step {step} saved")


def test_ckptd_killed_mid_shutdown_with_a_part_pending_slots_unlinked_committed_kept(
    tmp_path: Path, shm: Path, agent: _Agent
) -> None:
    """Row "Shutdown", killed: steps 1 and 2 are committed; step 3's part is pending (its
    persister held at the part's first directory) when the agent shuts ckptd down. ckptd
    stops listening and waits for the persister (mid-shutdown): SIGKILLed there. The agent's
    ``stop`` returns at once with every slot unlinked anyway; step 3 was not written (and
    nothing torn is committed); steps 1 and 2 restore exactly from disk."""
    root = tmp_path / "checkpoints"
    agent.sup.ensure(agent.conf)
    pid = agent.sup.pid
    assert pid is not None
    p = _worker(tmp_path, shm, "save", "--first", "1", "--last", "3", "--size-mb", "8",
                "--stepwise", "--hold")  # fmt: skip
    assert p.stdin is not None and p.stdout is not None
    stopper: threading.Thread | None = None
    try:
        for step in (1, 2):
            _go(p, step)
            wait_for(lambda: storage.list_committed(root) == list(range(1, step + 1)), 60,  # noqa: B023
                     "its commit")  # fmt: skip
        with strace_attached(pid, "-e", "trace=mkdir,mkdirat", "-e",
                     "inject=mkdir,mkdirat:delay_enter=600s") as tracer:  # fmt: skip
            _go(p, 3)
            wait_for(lambda: [3, 0] in agent.memory(), 60, "step 3 verified (its part pending)")
            p.kill()  # the workers are stopped before their ckptd
            p.communicate()
            stopper = threading.Thread(target=agent.sup.stop)
            stopper.start()
            wait_for(lambda: not _listening(), 60, "ckptd to stop listening (shutting down)")
            assert agent.proc.poll() is None  # not listening, still running: mid-shutdown
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            _untrace(tracer)
            stopper.join(timeout=60)
            assert not stopper.is_alive()
            print(f"the agent's stop returned {time.monotonic() - t0:.2f}s after the kill")
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        if stopper is not None:
            stopper.join(timeout=120)
    assert agent.proc.returncode == -signal.SIGKILL
    assert not list(shm.iterdir())  # every slot and checksum file unlinked anyway
    assert storage.list_committed(root) == [1, 2]  # step 3 not written, nothing torn
    assert storage.verify(root, 1) == [] and storage.verify(root, 2) == []
    assert "durable tier" in _load(tmp_path, shm, (2, 0), "8", ckptd=False)
    assert "durable tier" in _load(tmp_path, shm, (1, 0), "8", ckptd=False)


@pytest.mark.slow  # the frozen variants: CI's slow run keeps the default one short
def test_ckptd_frozen_mid_shutdown_is_killed_at_the_stop_deadline_and_slots_unlinked(
    tmp_path: Path, shm: Path, agent: _Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row "Shutdown", frozen: ckptd stopped as it unlinks its slots at the end of its
    shutdown. The agent's ``stop`` waits for it until its deadline (70 s; 5 s here), SIGKILLs
    it and unlinks the slots itself; the committed step restores exactly from disk."""
    monkeypatch.setattr(ckptd_sup, "STOP_DEADLINE_S", 5.0)
    root = tmp_path / "checkpoints"
    agent.sup.ensure(agent.conf)
    pid = agent.sup.pid
    assert pid is not None
    _save(tmp_path, shm, 1, 2, "8", durable_every=1)
    assert storage.list_committed(root) == [1, 2]
    wait_for(lambda: [2, 0] in agent.memory(), 60, "step 2 verified in memory")
    first = snapshot.slot_paths(shm, JOB, NODE, 0)[0]
    assert first.exists()
    with strace_attached(pid, "-e", "trace=unlink,unlinkat", "-P", str(first), "-e",
                 "inject=unlink,unlinkat:signal=STOP"):  # fmt: skip
        t0 = time.monotonic()
        agent.sup.stop()
        took = time.monotonic() - t0
    assert agent.proc.returncode == -signal.SIGKILL
    assert 5.0 <= took < 30.0, took
    print(f"the agent's stop killed the frozen ckptd and returned after {took:.1f}s")
    assert not list(shm.iterdir())
    assert storage.list_committed(root) == [1, 2] and storage.verify(root, 2) == []
    assert "durable tier" in _load(tmp_path, shm, (2, 0), "8", ckptd=False)


# ------------------------------------------------------------------ PDEATHSIG
PARENT = """
import os, sys
from pathlib import Path
from trainguard.checkpoint.ckptd_client import spawn
job, node, ckpt, shm, log = sys.argv[1:6]
p = spawn(job=job, node=node, ckpt_dir=Path(ckpt), shm_dir=Path(shm), keep=2, log=Path(log),
          timeout_s=120.0, env={**os.environ, "TRAINGUARD_AGENT_PID": str(os.getpid())})
print(p.pid, flush=True)
sys.stdin.read()
"""


def test_ckptd_dies_with_its_agent_and_the_next_ckptd_adopts_its_slots(
    tmp_path: Path, shm: Path
) -> None:
    """Row "Dies with its agent (PDEATHSIG)": a ckptd started (as the agent starts it) by a
    parent process that is then SIGKILLed dies with it at once; its slots stay in memory and
    the node's next ckptd adopts them: the memory-only step restores exactly."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, JOB, NODE, str(tmp_path / "checkpoints"), str(shm),
         str(tmp_path / "ckptd.log")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert parent.stdout is not None
    pid = 0
    try:
        pid = int(parent.stdout.readline())
        _save(tmp_path, shm, 1, 2, "8", durable_every=0)
        wait_for(lambda: [2, 0] in _status().memory.get("0", []), 60, "step 2 verified")
        parent.kill()
        t0 = time.monotonic()
        parent.wait(timeout=30)
        wait_for(lambda: _gone(pid) and not _listening(), 15, "ckptd to die with its parent")
        died = time.monotonic() - t0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if pid and not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    print(f"ckptd gone {died:.2f}s after its parent's SIGKILL")
    assert not _listening()
    slots = [s for s in snapshot.slot_paths(shm, JOB, NODE, 0) if s.exists()]
    # Steps 1 and 2 stay in memory, each verified (its checksums beside it), whichever slots
    # the writer took for them.
    held = {s.name: snapshot.peek_header(s) for s in slots}
    summed = sorted(
        (h["step"], h["generation"])
        for s in slots
        if snapshot.sums_path(s).exists() and (h := held[s.name]) is not None
    )
    assert len(slots) == 3 and summed == [(1, 0), (2, 0)], (
        {k: h and (h["step"], h["generation"]) for k, h in held.items()},
        [s.name for s in slots if snapshot.sums_path(s).exists()],
    )
    d2 = _start_ckptd(tmp_path, shm)
    try:
        assert sorted(_status().memory["0"]) == [[1, 0], [2, 0]]
        assert storage.list_committed(tmp_path / "checkpoints") == []
        assert "memory tier" in _load(tmp_path, shm, (2, 0), "8")
        assert "memory tier" in _load(tmp_path, shm, (1, 0), "8")
    finally:
        _shutdown(d2)
