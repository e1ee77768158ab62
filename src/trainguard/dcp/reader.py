"""``trainguard.dcp.Reader``: DCP's storage reader from trainguard's tiers (the package docstring
says which tier serves a load)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from trainguard.checkpoint import snapshot, storage
from trainguard.checkpoint import state as state_mod
from trainguard.checkpoint.api import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    rank_world,
    say,
)
from trainguard.checkpoint.backend import CkptdBackend
from trainguard.checkpoint.checkpointer import Checkpointer
from trainguard.checkpoint.tiers.memory import has_slot, verified_slot
from trainguard.dcp.common import (
    UsesCheckpointer,
    check_checkpointer,
    check_step,
    done_future,
    step_of,
)
from trainguard.runtime import api as rt_api


class Reader(UsesCheckpointer, StorageReader):
    """DCP storage reader from trainguard's tiers (see the module docstring for the order).

    Args:
        step: the step to restore; default: under ``trainguard run`` the controller's choice
            (``resume_step()``), else the number at the end of ``dcp.load``'s
            ``checkpoint_id``, else the newest step this process holds in memory or the
            durable root holds verified.
        checkpointer: default ``trainguard.dcp.checkpointer()``.

    ``read_metadata`` raises CheckpointNotFoundError when there is no step to restore (call
    ``resume_step()`` first: None means a fresh start) or no tier holds it;
    CheckpointCorruptError when the only copy fails its checks. ``tier`` says afterwards
    which tier served this rank (``"memory"``, ``"replica"``, ``"prefetched"`` or
    ``"durable"``).
    """

    def __init__(
        self, step: int | None = None, *, checkpointer: Checkpointer | None = None
    ) -> None:
        super().__init__()
        self.step = check_step(step, "Reader")
        self._ck = check_checkpointer(checkpointer, "Reader")
        self._id: str | os.PathLike[str] | None = None
        self.tier: str | None = None
        self._slot: tuple[Path, dict[str, Any], dict[str, list[int]] | None] | None = None
        self._fs: Any = None  # the durable step's VerifyingReader, once needed
        self._fs_md: Metadata | None = None
        self._is_coordinator = False
        self._t0 = 0.0
        self._pt: tuple[int, int] | None = None
        self._plan: LoadPlan | None = None
        self._no_prefetch = False  # this node's prefetched copy failed: the durable root

    # ---------------------------------------------------------------- DCP's calls
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._id = checkpoint_id
        self._pt = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        ck = self.ck
        rank = rank_world()[0]
        step, gen = self._point()
        self._t0 = time.time()
        ck._rt.event("ckpt_load_start", step=step)
        same_world = os.environ.get(rt_api.ENV_RESTORE_MEMORY, "1") != "0"
        if ck.memory_tier and same_world:
            side = ck._rank_side(rank, memory=True)
            paths = None
            if not ck._rt.supervised:  # this process's own slots: their sums written first
                ck.wait_persisted()
                paths = self._own_slots()
            self.tier = "memory"
            if (
                ck._rt.supervised
                and not has_slot(side, (step, gen))
                and self._pull_replica(side, (step, gen))
            ):
                self.tier = "replica"
            self._slot = verified_slot(side, (step, gen), paths)
            if self._slot is not None:
                md = _memory_metadata(self._slot[0], self._slot[1])
                if md is not None:
                    return md
                self._slot = None
        return self._durable(step, gen)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:  # fmt: skip
        self._is_coordinator = is_coordinator
        if self._fs is not None:
            self._fs.set_up_storage_reader(metadata, is_coordinator)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Keep this rank's reads here: DCP's load needs no global coordination (its default
        planner's global step returns the plans unchanged), and a plan of a few hundred items
        costs ~20 ms to unpickle on the coordinator's gather (measured, 316 items), on every
        restore. The plan sent on carries no items; ``read_data`` reads this one."""
        self._plan = plan
        return LoadPlan([], storage_data=None, planner_data=plan.planner_data)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy this rank's items in: from its verified snapshot when it holds every item
        whole, else from the durable step (re-planned against its metadata)."""
        if not plan.items and self._plan is not None:  # the items kept by prepare_local_plan
            plan = self._plan
        ck, rank = self.ck, rank_world()[0]
        step = self._point()[0]
        if self._slot is not None:
            problem = self._read_memory(plan, planner)
            if problem is None:
                self._done(step, rank)
                return done_future()
            ck._rt.event("ckpt_memory_mismatch", step=step, problem=problem)
            self._slot = None
            durable_md = self._durable(step, self._point()[1])
            self._fs.set_up_storage_reader(durable_md, self._is_coordinator)
            plan = _replan(plan, durable_md)
        from trainguard.checkpoint.reader import CorruptFileError

        try:
            self._fs.read_data(plan, planner).wait()
        except CorruptFileError as e:
            if self.tier != "prefetched":
                self._failed(step, "durable", [str(e)])
                raise CheckpointCorruptError(f"step {step}: {e}") from None
            # the prefetched copy of the durable step failed while read: the durable root's
            # files have the same metadata (a copy), so the same plan reads them whole
            self._prefetch_failed(step, [str(e)])
            durable_md = self._durable(step, self._point()[1])
            self._fs.set_up_storage_reader(durable_md, self._is_coordinator)
            try:
                self._fs.read_data(plan, planner).wait()
            except CorruptFileError as e2:
                self._failed(step, "durable", [str(e2)])
                raise CheckpointCorruptError(f"step {step}: {e2}") from None
        self._done(step, rank)
        return done_future()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never inferred from a path: name the reader

    # ---------------------------------------------------------------- helpers
    def _point(self) -> tuple[int, int]:
        """(step, generation that wrote it) to restore, decided once a load; raises
        CheckpointNotFoundError."""
        if self._pt is None:
            self._pt = self._choose()
        return self._pt

    def _choose(self) -> tuple[int, int]:
        ck = self.ck
        rt = ck._rt
        if rt.supervised:
            if rt.restore_step is None:
                raise CheckpointNotFoundError(
                    "trainguard.dcp.Reader: the controller chose no step to restore (a fresh "
                    "start); call trainguard.dcp.resume_step() first and load only when it is "
                    "not None"
                )
            return rt.restore_step, int(os.environ.get(rt_api.ENV_RESTORE_GEN, "-1"))
        step = self.step if self.step is not None else step_of(self._id)
        held = self._held()
        if step is None:
            durable = storage.newest_verified(ck.root)[0]
            newest = max([s for s, _ in held] + ([durable] if durable is not None else []),
                         default=None)  # fmt: skip
            if newest is None:
                raise CheckpointNotFoundError(
                    f"trainguard.dcp.Reader: no checkpoint in memory or in {ck.root}; call "
                    "trainguard.dcp.resume_step() first and load only when it is not None"
                )
            step = newest
        gens = [g for s, g in held if s == step]
        return step, (max(gens) if gens else -1)

    def _own_slots(self) -> list[Path]:
        pool = self.ck._pool
        return [] if pool is None else [s.path for s in pool.slots]

    def _held(self) -> list[tuple[int, int]]:
        """(step, generation) of the snapshots this process's slots hold (standalone)."""
        heads = (snapshot.peek_header(p) for p in self._own_slots())
        return sorted((int(h["step"]), int(h["generation"])) for h in heads if h is not None)

    def _pull_replica(self, side: Any, point: tuple[int, int]) -> bool:
        """A replaced node's rank: have ckptd pull the replica of ``point`` from the peer that
        holds it into a local slot (verified). False when there is none."""
        source = os.environ.get(rt_api.ENV_REPLICA_SOURCE, "")
        backend = side.backend()
        if not source or not isinstance(backend, CkptdBackend):
            return False
        try:
            backend.fetch(side.rank, point[0], point[1], source)
        except CheckpointError as e:
            self.ck._rt.event("ckpt_corrupt", step=point[0], tier="replica", problems=[str(e)])
            return False
        return True

    def _durable(self, step: int, gen: int) -> Metadata:
        """Open the durable step (manifest, sizes and metadata checked now, each data file's
        checksum as it is read) and return its metadata: this node's prefetched copy of it
        (a standby's, ``$TRAINGUARD_PREFETCH_DIR``) when it holds that point whole, else the
        durable root. Sets ``tier``."""
        from trainguard.checkpoint import prefetch

        pre = None if self._no_prefetch else prefetch.present(
            os.environ.get(rt_api.ENV_PREFETCH_DIR), step, gen
        )  # fmt: skip
        if pre is not None:
            problems, sums = storage.verify_for_load(pre, step)
            if not problems:
                self.tier = "prefetched"
                return self._open(pre, step, sums)
            self._prefetch_failed(step, problems)
        self.tier = "durable"
        root = self.ck.root
        problems, sums = storage.verify_for_load(root, step)
        if problems:
            if not storage.step_dir(root, step).exists():
                self._failed(step, "every", [f"step {step} is in no tier of this rank"])
                raise CheckpointNotFoundError(
                    f"step {step} is in no tier of rank {rank_world()[0]} (memory, a replica or "
                    f"{root}); the controller restarts from an older checkpoint"
                )
            self._failed(step, "durable", problems)
            raise CheckpointCorruptError(f"step {step}: {'; '.join(problems[:4])}")
        return self._open(root, step, sums)

    def _open(self, root: Path, step: int, sums: Any) -> Metadata:
        """The step under ``root`` as this load's durable reader; its metadata."""
        from trainguard.checkpoint.reader import VerifyingReader

        self._fs = VerifyingReader(storage.step_dir(root, step), sums, direct=True)
        self._fs_md = self._fs.read_metadata()
        return self._fs_md

    def _read_memory(self, plan: LoadPlan, planner: LoadPlanner) -> str | None:
        """Serve ``plan`` from the verified snapshot; the problem when it cannot (nothing is
        copied unless every item is held whole: a read that fails its checksum while copying
        leaves items to the durable read that follows)."""
        assert self._slot is not None
        path, h, sums = self._slot
        layout = {e["key"]: e for e in h["layout"]["tensors"]}
        shards = h.get("shards", {})
        by_index: dict[tuple[str, tuple[int, ...]], str] = {}
        for key, e in layout.items():
            rec = shards.get(key)
            by_index[
                (rec["fqn"], tuple(rec["offset"])) if rec else (key, (0,) * len(e["shape"]))
            ] = key
        targets: dict[str, torch.Tensor] = {}
        reads: dict[str, ReadItem] = {}
        values: list[ReadItem] = []
        for it in plan.items:
            if it.type == LoadItemType.BYTE_IO:
                values.append(it)
                continue
            key = by_index.get((it.storage_index.fqn, tuple(it.storage_index.offset or ())))
            e = layout.get(key) if key is not None else None
            if (
                e is None
                or key in reads
                or any(it.storage_offsets)
                or (list(it.lengths) != list(e["shape"]))
            ):
                return f"{it.dest_index.fqn}: this rank's live shard differs from its snapshot's"
            dest = planner.resolve_tensor(it).detach()
            if str(dest.dtype).removeprefix("torch.") != e["dtype"]:  # DCP casts: the durable read
                return (
                    f"{it.dest_index.fqn}: saved as {e['dtype']}, the live tensor is {dest.dtype}"
                )
            targets[key] = dest
            reads[key] = it
        for key, e in layout.items():  # held but not asked for: read (its checksum) and dropped
            if key not in targets:
                targets[key] = torch.empty(tuple(e["shape"]), dtype=getattr(torch, e["dtype"]))
        try:
            objects, replaced = snapshot.restore(path, h, sums, targets, snapshot.restore_threads())
        except CheckpointCorruptError as e:
            self.ck._rt.event("ckpt_corrupt", step=h["step"], tier="memory", problems=[str(e)])
            self.ck._connect().forget(path)  # out of the memory index
            return f"the snapshot failed its checksum: {e}"
        missing = [it.storage_index.fqn for it in values if it.storage_index.fqn not in objects]
        if missing or replaced:
            return f"{(missing or list(replaced))[0]}: not restorable from the snapshot"
        for key, it in reads.items():
            planner.commit_tensor(it, targets[key])
        for it in values:
            planner.load_bytes(it, io.BytesIO(objects[it.storage_index.fqn]))
        return None

    def _prefetch_failed(self, step: int, problems: list[str]) -> None:
        """This node's prefetched copy cannot serve: an event; the durable root serves."""
        self._no_prefetch = True
        self.ck._rt.event("ckpt_corrupt", step=step, tier="prefetched", problems=problems[:4])

    def _done(self, step: int, rank: int) -> None:
        where = {"memory": "memory", "replica": "a peer's replica", "durable": str(self.ck.root),
                 "prefetched": "this node's prefetched copy"}  # fmt: skip
        self.ck._rt.event("ckpt_load_end", step=step, tier=self.tier,
                          duration_s=time.time() - self._t0, via="dcp")  # fmt: skip
        say(f"rank {rank} restored step {step} from {where.get(self.tier or '', self.tier)} (DCP)")

    def _failed(self, step: int, tier: str, problems: list[str]) -> None:
        """Tell the controller at once (the rank raises next): it excludes the point."""
        if self.ck._rt.supervised:
            gen = int(os.environ.get(rt_api.ENV_RESTORE_GEN, "-1"))
            self.ck._restore_failed(rank_world()[0], step, gen, tier, problems)


