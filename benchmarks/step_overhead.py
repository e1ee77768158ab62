"""Training-step overhead of checkpointing every step, on the GPT example under ``trainguard run``.

One run of the example (same model and seed as its defaults) alternates blocks of
``--block`` steps with a memory snapshot every step (persisted to disk every
``--durable-every`` steps) and blocks with no checkpoint (``--ckpt-ab``). Alternating
inside one run makes this noisy 2-core VM's drift (step times wander by ±30% over a
minute) hit both sides equally; whole runs compared one after the other did not.
Blocks are offset by half a block so that durable steps (multiples of
``--durable-every``, 10) fall mid-block: their persistence runs during, and is charged
to, the checkpointing block. The first step of each block is dropped (it still carries
the previous block's mode: an overlapped copy finishes during the next step), and so
are the first two blocks (warm-up). ``step_time_ratio`` is the median, over checkpointing
blocks, of the block's median step time over the mean of its two neighbours' medians. Step times are rank 0's step records in the run's store.

Run: ``python benchmarks/step_overhead.py`` (``--json``: one object with ``step_time_ratio``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt" / "train.py"


def step_times(run_dir: Path) -> list[tuple[int, float]]:
    db = sqlite3.connect(run_dir / "job.sqlite")
    try:
        return db.execute(
            "SELECT step, duration_s FROM steps WHERE rank = 0 ORDER BY step"
        ).fetchall()
    finally:
        db.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--durable-every", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "model_args", nargs="*", help="extra example flags after --, e.g. -- --n-embd 384"
    )
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tg-step-"))
    try:
        run_dir = tmp / "run"
        cmd = [
            sys.executable, "-m", "trainguard", "run", "--nodes", str(args.nodes),
            "--run-dir", str(run_dir), str(GPT), "--steps", str(args.steps),
            "--ckpt-every", "1", "--durable-every", str(args.durable_every),
            "--ckpt-ab", str(args.block), *args.model_args,
        ]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if res.returncode != 0:
            raise RuntimeError(f"the run failed:\n{res.stderr[-3000:]}")
        blocks: dict[int, list[float]] = {}
        for step, dur in step_times(run_dir):
            block, pos = divmod(step - 1 + args.block // 2, args.block)
            if block >= 2 and pos > 0:
                blocks.setdefault(block, []).append(dur)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    every = [d for b, ds in blocks.items() if b % 2 == 0 for d in ds]
    never = [d for b, ds in blocks.items() if b % 2 == 1 for d in ds]
    # each checkpointing block against the mean of its two neighbours (drift cancels)
    pairs = [
        statistics.median(blocks[b])
        / ((statistics.median(blocks[b - 1]) + statistics.median(blocks[b + 1])) / 2)
        for b in blocks
        if b % 2 == 0 and b - 1 in blocks and b + 1 in blocks
    ]
    r = {
        "median_step_s_every_step": statistics.median(every),
        "median_step_s_never": statistics.median(never),
        "steps_measured_each": min(len(every), len(never)),
        "step_time_ratio": statistics.median(pairs),
        "block_ratios": pairs,
    }
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(
            f"median step, snapshot every step (durable every {args.durable_every}): "
            f"{r['median_step_s_every_step'] * 1e3:.1f} ms"
        )
        print(f"median step, no checkpoint: {r['median_step_s_never'] * 1e3:.1f} ms")
        ratios = ", ".join(f"{x:.2f}" for x in r["block_ratios"])
        print(f"step_time_ratio (median of block ratios): {r['step_time_ratio']:.3f}")
        print(f"  {r['steps_measured_each']} steps each; per-block ratios: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
