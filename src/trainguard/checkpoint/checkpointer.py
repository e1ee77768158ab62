"""The runtime Checkpointer: ``save(step, state)``, ``load(state)``, ``wait()``, ``close()``.

The training step pays only for a memory copy: ``save`` copies the state's tensors
into a pre-allocated, pre-faulted shared-memory slot (one of ``snapshot.SLOTS``), writes the
header last and notifies the persister, which checksums it and writes it to the
durable tier (DCP layout) in the background. Under ``trainguard run`` the slots and
the persister belong to the node's ckptd, so they outlive a crashed worker; outside
it (plain python, torchrun) the persister runs in this process.

``state`` is a nested dict of tensors, ``Stateful`` objects and picklable values.
Plain tensors and values are treated as replicated across data-parallel ranks, as
DCP does (rank 0's copy is the durable one); everything under ``state["per_rank"]``
(RNG states, data position) is kept separately for every rank as ``per_rank.<rank>``.

With ``overlap=True`` the copy runs on a background thread during the next forward
and backward; call ``attach(optimizer)`` (a step pre-hook) or ``wait_staged()`` so
it finishes before the optimizer next writes the parameters.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from trainguard.checkpoint import device, runid, snapshot, storage, tiers
from trainguard.checkpoint import sdc_drill as sdc
from trainguard.checkpoint import state as state_mod
from trainguard.checkpoint.api import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    rank_world,
    say,
)  # fmt: skip
from trainguard.checkpoint.backend import CkptdBackend, LocalBackend
from trainguard.checkpoint.dcp_part import WRITE_ERRORS
from trainguard.checkpoint.pool import SLOT_WAIT_S, Lease, SlotPool, gc_paused
from trainguard.checkpoint.tiers import RankSide
from trainguard.checkpoint.tiers.api import Failure
from trainguard.checkpoint.tiers.disk import read_step
from trainguard.checkpoint.tiers.memory import read_verified
from trainguard.runtime import api as rt_api
from trainguard.runtime.core import init as runtime_init

DURABLE_WAIT_S = 600.0  # close()/wait() wait this long for the last durable step


def _storage_ptr(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", None)  # a DTensor's storage is its local tensor's
    return int((local if local is not None else t).untyped_storage().data_ptr())


class Checkpointer:
    """Saves and restores training state; one per process.

    Args:
        directory: durable root; default ``$TRAINGUARD_CKPT_DIR``, else
            ``$TRAINGUARD_RUN_DIR/checkpoints``, else ``./checkpoints``.
        keep: committed durable steps retained (>= 1; the newest is never deleted).
        durable_every: persist steps that are multiples of this to disk (every staged step
            is in memory); 0 = only saves with ``durable=True``.
        overlap: copy in the background (see module docstring).
        memory_tier: False = synchronous DCP saves straight to the durable tier.
        max_skipped: snapshots in a row that may be skipped while every slot is still being
            persisted (disk slower than the steps); the next save then waits for a slot
            (keep-alives sent: waiting is not a hang), so a memory restore never loses more
            than ``max_skipped + 1`` steps. Each skip is a ``ckpt_skipped`` event; a run of
            skips is said once on stderr. 0 = never skip.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        keep: int = 2,
        durable_every: int = 1,
        overlap: bool = False,
        memory_tier: bool | None = None,
        max_skipped: int = 4,
    ) -> None:
        if max_skipped < 0:
            raise ValueError(f"max_skipped={max_skipped}: must be >= 0")
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint")
        if durable_every < 0:
            raise ValueError(f"durable_every={durable_every}: must be >= 0")
        env = os.environ
        if directory is None:
            run_dir = env.get(rt_api.ENV_RUN_DIR)
            directory = env.get(rt_api.ENV_CKPT_DIR) or (
                Path(run_dir) / "checkpoints" if run_dir else "checkpoints"
            )
        self.root = Path(directory)
        self.keep, self.durable_every, self.overlap = keep, durable_every, overlap
        if memory_tier is None:
            memory_tier = env.get(rt_api.ENV_MEMORY_TIER, "1") != "0"
        self.memory_tier = memory_tier
        self._rt = runtime_init()
        self._backend: LocalBackend | CkptdBackend | None = None
        self._pool: SlotPool | None = None  # this rank's snapshot slots
        self._copy: threading.Thread | None = None
        self._copied = threading.Event()  # the background copy is in memory (params may change)
        self._copied.set()
        self._copy_error: BaseException | None = None
        self._last_durable: int | None = None
        self._codec = state_mod.ObjectCodec()
        self._optimizers: list[torch.optim.Optimizer] = []
        self._stager: device.Stager | None = None  # pinned staging of GPU entries
        self._stager_plan = 0  # the pool's layout the stager's buffers were shaped for
        self._device_hold: tuple[device.Stager, device.Event] | None = None
        self.max_skipped, self._skipped = max_skipped, 0  # snapshots skipped in a row
        self._grad_flip: sdc.GradFlip | None = None  # an armed sdc:target=grad drill
        self._hooks: list[Any] = []  # optimizer pre-hook handles (removed by abandon)
        self._run: runid.RunIdentity | None = None  # drawn at the first save (runid.py)
        self._rt.owned.add(self)  # released by an in-process recovery (runtime/inprocess.py)

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Any], *, durable: bool | None = None) -> None:
        """Snapshot ``state`` as ``step``. Blocks for the memory copy only; with ``overlap``,
        the tensors of attached optimizers (parameters, optimizer state) are copied in the
        background, everything else (buffers, counters, RNG and data state) before ``save``
        returns, so the snapshot is one consistent step even when the next forward changes
        buffers. ``durable``: force (True) or skip (False) the disk tier for this step;
        default: ``step % durable_every == 0``. Every rank saves every step it saves (a step's
        durable copy is one part per rank); with a process group of several ranks and no
        ``TRAINGUARD_RUN_ID`` the first save is a collective: rank 0's run identity is
        broadcast (runid.py), so parts of two runs are never merged.

        Raises CheckpointError when the snapshot cannot be staged (e.g. /dev/shm too small,
        a value that cannot be serialized: the message names the key and the fix). Nothing
        already saved is touched.
        """
        if step < 0:
            raise ValueError(f"save(step={step}): steps are >= 0")
        t0 = time.perf_counter()
        try:
            self._save(step, state, durable)
        finally:  # the step's stall, as its "checkpoint" section (goodput, /metrics)
            self._rt.add_time("checkpoint", time.perf_counter() - t0)

    def _save(self, step: int, state: dict[str, Any], durable: bool | None) -> None:
        self._inject_sdc(step, state)
        self.wait_staged()
        if durable is None:
            durable = self.durable_every > 0 and step % self.durable_every == 0
        if not self.memory_tier:
            if self._run is None:
                self._run = runid.identify()
            self._save_sync(step, state)
            return
        rank = rank_world()[0]
        with gc_paused():
            flat = state_mod.flatten(state, rank, paths=False)  # paths only when re-planning
            blob = state_mod.pack_objects(self._codec.encode(flat.objects))
        got = self._lease(step, flat, len(blob), lambda: state_mod.flatten(state, rank), durable)
        if got is None:
            return
        lease, meta = got
        self._stage(
            lease, list(flat.tensors.values()), blob, meta, lambda: self._staged(lease, meta)
        )

    def _lease(
        self,
        step: int,
        flat: state_mod.Flat,
        nblob: int,
        replan: Callable[[], state_mod.Flat],
        durable: bool,
    ) -> tuple[Lease, dict[str, Any]] | None:
        """A slot for ``flat`` (and an object blob of ``nblob`` bytes) and the snapshot's header
        fields; None when every slot is still being persisted and this step is skipped
        (``max_skipped``). Shared with ``trainguard.dcp``'s writer."""
        rank, world = rank_world()
        if self._run is None:
            self._run = runid.identify()
        backend = self._connect()
        if self._pool is None:
            self._pool = SlotPool(lambda n: backend.alloc(rank, n), self._rt.keepalive)
        lease = self._pool.acquire(
            flat, nblob, replan, wait=durable or self._skipped >= self.max_skipped
        )
        if lease is None:
            self._skip(step, rank)
            return None
        self._skipped = 0
        meta = {
            "step": step,
            "generation": self._rt.generation,
            "rank": rank,
            "world_size": world,
            "durable": durable,
            "time": time.time(),
            **self._run.to_json(),  # who writes its durable part (runid.py)
        }
        return lease, meta

    def _staged(self, lease: Lease, meta: dict[str, Any]) -> None:
        """After the copy and the header: the persister takes the snapshot from here."""
        assert self._backend is not None
        step, durable = int(meta["step"]), bool(meta["durable"])
        self._backend.staged(int(meta["rank"]), lease.slot.path, step, int(meta["generation"]),
                             durable)  # fmt: skip
        if durable:
            self._last_durable = step

    def _publish(self, lease: Lease, blob: bytes, meta: dict[str, Any]) -> None:
        """Write the header of a slot whose tensors are copied, and hand it to the persister
        (``trainguard.dcp``'s writer: the copy was made when DCP staged the state)."""
        assert self._pool is not None
        self._pool.publish(lease, blob, meta)
        self._staged(lease, meta)

    def _inject_sdc(self, step: int, state: dict[str, Any]) -> None:
        """An injected silent corruption of this step's state (tests, drills), if armed."""
        drill = self._rt.sdc_drill(step)
        if drill is None:
            return
        among = sdc.state_pointers(self._optimizers, drill.target) if self._optimizers else None
        if among is None and drill.target == "optimizer":
            raise ValueError("sdc drill target=optimizer: attach the optimizer first")
        flipped = sdc.flip_bit(state, rank_world()[0], drill.bit, among=among)
        self._rt.event("sdc_injected", step=step, target=drill.target, **flipped)

    def _skip(self, step: int, rank: int) -> None:
        """Every slot is still being persisted: this step is not snapshotted (said once a run)."""
        self._skipped += 1
        self._rt.event(
            "ckpt_skipped", step=step, skipped_in_a_row=self._skipped,
            reason="every snapshot slot busy persisting (disk slower than the steps)",
        )  # fmt: skip
        if self._skipped == 1:
            say(
                f"rank {rank} skipped the snapshot of step {step}: every slot is still "
                f"being persisted; at most {self.max_skipped} in a row, then saves wait"
            )

    def _stage(
        self,
        lease: Lease,
        srcs: list[torch.Tensor],
        blob: bytes,
        meta: dict[str, Any],
        staged: Callable[[], None],
    ) -> None:
        """Copy ``srcs`` into the leased slot and publish it, then ``staged()``. Now: the
        host tensors that the optimizer does not own; with ``overlap``, the optimizer's on
        a background thread (``wait_copied`` holds its step), and GPU tensors through pinned
        buffers (device → host copies queued now, the next forward's kernels behind those
        of the non-optimizer buffers)."""
        assert self._pool is not None
        pool = self._pool
        late = self._optimizer_owned(srcs) if self.overlap else set()
        cpu = [t.is_cpu for t in srcs]
        on_dev = [] if all(cpu) else [i for i, c in enumerate(cpu) if not c]
        dev = set(on_dev)
        now_host = (  # None: every entry
            None
            if not late and not dev
            else [i for i in range(len(srcs)) if i not in late and i not in dev]
        )
        late_host = [i for i in sorted(late) if i not in dev]
        events, host_srcs = self._from_device(srcs, on_dev, late) if on_dev else ([], srcs)
        try:
            lease.write(srcs, now_host)
        except BaseException:
            lease.release()
            raise

        def finish() -> None:
            try:
                lease.write(srcs, late_host)
                if events:  # the optimizer may write the host parameters now
                    self._copied.set()
                for ev in events:
                    ev.synchronize()
                lease.write(host_srcs, on_dev)
                # On the host, the header first: a snapshot the optimizer was let past is a
                # complete one (ckptd takes it in even if this process dies before ``staged``)
                pool.publish(lease, blob, meta)
            finally:
                lease.release()
                self._copied.set()
            staged()

        if self.overlap and (late or on_dev):

            def run() -> None:
                try:
                    finish()
                except BaseException as e:  # surfaced by wait_staged() on the training thread
                    self._copy_error = e

            self._copied.clear()
            self._copy = threading.Thread(target=run, name="trainguard-stage", daemon=True)
            self._copy.start()
        else:
            finish()

    def _from_device(
        self, srcs: list[torch.Tensor], on_dev: list[int], late: set[int]
    ) -> tuple[list[device.Event], list[torch.Tensor]]:
        """Queue the device → pinned host copies of the GPU entries ``on_dev`` (two groups:
        not optimizer-owned, then ``late``): their events, and ``srcs`` with those entries
        replaced by their host buffers."""
        stager = self._stager_for(srcs, on_dev)
        groups = [[i for i in on_dev if i not in late], [i for i in on_dev if i in late]]
        events = stager.start(srcs, groups)
        stager.hold(events[0])  # the next forward's kernels queue behind the buffer copies
        self._device_hold = (stager, events[1])  # the optimizer's pre-hook holds on this
        host_srcs = list(srcs)
        for i in on_dev:
            host_srcs[i] = stager.buffers[i]
        return events, host_srcs

    def _optimizer_owned(self, srcs: list[torch.Tensor]) -> set[int]:
        """Indices of ``srcs`` whose storage belongs to an attached optimizer's parameters or
        state: only ``optimizer.step()`` writes those, and it waits for the copy."""
        owned: set[int] = set()
        for opt in self._optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    owned.add(_storage_ptr(p))
                    for v in opt.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor):
                            owned.add(_storage_ptr(v))
        owned.discard(0)
        return {i for i, t in enumerate(srcs) if _storage_ptr(t) in owned}

    def _stager_for(self, srcs: list[torch.Tensor], on_dev: list[int]) -> device.Stager:
        plan = self._pool.plans if self._pool is not None else 0  # buffers of this layout's
        stager = self._stager
        if stager is None or self._stager_plan != plan or set(stager.buffers) != set(on_dev):
            dev = srcs[on_dev[0]].device
            self._stager = device.Stager({i: srcs[i] for i in on_dev}, device.backend_for(dev))
            self._stager_plan = plan
        assert self._stager is not None
        return self._stager

    def wait_copied(self, timeout_s: float = SLOT_WAIT_S) -> None:
        """Block until the last background copy is in memory (its notification to the
        persister may still be in flight): the optimizer may then write the parameters.
        Raises CheckpointError if the copy failed or took longer than ``timeout_s``."""
        t0 = time.perf_counter()
        copied = self._copied.wait(timeout_s)
        self._rt.add_time("checkpoint", time.perf_counter() - t0)  # a stall of the step too
        if not copied:
            raise CheckpointError(f"the snapshot copy did not finish within {timeout_s:.0f}s")
        if self._copy_error is not None:
            self.wait_staged()

    def wait_staged(self) -> None:
        """Block until the last background copy is in memory and the persister knows of it.
        Re-raises its error, if any."""
        if self._copy is not None:
            self._copy.join(timeout=SLOT_WAIT_S + CkptdBackend.RECONNECT_S)
            if self._copy.is_alive():
                raise CheckpointError("staging the snapshot did not finish; is ckptd alive?")
            self._copy = None
        if self._copy_error is not None:
            err, self._copy_error = self._copy_error, None
            raise CheckpointError(f"staging the snapshot failed: {err}") from err

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait for a background copy first (overlap mode): on the
        host for host tensors; for GPU tensors the current stream waits for the device →
        pinned copy (the host does not block). Only tensors of attached optimizers are
        copied in the background."""
        self._optimizers.append(optimizer)
        self._hooks.append(
            optimizer.register_step_pre_hook(lambda *_: self._before_optimizer_step())
        )
        spec = self._rt.grad_drill()  # an injected corrupt gradient (tests, drills)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.is_floating_point()]
        if spec is not None and spec.step is not None and params and self._grad_flip is None:

            def fired(info: dict[str, Any], spec: Any = spec) -> None:
                self._rt.fire(spec, spec.step)
                self._rt.event("sdc_injected", step=spec.step, **info)

            self._grad_flip = sdc.GradFlip(
                params[0], spec.step, spec.bit, self._rt.next_step, fired, name="parameter 0"
            )

    def _before_optimizer_step(self) -> None:
        self.wait_copied()
        if self._device_hold is not None:
            stager, event = self._device_hold
            self._device_hold = None
            stager.hold(event)

    def _connect(self) -> LocalBackend | CkptdBackend:
        if self._backend is None:
            name = os.environ.get(rt_api.ENV_CKPTD)
            shm = Path(os.environ.get(rt_api.ENV_SHM_DIR, "/dev/shm"))
            self._backend = (
                CkptdBackend(name, self._rt.keepalive)
                if name
                else LocalBackend(self.root, shm, self.keep)
            )
        return self._backend

    def _save_sync(self, step: int, state: dict[str, Any]) -> None:
        """Durable-only mode: DCP straight to disk, committed by atomic rename."""
        self.root.mkdir(parents=True, exist_ok=True)
        run = self._run
        assert run is not None  # drawn by _save
        tmp = storage.tmp_dir(self.root, step, self._rt.generation, run.run_id)
        try:
            dcp.save(
                state_mod.with_rank_key(state, rank_world()[0]),
                checkpoint_id=str(tmp),
                planner=state_mod.TypedSavePlanner(),
            )
            if rank_world()[0] == 0:
                try:
                    storage.commit(tmp, self.root, step, generation=self._rt.generation, run=run)
                except FileExistsError:  # a verified copy of this step is there: keep it
                    shutil.rmtree(tmp, ignore_errors=True)
                removed: list[str] = []
                storage.prune(self.root, self.keep, committed_step=step,
                              generation=self._rt.generation, run_id=run.run_id,
                              removed=removed)  # fmt: skip
                if removed:
                    self._rt.event("ckpt_leftover_removed", step=step, removed=removed,
                                   reason="temporary directories of a dead run")  # fmt: skip
        except WRITE_ERRORS as e:
            raise CheckpointError(f"saving step {step} to {self.root} failed: {e}") from e
        self._last_durable = step

    # ------------------------------------------------------------------ load
    def resume_step(self) -> int | None:
        """The step ``load`` would restore (the controller's choice under ``trainguard run``,
        else the newest verified durable step), or None for a fresh start. Reads nothing."""
        if self._rt.supervised:
            return self._rt.restore_step
        return storage.newest_verified(self.root)[0]

    def load(self, state: dict[str, Any]) -> int | None:
        """Restore ``state`` in place from the agreed step; returns that step or None.

        Under ``trainguard run`` the step is the one the controller chose for every rank
        (``$TRAINGUARD_RESTORE_STEP``); this rank reads it from its fastest tier with a
        verified copy (``tiers.TIERS``: its memory snapshot, a peer's replica, this node's
        prefetched copy, the durable copy). Standalone: the newest verified durable
        step. A corrupt copy is skipped with an event, never loaded. Keys the live state
        does not have yet (optimizer state created at the first ``step()``) are created from
        the saved ones. Sharded values (DTensor) restore from memory when this rank's shards
        are unchanged, else from the durable tier, resharded by DCP to the current mesh.

        Raises CheckpointNotFoundError / CheckpointCorruptError when no verified copy of the
        agreed step exists; CheckpointError when the saved state cannot be put into this one
        (the message names the key).
        """
        rank, _ = rank_world()
        if not self._rt.supervised:
            return self._load_newest(state, rank)
        step = self._rt.restore_step
        if step is None:
            return None
        point = (step, int(os.environ.get(rt_api.ENV_RESTORE_GEN, "-1")))
        t0 = time.time()
        self._rt.event("ckpt_load_start", step=step)
        # After a world change the memory snapshots are the old world's ranks': DCP reshards.
        same_world = os.environ.get(rt_api.ENV_RESTORE_MEMORY, "1") != "0"
        side = self._rank_side(rank, memory=self.memory_tier and same_world)
        tier, tried = tiers.restore(side, state, point)  # fastest first (tiers.TIERS)
        if tier is not None:
            self._rt.event(
                "ckpt_load_end", step=step, tier=tier.name, duration_s=time.time() - t0,
                **tier.details,
            )  # fmt: skip
            say(f"rank {rank} restored step {step} from {tier.where}")
            return step
        failure, failed = None, ""
        for t in tried:
            if t.failure is not None:
                failure, failed = t.failure, t.name
        if failure is None:
            missing = f"step {step} is in no tier of rank {rank}"
            failure, failed = Failure(CheckpointNotFoundError(missing), [missing]), "every"
        self._restore_failed(rank, step, point[1], failed, failure.problems)
        raise failure.error

    def load_memory(self, state: dict[str, Any], step: int | None = None) -> int:
        """Restore ``state`` in place from this rank's snapshot of ``step`` (default: the newest
        it holds) in node memory, in a living process: a rollback after a loss spike or a
        corrupt step found by the SDC checks, or a measurement of the memory tier
        (``benchmarks/checkpoint.py``). The snapshot is verified first: by ckptd when it owns
        the slots (``trainguard run``, ``node_daemon``; its result is kept for this
        generation, so a second load of the same step only copies), else here against the
        checksums taken when it was staged. Waits for the persister first (``wait_persisted``).

        Returns the step restored. Raises CheckpointNotFoundError when this Checkpointer holds
        no snapshot of ``step`` in memory, CheckpointCorruptError when the snapshot fails
        verification or does not fit ``state`` (a ``ckpt_corrupt`` / ``ckpt_memory_mismatch``
        event names the problem). A snapshot that does not fit writes nothing; one found
        corrupt while it is copied (the checksum is checked chunk by chunk, in the same pass)
        may have written part of ``state``: restore another step (or ``load`` the durable
        tier) next, as a restart does.
        """
        self.wait_persisted()
        slots = [] if self._pool is None else [s.path for s in self._pool.slots]
        held = sorted(
            (int(h["step"]), int(h["generation"]))
            for h in map(snapshot.peek_header, slots)
            if h is not None
        )
        points = [pt for pt in held if step is None or pt[0] == step]
        if not points:
            have = ", ".join(str(s) for s, _ in held) or "none"
            want = "any step" if step is None else f"step {step}"
            raise CheckpointNotFoundError(
                f"no snapshot of {want} in this rank's memory (held: {have}); save() first, "
                "or load() from the durable tier"
            )
        rank = rank_world()[0]
        point = points[-1]
        if not read_verified(self._rank_side(rank, memory=True), state, point, slots):
            raise CheckpointCorruptError(
                f"rank {rank}'s snapshot of step {point[0]} in memory failed verification or "
                "does not fit this state (see the ckpt_corrupt / ckpt_memory_mismatch event); "
                "load() the durable tier instead"
            )
        return point[0]

    def _rank_side(self, rank: int, *, memory: bool) -> RankSide:
        """What the tiers read this rank's copies with."""
        return RankSide(
            rank=rank, generation=self._rt.generation, root=self.root, memory=memory,
            backend=self._connect, emit=self._rt.event, env=os.environ,
        )  # fmt: skip

    def _load_newest(self, state: dict[str, Any], rank: int) -> int | None:
        """Standalone (not under ``trainguard run``): the newest verified durable step."""
        step, skipped = storage.newest_verified(self.root)
        for bad, problems in skipped.items():
            self._rt.event("ckpt_corrupt", step=bad, tier="durable", problems=problems)
        if step is None:
            return None
        t0 = time.time()
        self._rt.event("ckpt_load_start", step=step)
        read_step(state, rank, self.root, step, emit=self._rt.event)
        self._rt.event("ckpt_load_end", step=step, tier="durable", duration_s=time.time() - t0)
        say(f"rank {rank} restored step {step} from the durable tier ({self.root})")
        return step

    def _restore_failed(
        self, rank: int, step: int, gen: int, tier: str, problems: list[str]
    ) -> None:
        """Tell the controller (synchronously: the rank raises next) that this rank cannot
        restore the agreed point from any tier; it excludes the point and restarts from the
        newest older one every rank can read (not a user error)."""
        self._rt.event_now(
            "ckpt_restore_failed",
            step=step,
            point_generation=gen,
            tier=tier,
            problems=problems[:4],
        )

    # ------------------------------------------------------------------ durability
    def wait(self, timeout_s: float = DURABLE_WAIT_S) -> None:
        """Block until the last durable save is committed (keep-alives tell the agent this is not
        a hang). Raises CheckpointError past ``timeout_s``, or at once when this node's persister
        could not write the step (e.g. disk full: the event names the free space)."""
        self.wait_staged()
        if self._last_durable is None or self._backend is None:
            return
        deadline = time.monotonic() + timeout_s
        while not self._backend.wait_durable(
            self._last_durable, min(1.0, max(0.0, deadline - time.monotonic()))
        ):
            self._rt.keepalive()  # waiting under our own deadline is not a hang
            if time.monotonic() >= deadline:
                break
        else:
            return
        if not self._backend.wait_durable(self._last_durable, 0.0):
            raise CheckpointError(
                f"step {self._last_durable} was not durable within {timeout_s:.0f}s; "
                f"see the persister's events (disk full?) in the run's events"
            )

    def wait_persisted(self, timeout_s: float = DURABLE_WAIT_S) -> None:
        """Block until the persister (this node's ckptd, or the one in this process) has
        verified every snapshot staged so far: the memory index is whole and the next save
        finds its slot free. Durable writes may still run (``wait`` waits for those).
        Raises CheckpointError past ``timeout_s`` (seconds)."""
        self.wait_staged()
        if self._backend is None:
            return
        deadline = time.monotonic() + timeout_s
        while not self._backend.idle():
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"the persister did not verify the staged snapshots within {timeout_s:.0f}s"
                )
            self._rt.keepalive()  # waiting under our own deadline is not a hang
            time.sleep(0.002)

    def abandon(self) -> None:
        """Release this Checkpointer without waiting for durability (an in-process recovery
        drops the failed generation's; what it staged stays in ckptd): the background copy
        is joined (``SLOT_WAIT_S`` deadline), the optimizer hooks removed, slots and the
        ckptd connection closed. Never raises."""
        if self._copy is not None:
            self._copy.join(timeout=SLOT_WAIT_S)
            self._copy = None
        self._copied.set()
        for h in self._hooks:
            with contextlib.suppress(Exception):
                h.remove()
        self._hooks, self._optimizers, self._last_durable = [], [], None
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        """Wait for durability of the last durable save, then release slots and the persister."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.close()
                self._pool = None  # the next save allocates again (through a new backend)
            backend, self._backend = self._backend, None
            if backend is not None:
                backend.close()
            if isinstance(backend, LocalBackend):
                for kind, data in backend.events:
                    self._rt.event(kind, **data)
