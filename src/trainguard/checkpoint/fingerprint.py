"""Fingerprints of a snapshot's replicated state, for silent-data-corruption detection.

Data-parallel replicas hold bit-identical parameters and optimizer state after every
optimizer step (DDP all-reduces the gradients, so every replica applies the same update).
A flipped bit in one replica's state breaks that, and nothing else notices: the job goes on,
and the all-reduce spreads the error into every replica's next update.

ckptd already computes a CRC-32C of every piece of every tensor it verifies (the memory
tier's checksums, ``Slot.checksums``), off the training thread and without the GIL. The
fingerprint folds those into one number per snapshot, over the *chunks* the rank holds
that other ranks hold too:

- a plain tensor (DDP, or replicated state of any kind): the whole tensor, by its key;
- a ``DTensor``/``ShardedTensor`` chunk: by its key and its offset in the global tensor, so
  ranks that hold the same chunk (HSDP's replicate dimension, a tensor-parallel ``Replicate``
  placement) compare, and ranks holding different shards do not;
- never a rank's own keys (``per_rank``, ``per_shard``: RNG state, data position) nor the
  object blob (step counters, Python values).

The ``layout`` (CRC-32C of the chunk ids, shapes and dtypes) groups ranks that hold the same
chunks; within a group the ``value`` must be equal. Cost: one CRC-32C over a few bytes per
piece (PIECE_BYTES of data), nothing per byte of state beyond the checksums ckptd computes.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any

import crc32c

from trainguard.checkpoint.api import own_key

# "B": ckptd computes no fingerprint in every other block of B steps (benchmarks/sdc.py)
ENV_AB = "TRAINGUARD_FINGERPRINT_AB"
PART_FILE = "fingerprint.json"  # in each rank's part of a durable step: {"layout", "value"}
MIN_MAJORITY_GROUP = 3  # replicas needed to name a culprit by majority


def chunk_ids(header: dict[str, Any], rank: int) -> list[tuple[str, str]]:
    """(chunk id, entry key) of each tensor entry of a slot ``header`` that another rank may
    hold bit for bit, sorted by chunk id. A chunk id names the key, its shape and dtype, and
    for a shard its offset in the global tensor."""
    shards = header.get("shards", {})
    out = []
    for t in header["layout"]["tensors"]:
        key = t["key"]
        if own_key(key, rank):
            continue
        where = ""
        if key in shards:
            where = "@" + ",".join(str(int(x)) for x in shards[key]["offset"])
        shape = "x".join(str(int(x)) for x in t["shape"])
        out.append((f"{key}{where}:{t['dtype']}[{shape}]", key))
    return sorted(out)


def fingerprint(header: dict[str, Any], sums: dict[str, list[int]], rank: int) -> list[int] | None:
    """``[layout, value]`` of one rank's verified snapshot (``sums``: its per-piece CRC-32Cs,
    ``Slot.checksums``), both unsigned 32-bit ints; None when it holds no chunk another rank
    could hold (then there is nothing to compare)."""
    ids = chunk_ids(header, rank)
    if not ids:
        return None
    layout = crc32c.crc32c("\n".join(c for c, _ in ids).encode())
    value = 0
    for cid, key in ids:
        value = crc32c.crc32c(cid.encode(), value)
        for piece in sums.get(key, []):
            value = crc32c.crc32c(int(piece).to_bytes(4, "little"), value)
    return [layout, value]


def ab_off(step: int) -> bool:
    """Whether ``step`` falls in a block without fingerprints under ``ENV_AB`` (blocks offset
    by half a block, as ``--ckpt-ab``'s, so that a block's first step is dropped cleanly)."""
    block = int(os.environ.get(ENV_AB, "0") or 0)
    return block > 0 and (step - 1 + block // 2) // block % 2 == 1


def compare(fps: dict[int, tuple[int, int]]) -> tuple[list[int], list[int]]:
    """One step's fingerprints, rank → (layout, value): (culprits, undecided). Ranks with the
    same layout must hold equal values; in a group of at least MIN_MAJORITY_GROUP a strict
    majority names the others culprits, else the whole group is undecided. Both empty:
    every group agrees."""
    groups: dict[int, dict[int, int]] = collections.defaultdict(dict)
    for rank, (layout, value) in fps.items():
        groups[layout][rank] = value
    culprits: list[int] = []
    undecided: list[int] = []
    for members in groups.values():
        counts = collections.Counter(members.values())
        if len(counts) <= 1:
            continue
        top, n = counts.most_common(1)[0]
        if len(members) >= MIN_MAJORITY_GROUP and 2 * n > len(members):
            culprits += sorted(r for r, v in members.items() if v != top)
        else:
            undecided += sorted(members)
    return sorted(culprits), sorted(undecided)


def write_part(part: Path, fp: list[int] | None) -> None:
    """Record a rank's fingerprint in its part of a durable step (covered by the step's
    manifest checksums like every file of the part)."""
    if fp is not None:
        (part / PART_FILE).write_text(json.dumps({"layout": fp[0], "value": fp[1]}))


def durable_verdict(step_dir: Path) -> bool | None:
    """Whether a durable step's ranks held agreeing state (``compare``), from the fingerprint
    each rank's part records: True (every part has one and they agree), False (they differ),
    None (nothing to compare: a part without a fingerprint, an unreadable one, or one rank)."""
    parts = list(step_dir.glob("rank_*"))
    fps: dict[int, tuple[int, int]] = {}
    for part in parts:
        try:
            d = json.loads((part / PART_FILE).read_text())
            fps[int(part.name.removeprefix("rank_"))] = (int(d["layout"]), int(d["value"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
    if len(fps) < 2:
        return None
    culprits, undecided = compare(fps)
    return not culprits and not undecided