def _memory_metadata(path: Path, h: dict[str, Any]) -> Metadata | None:
    """DCP metadata of one rank's snapshot: each tensor's global size with this rank's chunk
    plus boxes tiling the rest of it (``_complement``: a live shard that reaches into them
    is read from the durable tier), and each value. None when a tensor has several local
    chunks here (a ShardedTensor's): the durable tier serves those."""
    shards = h.get("shards", {})
    md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for e in h["layout"]["tensors"]:
        rec = shards.get(e["key"])
        fqn = rec["fqn"] if rec else e["key"]
        shape = tuple(e["shape"])
        size = tuple(rec["global_shape"]) if rec else shape
        offset = tuple(rec["offset"]) if rec else (0,) * len(shape)
        if fqn in md:
            return None
        chunks = [ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape))]
        chunks += [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
            for o, s in _complement(size, offset, shape)
        ]
        md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=getattr(torch, e["dtype"])),
            size=torch.Size(size), chunks=chunks,
        )  # fmt: skip
    fd = os.open(path, os.O_RDONLY)
    try:
        blob = os.pread(fd, h["objects_nbytes"], h["layout"]["objects_offset"])
    finally:
        os.close(fd)
    try:
        keys = state_mod.unpack_objects(blob)
    except Exception:
        return None  # a torn or corrupt blob: the durable tier serves
    for key in keys:
        md[key] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=md, planner_data=h.get("mappings", {}), storage_data={})


