"""The checkpoint tiers, fastest first: the one order that the controller's choice of a
restore point (``controller/restore.py``) and a rank's restore (``Checkpointer.load``) read.
A new tier is a file of this package (a ``Tier``, ``tiers/api.py``) and an entry here."""

from __future__ import annotations

from trainguard.checkpoint.tiers.api import Held, Index, NodeIndex, Point, RankSide, Tier
from trainguard.checkpoint.tiers.cold import ColdTier
from trainguard.checkpoint.tiers.disk import DiskTier
from trainguard.checkpoint.tiers.memory import MemoryTier
from trainguard.checkpoint.tiers.prefetch import PrefetchTier
from trainguard.checkpoint.tiers.replica import ReplicaTier

TIERS: tuple[type[Tier], ...] = (MemoryTier, ReplicaTier, PrefetchTier, DiskTier, ColdTier)

__all__ = ["TIERS", "Held", "Index", "NodeIndex", "Point", "RankSide", "Tier"]
