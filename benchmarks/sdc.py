"""Silent data corruption on the GPT example: how fast a flipped bit is found, and what the
fingerprints cost.

Detection: ``trainguard run --nodes 2 --nproc-per-node 2 --standby 1`` (4 data-parallel
ranks) with ``--inject sdc:rank=0:step=S:bit=B`` for a float32 exponent bit (30), the top
mantissa bit (22) and the lowest mantissa bit (0). Printed per bit: the steps and seconds
from the flip to the ``sdc_detected`` event, the culprit named, the rollback point, the
steps recomputed, and whether the final losses equal a fault-free run's step for step.

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
BITS = {"exponent (bit 30)": 30, "high mantissa (bit 22)": 22, "low mantissa (bit 0)": 0}


def _run(tmp: Path, name: str, run_args: list[str], script_args: list[str],
         env: dict[str, str] | None = None) -> Path:  # fmt: skip
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG)
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
    ref = _losses(_run(tmp, "reference", FOUR, script))
    out = {}
    for name, bit in BITS.items():
        inject = ["--inject", f"sdc:rank=0:step={at}:bit={bit}"]
        run = _run(tmp, f"bit{bit}", [*FOUR, "--standby", "1", *inject], script)
        evs = _events(run)
        flip = next(e for e in evs if e["kind"] == "sdc_injected")
        found = [e for e in evs if e["kind"] == "sdc_detected"]
        row: dict[str, Any] = {"flipped_at_step": flip["step"], "before": flip["before"],
                               "after": flip["after"], "detected": bool(found)}  # fmt: skip
        if found:
            d = found[0]
            start = next(e for e in evs[evs.index(d) :] if e["kind"] == "generation_started")
            row.update(
                detected_at_step=d["step"],
                steps_to_detect=d["step"] - flip["step"],
                seconds_to_detect=round(d["ts"] - flip["ts"], 3),
                culprits=d["culprits"],
                rollback_to=start["restore_step"],
                steps_recomputed=d["step"] - (start["restore_step"] or 0),
            )
        row["losses_equal_fault_free"] = _losses(run) == ref
        out[name] = row
    return out


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
        result = {
            "detection": detection(tmp, args.steps, args.every, args.at),
            "overhead": [
                overhead(tmp, args.overhead_steps, every, args.block) for every in (1, args.every)
            ],
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"detection, 4 data-parallel ranks, snapshots every {args.every} steps:")
    for name, r in result["detection"].items():
        if not r["detected"]:
            print(f"  {name}: flipped at step {r['flipped_at_step']}, NOT detected")
            continue
        print(
            f"  {name}: {r['before']:.6g} -> {r['after']:.6g} at step {r['flipped_at_step']}; "
            f"found {r['steps_to_detect']} steps / {r['seconds_to_detect']} s later, culprit "
            f"rank(s) {r['culprits']}; rolled back to step {r['rollback_to']} "
            f"({r['steps_recomputed']} recomputed); losses equal a fault-free run: "
            f"{r['losses_equal_fault_free']}"
        )
    for o in result["overhead"]:
        print(
            f"overhead, snapshots every {o['snapshot_every']} step(s): step time with / without "
            f"fingerprints {o['ratio_median']} (median of {o['blocks']} block ratios; "
            f"{o['median_step_ms_with']} vs {o['median_step_ms_without']} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
