"""``trainguard.dcp.Writer``: DCP's storage writer and async stager into trainguard's tiers
(the package docstring says how a save goes)."""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from trainguard.checkpoint import runid
from trainguard.checkpoint import state as state_mod
from trainguard.checkpoint.api import (
    DCP_WRITES,
    CheckpointError,
)
from trainguard.checkpoint.checkpointer import Checkpointer
from trainguard.checkpoint.pool import Lease, gc_paused
from trainguard.dcp.common import UsesCheckpointer, check_checkpointer, check_step, step_of

STAGE_WAIT_S = 600.0  # a stage waits this long for the previous background save's publish
# (step, generation) saved through each checkpointer: a step is saved once (see ``_once``)
_SAVED: weakref.WeakKeyDictionary[Checkpointer, set[tuple[int, int]]] = weakref.WeakKeyDictionary()


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


class Writer(UsesCheckpointer, StorageWriter, AsyncStager):
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
        self.step = self._given = check_step(step, "Writer")
        self.durable = durable
        self._ck = check_checkpointer(checkpointer, "Writer")
        self._local: list[WriteItem] = []
        self._staged: tuple[Lease, dict[str, Any], state_mod.Flat, bytes] | None = None
        self._published = threading.Event()
        self._published.set()
        self._skip = False  # stage() skipped this step (every slot still persisting)

    # ---------------------------------------------------------------- DCP's calls
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if self._given is None:  # each save's own checkpoint_id (a writer reused across saves)
            self.step = step_of(checkpoint_id)

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
        skip, self._skip = self._skip, False
        try:
            if staged is None and not skip:
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
        self._once(step)
        got = ck._lease(
            step, flat, len(blob), lambda: state_mod.flatten_converted(state_dict), self._durable()
        )
        out: dict[str, Any] = dict(flat.objects)
        live = state_mod.flatten_typed(state_dict, paths=False)[0] if flat.shards else {}
        if got is None:  # every slot still persisting: this step is skipped (an event);
            self._skip = True  # DCP plans on the live state, nothing of it is read
            return state_dict
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

    def _once(self, step: int) -> None:
        """A step is saved once a generation: a second save of it would leave the memory tier
        with the new state and the durable tier with the first (a committed step is never
        replaced). Raises CheckpointError; the first save stands."""
        point = (step, self.ck._rt.generation)
        saved = _SAVED.setdefault(self.ck, set())
        if point in saved:
            raise CheckpointError(
                f"step {step} was saved already in this run (generation {point[1]}); a step is "
                "saved once: its first save stands, save the next step's number instead"
            )
        saved.add(point)

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
        self._once(self._step())
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
