"""Where a run's wall time went, computed once for ``trainguard report`` (text and JSON) and
the job page (the dashboard and ``report --html``), so the two never disagree.

From rank 0's step records (each step counted once: the newest generation's run of it) and
the events of the run dir's newest run:

- ``wall_s``: ``job_started`` to ``job_ended`` (or the newest event, for a job still running
  or killed);
- ``preflight_s``: the pre-flight checks before the first generation, not counted against
  goodput (the nodes were not training yet);
- ``checkpoint_s``: the counted steps' ``checkpoint`` section, the time they were blocked in
  a save or waiting for its copy;
- ``productive_s``: the counted steps' time less that stall;
- ``recomputation_s``: steps run again after a restore (their earlier runs);
- ``recovery_s``: each recovery, fault to first resumed step (``durations_s.total``);
- ``other_s``: the rest (start-up, the first rendezvous, the end);
- ``ratio``: productive over wall time less pre-flight: goodput, the effective training time
  ratio (ETTR) of Google's "ML Goodput" and Meta's Llama 3 report. None when rank 0 reported
  no step (a script that never calls trainguard's runtime).
"""

from __future__ import annotations

import json
from typing import Any

# One rank-0 step record as the store holds it: (generation, step, duration_s, sections JSON).
Rank0Row = tuple[int, int, float, str | None]


def counted(rank0: list[Rank0Row]) -> list[Rank0Row]:
    """Each step once, as the newest generation ran it, in step order."""
    kept: dict[int, Rank0Row] = {}
    for r in rank0:
        if r[1] not in kept or r[0] >= kept[r[1]][0]:
            kept[r[1]] = r
    return [kept[s] for s in sorted(kept)]


def wall_span(events: list[dict[str, Any]]) -> tuple[float | None, float]:
    """When the job started (None: it never did) and its wall time in seconds, to its end or
    its newest event."""
    t0 = next((e["ts"] for e in events if e["kind"] == "job_started"), None)
    t1 = next(
        (e["ts"] for e in reversed(events) if e["kind"] == "job_ended"),
        events[-1]["ts"] if events else None,
    )
    return t0, (t1 - t0) if t0 is not None and t1 is not None else 0.0


def preflight_seconds(events: list[dict[str, Any]]) -> float:
    """Seconds of pre-flight checks before the first generation."""
    first = next((e["ts"] for e in events if e["kind"] == "generation_started"), None)
    return sum(
        float(e.get("stage_s", {}).get("total") or 0.0)
        for e in events
        if e["kind"] == "preflight_finished" and (first is None or e["ts"] <= first)
    )


def breakdown(
    rank0: list[Rank0Row], events: list[dict[str, Any]], state: dict[str, Any]
) -> dict[str, Any]:
    """The breakdown (module docstring) in seconds, and ``ratio``. ``rank0``: every rank-0
    step record of the newest run, all generations; ``state``: the job state as stored."""
    _, wall = wall_span(events)
    preflight = preflight_seconds(events)
    kept = counted(rank0)
    ids = {id(r) for r in kept}
    ckpt = sum(float(json.loads(r[3] or "{}").get("checkpoint", 0.0)) for r in kept)
    productive = max(0.0, sum(r[2] for r in kept if r[2]) - ckpt)
    redone = sum(r[2] for r in rank0 if r[2] and id(r) not in ids)
    recs = [*state.get("recoveries", []), *([state["recovery"]] if state.get("recovery") else [])]
    recovery = sum((r.get("durations_s") or {}).get("total") or 0.0 for r in recs)
    counted_s = wall - preflight
    return {
        "wall_s": wall,
        "ratio": productive / counted_s if kept and counted_s > 0 else None,
        "preflight_s": preflight,
        "productive_s": productive,
        "recomputation_s": redone,
        "recovery_s": recovery,
        "checkpoint_s": ckpt,
        "other_s": max(0.0, counted_s - productive - redone - recovery - ckpt),
    }