def _complement(
    size: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Disjoint boxes (offset, size) covering the global box ``size`` less the box at ``offset``
    of ``shape``: along each dimension in turn, the part before it and after it, within the
    box's extent on the dimensions already cut."""
    out = []
    lo, hi = [0] * len(size), list(size)
    for d in range(len(size)):
        for a, b in ((0, offset[d]), (offset[d] + shape[d], size[d])):
            if b > a:
                o, s = list(lo), [b_ - a_ for a_, b_ in zip(lo, hi, strict=True)]
                o[d], s[d] = a, b - a
                if all(s):
                    out.append((tuple(o), tuple(s)))
        lo[d], hi[d] = offset[d], offset[d] + shape[d]
    return out


def _replan(plan: LoadPlan, durable_md: Metadata) -> LoadPlan:
    """``plan``'s reads made against ``durable_md`` instead: each live chunk (the box its items
    fill, at its ``dest_index`` offset) read from the durable step's chunks."""
    boxes: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    values: list[ReadItem] = []
    for it in plan.items:
        if it.type == LoadItemType.BYTE_IO:
            values.append(it)
            continue
        where = (it.dest_index.fqn, tuple(it.dest_index.offset or ()))
        ends = [int(o) + int(n) for o, n in zip(it.dest_offsets, it.lengths, strict=True)]
        have = boxes.setdefault(where, ends)
        boxes[where] = [max(a, b) for a, b in zip(have, ends, strict=True)]
    items: list[ReadItem] = list(values)
    for (fqn, offset), sizes in boxes.items():
        tmd = durable_md.state_dict_metadata.get(fqn)
        if not isinstance(tmd, TensorStorageMetadata):
            raise CheckpointNotFoundError(f"{fqn}: not in the durable step")
        chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(sizes))
        items += create_read_items_for_chunk_list(fqn, tmd, [chunk])
    return LoadPlan(items)
