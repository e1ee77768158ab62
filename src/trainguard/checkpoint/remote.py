"""Talking to a storage URL: errors that name the fix, retries with jittered back-off, a
bandwidth cap. Used by the cold tier (``archive.py``)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from trainguard.checkpoint.api import CheckpointError

RETRIES = 4  # attempts after the first (back-off 0.5 s doubling to 8 s, ±50%)
NOT_FOUND = (FileNotFoundError,)
T = TypeVar("T")


class ArchiveError(CheckpointError):
    """The cold tier cannot be used (unreachable, refused, corrupt step). The message is
    one line naming the URL, the problem and the fix."""


# fsspec schemes that can hold an archive (read-only or archive-file schemes cannot)
WRITABLE = frozenset({"file", "local", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hdfs",
                      "webhdfs", "oss", "memory"})  # fmt: skip


def check_archive_url(url: str) -> None:
    """Raise ValueError naming the fix when ``url`` cannot hold an archive: an unknown or
    read-only scheme, no bucket or path after it, or a backend (s3fs, gcsfs) not installed.
    Imports the backend; reaches nothing."""
    import fsspec
    from fsspec.core import split_protocol
    from fsspec.registry import known_implementations

    proto, rest = split_protocol(url)
    proto = proto or "file"
    if proto in known_implementations and proto not in WRITABLE:
        raise ValueError(
            f"archive_url = {url!r}: scheme {proto!r} cannot hold an archive; use "
            "s3://bucket/prefix, gs://bucket/prefix or file:///path"
        )
    if not rest.strip("/"):
        where = "a bucket (s3://bucket/prefix)" if proto != "file" else "a path (file:///path)"
        raise ValueError(f"archive_url = {url!r}: give {where} after the scheme")
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


def describe(url: str, e: BaseException) -> str:
    """One line: the URL, the error, and the fix."""
    text = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    low = text.lower()
    if any(w in low for w in _REFUSED):
        fix = "check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
    elif any(w in low for w in _NO_BUCKET):
        fix = "create the bucket or check archive_url"
    elif any(w in low for w in ("connect", "timeout", "timed out", "unreachable", "refused")):
        fix = "check archive_url / archive_endpoint_url and the network"
    elif "no space" in low or "quota" in low:
        fix = "free space at the archive (or lower archive_keep)"
    elif "permission" in low or "read-only" in low:
        fix = "make the archive's location writable for this user"
    else:
        fix = "check archive_url"
    return f"archive {url}: {text}; {fix}"


def retry(
    fn: Callable[[], T],
    url: str,
    stop: threading.Event | None = None,
    passthrough: tuple[type[BaseException], ...] = (),
    retries: int = RETRIES,
) -> T:
    """``fn()``, retried ``retries`` times with jittered exponential back-off (not for refused
    credentials or a missing bucket: those do not heal); the last error is raised as
    ArchiveError naming the fix. ``passthrough`` errors are raised at once, as they are."""
    delay = 0.5
    for attempt in range(retries + 1):
        try:
            return fn()
        except ArchiveError:
            raise
        except passthrough:
            raise
        except Exception as e:  # every backend has its own errors: the message says which
            low = str(e).lower()
            lasting = any(w in low for w in _REFUSED + _NO_BUCKET)
            if lasting or attempt == retries or (stop is not None and stop.is_set()):
                raise ArchiveError(describe(url, e)) from e
        time.sleep(delay * random.uniform(0.5, 1.5))
        delay = min(8.0, delay * 2)
    raise AssertionError("unreachable")


class Throttle:
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
