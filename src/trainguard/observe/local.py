"""Local recovery's account (replica groups, ``runtime/replica.py``), from the run's events:
each group restart (what failed, how long until the group was back in the quorum with a
peer's state, what the heal moved), and each step trained at reduced width with the batches
that were not trained. Those steps are a departure from the fault-free run by design; the
report, the dashboard and the loss curve show them.

A batch is named by (step, rank): the data shard of job rank ``r`` at step ``s`` (in the GPT
example ``BatchSampler(seed, rank=r).batch(s)``); a group's missing batches are its ranks'.
"""

from __future__ import annotations

from typing import Any


def _epochs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each generation's quorum epochs once (every group's slot 0 reports the ones it
    entered): generation, epoch, members, and ``step``, the steps done when it began."""
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for e in events:
        if e["kind"] != "quorum_epoch":
            continue
        k = (int(e.get("generation") or 0), int(e["epoch"]))
        if k not in seen:
            seen[k] = {"generation": k[0], "epoch": k[1], "members": list(e["members"]),
                       "step": int(e["step"]), "ts": e.get("ts")}  # fmt: skip
    return [seen[k] for k in sorted(seen)]


def reduced_width(events: list[dict[str, Any]], last_step: int | None) -> list[dict[str, Any]]:
    """Every step trained by fewer than all groups: ``{"step", "width", "missing_groups",
    "missing_batches": [[step, rank], …]}``, from the epochs' members and starts."""
    first = next((e for e in events if e["kind"] == "quorum_epoch"), None)
    epochs = _epochs(events)
    if first is None:
        return []
    groups, size = int(first.get("groups", 0)), int(first.get("group_size", 1))
    out: dict[int, dict[str, Any]] = {}
    for i, ep in enumerate(epochs):
        nxt = epochs[i + 1] if i + 1 < len(epochs) else None
        same_gen = nxt is not None and nxt["generation"] == ep["generation"]
        end = nxt["step"] if same_gen and nxt is not None else (last_step or ep["step"])
        missing = [g for g in range(groups) if g not in ep["members"]]
        if not missing:
            continue
        for step in range(ep["step"] + 1, end + 1):
            out[step] = {
                "step": step,
                "width": len(ep["members"]),
                "missing_groups": missing,
                "missing_batches": [[step, g * size + s] for g in missing for s in range(size)],
            }
    return [out[s] for s in sorted(out)]


def local_recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each replica group restart: group, generation, reason, the epoch it left at, and once
    it was back: ``rejoined_s`` (fault → in the quorum with the peer's state), the heal's
    source group, bytes and seconds, the step it rejoined at."""
    out = []
    for i, e in enumerate(events):
        if e["kind"] != "group_restarted":
            continue
        g, gen = e["group"], e.get("generation")
        later = events[i + 1 :]
        until = next((j for j, x in enumerate(later) if x["kind"] == "group_restarted"
                      and x.get("group") == g and x.get("generation") == gen), len(later))  # fmt: skip
        healed = next(
            (x for x in later[:until] if x["kind"] == "group_healed" and x.get("group") == g
             and x.get("generation") == gen and x.get("slot", 0) == 0),
            None,
        )  # fmt: skip
        t_fault = e.get("t_fault") or e.get("ts")
        rec: dict[str, Any] = {
            "group": g, "generation": gen, "reason": e.get("reason"),
            "incarnation": e.get("incarnation"), "left_epoch": e.get("epoch"),
            "store_reached": e.get("store_reached", True),
            "rejoined_s": None, "heal": None,
        }  # fmt: skip
        if healed is not None:
            rec["rejoined_s"] = round(float(healed["ts"]) - float(t_fault), 3)
            rec["heal"] = {k: healed.get(k) for k in ("source_group", "step", "bytes", "seconds",
                                                         "epoch")}  # fmt: skip
        out.append(rec)
    return out


def fallbacks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Faults of a group that local recovery left to global recovery, and why."""
    return [
        {k: e.get(k) for k in ("generation", "group", "reason", "because")}
        for e in events
        if e["kind"] == "group_fallback"
    ]
