"""Cold tier: durable steps kept at a storage URL (``s3://bucket/prefix``, ``gs://…``,
``file:///path``) through fsspec and its backends (s3fs for S3), incrementally.

Layout under the URL:

- ``chunks/<ab>/<address>``: content-addressed chunks. Each file of a step is cut into
  ``CHUNK``-byte pieces; a piece's address is the xxh3-128 of its bytes (``codec.address``)
  and it is stored once, raw or compressed (``codec``), whichever step first had it.
- ``step_<N>/manifest.json``: the hot tier's manifest (size and CRC-32C of every DCP file)
  plus ``archive.files``: for every file of the step, its size, CRC-32C and chunk addresses.
  It is uploaded **last**: a step is listed only once its manifest exists, so a
  half-uploaded step (a crash, a lost link) is never listed, never restored.

A step uploads only the chunks that the tier does not hold yet (a frozen backbone, LoRA, an
embedding table with sparse updates: most chunks repeat). Retention deletes manifests first,
then every chunk no remaining manifest references (mark and sweep), so each kept step stays
restorable on its own whatever was deleted before it. ``fetch`` rebuilds a plain DCP
directory: chunks read ``concurrency`` at once, each checked against its address, each file
against its CRC-32C in order, then committed into the hot tier (``storage.commit``), where the
restore and plain ``dcp.load`` read it; ``trainguard ckpt export`` goes through it too.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import crc32c

from trainguard.checkpoint import codec, storage
from trainguard.checkpoint.api import MANIFEST
from trainguard.checkpoint.remote import (
    NOT_FOUND,
    RETRIES,
    ArchiveError,
    Throttle,
    check_archive_url,
    describe,
    retry,
)
from trainguard.checkpoint.runid import RunIdentity

__all__ = ["CHUNK", "Archive", "ArchiveError", "check_archive_url"]
# Bytes a chunk: S3's advice for ranged requests is 8-16 MiB; the smaller end keeps what an
# incremental step re-uploads around a changed tensor small (at most a chunk on each side).
CHUNK = 8 << 20
T = TypeVar("T")
SAMPLE_CHUNKS = 2  # chunks of each step that the compression chooser measures


class Archive:
    """One cold tier at ``url``.

    Args:
        url: ``s3://bucket/prefix``, ``file:///abs/path`` or any fsspec URL (a plain path is
            a local directory).
        endpoint_url: S3 endpoint (MinIO, moto); default ``AWS_ENDPOINT_URL``, else AWS.
        concurrency: chunks uploaded, and read on restore, at once.
        mbps: upload bandwidth cap in MB/s of stored bytes (0 = none).
        compress: "auto" (when measured to pay against the link: ``codec.Chooser``), "off",
            or a mode ("zstd", "zstd+shuf4", "zstd+shuf2").
        retries: attempts after the first of each request (``remote.retry``).

    Raises ValueError naming the fix when the URL's backend is unknown or not installed.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        concurrency: int = 8,
        mbps: float = 0.0,
        compress: str = "auto",
        retries: int = RETRIES,
    ) -> None:
        import fsspec

        check_archive_url(url)
        self.url = url.rstrip("/")
        opts: dict[str, Any] = {}
        if self.url.startswith(("s3://", "s3a://")):
            opts = {
                "config_kwargs": {
                    "connect_timeout": 5,
                    "read_timeout": 60,
                    "retries": {"max_attempts": 2},
                    "max_pool_connections": max(10, 2 * concurrency),
                },
                "skip_instance_cache": True,
            }
            endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                opts["client_kwargs"] = {"endpoint_url": endpoint}
        if "://" not in self.url or self.url.startswith(("file://", "local://")):
            opts = {"auto_mkdir": True}  # a local directory: chunks/<ab>/ made as needed
        self.fs, base = fsspec.core.url_to_fs(self.url, **opts)
        self.base = base.rstrip("/")
        self.concurrency = max(1, concurrency)
        self.retries = retries
        self._throttle = Throttle(mbps)
        if compress not in ("auto", "off", *codec.Chooser.NAMES):
            raise ValueError(f"archive_compress = {compress!r}: use auto, off, zstd, zstd+shuf4 or zstd+shuf2")  # fmt: skip
        self.chooser = codec.Chooser(policy=compress, threads=self.concurrency)
        self._known: set[str] | None = None  # addresses the tier holds (from its manifests)

    def _retry(self, fn: Callable[[], T], *args: Any, **kw: Any) -> T:
        return retry(fn, *args, retries=self.retries, **kw)

    def _path(self, step: int, name: str = "") -> str:
        return f"{self.base}/step_{step}" + (f"/{name}" if name else "")

    def chunk_path(self, addr: str) -> str:
        """Where the chunk with content address ``addr`` is stored."""
        return f"{self.base}/chunks/{addr[:2]}/{addr}"

    # ------------------------------------------------------------------ listing
    def list_steps(self) -> list[int]:
        """Steps whose manifest exists (complete uploads), ascending. Raises ArchiveError."""

        def ls() -> list[str]:
            try:
                return list(self.fs.ls(self.base, detail=False, refresh=True))
            except FileNotFoundError:
                bucket = self.base.split("/", 1)[0]
                if self.url.startswith(("s3://", "s3a://", "gs://")) and not self.fs.exists(bucket):
                    raise FileNotFoundError(f"the bucket does not exist: {bucket}") from None
                return []  # nothing archived yet

        steps = []
        for entry in self._retry(ls, self.url):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("step_") and name[5:].isdigit():
                steps.append(int(name[5:]))
        return sorted(
            s
            for s in steps
            if self._retry(lambda s=s: self.fs.exists(self._path(s, MANIFEST)), self.url)
        )

    def manifest(self, step: int) -> dict[str, Any]:
        """The step's manifest. Raises ArchiveError when it is missing or unreadable."""
        try:
            path = self._path(step, MANIFEST)
            m = json.loads(
                self._retry(lambda: self.fs.cat_file(path), self.url, passthrough=NOT_FOUND)
            )
            _check_manifest(m)
            return m
        except (FileNotFoundError, ValueError, TypeError, AttributeError, KeyError) as e:
            raise ArchiveError(
                f"archive {self.url}: step {step} has no valid manifest ({type(e).__name__}: "
                f"{e}); it is not a complete archived step"
            ) from None

    def _referenced(self, steps: list[int]) -> set[str]:
        out: set[str] = set()
        for step in steps:
            for f in self.manifest(step)["archive"]["files"].values():
                out.update(f["chunks"])
        return out

    # ------------------------------------------------------------------ upload
    def upload(self, src: Path, step: int, stop: threading.Event | None = None) -> dict[str, Any]:
        """Archive the committed step in ``src`` (a ``step_<N>`` directory or a hard-linked
        copy): chunks the tier lacks, then the manifest. Returns ``{"bytes"`` (the step's),
        ``"new_bytes"`` (raw bytes of chunks uploaded), ``"stored_bytes"`` (their stored
        size), ``"files", "chunks", "new_chunks", "mode", "seconds"}``. Raises ArchiveError
        (the manifest is not written; orphan chunks go at the next prune) or
        FileNotFoundError (``src`` vanished)."""
        t0 = time.monotonic()
        manifest = json.loads((src / MANIFEST).read_text())
        want = manifest["files"]
        if self._known is None:
            self._known = self._referenced(self.list_steps())
        names = sorted(
            str(p.relative_to(src)) for p in src.rglob("*") if p.is_file() and p.name != MANIFEST
        )
        files: dict[str, dict[str, Any]] = {}
        stats = {"new_bytes": 0, "stored_bytes": 0, "new_chunks": 0, "chunks": 0, "put_s": 0.0}
        mode = self.chooser.choose()  # from the previous step's measurements
        self.chooser.sample = {}  # this step's own, for the next
        lock = threading.Lock()

        def put(addr: str, raw: bytes) -> None:
            stored = codec.encode(raw, mode)
            self._throttle.take(len(stored))
            t = time.monotonic()
            self._retry(lambda: self.fs.pipe_file(self.chunk_path(addr), stored), self.url, stop)
            with lock:
                stats["put_s"] += time.monotonic() - t
                stats["stored_bytes"] += len(stored)

        try:
            self._put_files(src, names, want, files, stats, put, stop, step)
        except BaseException:
            self._known = None  # some chunks may be missing: list the tier again next time
            raise
        if stats["stored_bytes"]:
            busy = stats["put_s"] / min(self.concurrency, max(1, stats["new_chunks"]))
            self.chooser.link_bps = stats["stored_bytes"] / max(busy, 1e-6)
        body = {**manifest, "archive": {"files": files, "chunk_bytes": CHUNK, "time": time.time(),
                                         "mode": mode.name.lower()}}  # fmt: skip
        data = json.dumps(body).encode()
        self._retry(lambda: self.fs.pipe_file(self._path(step, MANIFEST), data), self.url, stop)
        return {
            "bytes": sum(f["size"] for f in files.values()),
            "files": len(files),
            "mode": mode.name.lower(),
            "seconds": time.monotonic() - t0,
            **{k: v for k, v in stats.items() if k != "put_s"},
        }

    def _put_files(
        self,
        src: Path,
        names: list[str],
        want: dict[str, Any],
        files: dict[str, dict[str, Any]],
        stats: dict[str, Any],
        put: Any,
        stop: threading.Event | None,
        step: int,
    ) -> None:
        """Chunk, address and CRC each file in one read; upload the chunks the tier lacks."""
        assert self._known is not None
        with cf.ThreadPoolExecutor(self.concurrency, thread_name_prefix="tg-archive") as pool:
            inflight: deque[cf.Future[None]] = deque()
            for name in names:
                size, crc, addrs = 0, 0, []
                for raw in _chunks(src / name):
                    if stop is not None and stop.is_set():
                        raise ArchiveError(f"archive {self.url}: upload of step {step} stopped")
                    addr = codec.address(raw)
                    crc, size = crc32c.crc32c(raw, crc), size + len(raw)
                    addrs.append(addr)
                    stats["chunks"] += 1
                    if addr in self._known:
                        continue
                    self._known.add(addr)
                    stats["new_bytes"] += len(raw)
                    stats["new_chunks"] += 1
                    if self.chooser.policy == "auto" and not self.chooser.sample:
                        self.chooser.measure([raw[: codec.CHUNK_SAMPLE]])
                    inflight.append(pool.submit(put, addr, raw))
                    while len(inflight) >= 2 * self.concurrency:  # bounded memory
                        inflight.popleft().result()
                w = want.get(name)
                if w is not None and (size, crc) != (w["size"], w[storage.CHECKSUM]):
                    raise ArchiveError(f"{src / name}: differs from its manifest: not archived")
                files[name] = {"size": size, storage.CHECKSUM: crc, "chunks": addrs}
            while inflight:
                inflight.popleft().result()

    # ------------------------------------------------------------------ verify, restore
    def _read_file(self, name: str, entry: dict[str, Any], fd: int | None) -> None:
        """Read a file's chunks (``concurrency`` at once), check each against its address and
        the whole against its size and CRC-32C, in order; write it to ``fd`` if given.
        Raises ArchiveError naming what failed."""

        def get(addr: str) -> bytes:
            try:
                stored = self._retry(
                    lambda: self.fs.cat_file(self.chunk_path(addr)), self.url, passthrough=NOT_FOUND
                )
            except FileNotFoundError:
                raise ArchiveError(f"archive {self.url}: {name}: chunk {addr} is missing") from None
            try:
                raw = codec.decode(bytes(stored))
            except ValueError as e:
                raise ArchiveError(
                    f"archive {self.url}: {name}: chunk {addr} fails its checksum ({e})"
                ) from None
            if codec.address(raw) != addr:
                raise ArchiveError(f"archive {self.url}: {name}: chunk {addr} fails its checksum")
            return raw

        crc, off = 0, 0
        with cf.ThreadPoolExecutor(self.concurrency, thread_name_prefix="tg-archive-get") as pool:
            addrs = iter(entry["chunks"])
            window = deque(
                pool.submit(get, a) for _, a in zip(range(self.concurrency), addrs, strict=False)
            )
            while window:
                raw = window.popleft().result()
                crc = crc32c.crc32c(raw, crc)
                if fd is not None:
                    os.pwrite(fd, raw, off)
                off += len(raw)
                nxt = next(addrs, None)
                if nxt is not None:
                    window.append(pool.submit(get, nxt))
        if (off, crc) != (entry["size"], entry[storage.CHECKSUM]):
            raise ArchiveError(f"archive {self.url}: {name} fails its size or CRC-32C")

    def verify(self, step: int) -> list[str]:
        """Read every chunk of an archived step back and check it. Returns the problems
        ([] = ok)."""
        try:
            files = self.manifest(step)["archive"]["files"]
            problems = []
            for name, entry in files.items():
                try:
                    self._read_file(f"step_{step}/{name}", entry, None)
                except ArchiveError as e:
                    problems.append(str(e))
            return problems
        except ArchiveError as e:
            return [str(e)]

    def fetch(self, step: int, root: Path) -> Path:
        """Rebuild archived ``step`` as a plain DCP directory in the hot tier ``root``
        (verified while reading, then committed). Returns its directory. Raises ArchiveError
        (nothing is committed; the temp directory is removed)."""
        m = self.manifest(step)
        tmp = root / f".tmp-step_{step}-gen{int(m.get('generation', 0))}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for name, entry in m["archive"]["files"].items():
                dest = tmp / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    self._read_file(f"step_{step}/{name}", entry, fd)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            gen = int(m.get("generation", 0))
            run = RunIdentity.from_json(m)  # the run that wrote it, as its manifest says
            return storage.commit(tmp, root, step, generation=gen, files=m["files"], run=run)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # ------------------------------------------------------------------ retention
    def delete(self, step: int) -> None:
        """Remove a step's manifest (it is no longer listed); its chunks go at ``sweep``."""
        try:
            for path in (self._path(step, MANIFEST), self._path(step)):
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=True)
        except Exception as e:
            raise ArchiveError(describe(self.url, e)) from e

    def prune(self, keep: int) -> list[int]:
        """Delete archived steps beyond the newest ``keep`` (>= 1), then every chunk that no
        kept step references. Returns the steps deleted."""
        steps = self.list_steps()
        doomed = steps[: -max(1, keep)] if len(steps) > max(1, keep) else []
        for step in doomed:
            self.delete(step)
        if doomed:
            self.sweep()
        return doomed

    def sweep(self) -> int:
        """Delete chunks no listed step references (left by deleted steps and killed
        uploads). Returns how many. Call it only while nothing uploads to this tier."""
        live = self._referenced(self.list_steps())
        try:
            stored = self._retry(lambda: self.fs.find(f"{self.base}/chunks"), self.url)
        except ArchiveError:
            return 0
        dead = [p for p in stored if p.rsplit("/", 1)[-1] not in live]
        if dead:
            self._retry(lambda: self.fs.rm(dead), self.url)
        self._known = live
        return len(dead)


def _check_manifest(m: Any) -> None:
    """Raise ValueError unless ``m`` is a manifest this module wrote: an integer generation,
    the hot manifest's files, and per archived file a size, a CRC-32C and chunk addresses,
    under a relative name that stays inside the step (never ``..``, never absolute)."""
    if not isinstance(m, dict) or not isinstance(m.get("generation", 0), int):
        raise ValueError("not a manifest object with an integer generation")
    files = m.get("files")
    archived = m.get("archive", {}).get("files") if isinstance(m.get("archive"), dict) else None
    if not isinstance(files, dict) or not isinstance(archived, dict) or not archived:
        raise ValueError("no files listed")
    for name, e in archived.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts:
            raise ValueError(f"file name {name!r} leaves the step")
        ok = (
            isinstance(e, dict)
            and isinstance(e.get("size"), int)
            and isinstance(e.get(storage.CHECKSUM), int)
            and isinstance(e.get("chunks"), list)
            and all(isinstance(a, str) and len(a) == 32 and a.isalnum() for a in e["chunks"])
        )
        if not ok:
            raise ValueError(f"entry of {name!r} is not size, crc32c and chunk addresses")


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk
