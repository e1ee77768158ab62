"""From a training state to what a snapshot holds, and back.

A state (nested dicts and lists of tensors, ``Stateful`` objects and other values) is
flattened with DCP's own flattening, so durable keys are the ones plain ``dcp.load``
expects. Each flat value becomes one of:

- a **tensor entry**: the bytes this rank holds. A plain tensor is its own entry; a
  ``DTensor`` (FSDP2 ``fully_shard``, tensor parallel, any ``DeviceMesh``) contributes its
  local tensor and a ``ShardRecord`` giving the global shape and this chunk's global
  offset (DCP's own ``__create_chunk_list__``); a ``ShardedTensor`` one entry per local shard.
  Each rank's snapshot therefore holds only its own shards.
- an **object**: any other value, serialized here, in the worker, with ``torch.save`` — the
  bytes DCP itself writes for a non-tensor value. Nothing downstream (ckptd, the persister,
  a peer's replica) ever unpickles it, so classes defined in the user's script never need to
  be importable there, and plain ``dcp.load`` still reads the value.

At restore the saved structure wins for keys the live state does not have yet (optimizer
state that is created lazily, at the first ``step()``): ``fill_missing`` allocates them from
the saved shapes and dtypes and inserts them where the saved mapping says, so
``load_state_dict`` receives the complete saved state.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.stateful import Stateful

from trainguard.checkpoint.api import PER_RANK_KEY, PER_SHARD_KEY, CheckpointError

try:  # DTensor is part of torch.distributed; absent on builds without it
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]
try:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
except ImportError:  # pragma: no cover
    ShardedTensor = None  # type: ignore[assignment,misc]

SHARD_SEP = "@shard"  # entry key of a ShardedTensor's i-th local shard: f"{fqn}@shard{i}"
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types: subclasses take the general path
_STRIDED = torch.strided


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShardRecord:
    """Where one entry sits in a global (sharded) tensor.

    ``global_shape`` and ``offset`` are element counts per dimension (DCP's chunk
    ``offsets``); ``write``: this rank persists the chunk (on mesh dimensions where the
    tensor is replicated only coordinate 0 does, so every chunk is written once).
    """

    fqn: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    write: bool

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> ShardRecord:
        return ShardRecord(
            fqn=d["fqn"],
            global_shape=tuple(d["global_shape"]),
            offset=tuple(d["offset"]),
            write=bool(d["write"]),
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class Flat:
    """One rank's state, flattened. ``tensors`` keeps the insertion order of the flattening."""

    converted: dict[str, Any]  # the nested state, Statefuls replaced by their state_dict()
    tensors: dict[str, torch.Tensor]  # entry key → local data (any device, any strides)
    shards: dict[str, ShardRecord]  # entry key → place in its global tensor (sharded only)
    objects: dict[str, Any]  # flat key → non-tensor value
    mappings: dict[str, tuple[Any, ...]]  # flat key → path in ``converted``


