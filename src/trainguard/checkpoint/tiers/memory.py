"""The memory tier: this rank's snapshot slots in the node's shared memory (owned by ckptd,
which verified each snapshot's checksums at staging and re-checks the one a restart reads)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from trainguard.checkpoint.api import CheckpointCorruptError, CheckpointError
from trainguard.checkpoint.tiers.api import Held, Index, Point, RankSide, Tier, per_rank
from trainguard.runtime import api as rt_api


class MemoryTier(Tier):
    name: ClassVar[str] = "memory"

    @staticmethod
    def holds(index: Index) -> Held:
        """Each rank's verified snapshots on the node that runs it (none after a world change)."""

        def points(rank: int, node: str) -> set[Point]:
            n = index.nodes.get(node)
            if not index.memory or n is None:
                return set()
            return {(int(p[0]), int(p[1])) for p in n.memory.get(rank, [])}

        return per_rank(index, points)

    def restore(self, state: dict[str, Any], point: Point) -> bool:
        if not self.side.memory or not has_slot(self.side, point):
            return False
        return read_verified(self.side, state, point)


def slot_paths(rk: RankSide) -> tuple[Path, ...]:
    from trainguard.checkpoint import snapshot

    env = rk.env
    shm = Path(env.get(rt_api.ENV_SHM_DIR, "/dev/shm"))
    job, node = env.get(rt_api.ENV_JOB_ID, ""), env.get(rt_api.ENV_NODE_ID, "")
    return snapshot.slot_paths(shm, job, node, rk.rank)


def has_slot(rk: RankSide, point: Point) -> bool:
    """Does one of this rank's slots hold a complete snapshot of ``point``?"""
    from trainguard.checkpoint import snapshot

    heads = (snapshot.peek_header(p) for p in slot_paths(rk))
    return any(h is not None and (h["step"], h["generation"]) == point for h in heads)


def verified_slot(
    rk: RankSide, point: Point, paths: Sequence[Path] | None = None
) -> tuple[Path, dict[str, Any], dict[str, list[int]] | None] | None:
    """The slot holding ``point`` among ``paths`` (default: the rank's slots named by the
    environment), its header, and the checksums to check while it is read: None when ckptd
    verified it for this restart already (usually done while the workers started). None
    when no slot holds it, or ckptd found it corrupt (an event; dropped from its index)."""
    from trainguard.checkpoint import snapshot
    from trainguard.checkpoint.backend import CkptdBackend

    step, gen = point
    backend = rk.backend()
    verified: str | None = None  # the slot's name
    if isinstance(backend, CkptdBackend):
        reply = backend.verify(rk.rank, step, gen, rk.generation)
        if reply is None:
            pass  # ckptd is down: checksum the slot here, against the sums of its staging
        elif not reply.ok or reply.slot is None:
            if reply.slot is not None:  # corrupt: ckptd dropped it from its index
                rk.emit("ckpt_corrupt", step=step, tier="memory", problems=[reply.problem])
            return None
        else:
            verified = Path(reply.slot).name
    held = []
    for path in slot_paths(rk) if paths is None else paths:
        h = snapshot.peek_header(path)
        if h is not None and (h["step"], h["generation"]) == point:
            held.append((path.name == verified, float(h.get("time", 0.0)), path, h))
    # ckptd's verified slot, else the newest save of the point (a step saved twice: its last)
    for is_verified, _, path, h in sorted(held, key=lambda x: (x[0], x[1]), reverse=True):
        sums = None if is_verified else snapshot.read_sums(path, step, gen)
        if sums is None and not is_verified:
            continue
        return path, h, sums
    return None


def read_verified(
    rk: RankSide, state: dict[str, Any], point: Point, paths: Sequence[Path] | None = None
) -> bool:
    """Restore ``point`` from the rank's slot holding it (``verified_slot``). A corrupt slot
    is dropped from ckptd's index (the next restore point skips it)."""
    found = verified_slot(rk, point, paths)
    if found is None:
        return False
    path, h, sums = found
    try:
        read_slot(rk, state, path, h, sums)
    except CheckpointCorruptError as e:
        rk.emit("ckpt_corrupt", step=point[0], tier="memory", problems=[str(e)])
        rk.backend().forget(path)  # out of the memory index: the next restore point skips it
        return False
    except CheckpointError as e:  # the snapshot does not fit this state: use DCP's
        rk.emit("ckpt_memory_mismatch", step=point[0], problem=str(e))
        return False
    return True


def read_slot(
    rk: RankSide,
    state: dict[str, Any],
    path: Path,
    h: dict[str, Any],
    sums: dict[str, list[int]] | None,
) -> None:
    """Copy one verified slot into ``state``. Raises CheckpointError (nothing written
    yet) when the snapshot does not fit the live state, CheckpointCorruptError on a
    checksum mismatch."""
    import torch

    from trainguard.checkpoint import snapshot
    from trainguard.checkpoint import state as state_mod

    conv = state_mod.converted(state, rk.rank)
    mappings = {k: tuple(v) for k, v in h.get("mappings", {}).items()}
    shards = {k: state_mod.ShardRecord.from_json(v) for k, v in h.get("shards", {}).items()}
    live = state_mod.flatten_converted(conv)
    saved: dict[str, tuple[torch.dtype | None, tuple[int, ...], tuple[Any, ...]]] = {}
    for e in h["layout"]["tensors"]:
        rec = shards.get(e["key"])
        fqn = rec.fqn if rec is not None else e["key"]
        if fqn in live.mappings:
            continue
        if rec is not None:
            raise CheckpointError(
                f"{fqn}: the live state has no value for this sharded tensor (optimizer "
                "state created lazily?); build the state with torch.distributed.checkpoint"
                ".state_dict.get_state_dict(model, optimizer), which creates it"
            )
        saved[fqn] = (getattr(torch, e["dtype"]), tuple(e["shape"]), mappings.get(fqn, ()))
    if saved and state_mod.fill_missing(conv, live.mappings, saved):
        rk.emit("ckpt_keys_created", step=h["step"], tier="memory", count=len(saved))
        live = state_mod.flatten_converted(conv)
    for key, rec in shards.items():
        have = live.shards.get(key)
        if have is None or (have.global_shape, have.offset) != (rec.global_shape, rec.offset):
            raise CheckpointError(
                f"{key}: this rank's shard of {rec.fqn} differs from the snapshot's "
                f"(offset {rec.offset} of {rec.global_shape})"
            )
    objects, replaced = snapshot.restore(path, h, sums, live.tensors, snapshot.restore_threads())
    for key, raw in objects.items():
        where = mappings.get(key) or live.mappings[key]
        state_mod.set_path(conv, where, state_mod.decode_object(raw))
    for key, tensor in replaced.items():
        state_mod.set_path(conv, live.mappings[key], tensor)
    state_mod.apply(state, conv, rk.rank)
