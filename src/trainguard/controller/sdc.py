"""Silent data corruption: the ranks' snapshot fingerprints compared, step by step.

Data-parallel replicas hold bit-identical parameters and optimizer state after every
optimizer step; each rank's ckptd fingerprints the replicated chunks of every verified
snapshot (``checkpoint/fingerprint.py``) and the agents report them. The executor gathers
them per point as reports arrive (``ingest.FingerprintIndex``); each point of the running
generation that every rank reported reaches ``decide`` once (``Inputs.fingerprints``), and
ranks holding the same chunks (the same ``layout``) are compared:

- all equal: the step is the newest known-good point (``JobState.fp_agreed``);
- a strict majority of at least 3 agrees: each rank outside it is a culprit (its node is
  quarantined and replaced), the SDC is a fault of the generation;
- 2 replicas, or no majority: the corruption is certain but not localized; the job rolls
  back, recomputes with one of the disagreeing nodes held out, and names the culprit from
  the recomputed state (``recompute.py``);
- different at the job's first comparison (before any step agreed): taken for ranks that do
  not hold replicas (tensor-parallel shards saved as plain tensors, per-rank buffers such as
  BatchNorm statistics), not for a corruption: the check is off for the job (``sdc_off``, one
  event says why). A false alarm would quarantine healthy nodes and roll back for ever.

On an SDC every point newer than the last known-good one, of this generation or an older
one, is suspect (``JobState.suspect``) and never restored: the corruption may have reached
it (a snapshot, a replica or a durable step written after it, before the detection).
Corruption that fingerprints cannot see (``Inputs.suspected``, ``check_suspected``): a node
whose GEMMs go wrong, or one corrupt local gradient, is averaged into every replica alike
before the optimizer step, and the replicas then agree. Two other signals see it:

- a failed in-job known-answer GEMM probe (``agent/probe.py``): the node is the culprit
  (quarantined, replaced); every point after its last passing probe is suspect, agreeing
  fingerprints or not;
- a gradient-norm spike (analysis.py): every point from the step before it on is suspect (the
  spike's cause is in that step's gradients or in the state it started from), and the job
  rolls back and recomputes the step from a checkpoint before it (the seeds' "verify by
  recomputing"). If the spike comes back at the same step, it is the data's (training is
  deterministic from a checkpoint) and the job goes on; a spike that does not come back was
  a transient corruption, and no node is named (the probes name a persistent one).

Pure: reads the observations, writes only the state it is given (``decide``'s copy).
"""

from __future__ import annotations

from trainguard.checkpoint.fingerprint import compare
from trainguard.controller import recompute
from trainguard.controller.api import Fault, Pool
from trainguard.controller.config import JobConfig
from trainguard.controller.jobstate import Event, JobState, Suspicion, known_good
from trainguard.controller.pools import mark_faulty
from trainguard.protocol import FaultCause


def check_fingerprints(
    s: JobState,
    points: list[tuple[int, int, dict[int, tuple[int, int]]]],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    standby: bool = False,
) -> Fault | None:
    """Compare the running generation's complete snapshot points (``Inputs.fingerprints``:
    step, generation, rank → (layout, value)), oldest first (see the module); a fault on an
    SDC, with culprits' nodes marked faulty and the suspect range recorded. A disagreement
    no majority decides is settled by recomputation (``recompute.py``; ``standby``: a
    healthy standby can take a held-out node's rank)."""
    if not cfg.sdc.sdc_check or s.sdc_off:
        return None
    for step, gen, fps in sorted(points):
        if gen != s.generation:
            continue
        culprits, undecided = compare(fps)
        named: list[str] = []
        settled = recompute.settle(s, cfg, step, fps, culprits + undecided)
        if settled is not None:
            named, out, data = settled
            agreed = not culprits and not undecided
            data["action"] = _act_on_named(s, now, cfg, events, named, out, agreed, standby)
            events.append(("sdc_localized" if named else "sdc_unlocalized", data))
        if not culprits and not undecided:
            s.fp_agreed = [step, gen]
            known_good(s, (step, gen))
            continue
        by_rank = recompute.nodes_of_ranks(s, cfg)
        if any(n in named for n in by_rank.values()):  # the recomputation named them
            culprits, undecided = sorted(r for r, n in by_rank.items() if n in named), []
        if s.fp_agreed is None:
            # Never agreed: more likely not replicas (per-rank tensors saved as plain state,
            # BatchNorm statistics) than a corruption before the first snapshot. A false SDC
            # would quarantine a healthy node and roll back for ever: turn the check off.
            s.sdc_off = True
            events.append(
                (
                    "sdc_check_off",
                    {
                        "generation": gen,
                        "step": step,
                        "culprits": culprits,
                        "undecided": undecided,
                        "reason": "the ranks' state fingerprints differ at the job's first "
                        "comparison: they do not hold replicas (per-rank tensors saved outside "
                        "per_rank, BatchNorm statistics, tensor-parallel shards saved as plain "
                        "tensors); set sdc_check = false to silence this",
                    },
                )
            )
            return None
        verify = settled is None and cfg.sdc.sdc_recompute and bool(undecided)
        return _fault(
            s, now, cfg, events, step, culprits, undecided, fps if verify else None, standby
        )
    return None


