"""In-memory snapshots: one rank's state in a pre-allocated shared-memory slot.

A slot is a file in ``/dev/shm`` (owned by the node's ckptd, mapped by the worker):

    [0, 32)           magic "TGSNAP02" | state ("WRITING\\0" or "COMPLETE") | len | crc32c
    [32, reserve)     the header: JSON with step, generation, rank and the layout
    [reserve, end)    tensors, each 64-byte aligned, then the object blob (a pickle of
                      {key: torch.save bytes}: builtins only, see state.py)

A writer sets the state to WRITING before it touches the data and to COMPLETE only
after the data and the header are in place, so a writer killed mid-copy leaves a
slot that readers see as torn. Checksums (CRC-32C of every 64 MiB piece of every
tensor and of the object blob) are computed by the persister after staging, off the
training thread, and kept beside the slot in ``<slot>.sum``. CRC-32C (Castagnoli,
RFC 3720) runs in hardware (SSE4.2 / ARMv8 CRC) and releases the GIL, so a restore
verifies and copies pieces on several threads at memory bandwidth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import crc32c

from trainguard.checkpoint.api import CheckpointCorruptError, CheckpointError

if TYPE_CHECKING:  # torch is imported where tensors are made: ckptd reads slots without it
    import torch

MAGIC = b"TGSNAP02"  # 02: object blob of torch.save bytes per key
WRITING = b"WRITING\0"
COMPLETE = b"COMPLETE"
PREFIX_BYTES = 32
ALIGN = 64
PIECE_BYTES = 64 << 20  # one checksum per piece: pieces verify in parallel
RESTORE_CHUNK_BYTES = 1 << 20  # read into the target, then checksummed while in L2
# Readers map slots read-only on purpose; torch warns that it cannot mark such tensors read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorEntry:
    key: str  # flattened DCP key, e.g. "train.model.tok.weight"
    dtype: str  # e.g. "float32"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the slot
    nbytes: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Where each tensor lives in a slot. Same tensor keys/shapes/dtypes → same layout."""

    tensors: tuple[TensorEntry, ...]
    objects_offset: int
    objects_capacity: int
    total_bytes: int

    @staticmethod
    def plan(tensors: dict[str, torch.Tensor], objects_bytes: int, header_bytes: int = 0) -> Layout:
        """Offsets for ``tensors`` and an object blob of up to 2x ``objects_bytes``, after a
        header reserve of at least 1.25x ``header_bytes`` (0: estimated from the keys)."""
        header_guess = PREFIX_BYTES + 256 + sum(len(k) + 96 for k in tensors)
        reserve = _align(max(64 << 10, 2 * header_guess, header_bytes * 5 // 4 + 4096))
        offset, entries = reserve, []
        for key, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            entries.append(
                TensorEntry(
                    key=key,
                    dtype=str(t.dtype).removeprefix("torch."),
                    shape=tuple(t.shape),
                    offset=offset,
                    nbytes=nbytes,
                )
            )
            offset = _align(offset + nbytes)
        capacity = _align(max(64 << 10, 2 * objects_bytes))
        return Layout(
            tensors=tuple(entries),
            objects_offset=offset,
            objects_capacity=capacity,
            total_bytes=offset + capacity,
        )

    @property
    def reserve(self) -> int:
        return self.tensors[0].offset if self.tensors else self.objects_offset

    def signature(self) -> tuple[list[str], list[torch.Size], list[torch.dtype]]:
        """The keys, shapes and dtypes of the entries, in layout order."""
        import torch

        return (
            [e.key for e in self.tensors],
            [torch.Size(e.shape) for e in self.tensors],
            [getattr(torch, e.dtype) for e in self.tensors],
        )

    def fits(self, tensors: dict[str, torch.Tensor], objects_bytes: int) -> bool:
        """Do ``tensors`` (in this order) and a blob of ``objects_bytes`` fit this layout?
        (Three list comparisons: the per-save cost of a state of 10^5 small tensors.)"""
        if objects_bytes > self.objects_capacity or len(tensors) != len(self.tensors):
            return False
        keys, shapes, dtypes = self._sig()
        values = tensors.values()
        return (
            list(tensors) == keys
            and [t.dtype for t in values] == dtypes
            and [t.shape for t in values] == shapes
        )

    def _sig(self) -> tuple[list[str], list[torch.Size], list[torch.dtype]]:
        sig = _SIGNATURES.get(id(self))
        if sig is None or sig[0] is not self:
            sig = (self, self.signature())
            if len(_SIGNATURES) >= 8:  # layouts of earlier saves: only recent ones are reused
                _SIGNATURES.clear()
            _SIGNATURES[id(self)] = sig
        return sig[1]

    def static_header(self, mappings: dict[str, Any], shards: dict[str, Any]) -> str:
        """The header's part that is the same for every save into this layout (JSON members
        ``layout``, ``mappings`` and ``shards``): built once per layout, not per save."""
        return json.dumps(
            {"layout": dataclasses.asdict(self), "mappings": mappings, "shards": shards}
        )[1:-1]


_SIGNATURES: dict[int, tuple[Layout, tuple[list[str], list[torch.Size], list[torch.dtype]]]] = {}


def _view(buf: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    import torch

    return buf[e.offset : e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)


class Slot:
    """One mapped slot file. ``writable`` maps it shared read-write (MAP_POPULATE: pre-faulted)."""

    def __init__(self, path: Path, *, writable: bool) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < PREFIX_BYTES:
                raise CheckpointError(f"{path}: slot of {size} bytes is too small")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.mm = mmap.mmap(fd, size, flags=flags, prot=prot)
        finally:
            os.close(fd)
        self.size = size
        self.buf = None
        if writable:  # a writer's: torch is in (ckptd maps slots read-only, without torch)
            import torch

            self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        self._dsts: tuple[Layout, list[torch.Tensor]] | None = None
        self._nonempty: list[int] = []

    def close(self) -> None:
        self.buf = None
        self._dsts = None
        with contextlib.suppress(
            BufferError
        ):  # a tensor still views it: unmapped when that tensor dies
            self.mm.close()

    # ------------------------------------------------------------------ writer side
    def begin(self) -> None:
        self.mm[8:16] = WRITING

    def destinations(self, layout: Layout) -> list[torch.Tensor]:
        """One writable view of the slot per layout entry (built once per layout)."""
        assert self.buf is not None
        if self._dsts is None or self._dsts[0] is not layout:
            self._dsts = (layout, [_view(self.buf, e) for e in layout.tensors])
            self._nonempty = [i for i, e in enumerate(layout.tensors) if e.nbytes]
        return self._dsts[1]

    def write_tensors(
        self,
        layout: Layout,
        tensors: list[torch.Tensor] | dict[str, torch.Tensor],
        indices: list[int] | None = None,
    ) -> None:
        """Copy host tensors (any strides) into their places: entries ``indices`` (default
        all) of ``layout``, ``tensors`` in layout order. One ``_foreach_copy_`` call: the
        per-tensor cost of very many small tensors stays that of a memcpy loop."""
        import torch

        if isinstance(tensors, dict):
            tensors = list(tensors.values())
        dsts = self.destinations(layout)
        if indices is None and len(self._nonempty) == len(dsts):  # all of them: no index lists
            if dsts:
                with torch.no_grad():
                    torch._foreach_copy_(dsts, tensors)
            return
        full = self._nonempty
        idx = full if indices is None else [i for i in indices if layout.tensors[i].nbytes]
        if idx:
            with torch.no_grad():
                torch._foreach_copy_([dsts[i] for i in idx], [tensors[i] for i in idx])

    def commit(
        self,
        layout: Layout,
        objects_blob: bytes,
        meta: dict[str, Any],
        static: str | None = None,
    ) -> None:
        """Write the objects and the header (``meta`` plus ``static``, the layout's
        ``static_header``; default: the layout alone), then mark the slot COMPLETE."""
        o = layout.objects_offset
        self.mm[o : o + len(objects_blob)] = objects_blob
        if static is None:
            static = layout.static_header({}, {})
        dynamic = json.dumps({**meta, "objects_nbytes": len(objects_blob)})
        header = (dynamic[:-1] + ", " + static + "}").encode()
        if PREFIX_BYTES + len(header) > layout.reserve:
            raise CheckpointError(
                "snapshot header does not fit its reserve; the layout must be re-planned"
            )
        self.mm[PREFIX_BYTES : PREFIX_BYTES + len(header)] = header
        self.mm[16:24] = len(header).to_bytes(8, "little")
        self.mm[24:32] = _crc_bytes(header)
        self.mm[0:8] = MAGIC
        self.mm[8:16] = COMPLETE

    # ------------------------------------------------------------------ reader side
    def header(self) -> dict[str, Any] | None:
        """The header if the slot holds a complete snapshot, else None (empty or torn)."""
        if self.mm[0:8] != MAGIC or self.mm[8:16] != COMPLETE:
            return None
        n = int.from_bytes(self.mm[16:24], "little")
        if n <= 0 or PREFIX_BYTES + n > self.size:
            return None
        raw = self.mm[PREFIX_BYTES : PREFIX_BYTES + n]
        if _crc_bytes(raw) != self.mm[24:32]:
            return None
        return json.loads(raw)

    def views(self, header: dict[str, Any]) -> tuple[dict[str, torch.Tensor], bytes]:
        """Tensors as read-only views of the slot (exact storages, no copy) and the object blob."""
        import torch

        out = {}
        for d in header["layout"]["tensors"]:
            e = TensorEntry(**{**d, "shape": tuple(d["shape"])})
            dtype = getattr(torch, e.dtype)
            count = e.nbytes // torch.empty((), dtype=dtype).element_size()
            t = (
                torch.frombuffer(self.mm, dtype=dtype, count=count, offset=e.offset)
                if count
                else torch.empty(0, dtype=dtype)
            )
            out[e.key] = t.view(e.shape)
        o, n = header["layout"]["objects_offset"], header["objects_nbytes"]
        return out, bytes(self.mm[o : o + n])

    def checksums(self, header: dict[str, Any], threads: int = 1) -> dict[str, list[int]]:
        """CRC-32C of every ``PIECE_BYTES`` piece of every tensor, and of the object blob (key
        ``"__objects__"``), computed on ``threads`` threads (CRC-32C releases the GIL)."""
        mv = memoryview(self.mm)
        try:
            jobs = [(d["key"], d["offset"], d["nbytes"]) for d in header["layout"]["tensors"]]
            jobs.append(
                ("__objects__", header["layout"]["objects_offset"], header["objects_nbytes"])
            )
            pieces = [
                (k, off + a, min(n - a, PIECE_BYTES)) for k, off, n in jobs for a in _starts(n)
            ]

            def crc(p: tuple[str, int, int]) -> int:
                return crc32c.crc32c(mv[p[1] : p[1] + p[2]])

            out: dict[str, list[int]] = {}
            for (key, _, _), value in zip(pieces, _map(crc, pieces, threads), strict=True):
                out.setdefault(key, []).append(value)
            return out
        finally:
            mv.release()


def restore(
    path: Path,
    header: dict[str, Any],
    sums: dict[str, list[int]] | None,
    targets: dict[str, torch.Tensor],
    threads: int = 2,
) -> tuple[dict[str, bytes], dict[str, torch.Tensor]]:
    """Verify and copy a slot's tensors into ``targets`` (same keys, shapes and dtypes, any
    device and strides); ``sums=None``: copy only (ckptd verified the slot for this restart
    already). The slot is read with ``pread`` (no mapping of the slot: setting up page tables
    for a fresh mapping costs as much as the copy): straight into a target that is a
    contiguous CPU tensor; else into a contiguous host buffer (pinned for a CUDA target),
    which is then copied into the target (``copy_``: any strides; host → device for GPU
    tensors). With ``sums``, 1 MiB at a time, each chunk checksummed while it is in cache, so
    memory is crossed once; without, 64 MiB reads. Pieces are shared among ``threads``
    threads (pread and CRC-32C release the GIL).

    Returns the object blob's ``{key: torch.save bytes}`` and the tensors that could not be
    written in place (a target whose elements overlap, e.g. an ``expand``-ed view): the
    caller puts those into the state instead.

    Raises CheckpointError when a target is missing or does not match, or the slot is
    shorter than its header says; CheckpointCorruptError on any checksum mismatch (targets
    are then partly overwritten: the caller restores them from another tier).
    """
    from trainguard.checkpoint.state import unpack_objects

    pieces, staged = _pieces(header, targets)
    fd = os.open(path, os.O_RDONLY)
    try:
        _read_pieces(fd, path, pieces, sums, threads)
        blob = os.pread(fd, header["objects_nbytes"], header["layout"]["objects_offset"])
    finally:
        os.close(fd)
    if sums is not None and [crc32c.crc32c(blob)] != sums.get("__objects__"):
        raise CheckpointCorruptError(f"{path}: object blob fails its checksum")
    return unpack_objects(blob), _unstage(staged)


Piece = tuple[str, int, int, int, memoryview]  # key, piece index, slot offset, bytes, destination
Staged = tuple[str, "torch.Tensor", "torch.Tensor"]  # key, target, host buffer


def _pieces(
    header: dict[str, Any], targets: dict[str, torch.Tensor]
) -> tuple[list[Piece], list[Staged]]:
    """Where each piece of the slot goes: the target's own bytes (a contiguous CPU tensor),
    else a host buffer (pinned for a CUDA target) staged for ``_unstage``. Raises
    CheckpointError for a target that is missing or does not match the snapshot."""
    import torch

    pieces: list[Piece] = []
    staged: list[Staged] = []
    for d in header["layout"]["tensors"]:
        key, off, n = d["key"], d["offset"], d["nbytes"]
        target = targets.get(key)
        if target is None:
            raise CheckpointError(f"restore target {key} is missing from the state")
        dst = target.detach()
        if str(dst.dtype).removeprefix("torch.") != d["dtype"] or tuple(dst.shape) != tuple(
            d["shape"]
        ):
            raise CheckpointError(
                f"restore target {key} is {dst.dtype} {tuple(dst.shape)}; the snapshot holds "
                f"{d['dtype']} {tuple(d['shape'])}"
            )
        if dst.device.type != "cpu" or not dst.is_contiguous() or dst.is_conj() or dst.is_neg():
            buf = torch.empty(
                dst.shape, dtype=dst.dtype, pin_memory=dst.is_cuda and torch.cuda.is_available()
            )
            staged.append((key, dst, buf))
            dst = buf
        dst_mv = memoryview(dst.view(-1).view(torch.uint8).numpy()) if n else memoryview(b"")
        for i, a in enumerate(_starts(n)):
            m = min(n - a, PIECE_BYTES)
            pieces.append((key, i, off + a, m, dst_mv[a : a + m]))
    return pieces, staged


def _read_pieces(
    fd: int, path: Path, pieces: list[Piece], sums: dict[str, list[int]] | None, threads: int
) -> None:
    """``pread`` every piece into its destination on ``threads`` threads; with ``sums``, 1 MiB
    at a time, each chunk checksummed while in cache. Raises CheckpointCorruptError on a
    mismatch, CheckpointError when the slot is shorter than its header says."""

    def verify_copy(p: Piece) -> str | None:
        key, i, off, n, dst = p
        crc = 0
        step = RESTORE_CHUNK_BYTES if sums is not None else PIECE_BYTES
        for a in range(0, n, step):
            chunk = dst[a : min(n, a + step)]
            if os.preadv(fd, [chunk], off + a) != len(chunk):
                raise CheckpointError(f"{path}: shorter than its header says")
            if sums is not None:
                crc = crc32c.crc32c(chunk, crc)
        if sums is None:
            return None
        want = sums.get(key)
        return None if want is not None and i < len(want) and want[i] == crc else key

    bad = [k for k in _map(verify_copy, pieces, threads) if k is not None]
    if bad:
        raise CheckpointCorruptError(f"{path}: tensor {bad[0]} fails its checksum")


def _unstage(staged: list[Staged]) -> dict[str, torch.Tensor]:
    """Copy the staged host buffers into their targets (``copy_``: any strides, host → device
    for GPU tensors); returns those that cannot be written in place (overlapping elements)."""
    import torch

    from trainguard.checkpoint.state import overlaps

    replaced: dict[str, torch.Tensor] = {}
    cuda = False
    with torch.no_grad():
        for key, dst, buf in staged:
            if overlaps(dst):
                replaced[key] = buf.to(dst.device)
                continue
            dst.copy_(buf, non_blocking=dst.is_cuda)
            cuda = cuda or dst.is_cuda
    if cuda:
        torch.cuda.synchronize()  # the pinned buffers may be freed after this
    return replaced


def _crc_bytes(data: bytes) -> bytes:
    return crc32c.crc32c(data).to_bytes(8, "little")


def _starts(nbytes: int) -> range:
    """Start offsets of the pieces of an ``nbytes`` region (one piece for an empty region)."""
    return range(0, max(nbytes, 1), PIECE_BYTES)


def _map(fn: Any, items: list[Any], threads: int) -> list[Any]:
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="trainguard-crc") as ex:
        return list(ex.map(fn, items))


def restore_threads() -> int:
    """Threads for a restore: the cores this process may use, at most 4 (memory-bound beyond)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def sums_path(slot: Path) -> Path:
    return slot.with_name(slot.name + ".sum")


def write_sums(
    slot: Path, step: int, generation: int, sums: dict[str, list[int]], *, persisted: bool
) -> None:
    """Record the persister's checksums of a slot's snapshot; ``persisted``: the slot may be
    overwritten (its durable part is written, or it never needed one)."""
    tmp = slot.with_name(slot.name + ".sum.tmp")
    tmp.write_text(
        json.dumps({"step": step, "generation": generation, "sums": sums, "persisted": persisted})
    )
    os.replace(tmp, sums_path(slot))


def mark_forgotten(slot: Path, step: int, generation: int) -> None:
    """Record that the slot's snapshot of (``step``, ``generation``) failed its checksums: never
    indexed again, by this ckptd or a restarted one (``read_sums`` gives None for it), and
    free for the writer to overwrite."""
    tmp = slot.with_name(slot.name + ".sum.tmp")
    tmp.write_text(
        json.dumps({"step": step, "generation": generation, "forgotten": True, "persisted": True})
    )
    os.replace(tmp, sums_path(slot))


def forgotten(slot: Path, step: int, generation: int) -> bool:
    """``mark_forgotten`` was said of this very snapshot."""
    try:
        d = json.loads(sums_path(slot).read_text())
    except (OSError, ValueError):
        return False
    return bool(d.get("forgotten")) and (d.get("step"), d.get("generation")) == (step, generation)


def reusable(slot: Path, written: dict[str, Any] | None = None) -> bool:
    """May the writer overwrite this slot? Not while it holds a durable-flagged snapshot
    that the persister has not written yet. ``written``: the step, generation and durable
    flag the caller itself last committed there (spares parsing a header of every key)."""
    h = written if written is not None else peek_header(slot)
    if h is None or not h.get("durable"):
        return True
    try:
        d = json.loads(sums_path(slot).read_text())
    except (OSError, ValueError):
        return False
    return bool(d.get("persisted")) and (d.get("step"), d.get("generation")) == (
        h["step"],
        h["generation"],
    )


def peek_header(slot: Path) -> dict[str, Any] | None:
    """A slot's header without mapping its data (None: missing, empty or torn)."""
    try:
        with open(slot, "rb") as f:
            prefix = f.read(PREFIX_BYTES)
            if len(prefix) < PREFIX_BYTES or prefix[0:8] != MAGIC or prefix[8:16] != COMPLETE:
                return None
            n = int.from_bytes(prefix[16:24], "little")
            raw = f.read(n)
    except OSError:
        return None
    if len(raw) != n or _crc_bytes(raw) != prefix[24:32]:
        return None
    return json.loads(raw)


def read_sums(slot: Path, step: int, generation: int) -> dict[str, list[int]] | None:
    try:
        d = json.loads(sums_path(slot).read_text())
    except (OSError, ValueError):
        return None
    if d.get("forgotten") or (d.get("step"), d.get("generation")) != (step, generation):
        return None
    return d.get("sums")


SLOTS = 3
"""Slots per rank. Two would let persisting one never race staging the other, but while a
durable write pins one, the other is rewritten every step: a worker killed mid-copy (a
planned stop's SIGTERM to a script without a handler, a crash) then leaves nothing newer than
the pinned step, and ranks one step apart share no newer snapshot either. The third keeps the
previous step whole while the next is copied, so a stop or crash costs the snapshot in flight,
not every step since the durable one (seen: 9 steps in CI). Memory: 3 x the rank's state."""


def slot_prefix(job: str, node: str) -> str:
    """What every slot name of ``job``'s ``node`` starts with."""
    return f"trainguard-{job}-{node}-r"


def slot_paths(shm_dir: Path, job: str, node: str, rank: int) -> tuple[Path, ...]:
    """The ``SLOTS`` slots of one rank, in a fixed order (see ``SLOTS``)."""
    base = f"{slot_prefix(job, node)}{rank}"
    return tuple(shm_dir / f"{base}-s{i}" for i in range(SLOTS))


def create_slot(path: Path, nbytes: int) -> None:
    """Create (or grow) a slot file and allocate its pages now. Raises CheckpointError when
    /dev/shm cannot hold it, naming the fix."""
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    have = path.stat().st_size if path.exists() else 0
    # Its pages, not its size: an allocation cut short (ckptd SIGKILLed inside fallocate; tmpfs
    # frees what it had allocated) leaves the file at full size with no pages behind it.
    held = path.stat().st_blocks * 512 if path.exists() else 0
    if nbytes - held > free:
        raise CheckpointError(
            f"{path.parent} has {free / 2**20:.0f} MiB free but a snapshot slot needs {nbytes / 2**20:.0f} MiB; "
            "enlarge it (mount -o remount,size=… /dev/shm) or set memory_tier = false for durable-only checkpoints"
        )
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if have < nbytes:
            os.ftruncate(fd, nbytes)
        if held < nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                os.ftruncate(fd, have)
                raise CheckpointError(
                    f"{path}: cannot allocate {nbytes} bytes ({e.strerror}); enlarge /dev/shm "
                    "or set memory_tier = false"
                ) from None
    finally:
        os.close(fd)
