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
import fcntl
import gc
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainguard.checkpoint import device, prefetch, snapshot, storage
from trainguard.checkpoint import sdc_drill as sdc
from trainguard.checkpoint import state as state_mod
from trainguard.checkpoint.api import (
    PER_RANK_KEY,
    PER_SHARD_KEY,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
)
from trainguard.checkpoint.backend import CkptdBackend, LocalBackend
from trainguard.checkpoint.persister import WRITE_ERRORS
from trainguard.checkpoint.reader import CorruptFileError, VerifyingReader
from trainguard.runtime import api as rt_api
from trainguard.runtime.core import init as runtime_init

SLOT_WAIT_S = 600.0  # a durable step waits this long for a slot the persister still holds
DURABLE_WAIT_S = 600.0  # close()/wait() wait this long for the last durable step


def _say(line: str) -> None:
    """One line to the user on stderr (a re-run says where it resumed from)."""
    print(f"trainguard: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cycle collector off while a save walks the state: the shape objects of 10^5
    tensors alive at once would set off full collections (each scanning every tensor) in the
    middle of the step. Nothing here creates a reference cycle, so nothing is left for it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _storage_ptr(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", None)  # a DTensor's storage is its local tensor's
    return int((local if local is not None else t).untyped_storage().data_ptr())


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


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
        self._slots: list[snapshot.Slot] = []
        self._layout: snapshot.Layout | None = None
        self._written: dict[Path, dict[str, Any]] = {}  # slot → meta this process committed
        self._static = ""  # the layout's static header (layout, mappings, shards) as JSON
        # the mappings, shards and object keys it was built for (tensor keys: in the layout)
        self._static_of: tuple[Any, Any, list[str]] = ({}, {}, [])
        self._age: list[int] = []  # slot indices, least recently written first
        self._copy: threading.Thread | None = None
        self._copied = threading.Event()  # the background copy is in memory (params may change)
        self._copied.set()
        self._copy_error: BaseException | None = None
        self._last_durable: int | None = None
        self._tier = "memory"  # where the last load came from (memory | replica | durable)
        self._codec = state_mod.ObjectCodec()
        self._optimizers: list[torch.optim.Optimizer] = []
        self._stager: device.Stager | None = None  # pinned staging of GPU entries
        self._device_hold: tuple[device.Stager, device.Event] | None = None
        self.max_skipped, self._skipped = max_skipped, 0  # snapshots skipped in a row
        self._grad_flip: sdc.GradFlip | None = None  # an armed sdc:target=grad drill

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Any], *, durable: bool | None = None) -> None:
        """Snapshot ``state`` as ``step``. Blocks for the memory copy only; with ``overlap``,
        the tensors of attached optimizers (parameters, optimizer state) are copied in the
        background, everything else (buffers, counters, RNG and data state) before ``save``
        returns, so the snapshot is one consistent step even when the next forward changes
        buffers. ``durable``: force (True) or skip (False) the disk tier for this step;
        default: ``step % durable_every == 0``.

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
        drill = self._rt.sdc_drill(step)  # an injected silent corruption (tests, drills)
        if drill is not None:
            among = sdc.state_pointers(self._optimizers, drill.target) if self._optimizers else None
            if among is None and drill.target == "optimizer":
                raise ValueError("sdc drill target=optimizer: attach the optimizer first")
            flipped = sdc.flip_bit(state, _rank_world()[0], drill.bit, among=among)
            self._rt.event("sdc_injected", step=step, target=drill.target, **flipped)
        self.wait_staged()
        durable = (
            (self.durable_every > 0 and step % self.durable_every == 0)
            if durable is None
            else durable
        )
        if not self.memory_tier:
            self._save_sync(step, state)
            return
        rank, world = _rank_world()
        backend = self._connect()
        with _gc_paused():
            flat = state_mod.flatten(state, rank, paths=False)  # paths only when re-planning
            blob = state_mod.pack_objects(self._codec.encode(flat.objects))
            fits = (
                self._layout is not None
                and self._layout.fits(flat.tensors, len(blob))
                and flat.shards == self._static_of[1]
                and list(flat.objects) == self._static_of[2]
            )
        if not fits:
            self._allocate(backend, rank, state_mod.flatten(state, rank), len(blob))
        assert self._layout is not None
        slot, lockf = self._take_slot(durable or self._skipped >= self.max_skipped)
        if slot is None:
            self._skipped += 1
            self._rt.event(
                "ckpt_skipped", step=step, skipped_in_a_row=self._skipped,
                reason="every snapshot slot busy persisting (disk slower than the steps)",
            )  # fmt: skip
            if self._skipped == 1:
                _say(
                    f"rank {rank} skipped the snapshot of step {step}: every slot is still "
                    f"being persisted; at most {self.max_skipped} in a row, then saves wait"
                )
            return
        self._skipped = 0
        meta = {
            "step": step,
            "generation": self._rt.generation,
            "rank": rank,
            "world_size": world,
            "durable": durable,
            "time": time.time(),
        }
        static = self._static
        layout = self._layout
        self._written.pop(slot.path, None)  # torn until committed
        srcs = list(flat.tensors.values())
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
        events: list[device.Event] = []
        host_srcs = srcs
        if on_dev:
            stager = self._stager_for(srcs, on_dev)
            groups = [[i for i in on_dev if i not in late], [i for i in on_dev if i in late]]
            events = stager.start(srcs, groups)
            stager.hold(events[0])  # the next forward's kernels queue behind the buffer copies
            self._device_hold = (stager, events[1])  # the optimizer's pre-hook holds on this
            host_srcs = list(srcs)
            for i in on_dev:
                host_srcs[i] = stager.buffers[i]
        slot.begin()
        try:
            slot.write_tensors(layout, srcs, now_host)
        except BaseException:
            fcntl.flock(lockf, fcntl.LOCK_UN)
            lockf.close()
            raise

        def finish() -> None:
            try:
                slot.write_tensors(layout, srcs, late_host)
                if events:  # the optimizer may write the host parameters now
                    self._copied.set()
                for ev in events:
                    ev.synchronize()
                slot.write_tensors(layout, host_srcs, on_dev)
                # On the host, the header first: a snapshot the optimizer was let past is a
                # complete one (ckptd takes it in even if this process dies before ``staged``)
                slot.commit(layout, blob, meta, static)
                self._copied.set()
                self._written[slot.path] = meta
                i = self._slots.index(slot)
                self._age = [j for j in self._age if j != i] + [i]
            finally:
                fcntl.flock(lockf, fcntl.LOCK_UN)
                lockf.close()
                self._copied.set()
            backend.staged(rank, slot.path, step, self._rt.generation, durable)
            if durable:
                self._last_durable = step

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
        if self._stager is None or set(self._stager.buffers) != set(on_dev):
            dev = srcs[on_dev[0]].device
            self._stager = device.Stager({i: srcs[i] for i in on_dev}, device.backend_for(dev))
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
        optimizer.register_step_pre_hook(lambda *_: self._before_optimizer_step())
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

    def _allocate(
        self, backend: LocalBackend | CkptdBackend, rank: int, flat: state_mod.Flat, nblob: int
    ) -> None:
        """Plan the slots' layout for this state (tensor places, and a header reserve that
        holds its static part) and have the backend create them."""
        for s in self._slots:
            s.close()
        mappings = {k: list(v) for k, v in flat.mappings.items()}
        shards = {k: r.to_json() for k, r in flat.shards.items()}
        layout = snapshot.Layout.plan(flat.tensors, nblob)
        static = layout.static_header(mappings, shards)
        if snapshot.PREFIX_BYTES + len(static) + 4096 > layout.reserve:
            layout = snapshot.Layout.plan(flat.tensors, nblob, header_bytes=len(static) + 4096)
            static = layout.static_header(mappings, shards)
        self._layout, self._static = layout, static
        self._static_of = (flat.mappings, flat.shards, list(flat.objects))
        paths = backend.alloc(rank, self._layout.total_bytes)
        self._slots = [snapshot.Slot(p, writable=True) for p in paths]
        self._age = list(range(len(self._slots)))
        self._stager = None

    def _take_slot(self, wait: bool) -> tuple[snapshot.Slot | None, Any]:
        """Lock a slot the persister does not hold, the least recently written first (so the
        newest snapshots stay whole). ``wait``: up to SLOT_WAIT_S (a durable step, or the skip
        bound reached), else not."""
        order = list(self._age)
        deadline = time.monotonic() + (SLOT_WAIT_S if wait else 0.0)
        alive = time.monotonic()
        while True:
            if time.monotonic() - alive > 1.0:  # waiting on our own machinery is not a hang
                self._rt.keepalive()
                alive = time.monotonic()
            for i in order:
                slot = self._slots[i]
                lockf = open(slot.path, "rb")  # noqa: SIM115 - closed when the copy finishes
                try:
                    fcntl.flock(lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    lockf.close()
                    continue
                if snapshot.reusable(slot.path, self._written.get(slot.path)):
                    return slot, lockf
                fcntl.flock(lockf, fcntl.LOCK_UN)
                lockf.close()
            if time.monotonic() >= deadline:
                return None, None
            time.sleep(0.005)

    def _save_sync(self, step: int, state: dict[str, Any]) -> None:
        """Durable-only mode: DCP straight to disk, committed by atomic rename."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = storage.tmp_dir(self.root, step, self._rt.generation)
        try:
            dcp.save(
                state_mod.with_rank_key(state, _rank_world()[0]),
                checkpoint_id=str(tmp),
                planner=state_mod.TypedSavePlanner(),
            )
            if _rank_world()[0] == 0:
                try:
                    storage.commit(tmp, self.root, step, generation=self._rt.generation)
                except FileExistsError:  # a verified copy of this step is there: keep it
                    shutil.rmtree(tmp, ignore_errors=True)
                storage.prune(
                    self.root, self.keep, committed_step=step, generation=self._rt.generation
                )
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
        (``$TRAINGUARD_RESTORE_STEP``); this rank reads it from its fastest verified tier:
        its memory snapshot, else the durable copy. Standalone: the newest verified durable
        step. A corrupt copy is skipped with an event, never loaded. Keys the live state
        does not have yet (optimizer state created at the first ``step()``) are created from
        the saved ones. Sharded values (DTensor) restore from memory when this rank's shards
        are unchanged, else from the durable tier, resharded by DCP to the current mesh.

        Raises CheckpointNotFoundError / CheckpointCorruptError when no verified copy of the
        agreed step exists; CheckpointError when the saved state cannot be put into this one
        (the message names the key).
        """
        rank, _ = _rank_world()
        if self._rt.supervised:
            step = self._rt.restore_step
            if step is None:
                return None
            gen = int(os.environ.get(rt_api.ENV_RESTORE_GEN, "-1"))
            t0 = time.time()
            self._rt.event("ckpt_load_start", step=step)
            self._tier = "memory"
            # After a world change the memory snapshots are the old world's ranks': DCP reshards.
            same_world = os.environ.get(rt_api.ENV_RESTORE_MEMORY, "1") != "0"
            if self.memory_tier and same_world and self._load_memory(state, rank, step, gen):
                self._rt.event(
                    "ckpt_load_end", step=step, tier=self._tier, duration_s=time.time() - t0
                )
                _say(f"rank {rank} restored step {step} from the {self._tier} tier")
                return step
            checked = self._load_prefetched(state, rank, step, gen)
            if checked is not None:
                self._rt.event(
                    "ckpt_load_end",
                    step=step,
                    tier="prefetched",
                    duration_s=time.time() - t0,
                    checked=checked,
                )
                _say(f"rank {rank} restored step {step} from this node's prefetched copy")
                return step
            # The manifest, sizes and metadata now; each data file's checksum as it is read.
            problems, sums = storage.verify_for_load(self.root, step)
            if problems:
                missing = not storage.step_dir(self.root, step).exists()
                self._restore_failed(rank, step, gen, "durable", problems)
                if missing:
                    raise CheckpointNotFoundError(
                        f"step {step} is in no tier of rank {rank} (memory or {self.root}); "
                        "the controller restarts from an older checkpoint"
                    )
                raise CheckpointCorruptError(
                    f"step {step}: {'; '.join(problems)}; the controller restarts from an "
                    "older checkpoint"
                )
            try:  # whole tensors straight into the live ones, no read buffer copied out
                self._load_durable(state, rank, step, sums, direct=True)
            except CheckpointCorruptError as e:
                self._restore_failed(rank, step, gen, "durable", [str(e)])
                raise CheckpointCorruptError(
                    f"step {step}: {e}; the controller restarts from an older checkpoint"
                ) from None
            except CheckpointReadError as e:
                self._restore_failed(rank, step, gen, "durable", [str(e)])
                raise
            self._rt.event("ckpt_load_end", step=step, tier="durable", duration_s=time.time() - t0)
            _say(f"rank {rank} restored step {step} from the durable tier ({self.root})")
            return step
        else:
            step, skipped = storage.newest_verified(self.root)
            for bad, problems in skipped.items():
                self._rt.event("ckpt_corrupt", step=bad, tier="durable", problems=problems)
            if step is None:
                return None
            t0 = time.time()
            self._rt.event("ckpt_load_start", step=step)
        self._load_durable(state, rank, step)
        self._rt.event("ckpt_load_end", step=step, tier="durable", duration_s=time.time() - t0)
        _say(f"rank {rank} restored step {step} from the durable tier ({self.root})")
        return step

    def _load_prefetched(self, state: dict[str, Any], rank: int, step: int, gen: int) -> str | None:
        """Restore durable ``step`` from this node's prefetched copy (a standby that took a
        lost node's place: ``prefetch.py``) if it holds that step of generation ``gen``.
        Returns how it was checked: ``"at the restart"`` (its agent verified it whole for
        this generation: read without checksums) or ``"while read"`` (each file's CRC-32C as
        it is read). None (an event if it was there but failed): read the durable tier
        instead, which overwrites whatever was read."""
        root = prefetch.present(os.environ.get(rt_api.ENV_PREFETCH_DIR), step, gen)
        if root is None:
            return None
        before = prefetch.verified(root, step, gen, self._rt.generation)
        problems, sums = storage.verify_for_load(root, step)
        if not problems:
            try:
                self._load_durable(
                    state, rank, step, sums, root=root, direct=True, checksums=not before
                )
                return "at the restart" if before else "while read"
            except (CheckpointCorruptError, CheckpointReadError) as e:
                problems = [str(e)]
        self._rt.event("ckpt_corrupt", step=step, tier="prefetched", problems=problems[:4])
        return None

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

    def _load_durable(
        self,
        state: dict[str, Any],
        rank: int,
        step: int,
        sums: dict[str, dict[str, Any]] | None = None,
        *,
        root: Path | None = None,
        direct: bool = False,
        checksums: bool = True,
    ) -> None:
        """Read this rank's keys of durable ``step`` into ``state``. ``sums``: the step's
        manifest files: each file read is checked against them as it is read (one pass,
        ``reader.VerifyingReader``); None: the step was verified whole already. Raises
        CheckpointCorruptError for a file that does not match (``state`` may then hold some
        of its values: do not go on with it), CheckpointReadError when a file cannot be read
        (permissions, I/O error, vanished), CheckpointError when the saved keys do not fit
        the live state. ``direct``: whole tensors are read straight into the live ones
        (``VerifyingReader``); ``checksums=False``: it was checked whole just before (sizes
        are still checked)."""
        root = self.root if root is None else root
        path = storage.step_dir(root, step)
        try:
            md = dcp.FileSystemReader(str(path)).read_metadata()
        except OSError as e:
            raise CheckpointReadError(f"step {step} of {root}: {e}") from e
        saved_md = md.state_dict_metadata
        conv = state_mod.converted(state, rank)
        self._account_per_rank(conv, saved_md, rank, step)
        live, _ = state_mod.flatten_typed(conv)
        paths = md.planner_data if isinstance(md.planner_data, dict) else {}
        saved = {
            k: (
                (m.properties.dtype, tuple(m.size), tuple(paths.get(k, ())))
                if isinstance(m, TensorStorageMetadata)
                else (None, (), tuple(paths.get(k, ())))
            )
            for k, m in saved_md.items()
        }
        filled = state_mod.fill_missing(conv, live, saved)
        state_mod.replace_overlapping(conv)
        if filled:
            self._rt.event("ckpt_keys_created", step=step, tier="durable", count=len(filled))
        # no_dist: each rank reads its own keys (DTensor targets: the chunks overlapping its
        # shard); a collective here would deadlock against ranks that restore from memory.
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.load(
                    conv,
                    checkpoint_id=str(path),
                    storage_reader=VerifyingReader(path, sums, direct=direct, checksums=checksums)
                    if sums is not None
                    else None,
                    planner=state_mod.TypedLoadPlanner(),
                    no_dist=True,
                )
        except CorruptFileError as e:
            raise CheckpointCorruptError(str(e)) from None
        except OSError as e:
            raise CheckpointReadError(f"step {step} of {root}: {e}") from e
        except CheckpointException as e:  # a BaseException: would escape `except Exception`
            failures = getattr(e, "failures", {}) or {}
            read = [
                f[0]
                for f in failures.values()
                if isinstance(f, tuple) and isinstance(f[0], OSError)
            ]
            corrupt = [x for x in read if isinstance(x, CorruptFileError)]
            if corrupt:
                raise CheckpointCorruptError(str(corrupt[0])) from None
            if read:
                raise CheckpointReadError(f"step {step} of {root}: {read[0]}") from None
            first = next((ln for ln in str(e).splitlines() if "Error" in ln), str(e)[:300])
            raise CheckpointError(
                f"step {step} of {root} does not fit this state ({first.strip()}); "
                "the script's state must have the keys it had when it saved"
            ) from None
        state_mod.apply(state, conv, rank)

    def _account_per_rank(self, conv: dict[str, Any], saved_md: Any, rank: int, step: int) -> None:
        """Per-rank and per-shard state across a world change (elastic), never silent:

        - a key of this rank's (``per_rank.<rank>``, ``per_shard.<id>``) that the step does
          not hold starts fresh (the world grew, or a shard no one ran): event
          ``ckpt_per_rank_absent`` / ``ckpt_per_shard_absent``;
        - rank 0 reports the ``per_rank`` state of ranks beyond the world that it drops (the
          world shrank: their RNG states cannot be merged): ``ckpt_per_rank_dropped``, and a
          stderr line. ``per_shard`` state is never dropped: every shard goes to the rank
          that runs it now.
        """
        saved_ranks: set[int] = set()
        for k in saved_md:
            head, _, rest = k.partition(".")
            if head == PER_RANK_KEY and rest.split(".", 1)[0].isdigit():
                saved_ranks.add(int(rest.split(".", 1)[0]))

        def held(key: str) -> bool:
            return any(k == key or k.startswith(key + ".") for k in saved_md)

        for key in [k for k in conv if k.startswith((PER_RANK_KEY + ".", PER_SHARD_KEY + "."))]:
            if not held(key):
                del conv[key]
                if key.startswith(PER_RANK_KEY + "."):
                    self._rt.event("ckpt_per_rank_absent", step=step, rank=rank)
                else:
                    self._rt.event("ckpt_per_shard_absent", step=step, shard=key.split(".", 1)[1])
        _, world = _rank_world()
        dropped = sorted(r for r in saved_ranks if r >= world)
        if rank == 0 and dropped:
            self._rt.event("ckpt_per_rank_dropped", step=step, ranks=dropped, world=world)
            _say(
                f"step {step} was saved by {max(saved_ranks) + 1} ranks, this world has {world}: "
                f"the per_rank state of ranks {', '.join(map(str, dropped))} is dropped (keep "
                f"what must follow the data in state['{PER_SHARD_KEY}'] instead)"
            )

    def _load_memory(self, state: dict[str, Any], rank: int, step: int, gen: int) -> bool:
        name_job = os.environ.get(rt_api.ENV_JOB_ID, "")
        node = os.environ.get(rt_api.ENV_NODE_ID, "")
        shm = Path(os.environ.get(rt_api.ENV_SHM_DIR, "/dev/shm"))
        backend = self._connect()
        source = os.environ.get(rt_api.ENV_REPLICA_SOURCE, "")
        if source and isinstance(backend, CkptdBackend):  # our node is new: the copy is on a peer
            have = [snapshot.peek_header(p) for p in snapshot.slot_paths(shm, name_job, node, rank)]
            if not any(h and (h["step"], h["generation"]) == (step, gen) for h in have):
                try:
                    backend.fetch(rank, step, gen, source)
                except CheckpointError as e:
                    self._rt.event("ckpt_corrupt", step=step, tier="replica", problems=[str(e)])
                    return False
                self._tier = "replica"
        verified: str | None = None  # the slot's name
        # ckptd checks the slot (usually done during the restart)
        if isinstance(backend, CkptdBackend):
            reply = backend.verify(rank, step, gen, self._rt.generation)
            if reply is None:
                pass  # ckptd is down: checksum the slot here, against the sums of its staging
            elif not reply.ok or reply.slot is None:
                if reply.slot is not None:  # corrupt: ckptd dropped it from its index
                    self._rt.event(
                        "ckpt_corrupt", step=step, tier="memory", problems=[reply.problem]
                    )
                return False
            else:
                verified = Path(reply.slot).name
        for path in snapshot.slot_paths(shm, name_job, node, rank):
            h = snapshot.peek_header(path)
            if h is None or (h["step"], h["generation"]) != (step, gen):
                continue
            sums = None if path.name == verified else snapshot.read_sums(path, step, gen)
            if sums is None and path.name != verified:
                continue
            try:
                self._restore_slot(state, rank, path, h, sums)
            except CheckpointCorruptError as e:
                self._rt.event("ckpt_corrupt", step=step, tier="memory", problems=[str(e)])
                backend.forget(path)  # out of the memory index: the next restore point skips it
                return False
            except CheckpointError as e:  # the snapshot does not fit this state: use DCP's
                self._rt.event("ckpt_memory_mismatch", step=step, problem=str(e))
                return False
            return True
        return False

    def _restore_slot(
        self,
        state: dict[str, Any],
        rank: int,
        path: Path,
        h: dict[str, Any],
        sums: dict[str, list[int]] | None,
    ) -> None:
        """Copy one verified slot into ``state``. Raises CheckpointError (nothing written
        yet) when the snapshot does not fit the live state, CheckpointCorruptError on a
        checksum mismatch."""
        conv = state_mod.converted(state, rank)
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
            self._rt.event("ckpt_keys_created", step=h["step"], tier="memory", count=len(saved))
            live = state_mod.flatten_converted(conv)
        for key, rec in shards.items():
            have = live.shards.get(key)
            if have is None or (have.global_shape, have.offset) != (rec.global_shape, rec.offset):
                raise CheckpointError(
                    f"{key}: this rank's shard of {rec.fqn} differs from the snapshot's "
                    f"(offset {rec.offset} of {rec.global_shape})"
                )
        objects, replaced = snapshot.restore(
            path, h, sums, live.tensors, snapshot.restore_threads()
        )
        for key, raw in objects.items():
            path = mappings.get(key) or live.mappings[key]
            state_mod.set_path(conv, path, state_mod.decode_object(raw))
        for key, tensor in replaced.items():
            state_mod.set_path(conv, live.mappings[key], tensor)
        state_mod.apply(state, conv, rank)

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

    def close(self) -> None:
        """Wait for durability of the last durable save, then release slots and the persister."""
        try:
            self.wait()
        finally:
            for s in self._slots:
                s.close()
            self._slots = []
            backend, self._backend = self._backend, None
            if backend is not None:
                backend.close()
            if isinstance(backend, LocalBackend):
                for kind, data in backend.events:
                    self._rt.event(kind, **data)
