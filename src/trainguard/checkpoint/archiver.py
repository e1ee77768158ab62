"""The controller's side of the cold tier: copy durable steps there in the background, keep
its retention, and restore from it when the hot tier has nothing newer.

The job never waits for the cold tier: the archiver is one thread of the controller that
polls the hot tier's committed steps. A step to upload is first hard-linked into
``<hot>/.archiving-<target>-step_<N>`` (same filesystem, no copy; one directory per target:
the targets' archivers run at once and must not unlink each other's), so hot retention may delete
``step_<N>`` while it uploads. Failures (unreachable endpoint, refused credentials, a full
bucket) are ``archive_failed`` events with the reason and the fix; the step is tried again
after a back-off (doubling from 5 s to 300 s) and training goes on.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainguard.checkpoint import storage
from trainguard.checkpoint.api import MANIFEST
from trainguard.checkpoint.archive import Archive, ArchiveError

Emit = Callable[..., None]  # emit(kind, **data): an event for the job's store
STAGING = ".archiving-"


def _link_tree(src: Path, dest: Path) -> None:
    """Hard-link every file of ``src`` under ``dest``. Raises FileNotFoundError if ``src``
    was deleted meanwhile (``dest`` is removed then)."""
    shutil.rmtree(dest, ignore_errors=True)
    try:
        for path in sorted(src.rglob("*")):
            target = dest / path.relative_to(src)
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(path, target)
        if not (dest / MANIFEST).is_file():
            raise FileNotFoundError(src / MANIFEST)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


class Archiver:
    """Uploads the hot tier's newest committed step when it is at least ``every`` steps after
    the newest archived one (0: every durable step it sees), then deletes archived steps
    beyond the newest ``keep``. ``close`` uploads the final step (bounded) and stops.

    Args:
        archive: the cold tier.
        root: the hot tier's directory.
        every: training steps between archived steps (0 = each durable step).
        keep: archived steps retained (>= 1).
        emit: ``emit(kind, **data)`` for events; called from the archiver's thread.
        poll_s: how often the hot tier is looked at.
    """

    def __init__(
        self,
        archive: Archive,
        root: Path,
        *,
        every: int,
        keep: int,
        emit: Emit,
        poll_s: float = 1.0,
    ) -> None:
        self.archive, self.root, self.every, self.keep = archive, root, every, max(1, keep)
        self.emit, self.poll_s = emit, poll_s
        self.last: int | None = None  # newest archived step (None: not listed yet)
        self._listed = False
        self._retry_at = 0.0
        self._backoff = 5.0
        self._stop = threading.Event()  # aborts an upload in flight
        self._final = threading.Event()  # one last pass, then return
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-archiver", daemon=True)
        tag = hashlib.sha1(archive.url.encode()).hexdigest()[:8]
        self._staging = f"{STAGING}{tag}-step_"  # this target's own staging directories

    def start(self) -> None:
        for old in self.root.glob(f"{self._staging}*"):  # left by a controller killed mid-upload
            shutil.rmtree(old, ignore_errors=True)
        self._thread.start()

    def close(self, timeout_s: float) -> None:
        """Upload the newest committed step if it is not archived yet (within ``timeout_s``;
        past it the upload is abandoned, never half-listed), then stop the thread."""
        self._final.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            self._stop.set()
            self.emit("archive_failed", step=None, url=self.archive.url,
                      reason=f"final upload unfinished after {timeout_s:.0f}s",
                      hint="raise archive_final_timeout_s, or copy with: trainguard ckpt ls")  # fmt: skip
            self._thread.join(timeout=30.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            final = self._final.is_set()
            try:
                self._pass(final)
            except Exception as e:  # never let the thread die silently
                self.emit("archive_failed", step=None, reason=f"{type(e).__name__}: {e}")
            if final:
                return
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def _pass(self, final: bool) -> None:
        if not final and time.monotonic() < self._retry_at:
            return
        try:
            if not self._listed:
                steps = self.archive.list_steps()
                self.last, self._listed = (steps[-1] if steps else None), True
            hot = storage.list_committed(self.root)
            due = [s for s in hot if self.last is None or s > self.last]
            if not due:
                return
            step = due[-1]
            if not final and self.last is not None and step - self.last < self.every:
                return
            self._upload(step)
        except ArchiveError as e:
            self._retry_at = time.monotonic() + self._backoff
            self.emit("archive_failed", step=None, url=self.archive.url, reason=str(e),
                      retry_in_s=self._backoff)  # fmt: skip
            self._backoff = min(300.0, self._backoff * 2)

    def _upload(self, step: int) -> None:
        staging = self.root / f"{self._staging}{step}"
        try:
            _link_tree(storage.step_dir(self.root, step), staging)
        except FileNotFoundError:
            return  # pruned from the hot tier before it could be linked: a newer one follows
        try:
            done = self.archive.upload(staging, step, self._stop)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.last, self._backoff = step, 5.0
        mbps = done["bytes"] / 1e6 / max(done["seconds"], 1e-9)
        self.emit("archive_uploaded", step=step, url=self.archive.url, bytes=done["bytes"],
                  new_bytes=done["new_bytes"], stored_bytes=done["stored_bytes"],
                  mode=done["mode"], files=done["files"], seconds=round(done["seconds"], 3),
                  mb_per_s=round(mbps, 1))  # fmt: skip
        pruned = self.archive.prune(self.keep)
        if pruned:
            self.emit("archive_pruned", steps=pruned, keep=self.keep)


def restore_newest(archives: list[Archive], root: Path, emit: Emit) -> int | None:
    """Before a job starts: when a cold target holds a step newer than every committed step
    of the hot tier (a wiped or new local disk), copy the newest one that verifies into the
    hot tier, from whichever target holds a good copy. A copy that fails (missing chunk, bad
    checksum) is an event and the next target, then the next older step, is tried; an
    unreachable target is an event and the others serve. Returns the step restored, or None."""
    hot = storage.list_committed(root)
    held: dict[int, list[Archive]] = {}
    for a in archives:
        try:
            for s in a.list_steps():
                if not hot or s > hot[-1]:
                    held.setdefault(s, []).append(a)
        except ArchiveError as e:
            emit("archive_failed", step=None, url=a.url, reason=str(e))
    root.mkdir(parents=True, exist_ok=True)
    for step in sorted(held, reverse=True):
        for a in held[step]:
            t0 = time.monotonic()
            emit("archive_restore_started", step=step, url=a.url)
            try:
                path = a.fetch(step, root)
            except (ArchiveError, OSError) as e:  # OSError: the hot tier cannot take it
                emit("checkpoint_corrupt", step=step, tier="archive", url=a.url, problems=[str(e)])
                continue
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            took = time.monotonic() - t0
            emit("archive_restored", step=step, url=a.url, bytes=size, seconds=round(took, 3))
            return step
    return None
