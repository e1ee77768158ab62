"""The persister (a thread of ckptd) under real faults of its own: frozen while it holds a
slot's lock or writes a part, killed while a rank waits for durability or mid-prune, and a
memory tier (/dev/shm) that fills under a running rank. Each test ends with the committed
steps restored byte-exact (tests/helpers/ckpt_worker.py checks every element against the
step) and nothing committed lost (docs/self-faults.md §9, "Persister")."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import private_tmpfs, throttled_disk, wait_for
from tests.integration.test_hyckpt import (  # the standalone-daemon style's helpers
    JOB,
    NODE,
    WORKER,
    _env,
    _freeze,
    _largest_gap,
    _load,
    _start_ckptd,
)
from trainguard.agent.workers import IN_TRAINGUARD_S
from trainguard.checkpoint import snapshot, storage
from trainguard.checkpoint.ckptd import CkptdClient, socket_name
from trainguard.protocol.ckptd import Shutdown, Status
from trainguard.protocol.worker import Alive, Batch, WorkerEvent
from trainguard.runtime.wire import decode_message

TOKEN = "00" * 16
SLOW_BPS = 2 << 20  # the slow disk's writes: a 4 MiB part takes ~2 s to reach it


class AgentSink:
    """The agent's UDP report socket as a rank sees it: the keep-alives (``Alive``) and events
    the rank sends, with the time each arrived."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.alive: list[float] = []
        self.events: list[WorkerEvent] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _run(self) -> None:
        key = bytes.fromhex(TOKEN)
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            now = time.monotonic()
            _, msg = decode_message(key, data)
            for item in msg.items if isinstance(msg, Batch) else (msg,):
                if isinstance(item, Alive):
                    self.alive.append(now)
                elif isinstance(item, WorkerEvent):
                    self.events.append(item)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


class Rank:
    """tests/helpers/ckpt_worker.py as a supervised rank whose agent is ``sink``: its stdout
    lines are kept with the time each was read."""

    def __init__(self, tmp: Path, shm: Path, sink: AgentSink, *args: str, **env: str) -> None:
        full = {**_env(tmp, shm), "TRAINGUARD_AGENT_ADDR": sink.addr, "TRAINGUARD_TOKEN": TOKEN,
                **env}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), *args, "--root", str(tmp / "checkpoints")],
            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=full,
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.err: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream: object, out: bool) -> None:
        for line in stream:  # type: ignore[attr-defined]
            if out:
                self.lines.append((time.monotonic(), line.strip()))
            else:
                self.err.append(line)

    def said(self, line: str) -> float | None:
        """When the rank printed ``line`` (None: not yet)."""
        return next((t for t, x in self.lines if x == line), None)

    def go(self) -> None:
        """Let a ``--stepwise`` rank make its next save."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the rank did not finish: {''.join(self.err)[-2000:]}") from None
        for t in self._readers:
            t.join(timeout=10)
        return rc

    def stderr(self) -> str:
        return "".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


class Daemons:
    """The node's ckptd as its agent keeps it: started, SIGKILLed, started again; at the end
    shut down with its slots unlinked (or killed)."""

    def __init__(self, tmp: Path, shm: Path) -> None:
        self.tmp, self.shm = tmp, shm
        self.current = _start_ckptd(tmp, shm)

    def kill(self) -> None:
        self.current.send_signal(signal.SIGKILL)
        self.current.wait(timeout=10)

    def restart(self) -> subprocess.Popen[bytes]:
        assert self.current.poll() is not None
        self.current = _start_ckptd(self.tmp, self.shm)
        return self.current

    def close(self) -> None:
        d = self.current
        if d.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(d.pid, signal.SIGCONT)
            with contextlib.suppress(OSError, ValueError):
                c = CkptdClient(socket_name(JOB, NODE), timeout_s=5.0)
                c.call(Shutdown(unlink=True), timeout_s=5.0)
                c.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                d.wait(timeout=60)
        if d.poll() is None:
            d.kill()
            d.wait()


@pytest.fixture
def sink() -> Iterator[AgentSink]:
    s = AgentSink()
    yield s
    s.close()


@pytest.fixture
def slow_disk(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path/checkpoints`` on a real slow disk (``throttled_disk``, writes at SLOW_BPS).
    Yields the cgroup's ``cgroup.procs``: write a ckptd's pid there and its durable parts
    take seconds to write."""
    with throttled_disk(tmp_path, tmp_path / "checkpoints", 160, SLOW_BPS) as cg:
        yield cg / "cgroup.procs"


