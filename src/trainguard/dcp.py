"""trainguard's checkpoint tiers behind ``torch.distributed.checkpoint`` (DCP).

A script (or a framework: torchtitan, Megatron's DCP path) that saves with DCP keeps its calls
and names a trainguard storage writer and reader::

    import torch.distributed.checkpoint as dcp
    import trainguard.dcp

    step0 = trainguard.dcp.resume_step()           # the agreed step, None: a fresh start
    if step0 is not None:
        dcp.load(state, storage_reader=trainguard.dcp.Reader())
    ...
    dcp.async_save(state, storage_writer=trainguard.dcp.Writer(step),
                   process_group=ckpt_group)         # or dcp.save(...): the same snapshot

**Save.** Each rank's state (all of it: its shards and its copy of the replicated tensors and
values, before DCP's de-duplication) is copied into a snapshot slot in shared memory, the
same slots, header and checksums as ``Checkpointer.save``: under ``trainguard run`` the
node's ckptd owns them (they outlive a crashed worker), replicates them to peer nodes and
persists them. With ``dcp.async_save`` the writer is DCP's ``AsyncStager``: the copy is the
whole stall (``stage``); DCP's planning runs in its background thread, whose ``write_data``
publishes the snapshot with the entries DCP's plan has this rank write
(``api.DCP_WRITES``). The persister then writes exactly those, so the durable step
(``<root>/step_<N>``) is the DCP checkpoint ``dcp.save`` would have written: plain
``dcp.load(state, checkpoint_id=<root>/step_<N>)`` reads it.

**Load.** ``Reader`` serves the agreed step (``$TRAINGUARD_RESTORE_STEP`` under ``trainguard
run``; else the step named, else the newest this process or the durable root holds) from the
fastest tier with a verified copy: this rank's snapshot in memory (a peer's replica pulled
into a local slot first, for a replaced node's ranks), else the durable step, each file
checked against its manifest as it is read. The memory tier serves a rank whose live shards
are the ones it saved (same world, same parallelism); any other read (a resharded state, a
corrupt snapshot found while copying) is re-planned against the durable step's metadata. A
restore that no tier can serve emits ``ckpt_restore_failed`` (the controller then picks an
older point) and raises ``CheckpointNotFoundError`` / ``CheckpointCorruptError``.

Not served by the DCP reader (the ``Checkpointer``'s restore reads them): a standby's
prefetched copy and the cold tier (object storage). Lazily created optimizer state is DCP's
business: build the state with ``torch.distributed.checkpoint.state_dict.get_state_dict``.

Concurrency: a ``dcp.async_save`` runs DCP's collectives on a background thread; give it a
process group of its own (``dist.new_group(backend="gloo")``), as torchtitan does, so they
never interleave with the training's collectives. One writer's save at a time: ``stage``
waits (``STAGE_WAIT_S``) for the previous background save to publish its snapshot.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from trainguard.checkpoint import runid, snapshot, storage
from trainguard.checkpoint import state as state_mod
from trainguard.checkpoint.api import (
    DCP_WRITES,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    rank_world,
    say,
)
from trainguard.checkpoint.backend import CkptdBackend
from trainguard.checkpoint.checkpointer import Checkpointer
from trainguard.checkpoint.pool import Lease, gc_paused
from trainguard.checkpoint.tiers.memory import slot_paths, verified_slot
from trainguard.runtime import api as rt_api

__all__ = ["Reader", "Writer", "checkpointer", "resume_step"]

STAGE_WAIT_S = 600.0  # a stage waits this long for the previous background save's publish
_STEP_AT_END = re.compile(r"(\d+)$")
_lock = threading.Lock()
_default: Checkpointer | None = None


def checkpointer() -> Checkpointer:
    """The process's ``Checkpointer`` behind every ``Writer`` and ``Reader`` that is not given
    one: its slots, its connection to ckptd, its durable root (``$TRAINGUARD_CKPT_DIR``, else
    ``$TRAINGUARD_RUN_DIR/checkpoints``, else ``./checkpoints``). Made at the first call."""
    global _default
    with _lock:
        if _default is None:
            _default = Checkpointer()
        return _default


def resume_step() -> int | None:
    """The step a ``Reader`` would restore: under ``trainguard run`` the controller's choice for
    every rank, else the newest verified durable step; None for a fresh start. Reads no data."""
    return checkpointer().resume_step()


def _step_of(checkpoint_id: str | os.PathLike[str] | None) -> int | None:
    """The step a checkpoint id names at its end (``step-100``, ``.../step_100``, ``100``)."""
    if checkpoint_id is None:
        return None
    m = _STEP_AT_END.search(Path(checkpoint_id).name)
    return int(m.group(1)) if m else None


def _entry_keys(items: list[WriteItem]) -> dict[tuple[str, tuple[int, ...] | None], str]:
    """(fqn, chunk offset; None for a value) → the snapshot entry key, as ``state.flatten``
    names it: the fqn, or ``<fqn>@shard<i>`` for the i-th of several local chunks."""
    per_fqn: dict[str, list[WriteItem]] = {}
    for it in items:
        per_fqn.setdefault(it.index.fqn, []).append(it)
    out: dict[tuple[str, tuple[int, ...] | None], str] = {}
    for fqn, its in per_fqn.items():
        for i, it in enumerate(its):
            off = None if it.index.offset is None else tuple(it.index.offset)
            out[(fqn, off)] = fqn if len(its) == 1 else f"{fqn}{state_mod.SHARD_SEP}{i}"
    return out


def _index_of(key: str, flat: state_mod.Flat) -> tuple[str, tuple[int, ...] | None]:
    """The DCP index (fqn, chunk offset) of a snapshot entry; offset None for a value."""
    if key in flat.objects:
        return key, None
    rec = flat.shards.get(key)
    if rec is not None:
        return rec.fqn, tuple(rec.offset)
    return key, (0,) * flat.tensors[key].dim()


class Writer(StorageWriter, AsyncStager):
    """DCP storage writer (and ``AsyncStager``) into trainguard's tiers.

    Args:
        step: the training step this checkpoint is of (>= 0); default: the number at the end
            of the ``checkpoint_id`` given to ``dcp.save`` (``step-100``, ``step_100``).
            ``dcp.async_save`` stages before DCP hands the writer its checkpoint_id: name
            the step.
        durable: persist this step to the durable tier; default: the checkpointer's
            ``durable_every`` rule (every step by default).
        checkpointer: default ``trainguard.dcp.checkpointer()``.

    Raises CheckpointError (from ``dcp.save``, wrapped by DCP) when no step is known or the
    snapshot cannot be staged (the message names the value and the fix).
    """

    _synchronize_after_execute = False  # the copy is done when ``stage`` returns

    def __init__(
        self,
        step: int | None = None,
        *,
        durable: bool | None = None,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        super().__init__()
        if step is not None and step < 0:
            raise ValueError(f"Writer(step={step}): steps are >= 0")
        self.step, self.durable = step, durable
        self._ck = checkpointer
        self._local: list[WriteItem] = []
        self._staged: tuple[Lease, dict[str, Any], state_mod.Flat, bytes] | None = None
        self._published = threading.Event()
        self._published.set()

    @property
    def ck(self) -> Checkpointer:
        if self._ck is None:
            self._ck = checkpointer()
        return self._ck

    # ---------------------------------------------------------------- DCP's calls
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if self.step is None:
            self.step = _step_of(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._step()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Keep this rank's items here (all it holds, before any de-duplication) and send on
        only their (fqn, chunk offset, bytes): DCP's own metadata is never used (the memory
        tier describes each snapshot itself, the durable tier merges its parts' metadata),
        and pickling a few hundred items for the gather costs tens of milliseconds on the
        thread that shares the training's interpreter lock (measured: 316 items, ~20 ms to
        unpickle alone)."""
        self._local = list(plan.items)
        held = [(it.index.fqn, _offset(it), _nbytes(it)) for it in plan.items]
        return SavePlan([], storage_data=held, planner_data={})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Which rank writes each chunk and value to the durable tier: once, by the holder
        with the fewest bytes so far (DCP's own de-duplication, balanced by size)."""
        holders: dict[tuple[str, tuple[int, ...] | None], list[int]] = {}
        size: dict[tuple[str, tuple[int, ...] | None], int] = {}
        for r, p in enumerate(plans):
            for fqn, off, n in p.storage_data or []:
                holders.setdefault((fqn, off), []).append(r)
                size[(fqn, off)] = n
        load = [0] * len(plans)
        writes: list[list[tuple[str, tuple[int, ...] | None]]] = [[] for _ in plans]
        for key, ranks in holders.items():
            r = min(ranks, key=lambda x: (load[x], x))
            load[r] += size[key]
            writes[r].append(key)
        return [dataclasses.replace(p, storage_data=w) for p, w in zip(plans, writes, strict=True)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Publish this rank's snapshot (staged by ``stage``, else copied now from what the
        planner resolves) with the entries DCP's plan has this rank write."""
        staged, self._staged = self._staged, None
        try:
            if staged is None:
                staged = self._copy_items(planner)
            if staged is not None:
                lease, meta, flat, blob = staged
                keys = {_index_of(k, flat): k for k in [*flat.tensors, *flat.objects]}
                mine = plan.storage_data
                if mine is None:  # a planner that kept the items: DCP's own de-duplication
                    mine = [(it.index.fqn, _offset(it)) for it in plan.items]
                meta[DCP_WRITES] = [keys[(fqn, off)] for fqn, off in mine]
                self.ck._publish(lease, blob, meta)
        except BaseException:
            if staged is not None:
                staged[0].release()
            raise
        finally:
            self._published.set()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(
            [WriteResult(index=it.index, size_in_bytes=_nbytes(it), storage_data=None)
             for it in plan.items]
        )  # fmt: skip
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing: the durable tier commits the step once every rank's part is written."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never inferred from a path: name the writer

    def storage_meta(self) -> StorageMeta | None:
        return None

    # ---------------------------------------------------------------- AsyncStager
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s stall: copy ``state_dict`` (Statefuls already turned into their
        state_dict by DCP) into a snapshot slot and return the state made of the slot's
        copies, for DCP's background planning. Raises CheckpointError for a value no tier
        can hold (naming it), or when the previous save is still unpublished after
        ``STAGE_WAIT_S``."""
        if not self._published.wait(STAGE_WAIT_S):
            raise CheckpointError("the previous dcp.async_save never reached write_data")
        step, ck = self._step(), self.ck
        self._identify()
        with gc_paused():
            flat = state_mod.flatten_converted(state_dict, paths=False)
            if any(state_mod.SHARD_SEP in k for k in flat.shards):
                raise CheckpointError(
                    "a ShardedTensor cannot be staged by dcp.async_save; use dcp.save with "
                    "trainguard.dcp.Writer, or DTensor (FSDP2)"
                )
            blob = state_mod.pack_objects(ck._codec.encode(flat.objects))
        got = ck._lease(
            step, flat, len(blob), lambda: state_mod.flatten_converted(state_dict), self._durable()
        )
        out: dict[str, Any] = dict(flat.objects)
        live = state_mod.flatten_typed(state_dict, paths=False)[0] if flat.shards else {}
        if got is None:  # every slot still persisting: this step is skipped (an event)
            for key, t in flat.tensors.items():
                out[key] = _rewrap(live.get(key), t.detach().cpu().clone())
            return out
        lease, meta = got
        try:
            lease.write(list(flat.tensors.values()))
            views = lease.slot.destinations(lease.layout)
        except BaseException:
            lease.release()
            raise
        for key, view in zip(flat.tensors, views, strict=True):
            out[key] = _rewrap(live.get(key), view)
        self._published.clear()
        self._staged = (lease, meta, flat, blob)
        return out

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is in memory."""

    def close(self) -> None:
        """Release a staged slot that was never published (DCP's save failed before writing)."""
        staged, self._staged = self._staged, None
        if staged is not None:
            staged[0].release()
        self._published.set()

    # ---------------------------------------------------------------- helpers
    def _step(self) -> int:
        if self.step is None:
            raise CheckpointError(
                "trainguard.dcp.Writer does not know the step: pass Writer(step=N) (dcp.async_save "
                "stages before it sees a checkpoint_id), or to dcp.save a checkpoint_id that ends "
                "in it (e.g. 'step-100')"
            )
        return self.step

    def _identify(self) -> None:
        """Draw the run identity (at the first save: a broadcast on the default process group
        when no launcher names the run, ``runid.identify``) on the training thread only: on
        DCP's background thread it would interleave with the training's collectives."""
        ck = self.ck
        if ck._run is not None:
            return
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError(
                "trainguard.dcp.Writer staged nothing on the training thread: pass it to "
                "dcp.async_save as the storage_writer without another async_stager"
            )
        ck._run = runid.identify()

    def _durable(self) -> bool:
        if self.durable is not None:
            return self.durable
        every = self.ck.durable_every
        return every > 0 and self._step() % every == 0

    def _copy_items(
        self, planner: SavePlanner
    ) -> tuple[Lease, dict[str, Any], state_mod.Flat, bytes] | None:
        """``dcp.save`` (no stager): the snapshot of everything this rank's local plan holds,
        copied now from the tensors and bytes the planner resolves."""
        self._identify()
        tensors: dict[str, torch.Tensor] = {}
        shards: dict[str, state_mod.ShardRecord] = {}
        objects: dict[str, bytes] = {}
        names = _entry_keys(self._local)
        for it in self._local:
            data = planner.resolve_data(it)
            if it.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                objects[it.index.fqn] = data.getvalue()
                continue
            assert isinstance(data, torch.Tensor) and it.tensor_data is not None
            off = tuple(it.index.offset) if it.index.offset is not None else None
            key = names[(it.index.fqn, off)]
            tensors[key] = data.detach()
            if it.type == WriteItemType.SHARD:
                shards[key] = state_mod.ShardRecord(
                    fqn=it.index.fqn, global_shape=tuple(it.tensor_data.size),
                    offset=tuple(it.tensor_data.chunk.offsets), write=True,
                )  # fmt: skip
        mappings = {k: tuple(v) for k, v in getattr(planner, "mappings", {}).items()}
        flat = state_mod.Flat(
            converted={}, tensors=tensors, shards=shards, objects=dict(objects), mappings=mappings
        )
        blob = state_mod.pack_objects(objects)
        got = self.ck._lease(self._step(), flat, len(blob), lambda: flat, self._durable())
        if got is None:
            return None
        lease, meta = got
        try:
            lease.write(list(tensors.values()))
        except BaseException:
            lease.release()
            raise
        return lease, meta, flat, blob


def _offset(it: WriteItem) -> tuple[int, ...] | None:
    """A write item's chunk offset; None for a value (bytes)."""
    if it.type == WriteItemType.BYTE_IO or it.index.offset is None:
        return None
    return tuple(int(o) for o in it.index.offset)


def _nbytes(it: WriteItem) -> int:
    if it.tensor_data is None:
        return 0
    n = 1
    for s in it.tensor_data.chunk.sizes:
        n *= int(s)
    return n * it.tensor_data.properties.dtype.itemsize


def _rewrap(live: Any, local: torch.Tensor) -> Any:
    """The staged value of an entry whose live value is ``live``: the slot's copy ``local``, a
    DTensor again where it was one (same mesh, placements, global shape and stride), so
    DCP plans the same chunks."""
    from torch.distributed.tensor import DTensor

    if not isinstance(live, DTensor):
        return local
    return DTensor.from_local(
        local, live.device_mesh, live.placements, run_check=False,
        shape=live.shape, stride=live.stride(),
    )  # fmt: skip


class Reader(StorageReader):
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
    which tier served this rank (``"memory"``, ``"replica"`` or ``"durable"``).
    """

    def __init__(
        self, step: int | None = None, *, checkpointer: Checkpointer | None = None
    ) -> None:
        super().__init__()
        self.step = step
        self._ck = checkpointer
        self._id: str | os.PathLike[str] | None = None
        self.tier: str | None = None
        self._slot: tuple[Path, dict[str, Any], dict[str, list[int]] | None] | None = None
        self._fs: Any = None  # the durable step's VerifyingReader, once needed
        self._fs_md: Metadata | None = None
        self._is_coordinator = False
        self._t0 = 0.0
        self._pt: tuple[int, int] | None = None
        self._plan: LoadPlan | None = None

    @property
    def ck(self) -> Checkpointer:
        if self._ck is None:
            self._ck = checkpointer()
        return self._ck

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
                and not self._holds(side, (step, gen), paths)
                and self._pull_replica(side, (step, gen))
            ):
                self.tier = "replica"
            self._slot = verified_slot(side, (step, gen), paths)
            if self._slot is not None:
                md = _memory_metadata(self._slot[0], self._slot[1])
                if md is not None:
                    return md
                self._slot = None
        self.tier = "durable"
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
                return _done_future()
            ck._rt.event("ckpt_memory_mismatch", step=step, problem=problem)
            self.tier = "durable"
            self._slot = None
            durable_md = self._durable(step, self._point()[1])
            self._fs.set_up_storage_reader(durable_md, self._is_coordinator)
            plan = _replan(plan, durable_md)
        try:
            self._fs.read_data(plan, planner).wait()
        except CheckpointCorruptError:
            raise
        except Exception as e:
            from trainguard.checkpoint.reader import CorruptFileError

            if isinstance(e, CorruptFileError):
                self._failed(step, "durable", [str(e)])
                raise CheckpointCorruptError(f"step {step}: {e}") from None
            raise
        self._done(step, rank)
        return _done_future()

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
        step = self.step if self.step is not None else _step_of(self._id)
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

    def _holds(self, side: Any, point: tuple[int, int], paths: list[Path] | None) -> bool:
        heads = (snapshot.peek_header(p) for p in (slot_paths(side) if paths is None else paths))
        return any(h is not None and (h["step"], h["generation"]) == point for h in heads)

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
        checksum as it is read) and return its metadata."""
        from trainguard.checkpoint.reader import VerifyingReader

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
            targets[key] = planner.resolve_tensor(it).detach()
            reads[key] = it
        for key, e in layout.items():  # held but not asked for: read (its checksum) and dropped
            targets.setdefault(
                key, torch.empty(tuple(e["shape"]), dtype=getattr(torch, e["dtype"]))
            )
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

    def _done(self, step: int, rank: int) -> None:
        where = {"memory": "memory", "replica": "a peer's replica", "durable": str(self.ck.root)}
        self.ck._rt.event("ckpt_load_end", step=step, tier=self.tier,
                          duration_s=time.time() - self._t0, via="dcp")  # fmt: skip
        say(f"rank {rank} restored step {step} from {where.get(self.tier or '', self.tier)} (DCP)")

    def _failed(self, step: int, tier: str, problems: list[str]) -> None:
        """Tell the controller at once (the rank raises next): it excludes the point."""
        rt = self.ck._rt
        if rt.supervised:
            rt.event_now("ckpt_restore_failed", step=step,
                         point_generation=int(os.environ.get(rt_api.ENV_RESTORE_GEN, "-1")),
                         tier=tier, problems=problems[:4])  # fmt: skip


def _done_future() -> Future[None]:
    fut: Future[None] = Future()
    fut.set_result(None)
    return fut


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