def with_rank_key(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """``state`` with ``state["per_rank"]`` moved to ``"per_rank.<rank>"`` and each entry of
    ``state["per_shard"]`` to ``"per_shard.<shard id>"`` (keys of their own). Raises
    CheckpointError when ``per_shard`` is not a dict or a shard id holds a ``.``."""
    flat = {k: v for k, v in state.items() if k not in (PER_RANK_KEY, PER_SHARD_KEY)}
    if PER_RANK_KEY in state:
        flat[f"{PER_RANK_KEY}.{rank}"] = state[PER_RANK_KEY]
    shards = state.get(PER_SHARD_KEY, {})
    if not isinstance(shards, dict) or any("." in str(s) for s in shards):
        raise CheckpointError(
            f'state["{PER_SHARD_KEY}"] must be a dict of shard id (an int, or a str without ".") '
            "to that shard's state, e.g. {shard: sampler.state_dict()}"
        )
    for shard, value in shards.items():
        flat[f"{PER_SHARD_KEY}.{shard}"] = value
    return flat


def converted(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """The state as DCP sees it: every ``Stateful`` replaced by its ``state_dict()``."""
    return {
        k: (v.state_dict() if isinstance(v, Stateful) else v)
        for k, v in with_rank_key(state, rank).items()
    }


def flatten(state: dict[str, Any], rank: int, *, paths: bool = True) -> Flat:
    """Flatten ``state`` for a snapshot (``paths=False``: leave ``mappings`` empty, the per-save
    fast path). Raises CheckpointError for a value no tier can hold (sparse tensors, a
    ``Partial`` DTensor), naming the key and the fix."""
    return flatten_converted(converted(state, rank), paths=paths)


def flatten_typed(
    conv: dict[str, Any], *, paths: bool = True, plain: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """DCP's ``flatten_state_dict`` (same traversal, same flat keys), with paths that keep
    each dict key's own type: DCP's paths turn the int keys of an optimizer's ``state`` into
    strings, and a value restored along such a path lands under ``"0"`` beside the param id
    ``0``. Keys other than str and int raise CheckpointError (DCP stringifies them, and the
    restored value then lands under the string). Two values with one flat key (``{"a.b": x,
    "a": {"b": y}}``) raise CheckpointError, as DCP does. ``paths=False``: the
    flat dict only (no path tuples built). ``plain``: where to put plain strided tensors that
    are values of a mapping instead of the flat dict (the snapshot's fast path; order kept
    within each)."""
    flat: dict[str, Any] = {}
    fast = plain if plain is not None else flat
    mappings: dict[str, tuple[Any, ...]] = {}

    def leaf(key: str, path: tuple[Any, ...] | None, value: Any) -> None:
        if key in flat or key in fast:
            raise CheckpointError(f"two values of the state flatten to the same key {key}")
        flat[key] = value
        if path is not None:
            mappings[key] = path

    def walk(prefix: str, path: tuple[Any, ...] | None, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                if type(k) not in (str, int):
                    raise CheckpointError(
                        f"{prefix}: a key of type {type(k).__name__} ({k!r}); checkpoints keep "
                        "str and int keys (DCP turns others into strings, which then restore "
                        "under the string): use str(key) in the state"
                    )
                key = f"{prefix}.{k}"
                sub = None if path is None else (*path, k)
                if type(v) in _PLAIN and key not in flat and key not in fast:  # common, inline
                    if fast is not flat and v.layout is not _STRIDED:
                        walk(key, sub, v)  # to the general path (refused there)
                        continue
                    fast[key] = v
                    if sub is not None:
                        mappings[key] = sub
                else:
                    walk(key, sub, v)
        elif isinstance(value, torch.Tensor) or _is_terminal(value):
            leaf(prefix, path, value)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", None if path is None else (*path, i), v)

    for k, v in conv.items():
        walk(str(k), (str(k),) if paths else None, v)
    return flat, mappings


def _is_terminal(value: Any) -> bool:
    """DCP's rule: a list is a leaf unless it holds a mapping, a tensor or a non-leaf list."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return all(
        not isinstance(e, torch.Tensor)
        and not (isinstance(e, (Mapping, list)) and not _is_terminal(e))
        for e in value
    )


def flatten_converted(conv: dict[str, Any], *, paths: bool = True) -> Flat:
    """``flatten`` of a state already ``converted``."""
    tensors: dict[str, torch.Tensor] = {}
    flat, mappings = flatten_typed(conv, paths=paths, plain=tensors)
    shards: dict[str, ShardRecord] = {}
    objects: dict[str, Any] = {}
    for key, value in flat.items():
        if DTensor is not None and isinstance(value, DTensor):
            tensors[key], shards[key] = _dtensor_entry(key, value)
        elif ShardedTensor is not None and isinstance(value, ShardedTensor):
            with warnings.catch_warnings():  # ShardedTensor warns on every use that it is legacy
                warnings.simplefilter("ignore", FutureWarning)
                size = tuple(value.size())
            for i, shard in enumerate(value.local_shards()):
                entry = f"{key}{SHARD_SEP}{i}"
                tensors[entry] = shard.tensor
                shards[entry] = ShardRecord(
                    fqn=key,
                    global_shape=size,
                    offset=tuple(shard.metadata.shard_offsets),
                    write=True,
                )
        elif isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise CheckpointError(
                    f"{key}: {value.layout} tensors cannot be snapshotted; convert it "
                    "(.to_dense()) in state_dict(), or set memory_tier = false (DCP direct)"
                )
            tensors[key] = value
        else:
            objects[key] = value
    return Flat(converted=conv, tensors=tensors, shards=shards, objects=objects, mappings=mappings)


def _dtensor_entry(key: str, t: Any) -> tuple[torch.Tensor, ShardRecord]:
    if any(p.is_partial() for p in t.placements):
        raise CheckpointError(
            f"{key}: a DTensor with a Partial placement holds unreduced values; "
            "redistribute it to Shard/Replicate in state_dict() before saving"
        )
    (chunk,) = t.__create_chunk_list__()  # DCP's own chunk: identical metadata to dcp.save
    coord = t.device_mesh.get_coordinate()
    write = coord is not None and all(
        c == 0 for c, p in zip(coord, t.placements, strict=True) if not p.is_shard()
    )
    record = ShardRecord(
        fqn=key, global_shape=tuple(t.shape), offset=tuple(chunk.offsets), write=write
    )
    return t._local_tensor, record


class ObjectCodec:
    """Non-tensor values ⇄ the ``torch.save`` bytes DCP writes for them.

    Encoding runs on the training thread; a value whose pickle did not change since the last
    save reuses its bytes (``torch.save`` costs ~45 µs a value, ``pickle.dumps`` ~1 µs).
    """

    def __init__(self) -> None:
        self._cache: dict[str, tuple[bytes, bytes]] = {}

    def encode(self, objects: dict[str, Any]) -> dict[str, bytes]:
        """Raises CheckpointError naming the key and class of a value that cannot be saved."""
        out: dict[str, bytes] = {}
        for key, value in objects.items():
            try:
                fingerprint = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                cached = self._cache.get(key)
                if cached is not None and cached[0] == fingerprint:
                    out[key] = cached[1]
                    continue
                buf = io.BytesIO()
                torch.save(value, buf)
            except Exception as e:  # pickling runs user code (__reduce__, __getstate__)
                raise CheckpointError(
                    f"{key}: a value of type {type(value).__module__}.{type(value).__qualname__} "
                    f"cannot be saved ({type(e).__name__}: {e}); make it picklable or keep "
                    "it out of the state"
                ) from e
            out[key] = buf.getvalue()
            self._cache[key] = (fingerprint, out[key])
        return out


def pack_objects(encoded: dict[str, bytes]) -> bytes:
    """The slot's object blob: a pickle of ``{key: bytes}`` (builtins only)."""
    return pickle.dumps(encoded, protocol=pickle.HIGHEST_PROTOCOL)


class _BytesOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"an object blob names {module}.{name}; only bytes expected")


def unpack_objects(blob: bytes) -> dict[str, bytes]:
    """The ``{key: bytes}`` of a slot's object blob, without importing or running any class
    (safe in ckptd and the persister). Raises pickle.UnpicklingError on anything else."""
    out = _BytesOnly(io.BytesIO(blob)).load()
    if not isinstance(out, dict) or not all(isinstance(v, bytes) for v in out.values()):
        raise pickle.UnpicklingError("an object blob is not a dict of bytes")
    return out


def decode_object(raw: bytes) -> Any:
    """One value from its ``torch.save`` bytes (in the worker: user classes importable)."""
    return torch.load(io.BytesIO(raw), weights_only=False)


def set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in nested dicts and lists (``flatten_typed`` paths). Unlike
    DCP's ``set_element``, an int under a dict is a dict key (an optimizer's param id, an
    epoch number), never a list index; a missing container is made a dict (the paths do not
    say whether it was a list; the containers lazily created state lives in are dicts)."""
    cur: Any = root
    for key in path[:-1]:
        if isinstance(cur, list):
            while len(cur) <= key:
                cur.append(None)
            if cur[key] is None:
                cur[key] = {}
            cur = cur[key]
        else:
            cur = cur.setdefault(key, {})
    last = path[-1]
    if isinstance(cur, list):
        while len(cur) <= last:
            cur.append(None)
    cur[last] = value


def fill_missing(
    conv: dict[str, Any],
    live_keys: Iterable[str],
    saved: dict[str, tuple[torch.dtype | None, tuple[int, ...], tuple[Any, ...]]],
) -> list[str]:
    """Insert into ``conv`` a fresh tensor for every saved tensor key the live state lacks
    (``None`` for an object), at the saved path. ``saved``: key → (dtype, or None for an
    object; shape; path in the nested state).

    Only keys below a top-level key of ``conv`` are filled (a script that dropped a
    top-level entry does not get it back). Returns the keys filled.
    """
    live = set(live_keys)
    filled = []
    for key, (dtype, shape, path) in saved.items():
        if key in live or not path or path[0] not in conv:
            continue
        value = None if dtype is None else torch.empty(tuple(shape), dtype=dtype)
        set_path(conv, tuple(path), value)
        filled.append(key)
    return filled


def overlaps(t: torch.Tensor) -> bool:
    """Do several elements of ``t`` share memory (stride 0 along a dimension of size > 1, an
    ``expand``-ed view)? Nothing can be restored into such a tensor in place."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True))


def replace_overlapping(conv: dict[str, Any]) -> list[str]:
    """Put a fresh tensor of the same shape, dtype and device in place of every plain tensor of
    ``conv`` whose elements overlap, so a restore can write it. Returns the keys replaced."""
    flat, mappings = flatten_typed(conv)
    out = []
    for key, value in flat.items():
        if type(value) in (torch.Tensor, torch.nn.Parameter) and overlaps(value):
            fresh = torch.empty_like(value, memory_format=torch.contiguous_format)
            set_path(conv, mappings[key], fresh)
            out.append(key)
    return out


def apply(state: dict[str, Any], conv: dict[str, Any], rank: int) -> None:
    """Hand the restored ``conv`` back to ``state``: ``load_state_dict`` for a ``Stateful``,
    in place for ``per_rank`` and each ``per_shard`` entry, replacement for anything else."""
    for key, value in state.items():
        if isinstance(value, Stateful):
            value.load_state_dict(conv[key])
        elif key == PER_RANK_KEY:
            if f"{PER_RANK_KEY}.{rank}" in conv:  # absent: a rank new to the world starts fresh
                value.update(conv[f"{PER_RANK_KEY}.{rank}"])
        elif key == PER_SHARD_KEY:
            for shard, mine in value.items():
                got = conv.get(f"{PER_SHARD_KEY}.{shard}")
                if got is None:
                    continue  # a shard no checkpoint has yet: it starts fresh
                if isinstance(mine, dict) and isinstance(got, dict):
                    mine.update(got)
                else:
                    value[shard] = got
        else:
            state[key] = conv[key]


class TypedSavePlanner(DefaultSavePlanner):
    """DCP's save planner, recording ``flatten_typed`` paths as the checkpoint's mappings."""

    # DCP inspects this signature for ``storage_meta`` (and warns without it): spelt out
    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        if self.flatten_state_dict:
            self.mappings = flatten_typed(state_dict)[1]


class TypedLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, putting non-tensor values back along ``flatten_typed`` paths."""

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if self.flatten_state_dict:
            self.mappings = flatten_typed(self.original_state_dict)[1]

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = torch.load(value, weights_only=False)
        if self.flatten_state_dict and fqn in self.mappings:
            set_path(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