def _flocks(pid: int) -> set[int]:
    """Inodes on which ``pid`` holds a shared (READ) flock, from /proc/locks."""
    out = set()
    for line in Path("/proc/locks").read_text().splitlines():
        f = line.split()
        if "->" in f:  # a waiter's line: "1: -> FLOCK ..."
            continue
        if len(f) >= 6 and f[1] == "FLOCK" and f[3] == "READ" and f[4] == str(pid):
            out.add(int(f[5].rsplit(":", 1)[1]))
    return out


def _status() -> object:
    c = CkptdClient(socket_name(JOB, NODE))
    try:
        return c.call(Status())
    finally:
        c.close()


def _committed_ok(root: Path) -> list[int]:
    """The committed steps, each checked against its manifest."""
    steps = storage.list_committed(root)
    assert all(storage.verify(root, s) == [] for s in steps), {
        s: storage.verify(root, s) for s in steps
    }
    return steps


def _durable_load(tmp: Path, shm: Path, step: int, size_mb: str) -> dict[str, object]:
    """The agreed restore of ``step`` read from the durable tier alone (memory tier off)."""
    env = {**_env(tmp, shm, restore=(step, 0)), "TRAINGUARD_MEMORY_TIER": "0"}
    res = subprocess.run(
        [sys.executable, str(WORKER), "load", "--size-mb", size_mb, "--root",
         str(tmp / "checkpoints")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # over 12 s: CI's slow run (the default run stays under 15 min)
def test_a_persister_frozen_holding_a_slots_lock_holds_the_writer_alive_until_ckptd_is_killed(
    tmp_path: Path, shm: Path, slow_disk: Path, sink: AgentSink
) -> None:
    """Every slot of the rank holds a durable step the persister has not written (a disk slower
    than the steps), and ckptd is SIGSTOPped while its persister holds one slot's shared flock
    (in the middle of that step's part). The rank's next durable save waits for a slot, sending
    keep-alives all along; once ckptd is SIGKILLed (the agent's 15 s liveness deadline) and
    started again, the lock is gone, the new daemon writes the staged steps, the save goes on
    and every step is durable with its bytes."""
    root = tmp_path / "checkpoints"
    daemons = Daemons(tmp_path, shm)
    rank: Rank | None = None
    try:
        slow_disk.write_text(str(daemons.current.pid))  # its parts reach the disk at 2 MiB/s
        rank = Rank(tmp_path, shm, sink, "save", "--first", "1", "--last", "4", "--size-mb", "4")
        saving = wait_for(lambda: rank.said("saving 4"), 60, "the save of step 4 to begin")
        slots = {s.stat().st_ino: s for s in snapshot.slot_paths(shm, JOB, NODE, 0)}
        frozen = daemons.current.pid
        held: set[int] = set()
        deadline = time.monotonic() + 30
        while not held:  # freeze it while its persister holds a slot's lock
            assert time.monotonic() < deadline, "the persister never held a slot's lock"
            if _flocks(frozen) & set(slots):
                _freeze(frozen)
                held = _flocks(frozen) & set(slots)
                if not held:
                    os.kill(frozen, signal.SIGCONT)
            time.sleep(0.01)
        t_frozen = time.monotonic()
        # the rank cannot save step 4: every slot is locked or holds an unwritten durable step
        assert rank.said("saved 4") is None and storage.list_committed(root) == []
        assert not any(snapshot.reusable(s) for s in slots.values())
        time.sleep(4.0)  # the span the rank waits on the frozen lock (the agent: 15 s)
        assert rank.said("saved 4") is None and storage.list_committed(root) == []
        daemons.kill()
        t_killed = time.monotonic()
        daemons.restart()  # as the agent does at once
        assert rank.finish(timeout=120) == 0, rank.stderr()[-3000:]
        saved = rank.said("saved 4")
        assert saved is not None and saved > t_killed
        # keep-alives for the whole wait: the save began before the freeze, ended after the kill
        during = [t for t in sink.alive if saving <= t <= saved]
        assert _largest_gap(saving, during, saved) < IN_TRAINGUARD_S / 2, [
            round(t - saving, 2) for t in during
        ]
        assert len([t for t in during if t_frozen <= t <= t_killed]) >= 3
    finally:
        if rank is not None:
            rank.kill()
        daemons.close()
    assert _committed_ok(root) == [3, 4]  # keep = 2: every step was durable, nothing torn
    assert _durable_load(tmp_path, shm, 4, "4") == {"step": 4, "bytes_ok": True, "pos": 40}


@pytest.mark.slow  # over 12 s: CI's slow run (the default run stays under 15 min)
def test_a_persister_frozen_mid_part_then_killed_under_a_waiting_rank_commits_nothing_torn(
    tmp_path: Path, shm: Path, slow_disk: Path, sink: AgentSink
) -> None:
    """Step 1 is durable. Step 2's part is being written (a slow disk) while the rank waits in
    ``wait_durable`` (its ``close``); ckptd is SIGSTOPped mid-part, then SIGKILLed and left
    down for a while (the agent's restart). Nothing torn is committed (step 2's part has no
    ``.done``, step 1 is whole); the rank's wait reconnects to the restarted daemon, which
    writes the part again and commits: the answer it gets is the disk's, step 2 is durable
    and every committed step restores its bytes. The rank sends keep-alives throughout."""
    root = tmp_path / "checkpoints"
    daemons = Daemons(tmp_path, shm)
    rank = Rank(tmp_path, shm, sink, "save", "--first", "1", "--last", "2", "--size-mb", "4",
                "--stepwise")  # fmt: skip
    try:
        rank.go()
        wait_for(lambda: storage.list_committed(root) == [1], 60, "step 1 to become durable")
        slow_disk.write_text(str(daemons.current.pid))  # from now on its parts take seconds
        rank.go()
        saved = wait_for(lambda: rank.said("saved 2"), 60, "step 2 staged")  # close() waits next
        part = wait_for(lambda: list(root.glob(".tmp-step_2-gen0-*/rank_0")), 60,
                        "step 2's part to be written")[0]  # fmt: skip
        _freeze(daemons.current.pid)
        assert not (part / ".done").exists() and storage.list_committed(root) == [1]
        time.sleep(3.0)  # frozen mid-part: nothing moves (the agent kills it at 15 s)
        assert not (part / ".done").exists() and storage.list_committed(root) == [1]
        assert rank.proc.poll() is None  # still waiting for step 2
        daemons.kill()
        killed = time.monotonic()
        assert _committed_ok(root) == [1] and not (part / ".done").exists()  # nothing torn
        time.sleep(2.0)  # down: the rank's wait_durable reconnects meanwhile
        assert rank.proc.poll() is None
        daemons.restart()
        assert rank.finish(timeout=120) == 0, rank.stderr()[-3000:]
        closed = rank.said("closed")
        assert closed is not None and closed > killed
        assert 2 in storage.list_committed(root)  # the rank was told the truth: it is on disk
        during = [t for t in sink.alive if saved <= t <= closed]
        assert _largest_gap(saved, during, closed) < IN_TRAINGUARD_S / 2, [
            round(t - saved, 2) for t in during
        ]
    finally:
        rank.kill()
        daemons.close()
    assert _committed_ok(root) == [1, 2]
    assert _durable_load(tmp_path, shm, 1, "4") == {"step": 1, "bytes_ok": True, "pos": 10}
    assert _durable_load(tmp_path, shm, 2, "4") == {"step": 2, "bytes_ok": True, "pos": 20}


def _traced(pid: int, tracer: int) -> bool:
    """Every thread of ``pid`` is traced by ``tracer``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            status = (task / "status").read_text()
            if f"TracerPid:\t{tracer}\n" not in status:
                return False
    return True


@pytest.mark.slow  # over 12 s: CI's slow run (the default run stays under 15 min)
def test_ckptd_killed_mid_prune_leaves_no_half_removed_step_offered(
    tmp_path: Path, shm: Path, sink: AgentSink
) -> None:
    """Steps 1 and 2 are durable (keep = 2). ckptd's every ``unlinkat`` is held 3 s after it
    returns (strace fault injection, the daemon's own code running), so the retention
    ``rmtree`` of step 1 after step 3's commit is caught half done and ckptd is SIGKILLed
    there. The half-removed step 1 is not offered (neither listed nor verified); step 3, the
    newest, restores exact from disk; a restore asked for step 1 fails with a clear error (reported to the
    agent, which restarts from an older point); steps 2 and 3 are whole. What is left of step
    1 is removed by the restarted ckptd's next commit (before, the rmtree took the manifest
    first here: a ``step_1`` that nothing listed was never removed, its data kept forever)."""
    if shutil.which("strace") is None:
        pytest.skip("needs strace (fault injection into a running ckptd)")
    root = tmp_path / "checkpoints"
    daemons = Daemons(tmp_path, shm)
    tracer: subprocess.Popen[bytes] | None = None
    step1 = storage.step_dir(root, 1)

    def remains() -> list[Path]:  # step 1's directory, under its own name or moved aside
        return [d for d in (step1, *root.glob(".tmp-step_1-*")) if d.exists()]

    rank = Rank(tmp_path, shm, sink, "save", "--first", "1", "--last", "4", "--size-mb", "4",
                "--stepwise")  # fmt: skip
    try:
        rank.go()
        rank.go()
        wait_for(lambda: storage.list_committed(root) == [1, 2], 60, "steps 1 and 2 durable")
        assert _committed_ok(root) == [1, 2]
        whole = {q.relative_to(step1) for q in step1.rglob("*")}
        pid = daemons.current.pid
        tracer = subprocess.Popen(
            ["strace", "-f", "--seccomp-bpf", "-qq", "-o", "/dev/null", "-p", str(pid),
             "-e", "trace=unlinkat", "-e", "inject=unlinkat:delay_exit=3000000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        wait_for(lambda: _traced(pid, tracer.pid), 30, "strace to attach to every thread")
        rank.go()
        wait_for(lambda: 3 in storage.list_committed(root), 60, "step 3 durable")

        def half_removed() -> bool:
            return any(
                len(left := {q.relative_to(d) for q in d.rglob("*")}) > 0 and left != whole
                for d in remains()
            )

        wait_for(half_removed, 60, "the retention rmtree of step 1 to begin")
        daemons.kill()  # mid-delete
        tracer.wait(timeout=30)
        assert half_removed(), remains()  # the kill left step 1 half removed
        # not offered: out of the listing, or failing its check
        assert 1 not in storage.list_committed(root) or storage.verify(root, 1)
        assert storage.newest_verified(root)[0] == 3
        assert _committed_ok(root) == [2, 3]
        assert not step1.exists(), sorted(str(q.relative_to(step1)) for q in step1.rglob("*"))
        # an agreed restore of step 1 (memory aside) fails, clearly, and says so to the agent
        env = {**_env(tmp_path, shm, restore=(1, 0)), "TRAINGUARD_MEMORY_TIER": "0",
               "TRAINGUARD_AGENT_ADDR": sink.addr}  # fmt: skip
        res = subprocess.run(
            [sys.executable, str(WORKER), "load", "--size-mb", "4", "--root", str(root)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        last = res.stderr.strip().splitlines()[-1]
        assert res.returncode != 0 and "step 1" in last, res.stderr[-2000:]
        assert "restarts from an older checkpoint" in last, last
        failed = wait_for(
            lambda: [e for e in sink.events if e.kind == "ckpt_restore_failed"], 10, "the report"
        )
        assert failed[0].data["step"] == 1 and failed[0].data["tier"] == "durable", failed
        # the agent restarts ckptd; its next commit removes what is left of step 1
        daemons.restart()
        rank.go()
        assert rank.finish(timeout=120) == 0, rank.stderr()[-2000:]
        assert remains() == [] and _committed_ok(root) == [3, 4]
    finally:
        rank.kill()
        if tracer is not None and tracer.poll() is None:
            tracer.kill()
            tracer.wait(timeout=10)
        daemons.close()
    assert _durable_load(tmp_path, shm, 3, "4") == {"step": 3, "bytes_ok": True, "pos": 30}


def test_a_memory_tier_that_fills_mid_run_keeps_training_and_durable_steps(
    tmp_path: Path, sink: AgentSink
) -> None:
    """The memory tier's directory (a private 24 MiB tmpfs) is filled by another file after two
    saves. The rank trains on: every save returns, the durable step saved while it is full is
    still written to disk (before, its checksum record could not be written, the persister gave
    up on it: never durable, its slot pinned), ckptd says what is wrong and the fix once a slot
    (``ckpt_memory_full``), nothing committed is lost; once the file is removed, memory
    snapshots are indexed again and every committed step restores its bytes."""
    with private_tmpfs(tmp_path / "shm", "24m") as shm:  # unmounted whatever happens
        _fill_mid_run(tmp_path, shm, sink)


def _fill_mid_run(tmp_path: Path, shm: Path, sink: AgentSink) -> None:
    root = tmp_path / "checkpoints"
    daemons: Daemons | None = None
    rank: Rank | None = None
    try:
        daemons = Daemons(tmp_path, shm)
        rank = Rank(tmp_path, shm, sink, "save", "--first", "1", "--last", "8", "--size-mb", "4",
                    "--durable-every", "2", "--stepwise")  # fmt: skip
        events: list[dict[str, object]] = []

        def status() -> dict[str, object]:
            st = _status()
            events.extend(st.events)
            return st.memory

        rank.go()
        rank.go()
        wait_for(lambda: [2, 0] in status().get("0", []) and storage.list_committed(root) == [2],
                 60, "steps 1 and 2 in memory, step 2 durable")  # fmt: skip
        with open(shm / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # /dev/shm fills up
                f.write(b"\0" * (1 << 16))
        for step in (3, 4, 5):
            rank.go()
            wait_for(lambda s=step: rank.said(f"saved {s}"), 60, f"the save of step {step}")
        wait_for(lambda: 4 in storage.list_committed(root), 60, "step 4 durable, shm full")
        assert status().get("0", []) == [[2, 0]] or [4, 0] not in status().get("0", [])
        full = wait_for(lambda: [e for e in events if e["kind"] == "ckpt_memory_full"], 30,
                        "ckpt_memory_full")  # fmt: skip
        reason = str(full[0]["reason"])
        assert str(shm) in reason and "full" in reason and "enlarge it" in reason, reason
        assert "\n" not in reason
        (shm / "filler").unlink()
        for _ in (6, 7, 8):
            rank.go()
        assert rank.finish(timeout=120) == 0, rank.stderr()[-3000:]
        mem = wait_for(lambda: status().get("0"), 30, "memory snapshots again")
        assert [8, 0] in mem and [6, 0] in mem, mem  # memory snapshots resumed
        assert "Traceback" not in rank.stderr()
    finally:
        if rank is not None:
            rank.kill()
        if daemons is not None:
            daemons.close()
    assert _committed_ok(root) == [6, 8]
    assert _load(tmp_path, shm, (8, 0), "4") == {"step": 8, "bytes_ok": True, "pos": 80}
    assert _durable_load(tmp_path, shm, 6, "4") == {"step": 6, "bytes_ok": True, "pos": 60}
