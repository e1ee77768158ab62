"""A run dir as a long job leaves it, written with the controller's own ``Store``: a job of
``ranks`` ranks (2 nodes) that trained ``steps`` steps in two generations with one recovery
between them (a rank SIGKILLed at the middle step, resumed REDONE steps back), checkpoints in every tier, straggler and
loss-spike alerts. The step records are what the runtime reports (loss, tokens, a
communication section, the gap between collectives), with noise; nothing else is faked."""

from __future__ import annotations

import math
import random
from pathlib import Path

from trainguard.controller.store import Store
from trainguard.protocol import StepRecord

T0 = 1_796_000_000.0  # wall clock of the job's start
STEP_S = 0.25
REDONE = 20  # steps between the checkpoint restored and the fault: run twice


def synthetic_run(run: Path, steps: int, ranks: int = 8) -> Path:
    """Write the run dir at ``run`` (created); returns it."""
    run.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    s = Store(run)
    s.put("config", {"nodes": 2, "nproc_per_node": ranks // 2, "script": "train.py",
                     "straggler_window_steps": 20})  # fmt: skip
    s.record("job_started", {"nodes": 2, "world_size": ranks}, ts=T0)
    for n in ("node0", "node1"):
        s.record("node_joined", {"node": n, "addr": f"10.0.0.{n[-1]}"}, ts=T0 + 0.5)
    fault_at, restore = steps // 2, steps // 2 - REDONE
    t, gen = T0 + 2.0, 0
    s.record("generation_started", {"generation": 0}, ts=t)
    plan = [*range(1, fault_at + 1), *range(restore + 1, steps + 1)]
    for k, step in enumerate(plan):
        if k == fault_at:  # the recovery: 6 s, resumed from the checkpoint REDONE steps back
            t += 6.0
            gen = 1
            s.record("generation_started", {"generation": 1, "restore_step": restore}, ts=t)
        t += STEP_S
        loss = 4.0 * math.exp(-step / (steps / 3)) + 1.0 + rng.gauss(0, 0.02)
        for rank in range(ranks):
            comm = rng.uniform(0.02, 0.05)
            sections = {"communication": comm}
            if step % 50 == 0:  # a save's stall
                sections["checkpoint"] = 0.02
            item = StepRecord(step=step, t_end=t, duration_s=STEP_S * rng.uniform(0.95, 1.05),
                              loss=loss, tokens=8192, sections=sections,
                              gap=STEP_S - comm + rng.gauss(0, 0.005))  # fmt: skip
            s.add_steps(gen, rank, [item])
        if step % 50 == 0:
            s.record("ckpt_staged", {"generation": gen, "step": step}, ts=t)
        if step % 500 == 0:
            s.record("ckpt_durable", {"generation": gen, "step": step}, ts=t + 1.0)
    s.record("straggler", {"generation": 0, "rank": 3, "node": "node1", "score": 0.3,
                           "steps": [100, 160]}, ts=T0 + 60)  # fmt: skip
    s.record("loss_spike", {"generation": 1, "step": steps - 5, "loss": 9.0}, ts=t - 1.0)
    s.record("job_ended", {}, ts=t + 1.0)
    fault = {"cause": "worker_crash", "rank": 1, "node_id": "node0", "step": fault_at,
             "generation": 0, "message": "rank 1 exited by SIGKILL", "t_fault": T0 + 2 + fault_at * STEP_S,
             "t_detected": T0 + 2.1 + fault_at * STEP_S}  # fmt: skip
    t_fault = float(fault["t_fault"])  # type: ignore[arg-type]
    recovery = {"fault": fault, "from_generation": 0, "to_generation": 1,
                "restore_step": restore, "steps_lost": REDONE, "restore_tiers": {"memory": ranks},
                "t_stopped": t_fault + 0.6, "t_cleaned": t_fault + 0.8, "t_replaced": t_fault + 1.0,
                "t_rendezvous": t_fault + 3.0, "t_loaded": t_fault + 4.0,
                "t_first_step": t_fault + 6.0, "durations_s": {"total": 6.0}}  # fmt: skip
    s.put("state", {"phase": "SUCCEEDED", "reason": "done", "generation": 1, "restarts": 1,
                    "pools": {"node0": "running", "node1": "running"},
                    "assignment": {"node0": 0, "node1": 1}, "recoveries": [recovery]})  # fmt: skip
    s.close()
    return run


def html_report(run: Path, out: Path, timeout: float = 300.0) -> str:
    """``trainguard report --run-dir RUN --html OUT`` in a process of its own, as users run it;
    the file's text (AssertionError with its stderr if the command fails)."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", "--run-dir", str(run), "--html", str(out)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return out.read_text()
