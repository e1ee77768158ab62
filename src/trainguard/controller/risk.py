"""Failure prediction: which nodes' hardware counters say they are about to fail
(``health/signals.py`` reads them on each node; the agents report them).

A node is **at risk** when, since its counters were first seen (or since it was last
flagged):

- an uncorrected memory error appeared (EDAC ``edac_ue``, GPU ``gpu_ecc_ue``) or a GPU page
  was retired (``gpu_retired_pages``): NVIDIA's guidance is to drain a GPU with uncorrectable
  ECC errors or new retired pages;
- corrected errors rose by at least ``ce_delta`` within ``window_s`` (``edac_ce``,
  ``gpu_ecc_ce``): corrected DRAM errors are the strongest predictor of uncorrected ones
  (Schroeder, Pinheiro, Weber, "DRAM errors in the wild", SIGMETRICS 2009: a DIMM with
  corrected errors is tens to hundreds of times more likely to have an uncorrected one);
- a GPU Xid error that NVIDIA's catalogue counts as a hardware fault (``gpu_xid_critical``:
  double-bit ECC, fallen off the bus, row-remap failure, …), a block-device I/O error in the
  kernel log (``io_errors``), or a disk's SMART verdict or pre-failure counters rising
  (reallocated, pending or uncorrectable sectors; NVMe media errors, critical warning):
  sudden signs, each a reason on its own;
- a GPU newly held back by a hardware or thermal slowdown (``gpu_throttled``);
- the hottest GPU is within ``temp_margin_c`` of its slowdown threshold (it is about to be
  throttled, or to fail hot), or its temperature climbs fast enough to get there within
  ``temp_horizon_s`` (the least-squares slope of the window's samples, at least
  ``MIN_TREND_SAMPLES`` over ``MIN_TREND_S``: a cooling fan or pump failing shows as a steady
  climb minutes before the threshold).

The executor then has the node drained at the next checkpoint boundary (a planned stop: the
newest snapshot is persisted, a standby takes its place, no step is lost and no restart is
charged), with the signal in the ``node_at_risk`` event. History is bounded per node.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

_SUDDEN = (
    "edac_ue",
    "gpu_ecc_ue",
    "gpu_retired_pages",
    "gpu_xid_critical",
    "io_errors",
    "smart_failed",
    "smart_reallocated",
    "smart_pending",
    "smart_uncorrectable",
    "smart_media_errors",
    "smart_critical_warning",
    "gpu_throttled",
)
_RATE = ("edac_ce", "gpu_ecc_ce")
MAX_SAMPLES = 64
MIN_TREND_SAMPLES = 5
MIN_TREND_S = 30.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RiskConfig:
    ce_delta: float = 10.0  # corrected errors within window_s that flag a node
    window_s: float = 600.0
    temp_margin_c: float = 5.0  # °C below the GPU's slowdown threshold
    temp_horizon_s: float = 600.0  # a climb that reaches the slowdown threshold this soon


class RiskWatch:
    """Per-node counter history, fed with each report's ``signals``."""

    def __init__(self, cfg: RiskConfig) -> None:
        self.cfg = cfg
        self._base: dict[str, dict[str, float]] = {}
        self._hist: dict[str, collections.deque[tuple[float, dict[str, float]]]] = {}

    def observe(self, node: str, now: float, signals: dict[str, Any] | None) -> str | None:
        """The reason ``node`` is at risk, the first time a report shows it (then its
        counters start afresh: it is flagged again only for new errors); else None."""
        if not signals:
            return None
        sig = {k: float(v) for k, v in signals.items() if isinstance(v, int | float)}
        base = self._base.setdefault(node, dict(sig))
        hist = self._hist.setdefault(node, collections.deque(maxlen=MAX_SAMPLES))
        # Reports come every heartbeat; the window keeps samples spaced window_s/MAX_SAMPLES
        # apart (the newest replaces a sample younger than that), so MAX_SAMPLES span it.
        if len(hist) >= 2 and now - hist[-2][0] < self.cfg.window_s / MAX_SAMPLES:
            hist[-1] = (now, sig)
        else:
            hist.append((now, sig))
        while hist and now - hist[0][0] > self.cfg.window_s:
            hist.popleft()
        why = self._why(sig, base, hist)
        if why is not None:
            self._base[node] = dict(sig)
            self._hist[node] = collections.deque([(now, sig)], maxlen=MAX_SAMPLES)
        return why

    def _why(
        self,
        sig: dict[str, float],
        base: dict[str, float],
        hist: collections.deque[tuple[float, dict[str, float]]],
    ) -> str | None:
        for key in _SUDDEN:
            if key in sig and sig[key] > base.get(key, sig[key]):
                return f"{key} rose from {base[key]:g} to {sig[key]:g}"
        for key in _RATE:
            first = next((s[key] for _, s in hist if key in s), None)
            if first is not None and key in sig and sig[key] - first >= self.cfg.ce_delta:
                span = hist[-1][0] - hist[0][0]
                return (
                    f"{key}: {sig[key] - first:g} corrected errors in {span:.0f}s "
                    f"(threshold {self.cfg.ce_delta:g} in {self.cfg.window_s:.0f}s)"
                )
        t, limit = sig.get("gpu_temp_c"), sig.get("gpu_temp_slowdown_c")
        if t is None or limit is None:
            return None
        if t >= limit - self.cfg.temp_margin_c:
            return f"GPU at {t:g} °C, {limit - t:g} °C from its slowdown threshold {limit:g} °C"
        slope = _slope([(at, s["gpu_temp_c"]) for at, s in hist if "gpu_temp_c" in s])
        if slope is not None and slope > 0 and (limit - t) / slope <= self.cfg.temp_horizon_s:
            return (
                f"GPU temperature climbing {slope * 60:.1f} °C/min, at {t:g} °C: its slowdown "
                f"threshold {limit:g} °C in about {(limit - t) / slope:.0f}s"
            )
        return None


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope (units per second) of (time, value) points, None when too few or
    too short a span to call a trend."""
    if len(points) < MIN_TREND_SAMPLES or points[-1][0] - points[0][0] < MIN_TREND_S:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var if var > 0 else None
