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
blocks, of the block's median step time over the mean of its two neighbours' medians. Step
times are rank 0's, from the example's ``metrics.jsonl`` (each step's end, wall clock): the
interval from one step's end to the next, the one trainguard's runtime records as a step.

Keys: ``nodes``, ``steps``, ``block``, ``durable_every``, ``model_args`` (the example's
model flags; empty: its defaults), ``median_step_s_every_step``, ``median_step_s_never``,
``steps_measured_each``, ``step_time_ratio``, ``block_ratios``. Target: a snapshot every
step costs at most 2% (``step_time_ratio`` <= 1.02).

``--smoke``: the tiny model, 24 steps in blocks of 4 (CI). ``--record`` writes
``benchmarks/results/step_overhead.json`` (``table_rows``). Run:
``python benchmarks/step_overhead.py [--json] [-- EXAMPLE FLAGS]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import common

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt" / "train.py"
# The example's model at a size for smoke runs and many-rank cases on 2 cores.
SMALL = ["--n-embd", "32", "--n-layer", "1", "--n-head", "2", "--block-size", "32",
         "--batch-size", "4", "--data-max-bytes", "200000"]  # fmt: skip
TARGET = 1.02  # a snapshot every step: at most 2% on the step time


def model_text(model_args: list[str]) -> str:
    """The example's model as a table cell says it: its default size, the tiny one (``SMALL``)
    or the flags given."""
    if not model_args:
        return "default size"
    if model_args == SMALL:
        return "tiny model"
    return " ".join(model_args)


def step_times(run_dir: Path) -> list[tuple[int, float]]:
    """(step, seconds) for each step of rank 0 in the example's ``metrics.jsonl`` (one line a
    step: step, loss, wall time at its end): the time since the previous step's end. A step
    whose previous step is not logged (the first) has none; a step logged twice (after a
    restart) counts its last line."""
    ends: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            rec = json.loads(line)
            ends[int(rec["step"])] = float(rec["time"])
    return [(s, ends[s] - ends[s - 1]) for s in sorted(ends) if s - 1 in ends]


def ab_blocks(times: list[tuple[int, float]], block: int, offset: int) -> dict[int, list[float]]:
    """Step times by block of ``block`` steps (shifted by ``offset``), without each block's
    first step and without the first two blocks (warm-up). Even blocks are the "on" side."""
    blocks: dict[int, list[float]] = {}
    for step, dur in times:
        b, pos = divmod(step - 1 + offset, block)
        if b >= 2 and pos > 0:
            blocks.setdefault(b, []).append(dur)
    return blocks


def block_ratios(blocks: dict[int, list[float]]) -> list[float]:
    """Each "on" (even) block's median step time over the mean of its two neighbours'
    medians (this VM's drift cancels); blocks without both neighbours are left out."""
    out = []
    for b in sorted(blocks):
        if b % 2 == 0 and b - 1 in blocks and b + 1 in blocks:
            ref = (statistics.median(blocks[b - 1]) + statistics.median(blocks[b + 1])) / 2
            if ref > 0:
                out.append(statistics.median(blocks[b]) / ref)
    return out


def min_steps(block: int, offset: int) -> int:
    """The fewest steps that give one block ratio (block 4 against blocks 3 and 5)."""
    return 5 * block + 2 - offset


def run_to_end(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run ``cmd`` (a ``trainguard run``) to its end: (exit status, stderr). Past ``timeout``
    seconds, or on an exception here, it gets SIGTERM (trainguard run stops its nodes) and then
    SIGKILL, and the error is raised."""
    p = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    try:
        _, err = p.communicate(timeout=timeout)
    except BaseException:
        common.stop(p)
        raise
    return p.returncode, err


def table_rows(result: dict[str, Any]) -> list[common.Row]:
    """The README's "Measured" row: the step-time ratio against the 2% target."""
    model = model_text(result["model_args"])
    ratios = result["block_ratios"]
    nodes = result["nodes"]
    return [
        {
            "what": (
                f"step time, snapshot every step (durable every {result['durable_every']}) vs "
                f"never (GPT example, {model}; {nodes} node{'s' if nodes != 1 else ''}, "
                f"{result['steps']} steps in alternating blocks of {result['block']})"
            ),
            "result": (
                f"{result['step_time_ratio']:.3f}× ("
                f"{result['median_step_s_every_step'] * 1e3:.1f} vs "
                f"{result['median_step_s_never'] * 1e3:.1f} ms median step; "
                f"{len(ratios)} block ratio{'s' if len(ratios) != 1 else ''} "
                f"{min(ratios):.2f}–{max(ratios):.2f})"
            ),
            "target": common.verdict(
                result["step_time_ratio"],
                TARGET,
                "×",
                "the persister's checksums and durable writes share the 2 cores with the step",
            ),
        }
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--durable-every", type=int, default=10)
    p.add_argument(
        "model_args", nargs="*", help="extra example flags after --, e.g. -- --n-embd 384"
    )
    common.add_common(p, smoke="the tiny model, 24 steps in blocks of 4 (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.block, args.durable_every = 24, 4, 4
        args.model_args = [*SMALL, *args.model_args]
    if args.block < 2 or args.nodes < 1 or args.durable_every < 0:
        p.error("--block must be >= 2, --nodes >= 1, --durable-every >= 0")
    if args.steps < min_steps(args.block, args.block // 2):
        p.error(
            f"--steps must be >= {min_steps(args.block, args.block // 2)} for --block {args.block}"
        )
    tmp = Path(tempfile.mkdtemp(prefix="tg-step-"))
    try:
        run_dir = tmp / "run"
        cmd = [
            sys.executable, "-m", "trainguard", "run", "--nodes", str(args.nodes),
            "--run-dir", str(run_dir), str(GPT), "--steps", str(args.steps),
            "--ckpt-every", "1", "--durable-every", str(args.durable_every),
            "--ckpt-ab", str(args.block), *args.model_args,
        ]  # fmt: skip
        rc, err = run_to_end(cmd, 300 if args.smoke else 3600)
        if rc != 0:
            raise SystemExit(f"step_overhead.py: the run failed:\n{err[-3000:]}")
        blocks = ab_blocks(step_times(run_dir), args.block, args.block // 2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    every = [d for b, ds in blocks.items() if b % 2 == 0 for d in ds]
    never = [d for b, ds in blocks.items() if b % 2 == 1 for d in ds]
    pairs = block_ratios(blocks)
    if not pairs or not every or not never:
        raise SystemExit("step_overhead.py: the run logged too few steps for a block ratio")
    r = {
        "nodes": args.nodes,
        "steps": args.steps,
        "block": args.block,
        "durable_every": args.durable_every,
        "model_args": args.model_args,
        "median_step_s_every_step": statistics.median(every),
        "median_step_s_never": statistics.median(never),
        "steps_measured_each": min(len(every), len(never)),
        "step_time_ratio": statistics.median(pairs),
        "block_ratios": [round(x, 4) for x in pairs],
    }
    common.finish("step_overhead", args, r, argv)
    if not args.json:
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
