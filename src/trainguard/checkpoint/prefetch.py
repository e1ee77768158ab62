"""Standby prefetch: a node that waits as a standby keeps a verified copy of the job's newest
durable step in its own memory (a directory on its shared-memory filesystem, next to ckptd's
slots), so that when it replaces a lost node its ranks read the restore point from memory,
not from the (shared, remote) durable tier.

The copy is an ordinary committed step (``storage.commit``: manifest written last, the
directory renamed into place) under ``prefetch_root``; each file is CRC-32C'd as it is copied
and checked against the step's manifest, so a torn or changed file is never committed. Only
the newest step is kept. A worker restoring step S written by generation G reads the prefetched
copy when it holds that very (S, G), else the durable tier as before.

When the standby takes a rank (the restart of generation R), its agent checks the copy whole
once more (``verify_for_restart``: memory may have changed since the copy, hours ago) while
the workers start, and records that in ``verified.json``. A rank that finds the record for R
reads the copy without checksums, as a memory restore reads a slot ckptd verified during the
restart; one that does not (it got there first, or the check failed and removed the copy)
checks each file as it reads it, or reads the durable tier.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c

from trainguard.checkpoint import storage
from trainguard.checkpoint.api import MANIFEST

log = logging.getLogger("trainguard.prefetch")
CHUNK = 8 << 20
POLL_S = 0.5  # how often a standby looks for a newer durable step (one directory listing)
VERIFIED = "verified.json"  # in the prefetch root: the restart its copy was checked for


def prefetch_root(shm_dir: str | Path, job: str, node: str) -> Path:
    """Where node ``node`` of job ``job`` keeps its prefetched step."""
    return Path(shm_dir) / f"trainguard-{job}-{node}-prefetch"


def copy_step(src_root: Path, dest_root: Path, step: int) -> int:
    """Copy committed ``step`` of ``src_root`` into ``dest_root`` as a committed step, each
    file checked against the manifest while copied; older copies in ``dest_root`` are then
    removed. Returns the bytes copied. Raises OSError (e.g. the step was pruned meanwhile, or
    memory is full) or ValueError (a file does not match its manifest); nothing is committed
    then."""
    problems, files = storage.verify_for_load(src_root, step)
    if problems:
        raise ValueError(problems[0])
    gen = storage.committed_generation(src_root, step)
    tmp = storage.tmp_dir(dest_root, step, gen)
    for stale in dest_root.glob(".tmp-step_*"):  # this one, or any a killed copier left torn
        shutil.rmtree(stale, ignore_errors=True)
    total = 0
    try:
        src = storage.step_dir(src_root, step)
        for name, want in files.items():
            out = tmp / name
            out.parent.mkdir(parents=True, exist_ok=True)
            crc = 0
            with open(src / name, "rb") as f, open(out, "wb") as g:
                while chunk := f.read(CHUNK):
                    crc = crc32c.crc32c(chunk, crc)
                    g.write(chunk)
                    total += len(chunk)
            if (out.stat().st_size, crc) != (want["size"], want[storage.CHECKSUM]):
                raise ValueError(f"{src / name}: does not match its manifest")
        for extra in sorted(p for p in src.rglob("*") if p.is_file()):  # fingerprints, .done
            rel = extra.relative_to(src)
            if str(rel) not in files and rel.name != MANIFEST:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(extra, tmp / rel)
        storage.commit(tmp, dest_root, step, generation=gen, files=files)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in storage.list_committed(dest_root):
        if old != step:
            shutil.rmtree(storage.step_dir(dest_root, old), ignore_errors=True)
    return total


def verify_for_restart(root: Path, generation: int) -> tuple[int, list[str]] | None:
    """Check the committed step under prefetch ``root`` whole against its manifest (every
    file's CRC-32C) for the restart of ``generation``, and record it (``VERIFIED``, written
    atomically) if it is intact; a copy that is not is removed, so ranks read the durable
    tier. Returns (step, problems), None when there is no copy. Raises nothing: an I/O error
    (memory full while recording, say) is a problem found, and no record is left."""
    record_path = root / VERIFIED
    try:
        record_path.unlink(missing_ok=True)
        steps = storage.list_committed(root)
    except OSError as e:
        log.warning("prefetched copy in %s: %s", root, e)
        return None
    if not steps:
        return None
    step = steps[-1]
    try:
        gen = storage.committed_generation(root, step)
        problems = storage.verify(root, step)
    except (OSError, ValueError) as e:
        gen, problems = -1, [f"{type(e).__name__}: {e}"]
    if problems:
        shutil.rmtree(storage.step_dir(root, step), ignore_errors=True)
        return step, problems
    record = {"step": step, "generation": gen, "for_generation": generation}
    tmp = root / f".{VERIFIED}.tmp"
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, record_path)
    except OSError as e:  # the copy is fine; ranks check it as they read it
        tmp.unlink(missing_ok=True)
        return step, [f"recording the check failed: {type(e).__name__}: {e}"]
    return step, []


def verified(root: Path, step: int, generation: int, for_generation: int) -> bool:
    """Did this node's agent check the copy of (``step``, ``generation``) whole for the
    restart of ``for_generation`` (``verify_for_restart``)?"""
    try:
        record = json.loads((root / VERIFIED).read_text())
    except (OSError, ValueError):
        return False
    return bool(
        record == {"step": step, "generation": generation, "for_generation": for_generation}
    )


def restore(
    state: dict[str, Any],
    root: Path,
    step: int,
    generation: int,
    *,
    rank: int = 0,
    for_generation: int = 0,
    emit: Callable[..., None] = lambda kind, **data: None,
) -> str:
    """Restore durable (``step``, ``generation``) in place from the prefetched copy under
    ``root`` (``copy_step``), as a rank that a standby took over does (the prefetch tier of
    ``Checkpointer.load``; also ``benchmarks/storage.py``). Returns how the copy was checked:
    ``"at the restart"`` when ``verify_for_restart`` checked it whole for ``for_generation``
    (read without checksums, straight into the live tensors) or ``"while read"`` (each
    file's CRC-32C as it is read).

    Raises CheckpointCorruptError (a file missing, short or failing its checksum; the next
    tier's read then overwrites whatever was read) or CheckpointReadError."""
    from trainguard.checkpoint.api import CheckpointCorruptError
    from trainguard.checkpoint.tiers.disk import read_step

    before = verified(root, step, generation, for_generation)
    problems, sums = storage.verify_for_load(root, step)
    if problems:
        raise CheckpointCorruptError(f"prefetched step {step} in {root}: {'; '.join(problems[:4])}")
    read_step(state, rank, root, step, sums, emit=emit, direct=True, checksums=not before)
    return "at the restart" if before else "while read"


class Prefetcher:
    """A thread that, while ``follow``-ing, copies each newer committed step of the durable
    tier into this node's prefetch root; ``pause`` stops copying (the node took a rank: its
    copy stays for the restore); ``close`` stops the thread and removes the copy.

    ``emit(kind, **data)`` receives ``standby_prefetched`` (step, bytes, seconds) and
    ``standby_prefetch_failed`` (step, reason) events."""

    def __init__(self, emit: Callable[..., Any]) -> None:
        self.emit = emit
        self._lock = threading.Lock()
        self._target: tuple[Path, Path] | None = None  # (durable root, prefetch root)
        self._dest: Path | None = None  # the copy's place (kept after a pause)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed: set[int] = set()  # steps that could not be copied (not retried)
        self._checked_for: int | None = None  # the last generation the copy was checked for
        self._check: int | None = None  # a check due, for this generation
        self._last_error: str | None = None

    def follow(self, durable: Path, dest: Path) -> None:
        """Keep ``dest`` holding the newest committed step of ``durable`` (called on every
        reconcile while the node is a standby: cheap when nothing changed)."""
        with self._lock:
            changed = self._target != (durable, dest)
            self._target, self._dest = (durable, dest), dest
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="trainguard-prefetch", daemon=True
                )
                self._thread.start()
        if changed:
            self._wake.set()

    def pause(self, for_generation: int | None = None) -> None:
        """Stop copying (cheap: called on every reconcile). ``for_generation``: the node runs
        ranks of that generation now; its copy is checked for that restart (once per
        generation, on the prefetch thread: ``verify_for_restart``)."""
        with self._lock:
            self._target = None
            if for_generation is None or for_generation == self._checked_for:
                return
            self._checked_for = for_generation
            self._check = for_generation if self._dest is not None else None
        self._wake.set()

    def close(self, *, remove: bool = True) -> None:
        with self._lock:
            self._target = None
            thread, self._thread = self._thread, None
            dest = self._dest
        self._stop.set()
        self._wake.set()
        if thread is not None:
            thread.join(timeout=30.0)
        if remove and dest is not None:
            shutil.rmtree(dest, ignore_errors=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                target, check, dest = self._target, self._check, self._dest
                self._check = None
            try:  # the thread outlives any one failure (the next poll tries again)
                if check is not None and dest is not None:
                    self._verify(dest, check)
                if target is not None:
                    self._once(*target)
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
                if reason != self._last_error:  # said once, not every poll
                    log.exception("prefetch: %s", e)
                    self.emit("standby_prefetch_failed", step=None, reason=reason)
                self._last_error = reason
            self._wake.wait(POLL_S)
            self._wake.clear()

    def _once(self, durable: Path, dest: Path) -> None:
        steps = storage.list_committed(durable)
        if not steps or steps[-1] in self._failed:
            return
        step = steps[-1]
        gen = storage.committed_generation(durable, step)
        if present(str(dest), step, gen) is not None:
            return
        t0 = time.monotonic()
        try:
            dest.mkdir(parents=True, exist_ok=True)
            n = copy_step(durable, dest, step)
        except FileNotFoundError:
            return  # pruned while copied: a newer step is there to copy
        except (OSError, ValueError) as e:
            self._failed.add(step)
            self.emit("standby_prefetch_failed", step=step, reason=f"{type(e).__name__}: {e}")
            return
        took = time.monotonic() - t0
        log.info("prefetched step %d (%.1f MB in %.2fs)", step, n / 1e6, took)
        self.emit("standby_prefetched", step=step, bytes=n, seconds=round(took, 3))

    def _verify(self, dest: Path, generation: int) -> None:
        t0 = time.monotonic()
        found = verify_for_restart(dest, generation)
        if found is None:
            return
        step, problems = found
        took = round(time.monotonic() - t0, 3)
        if problems:
            reason = f"checked for the restart: {problems[0]}"
            self.emit("standby_prefetch_failed", step=step, reason=reason)
        else:
            self.emit("standby_prefetch_verified", step=step, generation=generation, seconds=took)


def present(root: str | None, step: int, generation: int) -> Path | None:
    """The prefetch root if it holds committed ``step`` of ``generation`` (any generation
    when ``generation`` < 0), else None."""
    if not root:
        return None
    path = Path(root)
    if step not in storage.list_committed(path):
        return None
    if generation >= 0 and storage.committed_generation(path, step) != generation:
        return None
    return path if os.access(storage.step_dir(path, step), os.R_OK) else None
