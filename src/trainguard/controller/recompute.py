"""Naming the culprit of a disagreement that no majority decides, by recomputation (the
seeds' "verify on another node"; issue 15).

Two data-parallel replicas whose snapshot fingerprints differ at step S prove a corruption
but not where it is. Training is deterministic from a checkpoint (bitwise on CPU; on GPU with
deterministic kernels), so the job rolls back to the last agreeing step P < S as for any
SDC, with one of the disagreeing nodes *held out*: a healthy standby takes its rank and the
held-out node is nobody's replacement until the verdict (``JobState.sdc_verify``). The
recomputed generation reaches S again, and its fingerprints decide:

- they agree (value V): V is S's true state; each old node whose value at S differs from V
  is the culprit. A held-out culprit is quarantined (it returns only after its re-check); a
  culprit still in the job is drained to a standby at the next checkpoint boundary (a planned
  stop: no step lost); an innocent held-out node returns to standby;
- they differ again: every node that computed S, old run and new, votes with its value;
  a value held by at least two distinct nodes and by more nodes than any other is the true
  state, the others are culprits (a fault of the running generation, quarantined and
  replaced);
- they differ at an earlier step: the node in both disagreements is the culprit (the other
  two are distinct machines that each disagreed with it);
- anything else (no value with a majority of nodes, or the recomputation agreed past S
  without S's fingerprints) leaves it unlocalized; the held-out node returns to standby.

Without a healthy standby nothing is held out: the rerun on the same nodes still names a
culprit whose error was transient (the recomputation agrees). Pure: writes only ``s``.
"""

from __future__ import annotations

import collections
from typing import Any

from trainguard.controller.config import JobConfig
from trainguard.controller.jobstate import JobState

Fps = dict[int, tuple[int, int]]  # rank → (layout, value)


def nodes_of_ranks(s: JobState, cfg: JobConfig) -> dict[int, str]:
    """Global rank → node of the running generation."""
    return {
        r * cfg.nproc_per_node + i: n
        for n, r in s.assignment.items()
        for i in range(cfg.nproc_per_node)
    }


def record(
    s: JobState, cfg: JobConfig, step: int, fps: Fps, undecided: list[int], standby: bool
) -> dict[str, Any]:
    """Start a recomputation for the disagreement at ``step`` among ``undecided`` ranks: the
    record, with the held-out node (the disagreeing node of the highest node rank) when a
    healthy standby can take its place. Returns the record (also ``s.sdc_verify``)."""
    by_rank = nodes_of_ranks(s, cfg)
    values = [[r, by_rank[r], *fps[r]] for r in undecided if r in by_rank and r in fps]
    nodes = sorted({v[1] for v in values}, key=lambda n: s.assignment[n])
    out = nodes[-1] if standby and nodes else None
    s.sdc_verify = {
        "step": step,
        "generation": s.generation,
        "values": values,
        "nodes": nodes,
        "held_out": out,
    }
    return s.sdc_verify


def _truth_by_votes(opinions: dict[str, set[tuple[int, int]]]) -> dict[int, int] | None:
    """Per layout, the value held by the most distinct nodes (at least two, and strictly
    more than any other value); None when a layout has no such value."""
    votes: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for held in opinions.values():
        for layout, value in held:
            votes[layout][value] += 1
    truth = {}
    for layout, counter in votes.items():
        ranked = counter.most_common(2)
        if ranked[0][1] < 2 or (len(ranked) > 1 and ranked[1][1] == ranked[0][1]):
            return None
        truth[layout] = ranked[0][0]
    return truth


def settle(
    s: JobState,
    cfg: JobConfig,
    step: int,
    fps: Fps,
    disagreeing: list[int],
) -> tuple[list[str], str | None, dict[str, Any]] | None:
    """Weigh the running generation's point ``step`` against the pending recomputation
    (``s.sdc_verify``, of an older generation): None when this point says nothing about it;
    else ``(culprit nodes, held-out node, event data)`` (no culprit: unlocalized) and the
    record cleared. The caller acts on the nodes and records the ``sdc_localized`` (or
    ``sdc_unlocalized``) event with its action."""
    v = s.sdc_verify
    if v is None or s.generation <= v["generation"]:
        return None
    target = int(v["step"])
    if step < target and not disagreeing:
        return None
    by_rank = nodes_of_ranks(s, cfg)
    old: dict[str, set[tuple[int, int]]] = collections.defaultdict(set)
    for _, node, layout, value in v["values"]:
        old[node].add((int(layout), int(value)))
    new: dict[str, set[tuple[int, int]]] = collections.defaultdict(set)
    for r, fp in fps.items():
        if r in by_rank:
            new[by_rank[r]].add(fp)
    helpers = sorted(set(new) - set(old))
    culprits: list[str] = []
    how = ""
    if step == target and not disagreeing:
        truth = {layout: value for held in new.values() for layout, value in held}
        culprits = [
            n for n in v["nodes"] if any(lo in truth and truth[lo] != va for lo, va in old[n])
        ]
        how = f"step {target} recomputed on {', '.join(sorted(new))}: their states agree"
    elif step == target:
        opinions = {n: old.get(n, set()) | new.get(n, set()) for n in set(old) | set(new)}
        truth_or_none = _truth_by_votes(opinions)
        if truth_or_none is not None:
            culprits = sorted(
                n for n, held in opinions.items()
                if any(truth_or_none.get(lo) != va for lo, va in held)
            )  # fmt: skip
            how = f"step {target} recomputed on {', '.join(sorted(new))}: a majority of nodes"
    elif step < target:
        now_bad = {by_rank[r] for r in disagreeing if r in by_rank}
        common = sorted(now_bad & set(v["nodes"]))
        if len(common) == 1:
            culprits = common
            how = (
                f"it disagreed with {', '.join(n for n in v['nodes'] if n not in common)} at "
                f"step {target} and with {', '.join(sorted(now_bad - set(common)))} at step "
                f"{step} of the recomputation"
            )
    else:
        how = f"the recomputation agreed past step {target} without its fingerprints"
    s.sdc_verify = None
    data = {
        "step": target,
        "generation": v["generation"],
        "nodes": culprits,
        "held_out": v["held_out"],
        "recomputed_on": helpers,
        "at_step": step,
        "how": how or "no value has a majority of the nodes that computed it",
    }
    return culprits, v["held_out"], data
