"""Standby prefetch (issue 16): a standby keeps a verified copy of the newest durable step in
its memory; when it replaces a node that was lost with its memory (no replicas), its rank
restores from that copy, not from the durable tier, and the losses are those of a run with
no fault. The copy itself: verified while copied, never committed when a file is wrong."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import (
    FAST_CONFIG,
    TINY,
    agent_pid,
    events,
    fault_free_losses,
    finish_job,
    losses,
    report,
    start_job,
    wait_for,
    worker_pid,
)
from trainguard.checkpoint import storage
from trainguard.checkpoint.checkpointer import Checkpointer
from trainguard.checkpoint.prefetch import (
    VERIFIED,
    Prefetcher,
    copy_step,
    present,
    verified,
    verify_for_restart,
)
from trainguard.checkpoint.tiers.prefetch import PrefetchTier
from trainguard.runtime import api as rt_api


def test_a_copy_is_verified_committed_and_only_the_newest_kept(tmp_path: Path) -> None:
    src, dest = tmp_path / "durable", tmp_path / "shm" / "prefetch"
    ck = Checkpointer(src, durable_every=1, keep=3)
    for step in (1, 2):
        ck.save(step, {"w": torch.full((1000,), float(step))})
    ck.close()
    assert copy_step(src, dest, 1) > 4000 and present(str(dest), 1, -1) == dest
    assert copy_step(src, dest, 2) and storage.list_committed(dest) == [2]  # 1 removed
    assert storage.verify(dest, 2) == []
    gen = storage.committed_generation(src, 2)
    assert present(str(dest), 2, gen) == dest and present(str(dest), 2, gen + 1) is None
    data = next(p for p in storage.step_dir(src, 1).rglob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 1
    data.write_bytes(bytes(blob))
    shutil.rmtree(dest)
    with pytest.raises(ValueError, match="does not match its manifest"):
        copy_step(src, dest, 1)
    assert storage.list_committed(dest) == [] and not list(dest.glob(".tmp-*"))


def test_a_copy_checked_at_the_restart_is_read_unchecked_and_a_changed_one_never(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The standby's agent checks its copy whole when the node takes a rank (memory may have
    changed since the copy); a rank that finds that check, for its own restart, reads the
    copy without checksums. A copy that changed after it was copied is caught by either
    check: the agent's removes it, the rank's (no record of a check) reads the durable tier."""
    src, dest = tmp_path / "durable", tmp_path / "shm" / "prefetch"
    ck = Checkpointer(src, durable_every=1, keep=3)
    state = {"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(3)}
    ck.save(1, state)
    ck.close()
    gen = storage.committed_generation(src, 1)
    monkeypatch.setenv(rt_api.ENV_PREFETCH_DIR, str(dest))
    seen: list[tuple[str, dict[str, Any]]] = []
    fetcher = Prefetcher(lambda kind, **d: seen.append((kind, d)))
    try:
        fetcher.follow(src, dest)
        wait_for(lambda: present(str(dest), 1, gen), 30, "the copy")
        reader = Checkpointer(tmp_path / "elsewhere", durable_every=0, memory_tier=False)
        restart = reader._rt.generation
        assert not verified(dest, 1, gen, restart)
        fetcher.pause(restart)  # the node took a rank of generation ``restart``
        wait_for(lambda: verified(dest, 1, gen, restart), 30, "the check at the restart")
        assert not verified(dest, 1, gen, restart + 1)  # another restart: not checked for it
        fetcher.pause(restart)  # every reconcile says so again: one check per restart
    finally:
        fetcher.close(remove=False)
    kinds = [k for k, _ in seen]
    assert kinds == ["standby_prefetched", "standby_prefetch_verified"], seen
    live = {"w": torch.zeros(1 << 20), "b": torch.zeros(3)}
    tier = PrefetchTier(reader._rank_side(0, memory=False))
    assert tier.restore(live, (1, gen)) and tier.details == {"checked": "at the restart"}
    assert all(torch.equal(live[k], state[k]) for k in state)
    # a bit flips in the copy after the agent's check: without it the rank's own catches it
    data = next(p for p in storage.step_dir(dest, 1).rglob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 1
    data.write_bytes(bytes(blob))
    (dest / VERIFIED).unlink()
    tier = PrefetchTier(reader._rank_side(0, memory=False))
    assert not tier.restore(live, (1, gen))  # the caller reads the next tier (the durable)
    found = verify_for_restart(dest, restart)  # the agent's check removes such a copy
    assert found is not None and "checksum mismatch" in found[1][0], found
    assert present(str(dest), 1, gen) is None and not verified(dest, 1, gen, restart)


def test_a_full_memory_fails_the_check_not_the_prefetcher(tmp_path: Path) -> None:
    """The node's memory is full when the agent records its check of the copy (a real
    tmpfs, filled): the check fails with an event and no record, and the prefetch thread
    lives on: once memory is freed it copies the next durable step."""
    src, mnt = tmp_path / "durable", tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    seen: list[tuple[str, dict[str, Any]]] = []
    fetcher = Prefetcher(lambda kind, **d: seen.append((kind, d)))
    try:
        ck = Checkpointer(src, durable_every=1, keep=3)
        ck.save(1, {"w": torch.arange(50_000, dtype=torch.float32)})
        gen = storage.committed_generation(src, 1)
        dest = mnt / "prefetch"
        fetcher.follow(src, dest)
        wait_for(lambda: present(str(dest), 1, gen), 30, "the copy")
        filler = mnt / "filler"
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while f.write(b"\0" * 65536):  # until ENOSPC
                pass
        fetcher.pause(7)
        wait_for(lambda: len(seen) > 1, 30, "the check's outcome")
        assert seen[1][0] == "standby_prefetch_failed", seen
        assert "No space left" in seen[1][1]["reason"], seen
        assert not verified(dest, 1, gen, 7)
        filler.unlink()
        ck.save(2, {"w": torch.arange(50_000, dtype=torch.float32) + 1})
        ck.close()
        fetcher.follow(src, dest)  # a standby again
        wait_for(lambda: storage.list_committed(dest) == [2], 30, "the next step's copy")
    finally:
        fetcher.close(remove=True)
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow  # two runs of the example (CI's slow run)
def test_a_standby_that_replaces_a_lost_node_restores_from_its_prefetched_copy(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Node rank 1's agent is SIGKILLed (its workers die with it: a lost node) while the
    standby holds the newest durable step, so that step is the restore point. The standby takes
    rank 1 and restores it from its own memory; the losses are those of a run with no fault.

    To hold training between a durable step and the next, rank 1's worker is SIGSTOPped (rank
    0 then waits in its next collective) as soon as a durable step is on disk, and the agent is
    killed once the standby has it. Earlier versions raced the standby's poll: at ~12 ms a step
    the window of 35 steps was 0.4 s, the standby's copy lagged up to 0.5 s behind, and a
    loaded CI machine missed every window (or took the final step's, and the "loss" came as
    the job ended)."""
    every, steps = 50, 300
    args = [*TINY, "--steps", str(steps), "--durable-every", str(every)]
    # The lost node's memory is gone with it; the stopped rank is no hang for a minute.
    config = FAST_CONFIG + "replicas = false\nhang_timeout_min_s = 60.0\n"
    reference = fault_free_losses(tmp_path_factory, ["--nodes", "2"], args)
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2", "--standby", "1"], args, config=config)
    rank1 = 0
    try:
        rank1 = worker_pid(run, rank=1)

        def durable_in_window() -> int | None:
            durable = storage.list_committed(run / "checkpoints")
            now = max((r["step"] for r in _records(run)), default=0)
            ok = durable and durable[-1] < steps and now < durable[-1] + every - 15
            return durable[-1] if ok else None

        step = wait_for(durable_in_window, 180, "a durable step well before the next one")
        os.kill(rank1, signal.SIGSTOP)  # no further durable step until the node is lost
        assert storage.list_committed(run / "checkpoints")[-1] == step

        def prefetched() -> bool:
            return any(e["kind"] == "standby_prefetched" and e["step"] == step
                       for e in events(run))  # fmt: skip

        wait_for(prefetched, 60, f"the standby to prefetch durable step {step}")
        gen0 = next(e for e in events(run) if e["kind"] == "generation_started")
        lost = next(n for n, r in gen0["assignment"].items() if r == 1)
        os.kill(agent_pid(run, lost), signal.SIGKILL)
        code, err = finish_job(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if rank1:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank1, signal.SIGKILL)  # stopped, if the test failed before the loss
    assert code == 0, err[-3000:]
    evs = events(run)
    faults = report(run)["faults"]  # a victim's error seen first is re-attributed to the loss
    assert [(f["cause"], f["node_id"]) for f in faults] == [("node_lost", lost)], faults
    gens = [e for e in evs if e["kind"] == "generation_started"]
    assert len(gens) == 2 and gens[1].get("restore_step") == step, gens
    loads = [
        e
        for e in evs
        if e["kind"] == "ckpt_load_end" and e.get("generation") == gens[1]["generation"]
    ]
    tiers = {e["rank"]: (e["tier"], e["step"]) for e in loads}
    assert tiers.get(1) == ("prefetched", step), loads  # the standby took rank 1
    checks = [e for e in evs if e["kind"] == "standby_prefetch_verified"]
    assert [(e["step"], e["generation"]) for e in checks] == [(step, gens[1]["generation"])]
    assert losses(run) == reference


def _records(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
