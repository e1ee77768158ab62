"""What the dashboard and the HTML report show, as one JSON object built from a run's store:
the job, its node pool, loss and throughput per step, per-rank progress, straggler scores
over time, the recovery timeline (each fault and its phases), the checkpoint tiers, the
goodput breakdown and the alerts.

``build_view(run_dir)`` reads the store read-only (the controller may be writing it), so the
controller serves it live (``GET /v1/view``) and ``trainguard report --html`` embeds it.
Series are thinned to ``max_points`` (every k-th step, the newest kept).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainguard.controller.analysis import DetectConfig, StragglerDetector
from trainguard.controller.api import RECOVERY_PHASES
from trainguard.controller.jobstate import pool_lists
from trainguard.controller.monitor import ALERT_KINDS
from trainguard.controller.store import open_readonly, read_events, read_kv
from trainguard.observe import goodput, local
from trainguard.observe.processes import processes
from trainguard.protocol import StepRecord

TIER_EVENTS = {  # tier → the event that says a step is held there
    "memory": "ckpt_staged",
    "peer replica": "replica_stored",
    "durable": "ckpt_durable",
    "archive": "archive_uploaded",
}


def _thin(points: list[Any], max_points: int) -> list[Any]:
    if len(points) <= max_points:
        return points
    k = -(-len(points) // max_points)
    return points[::k] + ([points[-1]] if (len(points) - 1) % k else [])


def build_view(run_dir: Path, *, max_points: int = 2000) -> dict[str, Any]:
    """The view of a run (see the module docstring). Raises FileNotFoundError for a directory
    that holds no trainguard store."""
    db = open_readonly(run_dir)
    try:
        state = read_kv(db, "state") or {}
        cfg = read_kv(db, "config") or {}
        events = read_events(db)
        rows = db.execute(
            "SELECT generation, rank, step, t_end, duration_s, loss, tokens, sections FROM steps "
            "ORDER BY t_end"
        ).fetchall()
    finally:
        db.close()
    starts = [i for i, e in enumerate(events) if e["kind"] == "job_started"]
    if starts:  # a run dir run again: its newest run
        events = events[starts[-1] :]
        first = next((e["generation"] for e in events if e["kind"] == "generation_started"), None)
        if first is not None:
            rows = [r for r in rows if r[0] >= first]
    t0, _ = goodput.wall_span(events)
    t1 = events[-1]["ts"] if events else None
    rank0 = [r for r in rows if r[1] == 0]
    kept: dict[int, tuple[Any, ...]] = {}  # step → its newest generation's record (rank 0)
    for r in rank0:
        if r[2] not in kept or r[0] >= kept[r[2]][0]:
            kept[r[2]] = r
    steps = [kept[s] for s in sorted(kept)]
    spent = goodput.breakdown([(r[0], r[2], r[4], r[7]) for r in rank0], events, state)
    loss = [[r[2], r[5]] for r in steps if r[5] is not None]
    throughput = [
        [r[2], (r[6] / r[4]) if r[6] else (1.0 / r[4]), r[3]] for r in steps if r[4] and r[4] > 0
    ]
    return {
        "run_dir": str(run_dir),
        "job": {
            "phase": state.get("phase"),
            "reason": state.get("reason", ""),
            "generation": state.get("generation"),
            "restarts": state.get("restarts", 0),
            "script": cfg.get("script"),
            "nodes": cfg.get("nodes"),
            "world_size": (cfg.get("nodes") or 0) * (cfg.get("nproc_per_node") or 1),
            "started": t0,
            "updated": t1,
            "last_step": steps[-1][2] if steps else None,
        },
        "nodes": _nodes(state, events),
        "lists": pool_lists(state.get("pools", {})),
        "loss": _thin(loss, max_points),
        # local recovery: steps trained without every replica group (marked on the loss curve)
        "reduced_width": [
            [r["step"], r["width"], r["missing_groups"]]
            for r in local.reduced_width(events, steps[-1][2] if steps else None)
        ][-max_points:],
        "throughput_unit": "tokens/s" if any(r[6] for r in steps) else "steps/s",
        "throughput": _thin(throughput, max_points),
        "ranks": _ranks(rows),
        "stragglers": _stragglers(rows, cfg, max_points),
        "recoveries": _recoveries(state, events),
        "checkpoints": _tiers(events),
        "goodput": spent,  # as trainguard report computes it (observe/goodput.py)
        "alerts": [e for e in events if e["kind"] in ALERT_KINDS][-50:],
    }


def _nodes(state: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    addr = {e["node"]: e.get("addr") for e in events if e["kind"] == "node_joined"}
    assignment = state.get("assignment", {})
    return [
        {"node": n, "pool": p, "addr": addr.get(n), "node_rank": assignment.get(n)}
        for n, p in sorted(state.get("pools", {}).items())
    ]


def _ranks(rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Per rank: newest step and its steps/s over its newest 20 steps."""
    by: dict[int, list[tuple[Any, ...]]] = {}
    for r in rows:
        by.setdefault(r[1], []).append(r)
    out = []
    for rank, rs in sorted(by.items()):
        last = rs[-20:]
        busy = sum(r[4] for r in last if r[4])
        out.append(
            {"rank": rank, "step": last[-1][2], "steps_per_s": len(last) / busy if busy else None}
        )
    return out


