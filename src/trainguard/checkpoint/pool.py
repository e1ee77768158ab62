"""One rank's snapshot slots (``snapshot.SLOTS`` of them): the pool plans their layout for the
state, has the backend allocate them, picks the one a save may overwrite, and publishes it.

A save: ``acquire(flat, nblob, …) → Lease`` (the layout re-planned and the slots re-allocated
when the state's tensors or objects changed; the least recently written slot that no
persister holds, locked and marked WRITING), ``lease.write(…)`` for the tensors (in parts if
need be: some before ``save`` returns, the rest on the background copy's thread), then
``publish(lease, blob, meta)``: the object blob and the header last, the slot COMPLETE, the
lock released.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from trainguard.checkpoint import snapshot
from trainguard.checkpoint import state as state_mod

SLOT_WAIT_S = 600.0  # a durable step waits this long for a slot the persister still holds


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
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


class Lease:
    """A slot locked for one save: written by ``write``, then published by the pool (or
    released, torn, when the save fails)."""

    def __init__(self, slot: snapshot.Slot, layout: snapshot.Layout, lockf: IO[bytes]) -> None:
        self.slot, self.layout = slot, layout
        self._lockf: IO[bytes] | None = lockf

    def write(self, tensors: list[torch.Tensor], indices: list[int] | None = None) -> None:
        """Copy host ``tensors`` (layout order) into entries ``indices`` (default all)."""
        self.slot.write_tensors(self.layout, tensors, indices)

    def release(self) -> None:
        """Unlock the slot (once; a later call does nothing)."""
        lockf, self._lockf = self._lockf, None
        if lockf is not None:
            fcntl.flock(lockf, fcntl.LOCK_UN)
            lockf.close()


class SlotPool:
    """The slots of one rank. ``alloc(nbytes)``: the backend creates (or grows) the slot
    files and returns their paths; ``keepalive``: called while a save waits for a slot."""

    def __init__(
        self, alloc: Callable[[int], Sequence[Path]], keepalive: Callable[[], None]
    ) -> None:
        self._alloc, self._keepalive = alloc, keepalive
        self.slots: list[snapshot.Slot] = []
        self.layout: snapshot.Layout | None = None
        self.plans = 0  # layouts planned so far (buffers shaped by the last one go with it)
        self._static = ""  # the layout's static header (layout, mappings, shards) as JSON
        # the mappings, shards and object keys it was built for (tensor keys: in the layout)
        self._static_of: tuple[Any, Any, list[str]] = ({}, {}, [])
        self._age: list[int] = []  # slot indices, least recently written first
        self._written: dict[Path, dict[str, Any]] = {}  # slot → meta this process committed

    def acquire(
        self,
        flat: state_mod.Flat,
        nblob: int,
        replan: Callable[[], state_mod.Flat],
        *,
        wait: bool,
    ) -> Lease | None:
        """A locked slot for a save of ``flat`` (tensors in layout order) with an object blob
        of ``nblob`` bytes, marked WRITING; re-planned for ``replan()`` (the state flattened
        with its paths) first when ``flat`` does not fit the current layout. None when every
        slot is held (``wait``: after up to SLOT_WAIT_S, else at once)."""
        with gc_paused():
            fits = (
                self.layout is not None
                and self.layout.fits(flat.tensors, nblob)
                and flat.shards == self._static_of[1]
                and list(flat.objects) == self._static_of[2]
            )
        if not fits:
            self._plan(replan(), nblob)
        assert self.layout is not None
        got = self._take(wait)
        if got is None:
            return None
        slot, lockf = got
        self._written.pop(slot.path, None)  # torn until committed
        slot.begin()
        return Lease(slot, self.layout, lockf)

    def publish(self, lease: Lease, blob: bytes, meta: dict[str, Any]) -> None:
        """Write the object blob and the header (``meta`` and the layout's static part),
        mark the slot COMPLETE and release it."""
        try:
            lease.slot.commit(lease.layout, blob, meta, self._static)
            self._written[lease.slot.path] = meta
            i = self.slots.index(lease.slot)
            self._age = [j for j in self._age if j != i] + [i]
        finally:
            lease.release()

    def close(self) -> None:
        for s in self.slots:
            s.close()
        self.slots = []

    def _plan(self, flat: state_mod.Flat, nblob: int) -> None:
        """Plan the slots' layout for this state (tensor places, and a header reserve that
        holds its static part) and have the backend create them."""
        self.close()
        mappings = {k: list(v) for k, v in flat.mappings.items()}
        shards = {k: r.to_json() for k, r in flat.shards.items()}
        layout = snapshot.Layout.plan(flat.tensors, nblob)
        static = layout.static_header(mappings, shards)
        if snapshot.PREFIX_BYTES + len(static) + 4096 > layout.reserve:
            layout = snapshot.Layout.plan(flat.tensors, nblob, header_bytes=len(static) + 4096)
            static = layout.static_header(mappings, shards)
        self.layout, self._static = layout, static
        self._static_of = (flat.mappings, flat.shards, list(flat.objects))
        self.slots = [snapshot.Slot(p, writable=True) for p in self._alloc(layout.total_bytes)]
        self._age = list(range(len(self.slots)))
        self.plans += 1

    def _take(self, wait: bool) -> tuple[snapshot.Slot, IO[bytes]] | None:
        """Lock a slot the persister does not hold, the least recently written first (so the
        newest snapshots stay whole). ``wait``: up to SLOT_WAIT_S, else not."""
        order = list(self._age)
        deadline = time.monotonic() + (SLOT_WAIT_S if wait else 0.0)
        alive = time.monotonic()
        while True:
            if time.monotonic() - alive > 1.0:  # waiting on our own machinery is not a hang
                self._keepalive()
                alive = time.monotonic()
            for i in order:
                slot = self.slots[i]
                lockf = open(slot.path, "rb")  # noqa: SIM115 - closed by Lease.release
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
                return None
            time.sleep(0.005)
