"""Restore from the durable tier in one pass: DCP's file reader, with every file a rank's
load touches read once, ``READ_THREADS`` requests of ``CHUNK`` bytes in flight, and its
CRC-32C checked against the step's manifest over those same bytes (no second read of the
step to verify it first, the way ``storage.verify`` then ``dcp.load`` read it twice).

Each item (a tensor's ``torch.save`` record, or an object's bytes) is read whole into memory,
checksummed in file order with the gaps between the items this rank needs (read too, so
that the file's checksum is whole) and handed to the planner as DCP's own reader would. A
file whose checksum or size differs raises ``CorruptFileError`` once its last byte is read:
items of it may already be in the live state by then, so the caller must not go on with
that state (``Checkpointer.load`` raises, the rank restarts from an older point).
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import crc32c
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index  # what DCP's reader uses
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

READ_THREADS = 8  # requests in flight per file (a virtual or network disk serves several)
CHUNK = 16 << 20  # bytes per request


class CorruptFileError(OSError):
    """A file of a durable step does not match the step's manifest (size or CRC-32C)."""


class VerifyingReader(FileSystemReader):
    """``FileSystemReader`` of step directory ``path`` checking each file it reads against
    ``sums`` (file name relative to ``path`` → ``{"size", "crc32c"}``, the manifest's).
    Raises CorruptFileError from ``read_data`` (wrapped by DCP in a CheckpointException) for
    a file that does not match, or one the manifest does not list."""

    def __init__(self, path: str | os.PathLike[str], sums: dict[str, dict[str, Any]]) -> None:
        super().__init__(path)
        self.sums = sums
        self.bytes_read = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ckpt-read") as pool:
            for rel, reqs in per_file.items():
                self._read_file(pool, rel, reqs, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(
        self, pool: ThreadPoolExecutor, rel: str, reqs: list[ReadItem], planner: LoadPlanner
    ) -> None:
        path = Path(str(self.path)) / rel
        want = self.sums.get(rel)
        if want is None:
            raise CorruptFileError(f"{path}: not in the step's manifest")
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != int(want["size"]):
                raise CorruptFileError(f"{path}: size {size} != {want['size']}")
            ranges: dict[tuple[int, int], list[ReadItem]] = {}
            for req in reqs:
                md = self.storage_data[req.storage_index]
                ranges.setdefault((int(md.offset), int(md.length)), []).append(req)
            crc, pos = 0, 0
            for (off, length), items in sorted(ranges.items()):
                if off > pos:  # bytes this rank does not need: read for the checksum only
                    crc = _crc_span(pool, fd, pos, off - pos, crc)
                    pos = off
                buf = _read(pool, fd, off, length)
                if off == pos:
                    crc = crc32c.crc32c(buf, crc)
                    pos = off + length
                elif off + length > pos:  # overlaps the previous range (not in DCP files)
                    crc = crc32c.crc32c(memoryview(buf)[pos - off :], crc)
                    pos = off + length
                self.bytes_read += length
                for req in items:
                    self._serve(req, buf, planner)
            if pos < size:
                crc = _crc_span(pool, fd, pos, size - pos, crc)
            if crc != int(want["crc32c"]):
                raise CorruptFileError(f"{path}: checksum mismatch")
        finally:
            os.close(fd)

    def _serve(self, req: ReadItem, buf: bytearray, planner: LoadPlanner) -> None:
        stream = io.BytesIO(buf)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, stream)
            return
        tensor = cast(torch.Tensor, torch.load(stream, map_location="cpu", weights_only=True))
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise AssertionError(
                f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def _read(pool: ThreadPoolExecutor, fd: int, off: int, length: int) -> bytearray:
    """``length`` bytes at ``off``, as CHUNK-sized preads in flight together."""
    buf = bytearray(length)
    view = memoryview(buf)

    def one(start: int) -> None:
        end = min(length, start + CHUNK)
        got = start
        while got < end:
            n = os.preadv(fd, [view[got:end]], off + got)
            if n == 0:
                raise CorruptFileError(f"fd {fd}: ended at byte {off + got}, before {off + end}")
            got += n

    for f in [pool.submit(one, s) for s in range(0, length, CHUNK)]:
        f.result()
    return buf


def _crc_span(pool: ThreadPoolExecutor, fd: int, off: int, length: int, crc: int) -> int:
    """The CRC-32C ``crc`` continued over ``length`` bytes at ``off`` (read CHUNK by CHUNK)."""
    for start in range(0, length, 4 * CHUNK):
        crc = crc32c.crc32c(_read(pool, fd, off + start, min(4 * CHUNK, length - start)), crc)
    return crc
