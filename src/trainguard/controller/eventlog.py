"""What the executor does with each event ``decide`` returns: recorded, raised as an alert
when it is one (status, webhook, metrics), and logged once, when it happens."""

from __future__ import annotations

import logging
from typing import Any

from trainguard.controller.monitor import Monitor
from trainguard.controller.store import Store

log = logging.getLogger("trainguard.controller")
ALERTED = ("sdc_detected", "sdc_localized", "sdc_ruled_out")  # decide's events that alert


def record_decided(store: Store, monitor: Monitor, kind: str, data: dict[str, Any]) -> None:
    """Record one of ``decide``'s events, alert and log it as its kind wants."""
    store.record(kind, data)
    if kind in ALERTED:
        monitor.alert(kind, data)
    if kind == "fault" and data["cause"] == "hang":
        monitor.alert("hang_localized", data)
        store.record("hang_localized", data)
    elif kind == "fault_refined":
        first = data["message"].splitlines()[0][:200]
        log.info("[gen %s] fault re-attributed: %s", data["generation"], first)
    elif kind == "phase":
        log.info(
            "[gen %s] %s → %s: %s",
            data["generation"], data["from"], data["to"], data["reason"],
        )  # fmt: skip
    elif kind in ("sdc_localized", "sdc_unlocalized"):
        who = ", ".join(data["nodes"]) or "no node"
        log.warning(
            "silent data corruption at step %d named by recomputation: %s (%s; %s)",
            data["step"], who, data["how"], data["action"],
        )  # fmt: skip
    elif kind == "recovery_completed":
        took = ", ".join(
            f"{k} {v:.3f}s"
            for k, v in data["durations_s"].items()
            if v is not None and k != "total"
        )
        total = data["durations_s"]["total"] or -1
        log.info("[gen %d] recovered in %.2fs (%s)", data["generation"], total, took)
