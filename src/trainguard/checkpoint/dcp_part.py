"""A rank's durable part in DCP's format, and the commit of a step: the parts of ``persister.py``
that need torch. ckptd imports this module before it listens (``ckptd.main``: ~2.5 s of CPU,
most of a ckptd's start), so that a first durable part never waits on the import while the
snapshots queued behind it wait to be indexed; ``persister.py`` itself imports no torch.

``write_part`` writes one rank's part with ``torch.distributed.checkpoint`` (single process);
``merge_and_commit`` merges the parts' metadata into one ``.metadata`` and commits the step
(``storage.commit``). Formats and ordering: ``persister.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem

from trainguard.checkpoint import storage
from trainguard.checkpoint.api import DCP_METADATA
from trainguard.checkpoint.persister import DONE
from trainguard.checkpoint.runid import RunIdentity
from trainguard.checkpoint.state import unpack_objects

__all__ = ["WRITE_ERRORS", "CheckpointException", "Opaque", "merge_and_commit", "unpack_objects",
           "write_part"]  # fmt: skip

# DCP wraps a rank's write error in CheckpointException, a BaseException subclass.
WRITE_ERRORS = (OSError, RuntimeError, CheckpointException)


class _CrcWriter(io.RawIOBase):
    """A file opened for writing that keeps the CRC-32C and size of what went through it."""

    def __init__(self, f: Any) -> None:
        super().__init__()
        self.f, self.crc, self.size = f, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.crc = crc32c.crc32c(b, self.crc)
        n = self.f.write(b)
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return int(self.f.fileno())


class _ChecksummingFileSystem(FileSystem):
    """DCP's local filesystem, checksumming every file as DCP writes it (sequentially)."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, dict[str, object]] = {}  # path → {"size", "crc32c"}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, mode) as f:
            w = _CrcWriter(f)
            yield w
            w.flush()
        self.sums[str(path)] = {"size": w.size, storage.CHECKSUM: w.crc}

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        if str(path) in self.sums:
            self.sums[str(new_path)] = self.sums.pop(str(path))


class Opaque:
    """A non-tensor value as the ``torch.save`` bytes the worker made of it (state.py)."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw


class _OpaquePlanner(DefaultSavePlanner):
    """DCP's planner, writing an ``Opaque`` value's bytes as they are: the same bytes DCP
    writes for the value itself (``torch.save``), without unpickling it here."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002
        if isinstance(object, Opaque):
            return io.BytesIO(object.raw)
        return super().transform_object(write_item, object)


_CRC32_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_zip_crc32() -> Iterator[None]:
    """``torch.save``'s per-record zlib CRC-32 off while DCP writes a part: the part's files
    are checksummed as they are written (CRC-32C, ``_CrcWriter``, hardware-accelerated), so
    the zip's own software CRC is a second pass over every byte for nothing (measured: a
    part wrote 1.5-1.7x faster without it). ``torch.load`` (and so ``dcp.load``) reads such
    files (torch.serialization.set_crc32_options). The option is process-wide: writers in
    this process hold the lock, and the previous setting is restored."""
    with _CRC32_LOCK:
        before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(before)


