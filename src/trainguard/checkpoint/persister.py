"""The persister: from staged shared-memory snapshots to committed durable checkpoints.

Runs inside ckptd (one per node) or, outside ``trainguard run``, inside the training
process. For each staged snapshot, newest first (older staged steps of the same rank
are skipped when persistence falls behind):

1. takes a shared ``flock`` on the slot (the writer holds an exclusive one while it
   copies), checks the header, computes CRC-32C of every tensor → ``<slot>.sum``:
   the snapshot is now a *verified* memory-tier copy;
2. writes the rank's part with ``torch.distributed.checkpoint`` (single process) to
   ``<root>/.tmp-step_<N>-gen<G>-<run id>/rank_<r>/`` and fsyncs it, then a ``.done`` marker
   listing its files with their checksums (computed while writing: no read-back) and the
   run, generation, step and rank that wrote it (runid.py);
3. the committer (whoever persists rank 0) waits for every rank's ``.done``, checks that each
   names the committer's run, generation and step (a part of another run is a leftover:
   removed with a ``ckpt_leftover_removed`` event, never merged), merges
   the per-rank DCP metadata into one global ``.metadata`` (keys are disjoint: rank 0
   holds the replicated state, rank r its ``per_rank.<r>`` and ``per_shard.<id>``), writes the manifest and
   renames the directory to ``step_<N>`` — plain ``dcp.load`` reads it.

Failures (disk full, a torn slot) are events; the memory tier keeps serving.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.checkpoint import fingerprint, snapshot, storage
from trainguard.checkpoint.api import DCP_WRITES, own_key
from trainguard.checkpoint.runid import RunIdentity

log = logging.getLogger("trainguard.persister")
DONE = ".done"
Emit = Callable[..., None]


def describe_write_error(e: BaseException, directory: Path, needed: int) -> str:
    """One line: the error, and the free space when the disk is the likely cause (a full disk
    surfaces from torch's zip writer as 'unexpected pos', not as ENOSPC)."""
    first = next(
        (ln for ln in str(e).splitlines() if ln.strip() and "Traceback" not in ln), type(e).__name__
    )
    try:
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return first[:300]
    if free < needed:
        return f"No space left on device at {directory}: {free} bytes free, the part needs ~{needed} ({first[:160]})"
    return first[:300]


FINGERPRINTS_KEPT = 8  # per rank, in ckptd's status (a report every few snapshots)


def _failures() -> tuple[type[BaseException], ...]:
    """What a persist or a commit may raise: DCP wraps a rank's error in CheckpointException, a
    BaseException subclass (caught only once DCP is imported: before, nothing can raise it)."""
    dcp_api = sys.modules.get("torch.distributed.checkpoint.api")
    return (Exception,) if dcp_api is None else (Exception, dcp_api.CheckpointException)


def part_writer(part: Path) -> dict[str, Any]:
    """Who wrote a persisted part (its ``.done``'s ``writer``: run_id, run_started,
    generation, step, rank); {} when it records none or is unreadable."""
    try:
        w = json.loads((part / DONE).read_text()).get("writer", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return w if isinstance(w, dict) else {}


def foreign_parts(tmp: Path, world_size: int, want: dict[str, Any]) -> list[str]:
    """The parts under ``tmp`` whose writer differs from ``want`` (run id, generation, step):
    a leftover of another run, never to be merged."""
    keys = ("run_id", "generation", "step")
    return [
        f"rank_{r}"
        for r in range(world_size)
        if (tmp / f"rank_{r}" / DONE).exists()
        and tuple(part_writer(tmp / f"rank_{r}").get(k) for k in keys)
        != tuple(want.get(k) for k in keys)
    ]


class Persister:
    """Persists staged snapshots of some ranks; commits steps when it persists rank 0.

    Ordering: snapshots flagged ``durable`` in their header (the writer chose them by step
    number, so every rank agrees) are persisted in order and never skipped; memory-only
    snapshots are checksummed, newest first, older ones skipped.

    Args:
        root: durable checkpoint directory.
        keep: committed steps retained.
        emit: ``emit(kind, **data)`` for events (staged, durable, failures).
        commit_timeout_s: how long the committer waits for the other ranks' parts.
    """

    def __init__(
        self,
        root: Path,
        *,
        keep: int = 2,
        emit: Emit,
        commit_timeout_s: float = 600.0,
        on_verified: Callable[[int, Path, int, int, Any], None] | None = None,
    ) -> None:
        self.root, self.keep, self.emit = root, keep, emit
        self.on_verified = on_verified  # (rank, slot, step, gen, sums): e.g. replicate it
        self.commit_timeout_s = commit_timeout_s
        self._cv = threading.Condition()
        self._pending: dict[
            int, list[tuple[Path, int, int, bool]]
        ] = {}  # rank → [(slot, step, gen, durable)]
        # (step, generation, world size, the run that wrote them)
        self._commits: list[tuple[int, int, int, RunIdentity | None]] = []
        self._verified: dict[int, dict[str, tuple[int, int]]] = {}  # rank → slot path → (step, gen)
        # rank → (step, gen) → [layout, value] of its newest FINGERPRINTS_KEPT verified
        # snapshots (fingerprint.py): facts that outlive the slot, so a report that comes
        # after a slot was reused still carries them
        self._fps: dict[int, dict[tuple[int, int], list[int]]] = {}
        self._closed = False
        self._busy = 0
        self._current: tuple[str, int, int] | None = None  # (slot, step, gen) being persisted
        self._verifying = False  # the current item's checksums are not indexed yet
        self._commits_waiting = False  # the committer is waiting for other ranks' parts
        self._newest_gen = -1  # newest generation seen: an older one's missing parts never come
        self._failed: dict[int, str] = {}  # step → why its part could not be persisted here
        self._commit_failed: set[int] = set()  # ... those of them whose commit failed
        # (rank, step, generation) whose durable part was written: a step saved twice in a
        # generation keeps its first durable copy (a second part would be written into the
        # directory its commit is renaming: a torn step)
        self._parted: set[tuple[int, int, int]] = set()
        # Read-only mappings of slots, kept across saves: mapping a slot anew sets up its page
        # tables every time (as long as copying it). Used by the persister thread only.
        self._maps: dict[str, tuple[tuple[int, int], snapshot.Slot]] = {}
        # slot → (step, gen, sums) whose ``.sum`` could not be written (the memory tier's
        # directory full): written again before each next item (persister thread only)
        self._unwritten: dict[Path, tuple[int, int, Any, bool]] = {}
        self._threads = [
            threading.Thread(target=self._run, name="trainguard-persister", daemon=True),
            threading.Thread(target=self._commit_loop, name="trainguard-committer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ API
    def staged(self, rank: int, slot: Path, step: int, generation: int, durable: bool) -> None:
        """A rank finished staging ``step`` into ``slot``. Returns at once."""
        with self._cv:
            self._newest_gen = max(self._newest_gen, generation)
            if durable and rank == 0 and step in self._commit_failed:
                # A new copy of rank 0's part (a replica group's restarted rank saves the step
                # again) queues a new commit of it: an earlier commit's failure (it raced the
                # dead incarnation's part) no longer says the step cannot become durable. A
                # part's own failure (a full disk) stands.
                self._commit_failed.discard(step)
                self._failed.pop(step, None)
            queue = [
                it for it in self._pending.get(rank, []) if it[3]
            ]  # memory-only items coalesce
            queue.append((slot, step, generation, durable))
            self._pending[rank] = queue
            self._cv.notify_all()

    def memory_index(self) -> dict[int, list[tuple[int, int]]]:
        """rank → verified (step, generation) copies still held in memory (headers re-checked)."""
        with self._cv:
            items = [(r, p, sg) for r, v in self._verified.items() for p, sg in v.items()]
        out: dict[int, list[tuple[int, int]]] = {}
        for rank, path, (step, gen) in items:
            h = snapshot.peek_header(Path(path))
            if h is not None and (h["step"], h["generation"]) == (step, gen):
                out.setdefault(rank, []).append((step, gen))
            else:
                with self._cv:
                    self._verified.get(rank, {}).pop(path, None)
        return {r: sorted(v) for r, v in out.items()}

    def fingerprints(self) -> dict[int, list[list[int]]]:
        """rank → [step, generation, layout, value] of its newest verified snapshots that
        hold replicated state (``fingerprint.py``), FINGERPRINTS_KEPT per rank at most."""
        with self._cv:
            return {
                r: [
                    [st, g, *fp]
                    for (st, g), fp in sorted(v.items(), key=lambda x: (x[0][1], x[0][0]))
                ]
                for r, v in self._fps.items()
            }

    def _remember(
        self, rank: int, step: int, gen: int, h: dict[str, Any], sums: Any
    ) -> list[int] | None:
        if fingerprint.ab_off(step):  # blocks without, for benchmarks/sdc.py's A/B
            return None
        fp = fingerprint.fingerprint(h, sums, rank)
        if fp is not None:
            with self._cv:
                mine = self._fps.setdefault(rank, {})
                mine[(step, gen)] = fp
                for k in sorted(mine, key=lambda p: (p[1], p[0]))[:-FINGERPRINTS_KEPT]:
                    del mine[k]
        return fp

    def adopt(self, rank: int, slot: Path) -> str | None:
        """Take over an existing slot after a ckptd restart, whatever state the old ckptd
        left it in. Returns what was done: "indexed" (verified before, checksums still
        match), "queued" (its work was not done: a snapshot staged but never verified, or a
        durable one not yet persisted, goes through the persister again, so its step still
        becomes durable and its slot reusable), "dropped" (it fails the checksums it was
        verified with: out of the index, never restored), or None (empty or torn: the writer
        overwrites it)."""
        h = snapshot.peek_header(slot)
        if h is None:
            return None
        step, gen, durable = int(h["step"]), int(h["generation"]), bool(h.get("durable"))
        if snapshot.forgotten(slot, step, gen):  # a reader or a check found it corrupt
            return "dropped"
        try:
            meta = json.loads(snapshot.sums_path(slot).read_text())
        except (OSError, ValueError):
            meta = {}
        sums = snapshot.read_sums(slot, step, gen)
        if sums is None:  # staged, never verified: verify (and persist) it now
            self.staged(rank, slot, step, gen, durable)
            return "queued"
        s = snapshot.Slot(slot, writable=False)
        try:
            ok = s.checksums(h) == sums
        finally:
            s.close()
        if not ok:
            snapshot.mark_forgotten(slot, step, gen)
            return "dropped"
        self._remember(rank, step, gen, h, sums)
        with self._cv:
            self._verified.setdefault(rank, {})[str(slot)] = (step, gen)
        if durable and not meta.get("persisted"):  # verified, its part not written yet
            self.staged(rank, slot, step, gen, True)
            return "queued"
        run = RunIdentity.from_json(h)
        if durable and rank == 0 and self._uncommitted_part(step, gen, run):
            # Rank 0's part was written but the old ckptd died before its commit (waiting for
            # the other ranks' parts, or merging): commit it here, or the step never is.
            with self._cv:
                self._commits.append((step, gen, int(h["world_size"]), run))
                self._cv.notify_all()
            return "queued"
        return "indexed"

    def _uncommitted_part(self, step: int, gen: int, run: RunIdentity | None) -> bool:
        """Rank 0's part of (``step``, ``gen``) of ``run`` is complete in its temp directory and
        the step is not committed by this or a newer copy."""
        part = storage.tmp_dir(self.root, step, gen, run.run_id if run else "") / "rank_0"
        if not (part / DONE).exists():
            return False
        return (
            step not in storage.list_committed(self.root)
            or storage.committed_generation(self.root, step) < gen
        )

    def rescan(self, rank: int, slot: Path) -> str | None:
        """Take in a complete snapshot this persister was never told of: its writer died
        between writing the slot's header and its ``staged`` call (a kill one instruction
        too early must not lose a finished snapshot). Call only while no writer of ``slot``
        runs (the agent asks after its workers exited). Returns what ``adopt`` did, or None
        when the slot is empty, torn, already known, or was forgotten as corrupt."""
        h = snapshot.peek_header(slot)
        if h is None:
            return None
        key = (str(slot), int(h["step"]), int(h["generation"]))
        with self._cv:
            known = (
                self._verified.get(rank, {}).get(key[0]) == key[1:]
                or self._current == key
                or any((str(p), st, g) == key for p, st, g, _ in self._pending.get(rank, []))
            )
        if known or snapshot.forgotten(slot, key[1], key[2]):  # (forgotten: found corrupt)
            return None
        return self.adopt(rank, slot)

    def persist_held(self, step: int, generation: int) -> list[int]:
        """Queue every rank's verified copy of (``step``, ``generation``) held here for the
        durable tier (a planned stop: the workers are gone, their snapshots are not).
        Returns the ranks queued; rank 0's node commits once every rank's part is written."""
        with self._cv:
            held = [
                (rank, Path(path))
                for rank, v in self._verified.items()
                for path, sg in v.items()
                if sg == (step, generation)
            ]
        for rank, path in held:
            self.staged(rank, path, step, generation, True)
        return sorted(rank for rank, _ in held)

    def failure(self, step: int) -> str | None:
        """Why ``step`` cannot become durable (its part failed on this node), or None."""
        with self._cv:
            return self._failed.get(step)

    def forget(self, slot: Path) -> None:
        """Drop a snapshot a reader found corrupt: out of the memory index, never re-adopted."""
        h = snapshot.peek_header(slot)
        with self._cv:
            for v in self._verified.values():
                v.pop(str(slot), None)
        if h is not None:  # a restarted ckptd must not take it in again either
            snapshot.mark_forgotten(slot, int(h["step"]), int(h["generation"]))
        else:
            snapshot.sums_path(slot).unlink(missing_ok=True)

    def wait_durable(self, step: int, timeout_s: float) -> bool:
        """Until ``step`` is committed in the durable tier (by anyone) or the deadline."""
        deadline = time.monotonic() + timeout_s
        while step not in storage.list_committed(self.root):
            if time.monotonic() >= deadline or self.failure(step) is not None:
                return False
            with self._cv:
                self._cv.wait(timeout=0.05)
        return True

    def idle(self) -> bool:
        """Nothing staged is left to verify here: the memory index is whole (what the
        controller waits for before it picks a restore point). A durable part still being
        written does not count: the index no longer changes with it."""
        with self._cv:
            return not any(self._pending.values()) and not self._verifying

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish pending persistence (bounded by ``timeout_s``), give up commits still waiting
        for other ranks' parts, and stop the threads."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._cv:
                persisting = any(self._pending.values()) or self._busy > (
                    1 if self._commits_waiting else 0
                )
            if not persisting and not self._commits:
                break
            time.sleep(0.01)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))

    # ------------------------------------------------------------------ threads
    def _run(self) -> None:
        while True:
            with self._cv:
                while not any(self._pending.values()) and not self._closed:
                    self._cv.wait()
                if self._closed and not any(self._pending.values()):
                    for path in list(self._maps):
                        self._unmap(Path(path))
                    return
                rank = min(r for r, q in self._pending.items() if q)
                retry = list(self._unwritten.items())
                slot, step, gen, durable = self._pending[rank].pop(0)
                self._busy += 1
                self._current = (str(slot), step, gen)
                self._verifying = True
            for path, (s_step, s_gen, s_sums, s_done) in retry:  # space may be free again
                h = snapshot.peek_header(path)
                if (
                    h is None
                    or (h["step"], h["generation"]) != (s_step, s_gen)
                    or snapshot.forgotten(path, s_step, s_gen)
                ):  # overwritten since, or found corrupt: that record must not come back
                    self._unwritten.pop(path, None)
                    continue
                self._write_sums(path, s_step, s_gen, s_sums, persisted=s_done)
            try:
                self._persist_one(rank, slot, step, gen, durable)
            except _failures() as e:  # one bad snapshot must not stop the persister
                log.exception("persisting rank %d step %d failed", rank, step)
                self.emit(
                    "ckpt_persist_failed", rank=rank, step=step, reason=f"{type(e).__name__}: {e}"
                )
            finally:
                with self._cv:
                    self._busy -= 1
                    self._current = None
                    self._verifying = False
                    self._cv.notify_all()

    def _persist_one(self, rank: int, slot_path: Path, step: int, gen: int, durable: bool) -> None:
        with open(slot_path, "rb") as lockf:
            if durable:  # the writer never overwrites an unpersisted durable snapshot: wait for its brief lock
                fcntl.flock(lockf, fcntl.LOCK_SH)
            else:
                try:
                    fcntl.flock(lockf, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # the writer is overwriting this memory-only snapshot with a newer step
            slot = self._mapped(slot_path)
            try:
                h = slot.header()
                if h is None or (h["step"], h["generation"]) != (step, gen):
                    return
                sums = slot.checksums(h)
                fp = self._remember(rank, step, gen, h, sums)
                if self._write_sums(slot_path, step, gen, sums, persisted=not durable):
                    with self._cv:
                        self._verified.setdefault(rank, {})[str(slot_path)] = (step, gen)
                    self.emit("ckpt_staged", rank=rank, step=step, snapshot_generation=gen)
                    if self.on_verified is not None:
                        self.on_verified(rank, slot_path, step, gen, sums)
                with self._cv:  # indexed (and replicated): what follows is the durable part
                    self._verifying = False
                if not durable:
                    return
                if (rank, step, gen) in self._parted:
                    self.emit("ckpt_durable_kept", rank=rank, step=step, snapshot_generation=gen,
                              reason="the step was saved again; its first durable copy stands")  # fmt: skip
                    return
                self._parted.add((rank, step, gen))
                from trainguard.checkpoint import dcp_part  # torch, DCP: loaded by ckptd at start

                tensors, blob = slot.views(h)
                # Objects stay the worker's torch.save bytes: no user class is imported here.
                objects = {k: dcp_part.Opaque(v) for k, v in dcp_part.unpack_objects(blob).items()}
                shards = h.get("shards", {})
                tensors, objects = _this_ranks_part(h, rank, tensors, objects)
                t0 = time.time()
                run = RunIdentity.from_json(h)
                part = storage.tmp_dir(self.root, step, gen, run.run_id if run else "")
                part /= f"rank_{rank}"
                writer = {**(run.to_json() if run else {}), "generation": gen, "step": step,
                          "rank": rank}  # fmt: skip
                try:
                    dcp_part.write_part(
                        part,
                        tensors,
                        objects,
                        h.get("mappings", {}),
                        {k: shards[k] for k in tensors if k in shards},
                        writer,
                    )
                    fingerprint.write_part(part, fp)  # the step's SDC verdict (retention)
                except dcp_part.WRITE_ERRORS as e:
                    needed = sum(int(t.numel() * t.element_size()) for t in tensors.values()) + len(
                        blob
                    )
                    reason = describe_write_error(e, self.root, needed)
                    with self._cv:
                        self._failed[step] = reason
                    self.emit(
                        "ckpt_persist_failed",
                        rank=rank,
                        step=step,
                        reason=reason,
                        hint="the memory tier still serves; free disk space for durable checkpoints",
                    )
                    return
                finally:
                    self._write_sums(slot_path, step, gen, sums, persisted=True)  # may be reused
                    del tensors
                self.emit("ckpt_part_durable", rank=rank, step=step, duration_s=time.time() - t0)
            except BaseException:
                self._unmap(slot_path)
                raise
        if rank == 0:
            with self._cv:
                self._commits.append((step, gen, int(h["world_size"]), run))
                self._cv.notify_all()

    def _write_sums(self, slot: Path, step: int, gen: int, sums: Any, *, persisted: bool) -> bool:
        """``snapshot.write_sums``; False when the memory tier's directory has no room for it
        (said once a slot, with the fix): the snapshot stays out of the memory index, its
        durable part is still written, and the record is written again once there is room
        (the writer reuses the slot only then)."""
        try:
            snapshot.write_sums(slot, step, gen, sums, persisted=persisted)
        except OSError as e:
            if slot not in self._unwritten:
                reason = (f"{slot.parent} is full ({e.strerror}): step {step} is not in the "
                          "memory tier (a durable step still goes to disk); memory snapshots "
                          "resume once there is room: free space there or enlarge it "
                          f"(mount -o remount,size=… {slot.parent})")  # fmt: skip
                log.warning("%s", reason)
                self.emit("ckpt_memory_full", step=step, slot=slot.name, reason=reason)
            self._unwritten[slot] = (step, gen, sums, persisted)
            return False
        self._unwritten.pop(slot, None)
        return True

    def _mapped(self, path: Path) -> snapshot.Slot:
        """The cached read-only mapping of ``path``, remapped if the file was replaced or grew."""
        st = os.stat(path)
        ident = (st.st_ino, st.st_size)
        cached = self._maps.get(str(path))
        if cached is not None and cached[0] == ident:
            return cached[1]
        self._unmap(path)
        slot = snapshot.Slot(path, writable=False)
        self._maps[str(path)] = (ident, slot)
        return slot

    def _unmap(self, path: Path) -> None:
        cached = self._maps.pop(str(path), None)
        if cached is not None:
            cached[1].close()

    def _commit_loop(self) -> None:
        while True:
            with self._cv:
                while not self._commits and not self._closed:
                    self._cv.wait()
                if not self._commits:
                    return
                step, gen, world, run = self._commits.pop(0)
                self._busy += 1
            try:
                self._commit(step, gen, world, run)
            except _failures() as e:  # report, keep committing later steps
                log.exception("committing step %d failed", step)
                reason = describe_write_error(e, self.root, 1 << 20)
                with self._cv:
                    self._failed[step] = reason  # wait_durable() fails at once, with the reason
                    self._commit_failed.add(step)
                self.emit("ckpt_commit_failed", step=step, reason=reason)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _commit(self, step: int, gen: int, world_size: int, run: RunIdentity | None) -> None:
        from trainguard.checkpoint import dcp_part  # its parts were written: torch is in

        tmp = storage.tmp_dir(self.root, step, gen, run.run_id if run else "")
        deadline = time.monotonic() + self.commit_timeout_s
        parts = [tmp / f"rank_{r}" / DONE for r in range(world_size)]
        self._commits_waiting = True
        try:
            self._await_parts(parts, tmp, deadline, step, gen)
        finally:
            self._commits_waiting = False
        if not all(p.exists() for p in parts):
            return
        want = {"run_id": run.run_id if run else None, "generation": gen, "step": step}
        foreign = foreign_parts(tmp, world_size, want)
        if foreign:  # not this run's: never merged (a writer that named no run, or a copy)
            for name in foreign:
                shutil.rmtree(tmp / name, ignore_errors=True)
            self.emit("ckpt_leftover_removed", step=step, snapshot_generation=gen,
                      removed=[f"{tmp.name}/{n}" for n in foreign],
                      reason="parts written by another run or generation")  # fmt: skip
            self.emit("ckpt_commit_abandoned", step=step, snapshot_generation=gen,
                      reason="a part was another run's")  # fmt: skip
            return
        t0 = time.time()
        with contextlib.suppress(FileExistsError):
            dcp_part.merge_and_commit(tmp, self.root, step, gen, world_size, run)
            removed: list[str] = []
            storage.prune(self.root, self.keep, committed_step=step, generation=gen,
                          run_id=run.run_id if run else None, removed=removed)  # fmt: skip
            if removed:
                self.emit("ckpt_leftover_removed", step=step, removed=removed,
                          reason="temporary directories of a dead run or an older generation")  # fmt: skip
            self.emit("ckpt_durable", step=step, snapshot_generation=gen, commit_s=time.time() - t0)
        with self._cv:
            self._cv.notify_all()

    def _await_parts(
        self, parts: list[Path], tmp: Path, deadline: float, step: int, gen: int
    ) -> None:
        """Until every rank's part exists; gives up (with an event) past the deadline, when the
        generation died (a newer one staged), or when a newer step is already complete."""
        while not all(p.exists() for p in parts):
            with self._cv:
                newer_gen = self._newest_gen > gen
                newer_done = any(
                    s > step
                    and all(
                        (
                            storage.tmp_dir(self.root, s, g, ru.run_id if ru else "")
                            / f"rank_{r}"
                            / DONE
                        ).exists()
                        for r in range(w)
                    )  # fmt: skip
                    for s, g, w, ru in self._commits
                )
            if (
                time.monotonic() > deadline
                or not tmp.exists()
                or self._closed
                or newer_gen
                or newer_done
            ):
                why = (
                    "its generation ended"
                    if newer_gen
                    else "a newer step is complete"
                    if newer_done
                    else "the other ranks' parts did not arrive in time"
                )
                self.emit("ckpt_commit_abandoned", step=step, snapshot_generation=gen, reason=why)
                return
            with self._cv:
                self._cv.wait(timeout=0.02)


def _this_ranks_part(
    h: dict[str, Any], rank: int, tensors: dict[str, Any], objects: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What of a snapshot (header ``h``) this rank persists: the entries DCP's plan gave it (a
    ``trainguard.dcp`` save, ``api.DCP_WRITES``); else its sharded chunks marked to write,
    and on rank 0 the replicated state (persisted once, DCP's rule), on any rank its own
    ``per_rank``/``per_shard`` keys."""
    writes = h.get(DCP_WRITES)
    if writes is not None:
        keep = set(writes)
        return (
            {k: v for k, v in tensors.items() if k in keep},
            {k: v for k, v in objects.items() if k in keep},
        )
    shards = h.get("shards", {})
    tensors = {k: v for k, v in tensors.items() if k not in shards or shards[k]["write"]}
    if rank != 0:
        tensors = {k: v for k, v in tensors.items() if own_key(k, rank) or k in shards}
        objects = {k: v for k, v in objects.items() if own_key(k, rank)}
    return tensors, objects
