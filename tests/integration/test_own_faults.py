"""Faults of trainguard's own parts (issue 13): corrupt copies in each checkpoint tier, a re-run
of a crashed run dir. Real processes, real bytes flipped in real /dev/shm segments and files;
each test ends with the losses of the fault-free run for every step."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import (
    FAST_CONFIG,
    GPT,
    PACE,
    PACED_ARGS,
    PACED_STEPS,
    ROOT,
    TINY,
    agent_pid,
    drop_segments,
    events,
    fault_free_losses,
    finish_job,
    losses,
    reached_step,
    report,
    run_job,
    run_process,
    start_job,
    throttled_disk,
    trainguard_cmd,
    wait_for,
)
from trainguard.chaos.faults import flip as _flip
from trainguard.chaos.faults import flip_snapshot as _flip_snapshot
from trainguard.chaos.faults import job_id as _job
from trainguard.checkpoint import snapshot, storage
from trainguard.checkpoint.replica import replica_path

STEPS, ARGS = PACED_STEPS, PACED_ARGS  # PACE: rank 0 paced 5x (tests/conftest.py)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The fault-free run's losses (two nodes, same model, data and seed)."""
    return fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)


def _workers(run_dir: Path, generation: int, n: int = 2) -> dict[int, int]:
    """rank → pid of the generation's workers (waits until all ``n`` started, or resumed:
    kept by an in-process recovery)."""

    def started() -> dict[int, int] | None:
        got = {
            int(e["rank"]): int(e["pid"])
            for e in events(run_dir)
            if e["kind"] in ("worker_started", "worker_resumed") and e["generation"] == generation
        }
        return got if len(got) == n else None

    return wait_for(started, 90, f"the workers of generation {generation}")


def _generation(run_dir: Path) -> int:
    return max(e["generation"] for e in events(run_dir) if e["kind"] == "generation_started")


def _freeze(pids: dict[int, int]) -> None:
    """SIGSTOP every worker: no new snapshot replaces the one a test corrupts."""
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    time.sleep(1.0)  # a push or persist in flight finishes (the daemons are not frozen)


def _step(path: Path) -> int:
    h = snapshot.peek_header(path)
    return -1 if h is None else int(h["step"])


def _newest(shm: Path, job: str, node: str, rank: int) -> int:
    return max(_step(p) for p in snapshot.slot_paths(shm, job, node, rank))


def _wait_verified(path: Path) -> None:
    """Until ckptd checksummed the snapshot in ``path`` (its ``.sum`` names that step): a
    byte flipped after that is a corruption of a verified copy."""

    def verified() -> bool:
        h = snapshot.peek_header(path)
        return h is not None and snapshot.read_sums(path, h["step"], h["generation"]) is not None

    wait_for(verified, 60, f"ckptd's checksums of {path.name}")


