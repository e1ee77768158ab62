"""The prefetch tier: the durable step a standby copied into its own memory while it waited
(``checkpoint/prefetch.py``), read by the ranks it takes over when it holds the very point.
The controller does not track it: its copies are of durable points (the disk tier's answer)."""

from __future__ import annotations

from typing import Any, ClassVar

from trainguard.checkpoint import prefetch
from trainguard.checkpoint.api import CheckpointCorruptError, CheckpointReadError
from trainguard.checkpoint.tiers.api import Index, Point, Tier
from trainguard.runtime import api as rt_api


class PrefetchTier(Tier):
    name: ClassVar[str] = "prefetched"
    where = "this node's prefetched copy"

    @staticmethod
    def holds(index: Index) -> None:
        return None

    def restore(self, state: dict[str, Any], point: Point) -> bool:
        """Restore durable ``point`` from this node's prefetched copy if it holds that step
        of that generation. ``details["checked"]`` says how it was checked: ``"at the
        restart"`` (its agent verified it whole for this generation: read without
        checksums) or ``"while read"`` (each file's CRC-32C as it is read). False (an event
        if it was there but failed): the next tier's read overwrites whatever was read."""
        rk, (step, gen) = self.side, point
        root = prefetch.present(rk.env.get(rt_api.ENV_PREFETCH_DIR), step, gen)
        if root is None:
            return False
        try:
            how = prefetch.restore(
                state, root, step, gen, rank=rk.rank, for_generation=rk.generation, emit=rk.emit
            )
            self.details = {"checked": how}
            return True
        except (CheckpointCorruptError, CheckpointReadError) as e:
            problems = [str(e)]
        rk.emit("ckpt_corrupt", step=step, tier="prefetched", problems=problems[:4])
        return False