def write_part(
    part: Path,
    tensors: dict[str, Any],
    objects: dict[str, Any],
    mappings: dict[str, list[Any]],
    shards: dict[str, dict[str, Any]] | None = None,
    written_by: dict[str, object] | None = None,
) -> dict[str, dict[str, object]]:
    """One rank's state as a single-process DCP checkpoint in ``part``; returns its file sums
    (size and CRC-32C, computed as the files are written). ``mappings``: DCP flatten mappings
    (key → nested path), kept for the merged metadata; ``shards``: entry key → ShardRecord
    JSON of the entries that are chunks of a global tensor (merged by ``merge_and_commit``).
    ``objects`` may hold ``Opaque`` values (written as their bytes). ``written_by``: who wrote the
    part (run identity, generation, step, rank), recorded in its ``.done``.

    Raises OSError (e.g. ENOSPC) or RuntimeError from DCP on a failed write; ``part`` is
    removed then.
    """
    if part.exists():
        shutil.rmtree(part)
    part.mkdir(parents=True)
    try:
        writer = dcp.FileSystemWriter(str(part), single_file_per_rank=True, sync_files=True)
        fs = _ChecksummingFileSystem()
        writer.fs = fs
        with warnings.catch_warnings(), _no_zip_crc32():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(
                {**tensors, **objects},
                storage_writer=writer,
                planner=_OpaquePlanner(),
                no_dist=True,
            )
        on_disk = {str(p) for p in part.rglob("*") if p.is_file()}
        if set(fs.sums) != on_disk:  # DCP wrote a file some other way: checksum it from disk
            sums = storage.file_sums(part, prefix=f"{part.name}/")
        else:
            sums = {f"{part.name}/{Path(k).relative_to(part)}": v for k, v in fs.sums.items()}
        tmp = part / (DONE + ".tmp")
        done = {
            "files": sums,
            "mappings": mappings,
            "shards": shards or {},
            "writer": written_by or {},
        }
        tmp.write_text(json.dumps(done))
        os.replace(tmp, part / DONE)
        return sums
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise


def merge_and_commit(
    tmp: Path,
    root: Path,
    step: int,
    generation: int,
    world_size: int,
    run: RunIdentity | None = None,
) -> Path:
    """Merge every ``rank_<r>/.metadata`` into ``tmp/.metadata`` and commit the step (as
    written by ``run``, recorded in its manifest).

    Plain keys are disjoint across parts (rank 0 holds the replicated state, rank r its
    ``per_rank.<r>`` and its ``per_shard.<id>``). A sharded entry becomes one chunk (its global offset, its size) of the
    global tensor it belongs to, as ``dcp.save`` would have described it; empty chunks
    (FSDP's last ranks of a short dimension) are left out unless the tensor is empty."""
    merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
    files: dict[str, dict[str, object]] = {}
    for r in range(world_size):
        part = tmp / f"rank_{r}"
        with open(part / DCP_METADATA, "rb") as f:
            md: Metadata = pickle.load(f)  # written by our own persister on this filesystem
        done = json.loads((part / DONE).read_text())
        shards = done.get("shards", {})
        renamed: dict[str, MetadataIndex | None] = {}  # entry key → its chunk's index
        for key, m in md.state_dict_metadata.items():
            rec = shards.get(key)
            if rec is None or not isinstance(m, TensorStorageMetadata):
                merged.state_dict_metadata[key] = m
                continue
            size = torch.Size(rec["global_shape"])
            whole = merged.state_dict_metadata.setdefault(
                rec["fqn"], TensorStorageMetadata(properties=m.properties, size=size, chunks=[])
            )
            assert isinstance(whole, TensorStorageMetadata)
            if m.size.numel() == 0 and (size.numel() > 0 or whole.chunks):
                renamed[key] = None  # nothing to read from an empty chunk
                continue
            offset = torch.Size(rec["offset"])
            whole.chunks.append(ChunkStorageMetadata(offsets=offset, sizes=m.size))
            renamed[key] = MetadataIndex(rec["fqn"], offset, len(whole.chunks) - 1)
        merged.planner_data.update({k: tuple(v) for k, v in done["mappings"].items()})
        for index, info in (md.storage_data or {}).items():
            if index.fqn in renamed:
                new = renamed[index.fqn]
                if new is None:
                    continue
                index = new
            info.relative_path = f"{part.name}/{info.relative_path}"
            merged.storage_data[index] = info
        files.update(done["files"])
    meta_tmp = tmp / (DCP_METADATA + ".tmp")
    with open(meta_tmp, "wb") as f:
        pickle.dump(merged, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(meta_tmp, tmp / DCP_METADATA)
    files[DCP_METADATA] = {
        "size": (tmp / DCP_METADATA).stat().st_size,
        storage.CHECKSUM: storage.file_digest(tmp / DCP_METADATA),
    }
    return storage.commit(tmp, root, step, generation=generation, files=files, run=run)
