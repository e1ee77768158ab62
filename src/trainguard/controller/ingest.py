"""From an agent's report to what the controller decides on: the node's observation
(``observe``: the latest report, with the facts that must outlive a report folded in) and the
recovery milestones every rank must reach (``Milestones``). Pure; the executor (server.py)
records the events and hands the milestones to ``decide`` as ``Inputs``."""

from __future__ import annotations

from typing import Any

from trainguard.controller.api import STEPS_SEEN_GENERATIONS, NodeObs, WorkerObs


def observe(node_id: str, body: dict[str, Any], old: NodeObs | None, now: float) -> NodeObs:
    """Node ``node_id``'s observation from its report ``body`` (validated by
    ``protocol.validate_report``) received at ``now`` (controller wall clock, s). ``old``: its
    previous observation; the newest step per generation carries over (``fold_steps``).
    Raises KeyError, TypeError or ValueError on a shape validation let through."""
    workers = {int(w["rank"]): WorkerObs(**w) for w in body.get("workers", [])}
    store = body.get("store")
    health = body.get("health") or {}
    o = NodeObs(
        node_id=node_id,
        addr=str(body["addr"]),
        incarnation=str(body["incarnation"]),
        last_seen=now,
        generation=body.get("generation"),
        workers=workers,
        hang=bool(body.get("hang")),
        stopped_generation=int(body.get("stopped_generation", -1)),
        stopped_at=body.get("stopped_at"),
        cleaned_at=body.get("cleaned_at"),
        memory={int(r): [tuple(p) for p in v] for r, v in (body.get("memory") or {}).items()},
        ckptd_idle=bool(body.get("ckptd_idle", True)),
        ckptd_at=body.get("ckptd_at"),
        replicas={int(r): [tuple(p) for p in v] for r, v in (body.get("replicas") or {}).items()},
        replica_addr=body.get("replica_addr"),
        fenced_generation=int(body.get("fenced_generation", -1)),
        health_ok=bool(health.get("ok", True)),
        health_problems=tuple(health.get("problems", [])),
        store=tuple(store) if store else None,  # type: ignore[arg-type]
        clock_skew_s=round(float(body["time"]) - now, 3) if "time" in body else None,
    )
    o.steps_seen = fold_steps(old, o, body.get("steps", []))
    return o


def addresses_changed(old: NodeObs | None, new: NodeObs) -> bool:
    """Whether peers' desired states must change: they name this node's addresses."""
    return old is None or (old.addr, old.replica_addr, old.incarnation) != (
        new.addr,
        new.replica_addr,
        new.incarnation,
    )


def fold_steps(old: NodeObs | None, new: NodeObs, batches: list[dict[str, Any]]) -> dict[int, int]:
    """``NodeObs.steps_seen`` after one more report: the old fold, the steps its workers show
    now, and its step records; the newest STEPS_SEEN_GENERATIONS generations kept. (Decisions
    run on a coalesced tick: a report after a stop lists no workers, and without the fold the
    steps of the report before it would never be seen.)"""
    seen = dict(old.steps_seen) if old is not None else {}
    now = [w.step for w in new.workers.values() if w.step is not None]
    if new.generation is not None and now:
        seen[new.generation] = max(seen.get(new.generation, 0), *now)
    for b in batches:
        steps = [int(it["step"]) for it in b["items"]]
        if steps:
            g = int(b["generation"])
            seen[g] = max(seen.get(g, 0), *steps)
    for g in sorted(seen)[:-STEPS_SEEN_GENERATIONS]:
        del seen[g]
    return seen


class FingerprintIndex:
    """The ranks' snapshot fingerprints by point, gathered from the reports as they arrive
    (work per report, not per tick), until every rank of the generation's world reported a
    point: ``complete`` then hands it to ``decide`` (``Inputs.fingerprints``) once. A report
    carries what its ckptd holds now, so a point stays gathered after its slot is reused.
    Bounded: the newest KEPT points gathered, the newest KEPT handed."""

    KEPT = 16

    def __init__(self) -> None:
        self._points: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        self._handed: set[tuple[int, int]] = set()

    def add(self, reported: dict[str, list[list[int]]]) -> None:
        """One report's ``fingerprints`` (rank → [step, gen, layout, value])."""
        for r, items in reported.items():
            for step, gen, layout, value in items:
                point = (int(gen), int(step))
                if point not in self._handed:
                    self._points.setdefault(point, {})[int(r)] = (int(layout), int(value))
        for point in sorted(self._points)[: -self.KEPT]:
            del self._points[point]

    def complete(
        self, generation: int, world: int
    ) -> list[tuple[int, int, dict[int, tuple[int, int]]]]:
        """(step, generation, rank → (layout, value)) of each point of ``generation`` that all
        ``world`` ranks reported, in step order; each once."""
        out = []
        for gen, step in sorted(self._points):
            fps = self._points[(gen, step)]
            if gen == generation and len(fps) >= world:
                out.append((step, gen, fps))
                del self._points[(gen, step)]
                self._handed.add((gen, step))
        if len(self._handed) > self.KEPT:
            self._handed = set(sorted(self._handed)[-self.KEPT :])
        return out


class Milestones:
    """When every rank of a generation reached a recovery's last phases, from the ranks'
    ``ckpt_load_start`` / ``ckpt_load_end`` events and their first step records: each
    milestone once, as ``(generation, name, wall time)`` for ``Inputs.milestones``
    (``jobstate.MILESTONES``). The time is the last rank's."""

    def __init__(self) -> None:
        self._marks: dict[str, dict[int, float]] = {}
        self._first_step: set[int] = set()  # generations whose first step was seen

    def clear(self) -> None:
        """A new recovery: its milestones are counted afresh."""
        self._marks.clear()

    def load(
        self, kind: str, gen: int, rank: int, ts: float, world: int
    ) -> list[tuple[int, str, float]]:
        """A rank's ``ckpt_load_start`` or ``ckpt_load_end`` at ``ts`` in generation ``gen``
        (the recovering one) of ``world`` ranks."""
        marks = self._marks.setdefault(f"{gen}:{kind}", {})
        marks[rank] = ts
        if len(marks) != world:
            return []
        name = "t_rendezvous" if kind == "ckpt_load_start" else "t_loaded"
        return [(gen, name, max(marks.values()))]

    def steps(
        self, gen: int, rank: int, items: list[dict[str, Any]], world: int
    ) -> tuple[dict[str, Any] | None, list[tuple[int, str, float]]]:
        """A rank's step records (``step``, ``t_end`` wall s, ``dur`` s). Returns the
        ``first_step`` event's data once every rank's first step of ``gen`` is in, and the
        first-step milestones then."""
        if gen in self._first_step or not items:
            return None, []
        first = min(items, key=lambda it: it["step"])
        ends = self._marks.setdefault(f"{gen}:first_step", {})
        ends.setdefault(rank, float(first["t_end"]))
        starts = self._marks.setdefault(f"{gen}:first_step_start", {})
        starts.setdefault(rank, float(first["t_end"]) - float(first["dur"]))
        if len(ends) < world:
            return None, []
        self._first_step.add(gen)
        t = max(ends.values())
        event = {"generation": gen, "step": first["step"], "t": t}
        return event, [(gen, "t_first_step_start", max(starts.values())), (gen, "t_first_step", t)]
