"""Training-step overhead of checkpointing every step, on the GPT example under ``trainguard run``.

Runs the example twice in one invocation, same model and seed: with a memory snapshot
every step (``--ckpt-every 1``, persisted to disk every ``--durable-every`` steps) and
with no checkpoint but the final one (``--ckpt-every 0``). Compares the median step time
(rank 0's step records in the run's store, the first 5 steps dropped as warm-up).

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


def median_step_s(run_dir: Path, warmup: int = 5) -> float:
    db = sqlite3.connect(run_dir / "job.sqlite")
    try:
        rows = db.execute(
            "SELECT duration_s FROM steps WHERE rank = 0 AND step > ? ORDER BY step", (warmup,)
        ).fetchall()
    finally:
        db.close()
    return statistics.median(r[0] for r in rows)


def run_once(tmp: Path, name: str, ckpt_every: int, args: argparse.Namespace) -> float:
    run_dir = tmp / name
    cmd = [
        sys.executable,
        "-m",
        "trainguard",
        "run",
        "--nodes",
        str(args.nodes),
        "--run-dir",
        str(run_dir),
        str(GPT),
        "--steps",
        str(args.steps),
        "--ckpt-every",
        str(ckpt_every),
        "--durable-every",
        str(args.durable_every),
        *args.model_args,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"{name} run failed:\n{res.stderr[-3000:]}")
    return median_step_s(run_dir)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--durable-every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of each")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "model_args", nargs="*", help="extra example flags after --, e.g. -- --n-embd 384"
    )
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tg-step-"))
    every, never = [], []
    try:
        for i in range(args.repeats):
            never.append(run_once(tmp, f"never{i}", 0, args))
            every.append(run_once(tmp, f"every{i}", 1, args))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r = {
        "median_step_s_every_step": statistics.median(every),
        "median_step_s_never": statistics.median(never),
    }
    r["step_time_ratio"] = r["median_step_s_every_step"] / r["median_step_s_never"]
    r["runs_every_step"], r["runs_never"] = every, never
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(
            f"median step, snapshot every step (durable every {args.durable_every}): "
            f"{r['median_step_s_every_step'] * 1e3:.1f} ms"
        )
        print(f"median step, no checkpoint: {r['median_step_s_never'] * 1e3:.1f} ms")
        print(f"step_time_ratio: {r['step_time_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
