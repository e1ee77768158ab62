"""Silent data corruption on the GPT example: how fast a flipped bit is found, and what the
fingerprints cost.

Detection: ``trainguard run --nodes 2 --nproc-per-node 2 --standby 1`` (4 data-parallel
ranks) with ``--inject sdc:rank=0:step=S:bit=B`` for a float32 exponent bit (30), the top
mantissa bit (22) and the lowest mantissa bit (0) of a parameter; the top mantissa bit of an
Adam moment (``target=optimizer``); an exponent and a mantissa bit of a gradient before the
all-reduce (``target=grad``: every replica applies the same corrupt average); and node1
computing wrong GEMMs from step S on (``gemm-wrong:node=1:step=S``, the in-job probe every
second). Printed per case: the signal that saw it, the steps and seconds from the fault to the
``sdc_detected`` event, the culprit named, the rollback point, the steps recomputed, and
whether the final losses equal a fault-free run's step for step.

Costs of the other signals, measured in-process: one known-answer probe (``health/probe.py``,
256x256) as a duty cycle at the default ``probe_every_s``, and the gradient norm the example
computes each step against that model's step.

Overhead: the same job without a fault in one run whose ckptd fingerprints snapshots only
in every other block of ``--block`` steps (``TRAINGUARD_FINGERPRINT_AB``), with snapshots
every step and every ``--every`` steps; the ratio is the median over blocks with
fingerprints of the block's median step time over its neighbours' (ckptd competes with
training for this machine's 2 cores, so this is where a cost would show). Whole runs
compared one after the other differed by ±20% on this VM, more than any effect.

Run: ``python benchmarks/sdc.py`` (``--json`` for one object).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_overhead import step_times  # noqa: E402  (rank 0's step records of a run)
from straggler import GPT, SMALL  # noqa: E402  (the example and its small model)

CONFIG = 'preflight = "off"\nheartbeat_s = 0.2\nnode_timeout_s = 3.0\nfault_stop_grace_s = 0.1\n'
FOUR = ["--nodes", "2", "--nproc-per-node", "2"]
# name -> (inject, job config added, slower pace): parameter flips, then what fingerprints
# cannot see (a gradient before the all-reduce, a node's GEMMs), then what nothing sees.
CASES: dict[str, tuple[str, str, bool]] = {
    "parameter, exponent (bit 30)": ("sdc:rank=0:step={at}:bit=30", "", False),
    "parameter, high mantissa (bit 22)": ("sdc:rank=0:step={at}:bit=22", "", False),
    "parameter, low mantissa (bit 0)": ("sdc:rank=0:step={at}:bit=0", "", False),
    "Adam moment, high mantissa (bit 22)": (
        "sdc:rank=0:step={at}:target=optimizer:bit=22", "", False),
    "gradient, exponent (bit 30)": ("sdc:rank=0:step={at}:target=grad:bit=30", "", True),
    "node1's GEMMs wrong from step S": (
        "gemm-wrong:node=1:step={at}", "probe_every_s = 1.0\n", True),
    "gradient, high mantissa (bit 22)": ("sdc:rank=0:step={at}:target=grad:bit=22", "", True),
}  # fmt: skip
PACE = ["--inject", "slow:rank=0:factor=4"]  # steps 4x longer: a probe every second sees them


def _run(tmp: Path, name: str, run_args: list[str], script_args: list[str],
         env: dict[str, str] | None = None, config: str = "") -> Path:  # fmt: skip
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG + config)
    run = tmp / name
    cmd = [sys.executable, "-m", "trainguard", "run", "--run-dir", str(run), "--config",
           str(cfg), *run_args, str(GPT), *script_args]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, **(env or {})})  # fmt: skip
    if res.returncode != 0:
        raise SystemExit(f"{name}: trainguard run failed:\n{res.stderr[-2000:]}")
    return run


def _events(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]


def _losses(run: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


def detection(tmp: Path, steps: int, every: int, at: int) -> dict[str, Any]:
    script = [*SMALL, "--steps", str(steps), "--ckpt-every", str(every),
              "--durable-every", str(every)]  # fmt: skip
    ref_run = _run(tmp, "reference", FOUR, script)
    ref = _losses(ref_run)
    out: dict[str, Any] = {"reference_step_s": statistics.median(d for _, d in step_times(ref_run))}
    for i, (name, (inject, config, slow)) in enumerate(CASES.items()):
        drill = ["--inject", inject.format(at=at), *(PACE if slow else [])]
        run = _run(tmp, f"case{i}", [*FOUR, "--standby", "1", *drill], script, config=config)
        evs = _events(run)
        flip = next(e for e in evs if e["kind"] == "sdc_injected"
                    or (e["kind"] == "inject_fired" and e["inject"]["kind"] == "gemm-wrong"))  # fmt: skip
        found = [e for e in evs if e["kind"] == "sdc_detected"]
        row: dict[str, Any] = {"flipped_at_step": flip["step"], "before": flip.get("before"),
                               "after": flip.get("after"), "detected": bool(found)}  # fmt: skip
        if found:
            d = found[0]
            start = next(e for e in evs[evs.index(d) :] if e["kind"] == "generation_started")
            row.update(
                signal=d.get("signal", "fingerprints"),
                detected_at_step=d["step"],
                steps_to_detect=d["step"] - flip["step"],
                seconds_to_detect=round(d["ts"] - flip["ts"], 3),
                culprits=d["culprits"] or d["nodes"],
                rollback_to=start["restore_step"],
                steps_recomputed=d["step"] - (start["restore_step"] or 0),
            )
        row["losses_equal_fault_free"] = _losses(run) == ref
        out[name] = row
    return out


def signal_costs(step_s: float) -> dict[str, Any]:
    """Seconds of one known-answer probe (as the probe process runs it) and of the example's
    gradient norm of the small model (in-process, one thread), the norm against ``step_s``
    (the 4-rank reference run's median step: what it adds to each step there)."""
    import time

    import torch

    from trainguard.controller.config import JobConfig
    from trainguard.health.probe import KnownAnswer

    torch.set_num_threads(1)
    probe = KnownAnswer(256, "cpu")
    probe.run(wrong=False)
    t = []
    for _ in range(50):
        t0 = time.perf_counter()
        probe.run(wrong=False)
        t.append(time.perf_counter() - t0)
    per_probe = statistics.median(t)
    every = JobConfig(script="x", run_dir="/tmp/x").sdc.probe_every_s
    sys.path.insert(0, str(GPT.parent))
    from model import GPT as Model  # noqa: E402  (the example's model)
    from model import GPTConfig  # noqa: E402

    torch.manual_seed(0)
    model = Model(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32, dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (4, 32))
    norms = []
    for _ in range(60):
        opt.zero_grad(set_to_none=True)
        model(x, x).backward()
        t1 = time.perf_counter()
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        norms.append(time.perf_counter() - t1)
        opt.step()
    norm, step = statistics.median(norms[10:]), step_s
    return {
        "probe_ms": round(per_probe * 1e3, 3),
        "probe_every_s": every,
        "probe_duty_cycle": per_probe / every,
        "grad_norm_ms": round(norm * 1e3, 4),
        "step_ms": round(step * 1e3, 3),
        "grad_norm_share": round(norm / step, 4),
    }


def overhead(tmp: Path, steps: int, every: int, block: int) -> dict[str, Any]:
    """One run, snapshots every ``every`` steps, ckptd fingerprinting only in every other
    block of ``block`` steps (``TRAINGUARD_FINGERPRINT_AB``): each block with fingerprints
    against the mean of its two neighbours' median step times (drift cancels, as in
    step_overhead.py); the first step of a block and the first two blocks are dropped."""
    script = [*SMALL, "--steps", str(steps), "--ckpt-every", str(every),
              "--durable-every", str(10 * block)]  # fmt: skip
    run = _run(tmp, f"ab{every}", FOUR, script, {"TRAINGUARD_FINGERPRINT_AB": str(block)})
    blocks: dict[int, list[float]] = {}
    for step, dur in step_times(run):
        b, pos = divmod(step - 1 + block // 2, block)
        if b >= 2 and pos > 0:
            blocks.setdefault(b, []).append(dur)
    ratios = [
        statistics.median(blocks[b])
        / ((statistics.median(blocks[b - 1]) + statistics.median(blocks[b + 1])) / 2)
        for b in blocks
        if b % 2 == 0 and b - 1 in blocks and b + 1 in blocks
    ]
    on = [d for b, ds in blocks.items() if b % 2 == 0 for d in ds]
    off = [d for b, ds in blocks.items() if b % 2 == 1 for d in ds]
    return {
        "snapshot_every": every,
        "median_step_ms_with": round(statistics.median(on) * 1e3, 2),
        "median_step_ms_without": round(statistics.median(off) * 1e3, 2),
        "ratio_median": round(statistics.median(ratios), 4),
        "blocks": len(ratios),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5, help="snapshot (fingerprint) interval")
    p.add_argument("--at", type=int, default=23, help="the step the flip is due")
    p.add_argument("--overhead-steps", type=int, default=400)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tg-sdc-"))
    try:
        detection_result = detection(tmp, args.steps, args.every, args.at)
        result = {
            "detection": detection_result,
            "overhead": [
                overhead(tmp, args.overhead_steps, every, args.block) for every in (1, args.every)
            ],
            "signal_costs": signal_costs(detection_result["reference_step_s"]),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"detection, 4 data-parallel ranks, snapshots every {args.every} steps:")
    for name, r in result["detection"].items():
        if name == "reference_step_s":
            continue
        what = f"{r['before']:.6g} -> {r['after']:.6g} " if r["before"] is not None else ""
        if not r["detected"]:
            print(f"  {name}: {what}at step {r['flipped_at_step']}, NOT detected; losses equal "
                  f"a fault-free run: {r['losses_equal_fault_free']}")  # fmt: skip
            continue
        print(
            f"  {name}: {what}at step {r['flipped_at_step']}; found by {r['signal']} "
            f"{r['steps_to_detect']} steps / {r['seconds_to_detect']} s later, culprit "
            f"{r['culprits'] or 'not named'}; rolled back to step {r['rollback_to']} "
            f"({r['steps_recomputed']} recomputed); losses equal a fault-free run: "
            f"{r['losses_equal_fault_free']}"
        )
    c = result["signal_costs"]
    print(f"GEMM probe: {c['probe_ms']} ms each, every {c['probe_every_s']:g} s by default: "
          f"{c['probe_duty_cycle']:.2e} of one core; gradient norm: {c['grad_norm_ms']} ms of a "
          f"{c['step_ms']} ms step ({c['grad_norm_share']:.2%})")  # fmt: skip
    for o in result["overhead"]:
        print(
            f"overhead, snapshots every {o['snapshot_every']} step(s): step time with / without "
            f"fingerprints {o['ratio_median']} (median of {o['blocks']} block ratios; "
            f"{o['median_step_ms_with']} vs {o['median_step_ms_without']} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
