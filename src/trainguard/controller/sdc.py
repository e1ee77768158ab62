"""Silent data corruption: the ranks' snapshot fingerprints compared, step by step.

Data-parallel replicas hold bit-identical parameters and optimizer state after every
optimizer step; each rank's ckptd fingerprints the replicated chunks of every verified
snapshot (``checkpoint/fingerprint.py``) and the agents report them. For each snapshot step
of the running generation that every rank reported, ranks holding the same chunks (the same
``layout``) are compared:

- all equal: the step is the newest known-good point (``JobState.fp_agreed``);
- a strict majority of at least 3 agrees: each rank outside it is a culprit (its node is
  quarantined and replaced), the SDC is a fault of the generation;
- 2 replicas, or no majority: the corruption is certain but not localized; the job rolls
  back without quarantining anyone;
- different from the job's first comparison on, with no majority: the ranks are not
  replicas (tensor-parallel shards saved as plain tensors, per-rank buffers such as
  BatchNorm statistics): the check is off for the job (``sdc_off``, one event says why).

On an SDC every point newer than the last known-good one, of this generation or an older
one, is suspect (``JobState.suspect``) and never restored: the corruption may have reached
it (a snapshot, a replica or a durable step written after it, before the detection).
Pure: reads the observations, writes only the state it is given (``decide``'s copy).
"""

from __future__ import annotations

from trainguard.checkpoint.fingerprint import compare
from trainguard.controller.api import Fault, JobConfig, NodeObs
from trainguard.controller.jobstate import Event, JobState, known_good
from trainguard.controller.pools import mark_faulty
from trainguard.protocol import FaultCause


def _points(
    s: JobState, obs: dict[str, NodeObs], cfg: JobConfig
) -> dict[int, dict[int, tuple[int, int]]]:
    """step → rank → (layout, value) of the current generation, past ``fp_checked``."""
    gen = s.generation
    after = s.fp_checked[0] if s.fp_checked and s.fp_checked[1] == gen else -1
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for node, node_rank in s.assignment.items():
        o = obs.get(node)
        if o is None:
            continue
        for i in range(cfg.nproc_per_node):
            rank = node_rank * cfg.nproc_per_node + i
            for (step, g), fp in o.fingerprints.get(rank, {}).items():
                if g == gen and step > after:
                    out.setdefault(step, {})[rank] = fp
    return out


def check_fingerprints(
    s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig, events: list[Event]
) -> Fault | None:
    """Compare the running generation's new complete snapshot steps (see the module); a
    fault on an SDC, with culprits' nodes marked faulty and the suspect range recorded."""
    if not cfg.sdc_check or s.sdc_off:
        return None
    world = len(s.assignment) * cfg.nproc_per_node
    gen = s.generation
    for step, fps in sorted(_points(s, obs, cfg).items()):
        if len(fps) < world:
            continue  # not every rank's snapshot of it is in (yet, or it skipped this one)
        s.fp_checked = [step, gen]
        culprits, undecided = compare(fps)
        if not culprits and not undecided:
            s.fp_agreed = [step, gen]
            known_good(s, (step, gen))
            continue
        if s.fp_agreed is None and not culprits:
            s.sdc_off = True
            events.append(
                (
                    "sdc_check_off",
                    {
                        "generation": gen,
                        "step": step,
                        "reason": "the ranks' state fingerprints differ from the first "
                        "comparison on, with no majority: they do not hold replicas (tensor-"
                        "parallel shards saved as plain tensors, per-rank buffers); set "
                        "sdc_check = false to silence this",
                    },
                )
            )
            return None
        return _fault(s, obs, now, cfg, events, step, culprits, undecided)
    return None


def _fault(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    step: int,
    culprits: list[int],
    undecided: list[int],
) -> Fault:
    gen = s.generation
    good = s.fp_agreed
    after = good[0] if good is not None else (s.restore_step if s.restore_step is not None else -1)
    s.suspect.append([after, gen])
    by_rank = {r * cfg.nproc_per_node + i: n for n, r in s.assignment.items()
               for i in range(cfg.nproc_per_node)}  # fmt: skip
    nodes = sorted({by_rank[r] for r in culprits if r in by_rank})
    if culprits:
        what = (
            f"silent data corruption: at step {step} the state of rank(s) "
            f"{', '.join(map(str, culprits))} differs from its replicas' (majority vote)"
        )
    else:
        what = (
            f"silent data corruption: at step {step} ranks {', '.join(map(str, undecided))} "
            "hold different states and no majority names the culprit"
        )
    back = f"step {good[0]} (generation {good[1]})" if good else "before any agreeing step"
    events.append(
        (
            "sdc_detected",
            {
                "generation": gen,
                "step": step,
                "culprits": culprits,
                "nodes": nodes,
                "undecided": undecided,
                "last_agreed": good,
                "suspect_after": after,
            },
        )
    )
    for n in nodes:
        mark_faulty(s, n, now, cfg, events, what)
    return Fault(
        cause=FaultCause.SDC,
        generation=gen,
        rank=culprits[0] if culprits else None,
        node_id=nodes[0] if nodes else None,
        step=step,
        t_fault=now,
        t_detected=now,
        message=f"{what}; rolling back to the last agreeing {back}",
    )
