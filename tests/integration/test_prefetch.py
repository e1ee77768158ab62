"""Standby prefetch (issue 16): a standby keeps a verified copy of the newest durable step in
its memory; when it replaces a node that was lost with its memory (no replicas), its rank
restores from that copy, not from the durable tier, and the losses are those of a run with
no fault. The copy itself: verified while copied, never committed when a file is wrong."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST_CONFIG, TINY, events, fault_free_losses, losses, run_job
from trainguard.checkpoint import storage
from trainguard.checkpoint.checkpointer import Checkpointer
from trainguard.checkpoint.prefetch import copy_step, present

ARGS = [*TINY, "--steps", "60", "--durable-every", "10"]


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


@pytest.mark.slow  # two runs of the example (CI's slow run)
def test_a_standby_that_replaces_a_lost_node_restores_from_its_prefetched_copy(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    config = FAST_CONFIG + "replicas = false\n"  # the lost node's memory is gone with it
    reference = fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)
    run = tmp_path / "run"
    res = run_job(
        run, ["--nodes", "2", "--standby", "1", "--inject", "node-down:node=1:step=35"], ARGS,
        config=config,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    evs = events(run)
    fault = next(e for e in evs if e["kind"] == "fault")
    fetched = [e for e in evs if e["kind"] == "standby_prefetched" and e["ts"] < fault["ts"]]
    assert fetched and fetched[-1]["step"] >= 20, fetched
    loads = [e for e in evs if e["kind"] == "ckpt_load_end" and e.get("generation", 1) >= 1]
    tiers = {e["rank"]: e["tier"] for e in loads}
    assert tiers.get(1) == "prefetched", loads  # the standby took rank 1
    assert losses(run) == reference