def _timeline(evs: list[dict[str, Any]]) -> str:
    """The restore-relevant events, one a line (a failure's message)."""
    keep = ("generation_started", "fault", "ckpt_corrupt", "checkpoint_corrupt",
            "restore_fallback", "ckpt_load_end", "sdc_detected", "inject_fired")  # fmt: skip
    return "\n".join(
        str({k: v for k, v in e.items() if k not in ("ts", "assignment")})[:300]
        for e in evs
        if e["kind"] in keep
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 300.0) -> str:
    code, err = finish_job(proc, timeout)
    assert code == 0, err[-3000:]
    return err


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_a_corrupt_copy_in_any_tier_falls_back_to_the_next_verified_one(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    run = tmp_path / "run"
    shm, job = Path("/dev/shm"), _job(run)
    # The test freezes the workers while it waits for copies (seconds under CI's load): a
    # 60 s hang floor keeps its own freezes from being a hang (CI: a hang at step 40 moved
    # the job on before the flips).
    config = FAST_CONFIG + "hang_timeout_min_s = 60.0\n"
    proc = start_job(run, ["--nodes", "2", "--standby", "1"], ARGS, config=config)
    try:
        # 1. Memory tier: rank 1's newest snapshot gets a flipped byte after ckptd verified
        #    it, then rank 1 is killed. The restore must not load it: it reads the durable
        #    copy of that step, or (none) the whole job falls back to an older point.
        pids = _workers(run, 0)
        wait_for(lambda: reached_step(run, 25), 120, "step 25")
        _freeze(pids)
        newest = max(snapshot.slot_paths(shm, job, "node1", 1), key=_step)
        _wait_verified(newest)  # flipped before: the checksums and fingerprint would hold it
        bad_mem = _flip_snapshot(newest)
        os.kill(pids[1], signal.SIGKILL)

        # 2. Replica and durable tiers: a byte flipped in the replica of rank 1 that node0
        #    holds and in the newest durable step, then node1's agent is SIGKILLed (its
        #    workers die with it): the standby takes rank 1 and must not restore either.
        wait_for(lambda: _generation(run) >= 1, 60, "the restart")
        wait_for(lambda: reached_step(run, bad_mem[0] + 20), 120, "20 more steps")
        gen = _generation(run)
        pids = _workers(run, gen)
        _freeze(pids)
        replica = replica_path(shm, job, "node0", 1)
        wait_for(
            lambda: (
                _step(replica) == _newest(shm, job, "node1", 1) == _newest(shm, job, "node0", 0)
            ),
            30,
            "the replica of the newest snapshot",
        )
        _wait_verified(replica)
        bad_replica = _flip_snapshot(replica)
        # The newest durable step is the one at or below the replica's (every 10th): wait for
        # its commit (the persister runs on while the workers are frozen), so that the flipped
        # disk copy is the one a fallback from the replica's point would reach.
        durable = bad_replica[0] - bad_replica[0] % 10
        wait_for(
            lambda: (
                durable in storage.list_committed(run / "checkpoints")
                and storage.committed_generation(run / "checkpoints", durable) == bad_replica[1]
            ),
            60,
            f"durable step {durable} of generation {bad_replica[1]}",
        )
        bad_disk = durable
        part = next((run / "checkpoints" / f"step_{bad_disk}").rglob("*.distcp"))
        _flip(part, part.stat().st_size // 2)
        os.kill(agent_pid(run, "node1"), signal.SIGKILL)
        for pid in pids.values():  # node0's worker resumes and sees its peer gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    assert losses(run) == reference  # every step, bit for bit
    evs = events(run)
    loads = [e for e in evs if e["kind"] == "ckpt_load_end"]
    starts = [e for e in evs if e["kind"] == "generation_started"]
    timeline = _timeline(evs)
    unusable = [tuple(e["unusable"]) for e in evs if e["kind"] == "restore_fallback"]
    # Nothing corrupt was ever loaded: the memory copy, the replica, the disk copy.
    for e in loads:
        assert not (e["rank"] == 1 and e["tier"] == "memory" and e["step"] == bad_mem[0]), timeline
        assert not (e["rank"] == 1 and e["tier"] == "replica" and e["step"] == bad_replica[0]), e
        assert not (e["tier"] == "durable" and e["step"] == bad_disk), e
    corrupt = [e for e in evs if e["kind"] in ("ckpt_corrupt", "checkpoint_corrupt")]
    # Whenever the corrupt replica was chosen as rank 1's source, its corruption was met
    # (and, above, never loaded). Which points the controller chooses depends on what each
    # report held at the time; what a chosen copy must do does not. The durable copy is met
    # only when the fallback reaches it (or the controller verifies it first).
    from_replica = [
        e for e in starts
        if (e["restore_step"], e["restore_generation"]) == bad_replica
        and "1" in e["replica_sources"]
    ]  # fmt: skip
    if from_replica:
        assert "replica" in {e["tier"] for e in corrupt}, timeline
    # A point a rank could not read anywhere is never chosen again. (It may have been chosen,
    # and read, before: a point restored from memory once can be found unreadable later, when
    # a fallback reaches only its corrupt durable copy.)
    for i, e in enumerate(evs):
        if e["kind"] == "restore_fallback":
            point = tuple(e["unusable"])
            later = [
                (x["restore_step"], x["restore_generation"])
                for x in evs[i + 1 :]
                if x["kind"] == "generation_started"
            ]
            assert point not in later, (point, timeline)
    # The corrupt copies were met: the job fell back to an older point, or rank 1 read a
    # fourth copy, good, of the step whose disk copy was flipped: the standby's prefetched
    # copy, taken (and checked against the step's manifest) before the flip.
    prefetched = [e for e in loads if e["tier"] == "prefetched" and e["step"] == bad_disk]
    assert unusable or (prefetched and corrupt), f"the corrupt copies were never met\n{timeline}"
    # The controller never called it a user error, and every fault was recovered from.
    assert not any(e["kind"] == "phase" and e["to"] == "FAILED" for e in evs)
    assert not any("user error" in str(e.get("reason", "")) for e in evs)


def _kill_everything(run_dir: Path, proc: subprocess.Popen[str]) -> None:
    """SIGKILL every process of the run at once: launcher, agents, daemons, workers; again
    until none is left (one that a live agent started between the scan and its own death has
    the run dir in its environment too; the launcher may already have exited). Raises
    AssertionError when processes of the run are still there after 60 s."""
    tag = str(run_dir)
    deadline = time.monotonic() + 60.0
    while True:
        victims = [] if proc.poll() is not None else [psutil.Process(proc.pid)]
        victims += [p for p in psutil.process_iter() if p.pid != proc.pid and run_process(p, tag)]
        if not victims:
            break
        assert time.monotonic() < deadline, f"processes of {run_dir} outlive SIGKILL: {victims}"
        for p in victims:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(victims, timeout=30)
    proc.communicate(timeout=30)


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_a_rerun_of_a_run_dir_killed_whole_never_mixes_the_two_runs(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    proc = start_job(run, ["--nodes", "2"], ARGS)
    try:
        wait_for(lambda: len(list(ckpts.glob("step_*"))) >= 2, 120, "two steps on disk")
        _kill_everything(run, proc)
        _check_rerun(run, reference)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        drop_segments(f"trainguard-{_job(run)}-*")  # a failed test's


def _check_rerun(run: Path, reference: dict[int, float]) -> None:
    ckpts = run / "checkpoints"
    old_gens = {e["generation"] for e in events(run) if e["kind"] == "generation_started"}
    real = {p.name for p in ckpts.glob(".tmp-*")}  # a step the dead run was writing, for real
    # Planted as well: a step half-written by generation 0 and by generation 1 (the numbers
    # the new run would reuse if it counted from 0 again), and a commit that died between
    # its two renames (the newest step moved aside, no step_N under its name).
    for gen in (0, 1):
        part = ckpts / f".tmp-step_1000-gen{gen}" / "rank_0"
        part.mkdir(parents=True)
        (part / "__0_0.distcp").write_bytes(b"half a step of the dead run")
    newest = max(int(d.name.removeprefix("step_")) for d in ckpts.glob("step_*"))
    aside = ckpts / f".replaced-step_{newest}-4242-1"
    os.rename(ckpts / f"step_{newest}", aside)

    res = run_job(run, ["--nodes", "2"], ARGS)
    assert res.returncode == 0, res.stderr[-3000:]
    assert losses(run) == reference  # every step, bit for bit, across the two runs
    evs = events(run)
    (rerun,) = [e for e in evs if e["kind"] == "rerun"]
    assert rerun["incarnation"] == 1 and rerun["previous_phase"] == "RUNNING"
    planted = {".tmp-step_1000-gen0", ".tmp-step_1000-gen1"}
    assert set(rerun["leftovers"]["removed"]) == planted | real
    assert rerun["leftovers"]["restored"] == [aside.name]
    new = [e for e in evs[evs.index(rerun) :] if e["kind"] == "generation_started"]
    assert min(e["generation"] for e in new) == max(old_gens) + 1  # numbering continues
    assert new[0]["restore_step"] >= newest  # nothing committed was lost
    assert not list(ckpts.glob(".tmp-*")) and not list(ckpts.glob(".replaced-*"))
    verify = subprocess.run(
        [*trainguard_cmd(), "ckpt", "verify", "--run-dir", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verify.returncode == 0, verify.stdout
    rep = report(run)
    assert rep["phase"] == "SUCCEEDED" and rep["incarnation"] == 1 and rep["earlier_runs"] == 1
    assert rep["generations"] == len(new)


@pytest.fixture
def slow_disk(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A real slow disk (``throttled_disk``: writes at 64 KiB/s for the processes of its
    cgroup). Yields (mount point, cgroup dir)."""
    with throttled_disk(tmp_path, tmp_path / "disk", 128, 64 << 10) as cg:
        yield tmp_path / "disk", cg


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_a_slow_disk_is_back_pressure_not_a_hang(
    tmp_path: Path, slow_disk: tuple[Path, Path], reference: dict[int, float]
) -> None:
    mnt, cg = slow_disk
    run = tmp_path / "run"
    run.mkdir()
    cfg = tmp_path / "slow.toml"
    cfg.write_text(FAST_CONFIG + f'checkpoint_dir = "{mnt / "checkpoints"}"\n')
    # Every step snapshotted, every 20th persisted through a disk far slower than the steps
    # (a step's ~0.4 MB take seconds): by step 60 every slot of a rank waits on the disk, the
    # next snapshots are skipped (at most max_skipped = 4 in a row), then a save waits for a
    # slot, inside trainguard, past the 3 s hang timeout, which must not fire on a rank that
    # waits on trainguard's own disk.
    args = [*TINY, "--steps", str(STEPS), "--ckpt-every", "1", "--durable-every", "20"]
    cmd = [
        *trainguard_cmd(), "run", "--run-dir", str(run), "--config", str(cfg), "--nodes", "2",
        "--hang-timeout", "3", str(GPT), *args,
    ]  # fmt: skip
    proc = subprocess.Popen(  # the whole job in the throttled cgroup: its writes are slow
        ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh", *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        _finish(proc, timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert losses(run) == reference
    evs = events(run)
    assert not [e for e in evs if e["kind"] == "fault"], [e for e in evs if e["kind"] == "fault"]
    skipped = [e for e in evs if e["kind"] == "ckpt_skipped"]
    assert skipped and max(e["skipped_in_a_row"] for e in skipped) <= 4, skipped
    rep = report(run)
    assert rep["snapshots_skipped"] == len(skipped) and rep["max_skipped_in_a_row"] <= 4
    text = subprocess.run(
        [*trainguard_cmd(), "report", "--run-dir", str(run)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "back-pressure" in text, text
    db = sqlite3.connect(run / "job.sqlite")
    (longest,) = db.execute("SELECT MAX(duration_s) FROM steps").fetchone()
    db.close()
    assert longest > 3.0  # a step waited on the disk for longer than the hang timeout
    durable = sorted(
        int(d.name.removeprefix("step_")) for d in (mnt / "checkpoints").glob("step_*")
    )
    assert durable and durable[-1] == STEPS  # the last step reached the slow disk


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_a_frozen_controller_blames_no_node_and_agents_cut_off_past_their_bound_exit(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """``trainguard controller`` frozen (SIGSTOP) twice. For twice the node timeout: the
    agents fence their workers; woken up, the controller holds only stale reports and must
    not call a node lost (nor mark one faulty) before it reports again. Then for longer than
    the agents' --give-up-after: each agent stops its workers, frees its memory slots and
    exits 3 with the reason, in bounded time; woken up, the controller waits for nodes, and
    agents started again resume the job from the durable tier. The fault-free losses."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = tmp_path / "job.toml"
    cfg.write_text(FAST_CONFIG)
    ctl = subprocess.Popen(
        [*trainguard_cmd(), "controller", "--bind", "127.0.0.1:0", "--run-dir", str(run),
         "--config", str(cfg), "--nodes", "2", *PACE, str(GPT), *ARGS],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    agents: list[subprocess.Popen[str]] = []

    def start_agents() -> None:
        addr = wait_for(lambda: _addr(run), 60, "the controller to listen")
        for i in range(2):
            agents.append(
                subprocess.Popen(
                    [
                        *trainguard_cmd(),
                        "agent",
                        "--controller",
                        addr,
                        "--token-file",
                        str(run / "token"),
                        "--node-id",
                        f"node{i}",
                        "--addr",
                        f"127.0.0.{i + 2}",
                        "--run-dir",
                        str(run),
                        "--give-up-after",
                        "8",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                )  # fmt: skip
            )

    try:
        start_agents()
        wait_for(lambda: reached_step(run, 25), 120, "step 25")
        ctl.send_signal(signal.SIGSTOP)
        time.sleep(6.0)  # node_timeout_s = 3: the agents stop their workers meanwhile
        ctl.send_signal(signal.SIGCONT)
        wait_for(lambda: _generation(run) >= 1, 60, "the restart after the fencing")
        gen = _generation(run)
        wait_for(lambda: len(_workers(run, gen)) == 2 and reached_step(run, 50), 120, "step 50")
        first = events(run)
        assert [e for e in first if e["kind"] == "controller_paused"]
        assert not [e for e in first if e["kind"] == "pool_changed" and e["to"] == "faulty"]
        assert {e["cause"] for e in first if e["kind"] == "fault"} == {"node_fenced"}

        ctl.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        errs = [a.communicate(timeout=60)[1] for a in agents]
        waited = time.monotonic() - t0
        assert [a.returncode for a in agents] == [3, 3], errs
        assert all("no contact with controller" in e for e in errs), errs
        assert 8 <= waited < 40, waited
        left = list(Path("/dev/shm").glob(f"trainguard-{_job(run)}-*"))
        assert not left, left  # the memory slots were freed
        ctl.send_signal(signal.SIGCONT)
        agents.clear()
        start_agents()  # the nodes come back (an operator, systemd): the job goes on
        _, err = ctl.communicate(timeout=300)
        assert ctl.returncode == 0, err[-3000:]
        for a in agents:
            a.wait(timeout=60)
    finally:
        for p in [ctl, *agents]:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.communicate()
    assert losses(run) == reference
    evs = events(run)
    assert {e["cause"] for e in evs if e["kind"] == "fault"} <= {"node_lost", "node_fenced"}


def _addr(run: Path) -> str | None:
    try:
        return str(json.loads((run / "controller.json").read_text())["addr"])
    except (OSError, ValueError, KeyError):
        return None
