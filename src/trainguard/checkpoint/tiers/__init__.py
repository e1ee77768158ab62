"""The checkpoint tiers, fastest first: the one order that the controller's choice of a
restore point (``controller/restore.py``) and a rank's restore (``Checkpointer.load``) read.
A new tier is a file of this package (a ``Tier``, ``tiers/api.py``) and an entry here."""

from __future__ import annotations

from typing import Any

from trainguard.checkpoint.tiers.api import Held, Index, NodeIndex, Point, RankSide, Tier
from trainguard.checkpoint.tiers.cold import ColdTier
from trainguard.checkpoint.tiers.disk import DiskTier
from trainguard.checkpoint.tiers.memory import MemoryTier
from trainguard.checkpoint.tiers.prefetch import PrefetchTier
from trainguard.checkpoint.tiers.replica import ReplicaTier

TIERS: tuple[type[Tier], ...] = (MemoryTier, ReplicaTier, PrefetchTier, DiskTier, ColdTier)


def restore(
    side: RankSide, state: dict[str, Any], point: Point, order: tuple[type[Tier], ...] = TIERS
) -> tuple[Tier | None, list[Tier]]:
    r"""Restore ``point`` into ``state`` from the first tier in ``order`` that holds a verified
    copy: that tier (None: none did) and every tier tried, in order (their ``failure``\ s say
    why they could not)."""
    tried: list[Tier] = []
    for kind in order:
        tier = kind(side)
        tried.append(tier)
        if tier.restore(state, point):
            return tier, tried
    return None, tried


__all__ = ["TIERS", "Held", "Index", "NodeIndex", "Point", "RankSide", "Tier", "restore"]
