"""The tier registry: one order, fastest first, read by the controller's choice of a restore
point and by a rank's restore; a tier without a verified copy passes the point on to the next.
Real tiers throughout: slots and durable steps written by a Checkpointer (its in-process
persister), one of them then corrupted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.checkpoint import snapshot, storage, tiers
from trainguard.checkpoint.api import CheckpointCorruptError, CheckpointNotFoundError
from trainguard.checkpoint.backend import LocalBackend
from trainguard.checkpoint.checkpointer import Checkpointer
from trainguard.checkpoint.tiers import TIERS, Index, NodeIndex, RankSide
from trainguard.runtime import api as rt_api

NAMES = ["memory", "replica", "prefetched", "durable", "archive"]


def test_the_registry_is_one_order_fastest_first() -> None:
    assert [t.name for t in TIERS] == NAMES


def test_the_controller_counts_each_rank_for_the_first_tier_holding_the_point() -> None:
    """Rank 0 holds (5, 0) in its node's memory, rank 1 as a replica on node a, rank 2 only
    durable: every tier the controller tracks answers, the untracked ones say None."""
    index = Index(
        ranks={0: "a", 1: "b", 2: "c"},
        nodes={
            "a": NodeIndex(healthy=True, memory={0: [[5, 0]]}, replicas={1: [[5, 0]]},
                           replica_addr="a:7000"),
            "b": NodeIndex(healthy=True),
            "c": NodeIndex(healthy=True, memory={2: [[4, 0]]}),
        },
        durable=((5, 0),),
        replicas=True,
    )  # fmt: skip
    held = {t.name: t.holds(index) for t in TIERS}
    assert held["prefetched"] is None and held["archive"] is None
    first = {
        r: next(n for n in NAMES if (h := held[n]) is not None and h.serves(r, (5, 0)))
        for r in index.ranks
    }
    assert first == {0: "memory", 1: "replica", 2: "durable"}
    assert not held["memory"].serves(1, (5, 0))  # type: ignore[union-attr]
    assert tiers.replica.sources(index, (5, 0)) == {"1": "a:7000"}


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Steps 1 and 2 saved (memory slots and durable steps); yields the checkpointer, the
    saved state and a RankSide reading its tiers (events into a list)."""
    shm, root = tmp_path / "shm", tmp_path / "durable"
    shm.mkdir()
    monkeypatch.setenv(rt_api.ENV_SHM_DIR, str(shm))
    monkeypatch.delenv(rt_api.ENV_CKPTD, raising=False)
    ck = Checkpointer(root, durable_every=1, keep=3)
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3)}
    for step in (1, 2):
        ck.save(step, {k: v + step for k, v in state.items()})
    ck.wait()
    backend = ck._connect()
    assert isinstance(backend, LocalBackend)
    events: list[tuple[str, dict[str, Any]]] = []
    env = {rt_api.ENV_SHM_DIR: str(shm), rt_api.ENV_JOB_ID: backend.job,
           rt_api.ENV_NODE_ID: backend.node}  # fmt: skip
    side = RankSide(
        rank=0, generation=ck._rt.generation, root=root, memory=True, backend=ck._connect,
        emit=lambda kind, **d: events.append((kind, d)), env=env,
    )  # fmt: skip
    point = (2, ck._rt.generation)
    want = {k: v + 2 for k, v in state.items()}
    try:
        yield side, point, want, events, shm
    finally:
        ck.close()


def _zeros() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(4096), "b": torch.zeros(3)}


def test_the_fastest_tier_holding_a_verified_copy_restores(saved: Any) -> None:
    side, point, want, events, _ = saved
    live = _zeros()
    tier, tried = tiers.restore(side, live, point)
    assert tier is not None and tier.name == "memory" and [t.name for t in tried] == ["memory"]
    assert all(torch.equal(live[k], want[k]) for k in want)
    assert not [e for e in events if e[0] == "ckpt_corrupt"]


def test_a_tier_without_a_verified_copy_passes_the_point_to_the_next(saved: Any) -> None:
    """The memory slot of step 2 changed after its checksums were taken: the memory tier
    says False (an event), replica and prefetch hold nothing, the durable tier restores."""
    side, point, want, events, shm = saved
    (slot,) = [p for p in shm.glob("*-s*") if not p.name.endswith(".sum")
               and (h := snapshot.peek_header(p)) is not None and h["step"] == 2]  # fmt: skip
    h = snapshot.peek_header(slot)
    assert h is not None
    off = h["layout"]["tensors"][0]["offset"]
    with open(slot, "r+b") as f:
        f.seek(off + 100)
        byte = f.read(1)
        f.seek(off + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    live = _zeros()
    tier, tried = tiers.restore(side, live, point)
    assert [t.name for t in tried] == ["memory", "replica", "prefetched", "durable"]
    assert tier is tried[-1] and tier.where == f"the durable tier ({side.root})"
    assert all(torch.equal(live[k], want[k]) for k in want)
    corrupt = [d for k, d in events if k == "ckpt_corrupt"]
    assert [d["tier"] for d in corrupt] == ["memory"] and "fails its checksum" in str(corrupt)
    # The slot left the memory index: a second restore skips it without reading it.
    assert snapshot.read_sums(slot, 2, point[1]) is None


def test_when_no_tier_holds_a_verified_copy_the_last_failure_is_raised(saved: Any) -> None:
    side, point, _, events, _ = saved
    no_memory = RankSide(**{**{f: getattr(side, f) for f in side.__slots__}, "memory": False})
    part = next(storage.step_dir(side.root, 2).rglob("*.distcp"))
    blob = bytearray(part.read_bytes())
    blob[len(blob) // 2] ^= 1
    part.write_bytes(bytes(blob))
    tier, tried = tiers.restore(no_memory, _zeros(), point)
    assert tier is None and [t.name for t in tried] == NAMES
    failed = [(t.name, t.failure.error) for t in tried if t.failure is not None]
    assert len(failed) == 1 and failed[0][0] == "durable", failed
    assert isinstance(failed[0][1], CheckpointCorruptError) and "step 2" in str(failed[0][1])
    tier, tried = tiers.restore(no_memory, _zeros(), (7, point[1]))  # never saved
    assert tier is None
    errors = [t.failure.error for t in tried if t.failure is not None]
    assert len(errors) == 1 and isinstance(errors[0], CheckpointNotFoundError)
