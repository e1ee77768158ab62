"""Which processes each recovery kept and which it started, from the run's events (the
report's and the dashboard's)."""

from __future__ import annotations

from typing import Any


def processes(recovery: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """Which processes a recovery kept and which are new: ``kept`` and ``new`` rank → pid
    (the ``worker_resumed`` and ``worker_started`` events of the generation it started), and
    ``escalated``: the kept ranks killed instead (``inprocess_escalated``: rank, reason)."""
    to, frm = recovery.get("to_generation"), recovery.get("from_generation")
    kept = {str(e["rank"]): e["pid"] for e in events
            if e["kind"] == "worker_resumed" and e.get("generation") == to}  # fmt: skip
    new = {str(e["rank"]): e["pid"] for e in events
           if e["kind"] == "worker_started" and e.get("generation") == to}  # fmt: skip
    escalated = [
        {"rank": e.get("rank"), "reason": e.get("reason")}
        for e in events
        if e["kind"] == "inprocess_escalated" and e.get("generation") in (frm, to)
    ]
    return {"kept": kept, "new": new, "escalated": escalated}
