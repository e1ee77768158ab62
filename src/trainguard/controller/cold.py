"""The controller's side of the cold tier (``archive_urls``): at the start, the cold tier's
newest step restored into the hot tier if the hot tier has nothing newer; then each target
archived in the background, one ``Archiver`` thread each. Their events are recorded; a step is
``archive_durable`` once ``archive_copies`` targets verified it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from trainguard.checkpoint.archive import Archive
from trainguard.checkpoint.archiver import Archiver, restore_newest
from trainguard.controller.config import JobConfig
from trainguard.controller.monitor import Monitor
from trainguard.controller.store import Store

log = logging.getLogger("trainguard.controller")


class ColdTier:
    """``await start()`` (on the controller's loop, before the first generation), then
    ``await close()`` at the end: the final step reaches every target, bounded by
    ``archive_final_timeout_s``."""

    def __init__(self, cfg: JobConfig, store: Store, monitor: Monitor) -> None:
        self.cfg, self.store, self.monitor = cfg, store, monitor
        self._archivers: list[Archiver] = []
        self._copies: dict[int, set[str]] = {}  # step → cold targets that hold it verified

    async def start(self) -> None:
        """Restore the cold tier's newest step into the hot tier if the hot tier has nothing
        newer (while the agents start: before any process group is up, since the first tick
        waits for this), then archive to each target in the background, one thread each."""
        loop = asyncio.get_running_loop()

        def emit(kind: str, **data: Any) -> None:
            loop.call_soon_threadsafe(self._event, kind, data)

        cfg = self.cfg
        archives = [
            Archive(url, endpoint_url=cfg.archive.archive_endpoint_url, concurrency=cfg.archive.archive_concurrency,
                    mbps=cfg.archive.archive_mbps, compress=cfg.archive.archive_compress)
            for url in cfg.archive.archive_urls
        ]  # fmt: skip
        root = Path(cfg.ckpt_dir)
        await asyncio.to_thread(restore_newest, archives, root, emit)
        for a in archives:
            arch = Archiver(
                a, root, every=cfg.archive.archive_every, keep=cfg.archive.archive_keep, emit=emit
            )
            arch.start()
            self._archivers.append(arch)

    async def close(self) -> None:
        """The final step reaches every cold target (bounded, in parallel)."""
        if not self._archivers:
            return
        limit = self.cfg.archive.archive_final_timeout_s
        await asyncio.gather(*(asyncio.to_thread(a.close, limit) for a in self._archivers))
        await asyncio.sleep(0)  # their last events reach the store

    def _event(self, kind: str, data: dict[str, Any]) -> None:
        self.store.record(kind, data)
        if kind == "archive_uploaded":  # archived once archive_copies targets verified it
            self.monitor.figures.tier_bytes["archive"] = int(data.get("bytes", 0))
            step = int(data["step"])
            held = self._copies.setdefault(step, set())
            held.add(str(data["url"]))
            if len(held) == self.cfg.archive.archive_copies:
                self.store.record("archive_durable", {"step": data["step"], "copies": sorted(held)})
                self._copies = {st: u for st, u in self._copies.items() if st > step}
        if kind in ("archive_failed", "checkpoint_corrupt"):
            log.warning("cold tier: %s %s", kind, data)
        elif kind != "archive_pruned":
            log.info("cold tier: %s %s", kind, data)