def _stragglers(
    rows: list[tuple[Any, ...]], cfg: dict[str, Any], max_points: int
) -> dict[str, list[list[float]]]:
    """rank → [[step, score]] as the controller's detector computed them, window by window
    (its scores replayed over the stored step records)."""
    world = (cfg.get("nodes") or 1) * (cfg.get("nproc_per_node") or 1)
    det = StragglerDetector(DetectConfig(window_steps=int(cfg.get("straggler_window_steps", 20))))
    series: dict[str, list[list[float]]] = {}
    seen: dict[int, float] = {}
    for gen, rank, step, t_end, dur, _loss, _tok, sec in rows:
        extra = json.loads(sec) if sec else {}
        item = StepRecord(
            step=step,
            t_end=t_end,
            duration_s=dur,
            sections={k: float(v) for k, v in extra.items() if k not in ("t_coll", "gap")},
            t_coll=extra.get("t_coll"),
            gap=extra.get("gap"),
        )
        det.add(gen, world, rank, [item])
        for r, score in det.scores.items():
            if seen.get(r) != score:
                seen[r] = score
                series.setdefault(str(r), []).append([step, round(score, 4)])
    return {r: _thin(pts, max_points) for r, pts in series.items()}


def _recoveries(state: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each fault with its phases as [name, start, end] (wall clock; missing marks skipped),
    its mode (in process or restart) and the processes it kept and started."""
    out = []
    attempts = list(state.get("recoveries", []))
    if state.get("recovery"):
        attempts.append(state["recovery"])
    for r in attempts:
        f = r["fault"]
        marks = [f.get("t_fault"), f.get("t_detected"), r.get("t_stopped"), r.get("t_cleaned"),
                 r.get("t_replaced"), r.get("t_rendezvous"), r.get("t_loaded"),
                 r.get("t_first_step")]  # fmt: skip
        phases = [
            [name, a, b]
            for name, a, b in zip(RECOVERY_PHASES[:-1], marks, marks[1:], strict=False)
            if a is not None and b is not None
        ]
        out.append(
            {
                "cause": f.get("cause"),
                "rank": f.get("rank"),
                "node": f.get("node_id"),
                "step": f.get("step"),
                "from_generation": r.get("from_generation"),
                "restore_step": r.get("restore_step"),
                "restore_tiers": r.get("restore_tiers", {}),
                "steps_lost": r.get("steps_lost"),
                "phases": phases,
                "total_s": (r.get("durations_s") or {}).get("total"),
                "mode": r.get("mode", "restart"),
                "mode_reason": r.get("mode_reason", ""),
                **processes(r, events),
            }
        )
    return out


def _tiers(events: list[dict[str, Any]]) -> dict[str, Any]:
    newest: dict[str, Any] = {}
    for tier, kind in TIER_EVENTS.items():
        steps = [e.get("step") for e in events if e["kind"] == kind and e.get("step") is not None]
        newest[tier] = max(steps) if steps else None
    return newest
