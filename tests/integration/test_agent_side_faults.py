"""Faults at four points of docs/self-faults.md §9 that no other test puts a fault at: a
standby's prefetched copy with the process copying or checking it SIGKILLed (Agent table), an
agent frozen while its workers report (Agent table), ckptd frozen under the agent's pre-verify
of a restore point (ckptd table), and a replacing commit of a durable step SIGKILLed at its
rename (Persister table). Real processes and real signals: ``strace --inject`` puts a SIGKILL
at one exact system call; a whole job's agent or ckptd is SIGSTOPped by its pid. Every test
ends with exact bytes (a restore checked element for element) or the fault-free losses."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.conftest import (
    FAST_CONFIG,
    ROOT,
    TINY,
    agent_pid,
    events,
    fault_free_losses,
    finish_job,
    losses,
    reached_step,
    report,
    start_job,
    strace_attached,
    wait_for,
    worker_pid,
)
from trainguard.chaos.faults import job_id, run_processes
from trainguard.checkpoint import snapshot, storage
from trainguard.checkpoint.checkpointer import Checkpointer
from trainguard.checkpoint.prefetch import (
    VERIFIED,
    Prefetcher,
    copy_step,
    prefetch_root,
    present,
    restore,
    verified,
)

CHILD_TIMEOUT_S = 240.0  # one python process importing torch on a loaded 2-core machine


def _need_strace() -> None:
    if shutil.which("strace") is None or os.geteuid() != 0:
        pytest.skip("needs strace and root (a SIGKILL injected at one system call)")


def _traced(code: str, trace: list[str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code args`` under ``strace trace`` (its filters and injection) to its
    end, killed at ``CHILD_TIMEOUT_S``. strace ends as its tracee did: -SIGKILL when killed."""
    cmd = ["strace", "-qq", "-f", "-o", "/dev/null", *trace, sys.executable, "-c", code]
    return subprocess.run(
        [*cmd, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        cwd=ROOT,
    )


def _killed(res: subprocess.CompletedProcess[str]) -> bool:
    return res.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


# ------------------------------------------------------------------ prefetched copy
PREFETCH_CHILD = """
import sys
from pathlib import Path
from trainguard.checkpoint import prefetch
what, src, dest, n = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
if what == "copy":
    prefetch.copy_step(src, dest, n)
else:
    print(prefetch.verify_for_restart(dest, n))
"""
BIG = 6 << 20  # float32 elements: a 24 MiB data file, copied in three 8 MiB writes


def _state(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s state: every element distinct, so a torn or stale read shows."""
    return {"w": torch.arange(BIG, dtype=torch.float32) + step * BIG, "b": torch.full((7,), step)}


def _save_durable(root: Path, step: int) -> int:
    """Save ``_state(step)`` as durable step ``step`` (straight to disk, in this process);
    returns the generation that committed it."""
    ck = Checkpointer(root, durable_every=1, keep=3, memory_tier=False)
    ck.save(step, _state(step))
    ck.close()
    return storage.committed_generation(root, step)


def _data_file(root: Path, step: int) -> str:
    """The step's largest file, relative to its directory (the data a copy writes longest)."""
    files = json.loads((storage.step_dir(root, step) / "manifest.json").read_text())["files"]
    return str(max(files, key=lambda name: files[name]["size"]))


def _restored_exact(dest: Path, step: int, gen: int, for_generation: int = 0) -> str:
    """Restore ``step`` from the prefetched copy into zeroed tensors, as a rank does; asserts
    every element equals the saved state's. Returns how the copy was checked."""
    live = {k: torch.zeros_like(v) for k, v in _state(step).items()}
    how = restore(live, dest, step, gen, for_generation=for_generation)
    want = _state(step)
    assert all(torch.equal(live[k], want[k]) for k in want), f"step {step} not restored exact"
    return how


def test_a_standby_killed_mid_copy_commits_nothing_torn_and_the_next_agent_copies_whole(
    tmp_path: Path, shm: Path
) -> None:
    """Agent row "The same, the standby's own agent killed mid-copy": a process copying durable
    step 1 into the node's prefetch root (``copy_step``, what a standby agent's prefetch thread
    runs) is SIGKILLed at its second 8 MiB write of the data file (strace). The torn
    ``.tmp-step_1-*`` is never committed (nothing listed, ``present`` says no copy). The job
    moves on to durable step 2; the next agent's Prefetcher copies it whole, the torn copy of
    step 1 is removed (it stayed in memory until the prefetcher closed), a restore from the copy
    is exact, and closing the prefetcher leaves the memory tier empty."""
    _need_strace()
    src, dest = tmp_path / "durable", prefetch_root(shm, "job", "node1")
    gen = _save_durable(src, 1)
    name = _data_file(src, 1)
    size = (storage.step_dir(src, 1) / name).stat().st_size
    torn = storage.tmp_dir(dest, 1, gen) / name
    res = _traced(
        PREFETCH_CHILD,
        ["-e", "trace=write", "-P", str(torn), "-e", "inject=write:signal=SIGKILL:when=2"],
        *("copy", src, dest, 1),
    )
    assert _killed(res), (res.returncode, res.stderr[-2000:])
    written = torn.stat().st_size
    assert 0 < written < size, (written, size)  # killed mid-copy
    assert storage.list_committed(dest) == [] and present(str(dest), 1, -1) is None
    gen2 = _save_durable(src, 2)  # the job went on meanwhile
    seen: list[tuple[str, dict[str, Any]]] = []
    fetcher = Prefetcher(lambda kind, **d: seen.append((kind, d)))
    try:
        fetcher.follow(src, dest)  # the node's next agent, a standby again
        wait_for(lambda: present(str(dest), 2, gen2), 120, "the next agent's copy of step 2")
        assert storage.list_committed(dest) == [2] and storage.verify(dest, 2) == []
        left = sorted(p.name for p in dest.iterdir())
        assert left == ["step_2"], f"left in the prefetch root: {left}"
        assert _restored_exact(dest, 2, gen2) == "while read"
    finally:
        fetcher.close(remove=True)
    assert [k for k, _ in seen] == ["standby_prefetched"], seen
    assert list(shm.iterdir()) == []  # nothing left in memory
    print(f"torn copy of {written} of {size} bytes never committed, removed by the next agent")


def test_a_standby_killed_mid_check_leaves_no_record_and_the_next_agent_keeps_and_checks(
    tmp_path: Path, shm: Path
) -> None:
    """Agent row "... or mid-check (``verified.json`` through a temp file)": the standby holds
    a whole copy of step 1; the process checking it for the restart of generation 7
    (``verify_for_restart``, run by the agent's prefetch thread when the node takes a rank) is
    SIGKILLed at the rename of ``.verified.json.tmp`` (strace), after its checksums. No record
    is left, so a rank checks each file as it reads (exact bytes); the copy stays committed.
    The next agent keeps it (no second copy), checks it for the restart (record written,
    temp file gone); the rank then reads it unchecked, exact; nothing is left in memory."""
    _need_strace()
    src, dest = tmp_path / "durable", prefetch_root(shm, "job", "node1")
    gen = _save_durable(src, 1)
    copy_step(src, dest, 1)
    tmp_record = dest / f".{VERIFIED}.tmp"
    res = _traced(
        PREFETCH_CHILD,
        ["-e", "trace=rename", "-P", str(tmp_record), "-e", "inject=rename:signal=SIGKILL:when=1"],
        *("check", src, dest, 7),
    )
    assert _killed(res), (res.returncode, res.stderr[-2000:])
    assert tmp_record.exists() and not (dest / VERIFIED).exists()  # killed at the rename
    assert storage.list_committed(dest) == [1] and not verified(dest, 1, gen, 7)
    assert _restored_exact(dest, 1, gen, for_generation=7) == "while read"
    seen: list[tuple[str, dict[str, Any]]] = []
    fetcher = Prefetcher(lambda kind, **d: seen.append((kind, d)))
    try:
        fetcher.follow(src, dest)  # the next agent: a standby that holds the copy
        fetcher.pause(7)  # ... and takes a rank of generation 7
        wait_for(lambda: verified(dest, 1, gen, 7), 120, "the next agent's check")
        assert sorted(p.name for p in dest.iterdir()) == sorted([VERIFIED, "step_1"])
        assert _restored_exact(dest, 1, gen, for_generation=7) == "at the restart"
    finally:
        fetcher.close(remove=True)
    assert [k for k, _ in seen] == ["standby_prefetch_verified"], seen  # kept, not copied
    assert list(shm.iterdir()) == []


# ------------------------------------------------------------------ replacing commit
SAVE_CHILD = """
import json, sys, torch
from trainguard.checkpoint.checkpointer import Checkpointer
what, root, n = sys.argv[1], sys.argv[2], 1 << 18
ck = Checkpointer(root, durable_every=1, keep=2, memory_tier=False)
if what == "save":
    ck.save(int(sys.argv[3]), {"w": torch.full((n,), float(sys.argv[4]))})
    ck.close()
else:
    state = {"w": torch.zeros(n)}
    step = ck.load(state)
    values = sorted(set(state["w"].tolist()))
    print(json.dumps({"step": step, "values": values}))
"""


def _load_in_new_process(root: Path) -> dict[str, Any]:
    """What a new standalone process restores from ``root``: its step and the distinct
    values of the restored tensor (one value: a whole copy's every element)."""
    res = subprocess.run(
        [sys.executable, "-c", SAVE_CHILD, "load", str(root)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def _copies(root: Path) -> dict[str, float]:
    """Every copy of step 1 under ``root`` (committed, aside or temp), by directory name: the
    value whose whole tensor its data file holds, byte for byte."""
    out: dict[str, float] = {}
    for d in sorted(root.iterdir()):
        if d.name != "step_1" and not d.name.startswith((".tmp-step_1-", ".replaced-step_1-")):
            continue
        data = b"".join(p.read_bytes() for p in sorted(d.rglob("*.distcp")))
        for v in (1.0, 2.0, 3.0):
            if torch.full((1 << 18,), v).numpy().tobytes() in data:
                out[d.name] = v
    return out


@pytest.mark.timeout(600)
@pytest.mark.slow  # four children importing torch: 60-100 s on a loaded 2-core machine
def test_a_replacing_commit_killed_at_its_rename_leaves_the_old_or_the_new_step_whole(
    tmp_path: Path,
) -> None:
    """Persister row "Replacing a ``step_<N>``", with no re-run after. Step 1 (all 1.0) is
    committed; a newer run's process saves step 1 again (all 2.0: the replacing commit) and
    is SIGKILLed by strace at the rename that puts its copy in place. Before the fix the
    commit was two renames (old ``step_1`` aside to ``.replaced-step_1-*``, then the new one
    in) and this kill left neither listed: a new process restored nothing and started over.
    Now the two swap in one ``renameat2(RENAME_EXCHANGE)``: killed at it, the old step is
    listed and verifies, and a load in a new process restores all 1.0. A third process (3.0)
    is SIGKILLed right after the exchange (its next system call, opening the root to fsync
    it): the new step is listed, a new process restores all 3.0; the old copy is left under
    the temp name, never listed, and removed by the next commit (step 2, this process)."""
    _need_strace()
    root = tmp_path / "ckpt"
    ck = Checkpointer(root, durable_every=1, keep=2, memory_tier=False)
    ck.save(1, {"w": torch.full((1 << 18,), 1.0)})
    ck.close()
    at_exchange = ["-e", "trace=renameat2", "-e", "inject=renameat2:signal=SIGKILL:when=1"]
    res = _traced(SAVE_CHILD, at_exchange, "save", root, 1, 2.0)
    assert _killed(res), (res.returncode, res.stderr[-2000:])
    assert storage.list_committed(root) == [1] and storage.newest_verified(root) == (1, {})
    assert _copies(root)["step_1"] == 1.0, _copies(root)
    assert _load_in_new_process(root) == {"step": 1, "values": [1.0]}
    after = ["-e", "trace=openat", "-P", str(root), "-e", "inject=openat:signal=SIGKILL:when=1"]
    res = _traced(SAVE_CHILD, after, "save", root, 1, 3.0)
    assert _killed(res), (res.returncode, res.stderr[-2000:])
    copies = _copies(root)
    assert copies["step_1"] == 3.0, copies  # the exchange was done
    assert storage.list_committed(root) == [1] and storage.newest_verified(root) == (1, {})
    assert _load_in_new_process(root) == {"step": 1, "values": [3.0]}
    leftovers = sorted(n for n in copies if n != "step_1")
    assert len(leftovers) == 2 and all(n.startswith(".tmp-step_1-") for n in leftovers), copies
    assert sorted(copies[n] for n in leftovers) == [1.0, 2.0]  # old copy, and the unswapped 2.0
    ck = Checkpointer(root, durable_every=1, keep=2, memory_tier=False)
    ck.save(2, {"w": torch.full((1 << 18,), 4.0)})  # the next commit's prune removes them
    ck.close()
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]
    assert storage.list_committed(root) == [1, 2] and storage.verify(root, 1) == []
    print(f"killed at the exchange: old step whole; after it: new step whole; left {leftovers}")


# ------------------------------------------------------------------ whole jobs
STEPS = 200
# Steps 10x longer (a sleep on rank 0; the losses do not change): the job is still training
# when a freeze, and a recovery, are over.
PACE = ["--inject", "slow:rank=0:factor=10"]
ARGS = [*TINY, "--steps", str(STEPS), "--ckpt-every", "5", "--durable-every", "10"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The fault-free run's losses (two nodes, same model, data and seed)."""
    return fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)


def _kill_run(run: Path, proc: subprocess.Popen[str]) -> None:
    """A failed test's clean-up: SIGCONT and SIGKILL every process of the run."""
    if proc.poll() is None:
        proc.kill()
    proc.communicate()
    for p in run_processes(run):
        with contextlib.suppress(psutil.Error):
            p.resume()
            p.kill()


def _ckptd_pid(run: Path, node: str) -> int:
    """The pid of ``node``'s ckptd of the job in ``run`` (waits up to 60 s)."""
    job = job_id(run)

    def find() -> int | None:
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "trainguard.checkpoint.ckptd" in cmd and job in cmd and node in cmd:
                return p.pid
        return None

    return int(wait_for(find, 60, f"{node}'s ckptd"))


def _log_time(line: str) -> float:
    """The epoch time of an agent log line (``%(asctime)s`` first)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.slow  # two runs of the example
@pytest.mark.timeout(900)
def test_an_agent_frozen_shorter_than_the_node_timeout_blames_no_rank_for_a_hang(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """Agent row "UDP report socket ..., frozen": node1's agent is SIGSTOPped for 6 s while
    its worker trains on and reports, then SIGCONTed. The hang timeout is fixed at 3 s, so the
    freeze is twice as long as a hang (and half the 12 s node timeout: the node is not lost).
    The reports queue in the socket (none dropped in 6 s); the woken agent drains them before
    its hang watch runs, so the frozen time is never counted against the rank: no
    ``hang_suspected``, no fault, one generation, and the fault-free losses."""
    freeze_s, hang_s = 6.0, 3.0
    config = FAST_CONFIG.replace("node_timeout_s = 3.0", "node_timeout_s = 12.0")
    assert config != FAST_CONFIG
    config += f"hang_timeout_s = {hang_s}\n"
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2", *PACE], ARGS, config=config)
    agent = 0
    try:
        worker_pid(run, rank=1)
        wait_for(lambda: reached_step(run, 20), 180, "step 20")
        agent = agent_pid(run, "node1")
        os.kill(agent, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: time.monotonic() - t0 >= freeze_s, freeze_s + 5, "the freeze's end")
        during = max(losses(run))  # the steps reached while the agent was frozen
        os.kill(agent, signal.SIGCONT)
        agent = 0
        assert proc.poll() is None and during < STEPS, "the job ended during the freeze"
        code, err = finish_job(proc, timeout=300)
    finally:
        if agent:
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent, signal.SIGCONT)
        if proc.poll() is None:
            _kill_run(run, proc)
    assert code == 0, err[-3000:]
    evs = events(run)
    hangs = [e for e in evs if e["kind"] in ("hang_suspected", "hang_cleared")]
    assert not hangs, hangs
    assert report(run)["faults"] == []
    gens = [e["generation"] for e in evs if e["kind"] == "generation_started"]
    assert gens == [0], gens
    assert losses(run) == reference
    print(f"agent frozen {freeze_s}s (hang timeout {hang_s}s): training reached step {during}")


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (SIGSTOP)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(st in "Tt" for st in states)


def _gone(pid: int) -> bool:
    """``pid`` exited (a zombie not yet reaped counts)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(900)
@pytest.mark.slow  # two runs of the example, and ckptd's 15 s liveness deadline
def test_ckptd_frozen_under_the_agents_preverify_is_killed_and_each_rank_verifies_itself(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """ckptd row "Agent's pre-verify of the restore point": node1's rank 1 worker is SIGKILLed;
    in the recovery node1's agent starts generation 1 and its pre-verify thread asks node1's
    ckptd to ``Verify`` rank 1's snapshot of the restore point (300 s deadline). strace
    SIGSTOPs ckptd inside that very call (at its open of the slot's ``.sum``: replicas off,
    nothing else opens it while training runs), then detaches, ckptd left stopped. The agent's liveness watch SIGKILLs the frozen
    ckptd (``ckptd_unresponsive``, 15 s) and restarts it (``ckptd_restarted``); the pre-verify
    call ends with the connection and is logged: its wait, from the generation's start to that
    log line, is bounded by the kill, not by its 300 s. Each rank restores the agreed point by
    itself (its own ``Verify`` on the new ckptd, or the slot's checksums); one fault (rank
    1's), one recovery, the fault-free losses."""
    _need_strace()
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2", *PACE], ARGS, config=FAST_CONFIG + "replicas = false\n")
    frozen = 0
    try:
        victim = worker_pid(run, rank=1)
        wait_for(lambda: reached_step(run, 30), 180, "step 30")
        frozen = _ckptd_pid(run, "node1")
        sums = [
            str(snapshot.sums_path(p))
            for p in snapshot.slot_paths(Path("/dev/shm"), job_id(run), "node1", 1)
        ]
        paths = [a for path in sums for a in ("-P", path)]
        with strace_attached(
            frozen, "-e", "trace=openat", *paths, "-e", "inject=openat:signal=STOP"
        ):
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: _stopped(frozen), 120, "ckptd frozen in the pre-verify's Verify")
        # strace detached (a traced zombie is not handed to its parent while its tracer lives:
        # the agent would not see its kill); ckptd stays stopped
        assert _stopped(frozen), "ckptd woke when strace detached"
        wait_for(lambda: _gone(frozen), 120, "the agent to kill its frozen ckptd")
        code, err = finish_job(proc, timeout=300)
    finally:
        if frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
        if proc.poll() is None:
            _kill_run(run, proc)
    assert code == 0, err[-3000:]
    evs = events(run)
    faults = report(run)["faults"]
    assert [(f["node_id"], f["rank"]) for f in faults] == [("node1", 1)], faults
    gens = [e for e in evs if e["kind"] == "generation_started"]
    assert [g["generation"] for g in gens] == [0, 1], gens
    point = gens[1]["restore_step"]
    assert point is not None and point >= 5, gens[1]
    mine = [e["kind"] for e in evs if e.get("node") == "node1" and e["kind"].startswith("ckptd_")]
    assert mine[:2] == ["ckptd_unresponsive", "ckptd_restarted"], mine
    loads = [e for e in evs if e["kind"] == "ckpt_load_end" and e.get("generation") == 1]
    assert sorted((e["rank"], e["step"]) for e in loads) == [(0, point), (1, point)], loads
    log = (run / "logs" / "agent.node1.log").read_text().splitlines()
    started = next(x for x in log if "[gen 1 node node1] started ranks" in x)
    failed = [x for x in log if "pre-verifying snapshots for generation 1 failed" in x]
    assert len(failed) == 1, "\n".join(log[-40:])
    waited = _log_time(failed[0]) - _log_time(started)
    assert 5 < waited < 60, (started, failed)  # waited on the frozen ckptd until its kill
    assert losses(run) == reference
    tiers = sorted((e["rank"], e["tier"]) for e in loads)
    print(f"pre-verify waited {waited:.1f}s on the frozen ckptd ({failed[0][24:]}); "
          f"restored step {point}: {tiers}")  # fmt: skip
