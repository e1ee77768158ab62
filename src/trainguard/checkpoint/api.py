"""Checkpoint errors and layout constants."""

from __future__ import annotations

MANIFEST = "manifest.json"  # per step: file sizes and CRC-32C checksums, written before commit
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's global metadata file
PER_RANK_KEY = "per_rank"  # values under this key are saved separately for every rank
# {shard id: value}: state of a data-parallel shard (its data position), saved by the rank
# that runs the shard and restored to whichever rank runs it after the world changed.
PER_SHARD_KEY = "per_shard"


class CheckpointError(Exception):
    """Base of checkpoint failures."""


class CheckpointNotFoundError(CheckpointError):
    """The requested step is not committed in any tier."""


class CheckpointCorruptError(CheckpointError):
    """A committed step failed checksum verification; it is never loaded."""


class CheckpointReadError(CheckpointError):
    """A committed step's files could not be read (permissions, I/O error, a file gone)."""
