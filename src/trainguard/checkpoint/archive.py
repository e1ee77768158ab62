"""Cold tier: durable steps copied to a storage URL (``s3://bucket/prefix``, ``gs://…``,
``file:///path``) through fsspec and its backends (s3fs for S3).

Layout under the URL: ``step_<N>/<the step's files>``, the same files as the hot tier's
``step_<N>/`` (plain DCP), then ``step_<N>/manifest.json`` uploaded **last**: a step is listed
only once its manifest exists, so a half-uploaded step (a crash, a lost link) is never
listed, never restored. The manifest is the hot tier's (size and CRC-32C of every DCP file)
plus ``archive.files``: size and CRC-32C of every file uploaded, computed from the bytes as
they were sent. Deleting a step removes its manifest first, for the same reason.

Uploads stream each file in ``CHUNK`` pieces (CRC-32C checked against the hot manifest on
the way: a file that changed on disk is not archived), ``concurrency`` files at once, under an
optional bandwidth cap, each retried with jittered exponential back-off. Restores read each
file as ranged reads, ``concurrency`` in flight, checked against the manifest in order as they
arrive, into the hot tier's temp directory, then committed there (``storage.commit``), so every
reader of the hot tier (the controller, ``dcp.load``) sees an ordinary step.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import crc32c

from trainguard.checkpoint import storage
from trainguard.checkpoint.api import MANIFEST, CheckpointError

CHUNK = 16 << 20  # bytes per streamed write, multipart part and ranged read (S3's advice: 8-16 MiB)
NOT_FOUND = (FileNotFoundError,)
RETRIES = 4  # attempts after the first, per file (back-off 0.5 s doubling to 8 s, ±50%)
T = TypeVar("T")


class ArchiveError(CheckpointError):
    """The cold tier cannot be used (unreachable, refused, corrupt step). The message is
    one line naming the URL, the problem and the fix."""


def check_archive_url(url: str) -> None:
    """Raise ValueError naming the fix when ``url`` has no fsspec backend here (an unknown
    scheme, or s3fs/gcsfs not installed). Imports the backend; reaches nothing."""
    import fsspec
    from fsspec.core import split_protocol

    proto = split_protocol(url)[0] or "file"
    try:
        fsspec.get_filesystem_class(proto)
    except ValueError:
        raise ValueError(
            f"archive_url = {url!r}: unknown storage scheme {proto!r}; use s3://bucket/prefix, "
            "gs://bucket/prefix or file:///path"
        ) from None
    except ImportError as e:
        raise ValueError(
            f"archive_url = {url!r}: the {proto} backend is not installed ({e}); "
            "pip install 'trainguard[s3]' (s3fs) or gcsfs"
        ) from None


_REFUSED = ("accessdenied", "forbidden", "signature", "invalidaccesskey", "credential")
_NO_BUCKET = ("nosuchbucket", "no such bucket", "bucket does not exist")


def _describe(url: str, e: BaseException) -> str:
    """One line: the URL, the error, and the fix."""
    text = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    low = text.lower()
    if any(w in low for w in _REFUSED):
        fix = "check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
    elif any(w in low for w in _NO_BUCKET):
        fix = "create the bucket or check archive_url"
    elif any(w in low for w in ("connect", "timeout", "timed out", "unreachable", "refused")):
        fix = "check archive_url / archive_endpoint_url and the network"
    elif "no space" in low:
        fix = "free space where the step is written"
    else:
        fix = "check archive_url"
    return f"archive {url}: {text}; {fix}"


def _retry(
    fn: Callable[[], T],
    url: str,
    stop: threading.Event | None = None,
    passthrough: tuple[type[BaseException], ...] = (),
) -> T:
    """``fn()``, retried ``RETRIES`` times with jittered exponential back-off (not for refused
    credentials or a missing bucket: those do not heal); the last error is raised as
    ArchiveError naming the fix. ``passthrough`` errors are raised at once, as they are."""
    delay = 0.5
    for attempt in range(RETRIES + 1):
        try:
            return fn()
        except ArchiveError:
            raise
        except passthrough:
            raise
        except Exception as e:  # every backend has its own errors: the message says which
            low = str(e).lower()
            lasting = any(w in low for w in _REFUSED + _NO_BUCKET)
            if lasting or attempt == RETRIES or (stop is not None and stop.is_set()):
                raise ArchiveError(_describe(url, e)) from e
        time.sleep(delay * random.uniform(0.5, 1.5))
        delay = min(8.0, delay * 2)
    raise AssertionError("unreachable")


class _Throttle:
    """A token bucket over bytes sent by every upload thread (``mbps`` MB/s; 0 = none)."""

    def __init__(self, mbps: float) -> None:
        self.rate = mbps * 1e6
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
        if start > now:
            time.sleep(start - now)


class Archive:
    """One cold tier at ``url``.

    Args:
        url: ``s3://bucket/prefix``, ``file:///abs/path`` or any fsspec URL (a plain path is
            a local directory).
        endpoint_url: S3 endpoint (e.g. a MinIO or moto server); default from the
            environment (``AWS_ENDPOINT_URL``) or AWS.
        concurrency: files uploaded at once, and ranged reads in flight on restore.
        mbps: upload bandwidth cap in MB/s (0 = none).

    Raises ArchiveError when the URL's backend is not installed (naming the package).
    """

    def __init__(
        self, url: str, *, endpoint_url: str | None = None, concurrency: int = 8, mbps: float = 0.0
    ) -> None:
        import fsspec

        self.url = url.rstrip("/")
        opts: dict[str, Any] = {}
        self._put_opts: dict[str, Any] = {}
        if self.url.startswith(("s3://", "s3a://")):
            self._put_opts = {"chunksize": CHUNK, "max_concurrency": max(1, concurrency)}
            opts = {
                "config_kwargs": {
                    "connect_timeout": 5,
                    "read_timeout": 60,
                    "retries": {"max_attempts": 2},
                },
                "skip_instance_cache": True,
            }
            endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                opts["client_kwargs"] = {"endpoint_url": endpoint}
        try:
            self.fs, self.base = fsspec.core.url_to_fs(self.url, **opts)
        except ImportError as e:
            raise ArchiveError(
                f"archive {url}: its backend is not installed ({e}); pip install s3fs (S3) or gcsfs (GCS)"
            ) from None
        self.base = self.base.rstrip("/")
        self.concurrency = max(1, concurrency)
        self._throttle = _Throttle(mbps)

    def _path(self, step: int, name: str = "") -> str:
        return f"{self.base}/step_{step}" + (f"/{name}" if name else "")

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
        for entry in _retry(ls, self.url):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("step_") and name[5:].isdigit():
                steps.append(int(name[5:]))
        return sorted(
            s
            for s in steps
            if _retry(lambda s=s: self.fs.exists(self._path(s, MANIFEST)), self.url)
        )

    def manifest(self, step: int) -> dict[str, Any]:
        """The step's manifest. Raises ArchiveError when it is missing or unreadable."""
        try:
            path = self._path(step, MANIFEST)
            raw = _retry(lambda: self.fs.cat_file(path), self.url, passthrough=NOT_FOUND)
            m = json.loads(raw)
            assert isinstance(m.get("archive", {}).get("files"), dict)
            return m
        except (FileNotFoundError, ValueError, AssertionError) as e:
            raise ArchiveError(
                f"archive {self.url}: step {step} has no readable manifest ({type(e).__name__}); "
                "it is not a complete archived step"
            ) from None

    # ------------------------------------------------------------------ upload
    def upload(self, src: Path, step: int, stop: threading.Event | None = None) -> dict[str, Any]:
        """Copy the committed step in ``src`` (a ``step_<N>`` directory or a hard-linked copy
        of one) to the archive; the manifest goes last. Returns ``{"bytes", "files",
        "seconds"}``. Raises ArchiveError (the partial upload is removed) or
        FileNotFoundError (``src`` vanished)."""
        t0 = time.monotonic()
        manifest = json.loads((src / MANIFEST).read_text())
        want = manifest["files"]
        names = sorted(
            str(p.relative_to(src)) for p in src.rglob("*") if p.is_file() and p.name != MANIFEST
        )
        sums: dict[str, dict[str, int]] = {}
        try:
            with cf.ThreadPoolExecutor(
                self.concurrency, thread_name_prefix="tg-archive-up"
            ) as pool:
                futs = {
                    n: pool.submit(self._put, src / n, self._path(step, n), want.get(n), stop)
                    for n in names
                }
                for n, f in futs.items():
                    sums[n] = f.result()
            missing = [
                n
                for n in names
                if _retry(lambda n=n: self.fs.size(self._path(step, n)), self.url)
                != sums[n]["size"]
            ]
            if missing:
                raise ArchiveError(
                    f"archive {self.url}: step {step}: size differs after upload: {missing[:3]}"
                )
            body = json.dumps(
                {**manifest, "archive": {"files": sums, "time": time.time()}}
            ).encode()
            _retry(lambda: self.fs.pipe_file(self._path(step, MANIFEST), body), self.url, stop)
        except BaseException:
            self.delete(step, quiet=True)
            raise
        return {
            "bytes": sum(s["size"] for s in sums.values()),
            "files": len(sums),
            "seconds": time.monotonic() - t0,
        }

    def _put(
        self, local: Path, remote: str, want: dict[str, Any] | None, stop: threading.Event | None
    ) -> dict[str, int]:
        """Upload one file; (size, CRC-32C) of what was sent, checked against ``want``."""

        def check(size: int, crc: int) -> dict[str, int]:
            if want is not None and (size, crc) != (want["size"], want[storage.CHECKSUM]):
                raise ArchiveError(
                    f"{local}: differs from its manifest (size or CRC-32C): not archived"
                )
            return {"size": size, storage.CHECKSUM: crc}

        if self._throttle.rate <= 0:  # the backend's own transfer (S3: parallel multipart)
            sent = check(local.stat().st_size, storage.file_digest(local))  # committed: immutable
            _retry(lambda: self.fs.put_file(str(local), remote, **self._put_opts), self.url, stop)
            return sent

        def once() -> dict[str, int]:  # streamed under the bandwidth cap, CRC'd on the way
            crc, size = 0, 0
            with open(local, "rb") as f, self.fs.open(remote, "wb") as out:
                while chunk := f.read(CHUNK):
                    if stop is not None and stop.is_set():
                        raise ArchiveError(f"archive {self.url}: upload stopped")
                    self._throttle.take(len(chunk))
                    crc = crc32c.crc32c(chunk, crc)
                    size += len(chunk)
                    out.write(chunk)
            return check(size, crc)

        return _retry(once, self.url, stop)

    # ------------------------------------------------------------------ verify, restore
    def verify(self, step: int) -> list[str]:
        """Read every file of an archived step and check size and CRC-32C against its
        manifest. Returns the problems ([] = ok); ArchiveError if the tier is unreachable."""
        problems: list[str] = []
        try:
            files = self.manifest(step)["archive"]["files"]
        except ArchiveError as e:
            return [str(e)]
        for name, want in files.items():
            try:
                size, crc = self._read(self._path(step, name), want["size"], None)
            except FileNotFoundError:
                problems.append(f"{self._path(step, name)}: missing")
                continue
            if (size, crc) != (want["size"], want[storage.CHECKSUM]):
                problems.append(f"{self._path(step, name)}: size or checksum mismatch")
        return problems

    def _read(self, remote: str, size: int, fd: int | None) -> tuple[int, int]:
        """Ranged reads of ``remote`` (``concurrency`` in flight), CRC-32C'd in order as they
        arrive, written to ``fd`` at their offsets if given. Returns (bytes, crc); a remote
        file whose size is not ``size`` returns its size unread. Raises FileNotFoundError."""
        actual = int(_retry(lambda: self.fs.size(remote), self.url, passthrough=NOT_FOUND))
        if actual != size:
            return actual, -1

        def get(off: int) -> bytes:
            end = min(off + CHUNK, size)
            data = _retry(lambda: self.fs.cat_file(remote, start=off, end=end), self.url)
            return bytes(data)

        crc, got = 0, 0
        offsets = iter(range(0, size, CHUNK))
        with cf.ThreadPoolExecutor(self.concurrency, thread_name_prefix="tg-archive-get") as pool:
            window: deque[tuple[int, cf.Future[bytes]]] = deque()
            for off in offsets:
                window.append((off, pool.submit(get, off)))
                if len(window) >= self.concurrency:
                    break
            while window:
                off, fut = window.popleft()
                data = fut.result()
                crc = crc32c.crc32c(data, crc)
                got += len(data)
                if fd is not None:
                    os.pwrite(fd, data, off)
                nxt = next(offsets, None)
                if nxt is not None:
                    window.append((nxt, pool.submit(get, nxt)))
        return got, crc

    def fetch(self, step: int, root: Path) -> Path:
        """Restore archived ``step`` into the hot tier ``root`` (verified while reading, then
        committed there as an ordinary step). Returns the step's directory. Raises
        ArchiveError (nothing is committed; the temp directory is removed)."""
        m = self.manifest(step)
        tmp = root / f".tmp-step_{step}-gen{int(m.get('generation', 0))}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for name, want in m["archive"]["files"].items():
                dest = tmp / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    size, crc = self._read(self._path(step, name), int(want["size"]), fd)
                    os.fsync(fd)
                except FileNotFoundError:
                    raise ArchiveError(
                        f"archive {self.url}: step {step}: {name} is missing; restore an older step"
                    ) from None
                finally:
                    os.close(fd)
                if (size, crc) != (want["size"], want[storage.CHECKSUM]):
                    raise ArchiveError(
                        f"archive {self.url}: step {step}: {name} fails its checksum; restore an older step"
                    )
            return storage.commit(
                tmp, root, step, generation=int(m.get("generation", 0)), files=m["files"]
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # ------------------------------------------------------------------ retention
    def delete(self, step: int, *, quiet: bool = False) -> None:
        """Remove an archived step, its manifest first (never a listed partial step)."""
        try:
            if self.fs.exists(self._path(step, MANIFEST)):
                self.fs.rm_file(self._path(step, MANIFEST))
            if self.fs.exists(self._path(step)):
                self.fs.rm(self._path(step), recursive=True)
        except Exception as e:
            if not quiet:
                raise ArchiveError(_describe(self.url, e)) from e

    def prune(self, keep: int) -> list[int]:
        """Delete archived steps beyond the newest ``keep`` (>= 1). Returns those deleted."""
        steps = self.list_steps()
        doomed = steps[: -max(1, keep)] if len(steps) > max(1, keep) else []
        for step in doomed:
            self.delete(step)
        return doomed