def _act_on_named(
    s: JobState,
    now: float,
    cfg: JobConfig,
    events: list[Event],
    named: list[str],
    out: str | None,
    agreed: bool,
    standby: bool,
) -> str:
    """Act on a recomputation's culprits (``recompute.settle``); returns what was done. A
    held-out culprit is quarantined (nothing to stop); one still in the job is drained at the
    next checkpoint boundary when the running state agrees and a standby can take its place
    (no step lost), kept when none can, and quarantined by the fault the caller raises when
    the running state disagrees."""
    acts = []
    for n in named:
        if n == out:
            mark_faulty(s, n, now, cfg, events, "silent data corruption (named by recomputation)")
            acts.append(f"{n} quarantined")
        elif n in s.assignment and not agreed:
            acts.append(f"{n} quarantined and replaced")
        elif n in s.assignment and (standby or out not in (None, *named)):  # out: innocent
            s.evict[n] = "silent data corruption: its state differed from the recomputed one"
            acts.append(f"{n} drained to a standby at the next checkpoint boundary")
        elif n in s.assignment:
            acts.append(f"{n} kept: no healthy standby to take its place")
    if out is not None and out not in named:
        acts.append(f"{out} back to standby")
    return "; ".join(acts) or "none"


def _fault(
    s: JobState,
    now: float,
    cfg: JobConfig,
    events: list[Event],
    step: int,
    culprits: list[int],
    undecided: list[int],
    fps: dict[int, tuple[int, int]] | None = None,
    standby: bool = False,
) -> Fault:
    """The SDC fault at ``step``; with ``fps`` (a disagreement to settle), a recomputation
    is recorded (``recompute.record``) and its held-out node leaves the job at the restart."""
    gen = s.generation
    good = s.fp_agreed
    after = good[0] if good is not None else (s.restore_step if s.restore_step is not None else -1)
    s.suspect.append([after, gen, step])
    by_rank = recompute.nodes_of_ranks(s, cfg)
    nodes = sorted({by_rank[r] for r in culprits if r in by_rank})
    verify = None if fps is None else recompute.record(s, cfg, step, fps, undecided, standby)
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
        if verify is not None:
            out = verify["held_out"]
            what += (
                f"; recomputing from the last agreeing step with {out} held out (a standby "
                "takes its rank)"
                if out
                else "; recomputing from the last agreeing step on the same nodes (no standby)"
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
                "signal": "fingerprints",
                "held_out": None if verify is None else verify["held_out"],
            },
        )
    )
    for n in nodes:
        mark_faulty(s, n, now, cfg, events, what)
    if verify is not None and verify["held_out"] is not None:
        out = verify["held_out"]
        s.pools[out] = Pool.STANDBY  # out of the job, nobody's replacement until the verdict
        events.append(
            (
                "pool_changed",
                {"node": out, "from": "running", "to": "standby",
                 "reason": f"held out while step {step} is recomputed without it"},
            )
        )  # fmt: skip
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


def check_suspected(
    s: JobState, signs: list[Suspicion], now: float, cfg: JobConfig, events: list[Event]
) -> Fault | None:
    """Act on the running generation's first sign of a corruption that fingerprints cannot
    see (see the module): a fault with the suspect range recorded (no exemption for agreeing
    points) and a probed culprit's node marked faulty; None when the signs are of another
    generation, the check is off, or a gradient spike came back where it was recomputed."""
    if not cfg.sdc.sdc_check:
        return None
    for sign in signs:
        if sign.generation != s.generation:
            continue
        if sign.signal == "grad_norm" and sign.step in s.recomputed:
            events.append(
                (
                    "sdc_ruled_out",
                    {
                        "generation": sign.generation,
                        "step": sign.step,
                        "signal": sign.signal,
                        "reason": f"{sign.detail}, again when recomputed from a checkpoint "
                        "before it: the data's, not a corruption",
                    },
                )
            )
            continue
        if sign.signal == "grad_norm":
            s.recomputed.append(sign.step)
        after = -1 if sign.after is None else sign.after
        if sign.after_generation is not None and sign.after_generation != s.generation:
            # The last pass was in an older generation (this one's first probe failed): what
            # this one computed, and its start point if written after that pass, is suspect.
            after = min(after, s.restore_step if s.restore_step is not None else -1)
        s.suspect.append([after, s.generation])  # no detected step: agreeing points too
        nodes = [sign.node] if sign.node is not None and sign.node in s.assignment else []
        where = f" on {sign.node}" if sign.node else ""
        what = f"silent data corruption{where} at step {sign.step}: {sign.detail}"
        events.append(
            (
                "sdc_detected",
                {
                    "generation": s.generation,
                    "step": sign.step,
                    "signal": sign.signal,
                    "detail": sign.detail,
                    "culprits": [],
                    "nodes": nodes,
                    "undecided": [],
                    "last_agreed": None,
                    "suspect_after": after,
                },
            )
        )
        for n in nodes:
            mark_faulty(s, n, now, cfg, events, what)
        back = f"a checkpoint of step {after} or older" if after >= 0 else "the start"
        return Fault(
            cause=FaultCause.SDC,
            generation=s.generation,
            rank=None,
            node_id=nodes[0] if nodes else None,
            step=sign.step,
            t_fault=now,
            t_detected=now,
            message=f"{what}; rolling back to {back}",
        )
    return None
