"""Checkpoint errors, layout constants, and the rank's place (rank, world, its stderr line)."""

from __future__ import annotations

import os
import sys

MANIFEST = "manifest.json"  # per step: file sizes and CRC-32C checksums, written before commit
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's global metadata file
# snapshot header field of a trainguard.dcp save: the entry keys DCP's plan has this rank write
DCP_WRITES = "dcp_writes"
PER_RANK_KEY = "per_rank"  # values under this key are saved separately for every rank
# {shard id: value}: state of a data-parallel shard (its data position), saved by the rank
# that runs the shard and restored to whichever rank runs it after the world changed.
PER_SHARD_KEY = "per_shard"


class CheckpointError(Exception):
    """Base of checkpoint failures."""


class CheckpointNotFoundError(CheckpointError):
    """The requested step is not committed in any tier."""


class CheckpointCorruptError(CheckpointError):
    """A committed step failed checksum verification; it is never restored from (a restore
    that finds it as it reads raises this: the state it partly filled must be discarded)."""


class CheckpointReadError(CheckpointError):
    """A committed step's files could not be read (permissions, I/O error, a file gone)."""


def own_key(key: str, rank: int) -> bool:
    """A key only ``rank`` holds: its ``per_rank`` state or a shard it runs (``per_shard``).
    Every other key is replicated (or a DTensor shard) and persisted from rank 0 (DCP's rule)."""
    mine = f"{PER_RANK_KEY}.{rank}"
    return key == mine or key.startswith((mine + ".", PER_SHARD_KEY + "."))


def rank_world() -> tuple[int, int]:
    """This process's (rank, world size): the process group's, else the launcher's variables.
    With replica groups the process group is the group's: the job's rank is the launcher's."""
    import torch.distributed as dist

    groups = os.environ.get("TRAINGUARD_REPLICA_GROUPS", "1")  # runtime/api.py's name
    if dist.is_available() and dist.is_initialized() and groups in ("", "1"):
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def say(line: str) -> None:
    """One line to the user on stderr (a re-run says where it resumed from)."""
    print(f"trainguard: {line}", file=sys.stderr, flush=True)
