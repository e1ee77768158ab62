"""The cold tier: the archive targets (S3 or a file URL, ``archive.py``). Neither side reads
it per rank: before the first generation the controller copies the archive's newest verified
step into an empty disk tier (``archiver.restore_newest``), which then serves it, and
``archiver.Archiver`` uploads each new durable step."""

from __future__ import annotations

from typing import Any, ClassVar

from trainguard.checkpoint.tiers.api import Index, Point, Tier


class ColdTier(Tier):
    name: ClassVar[str] = "archive"

    @staticmethod
    def holds(index: Index) -> None:
        return None  # its steps reach the controller's index through the disk tier

    def restore(self, state: dict[str, Any], point: Point) -> bool:
        return False  # a rank reads the disk tier the controller filled from it
