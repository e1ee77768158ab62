"""Straggler detection on the GPT example: how many windows it takes to name a slowed rank,
and what the timing costs.

Detection: ``trainguard run --nodes 4 --nproc-per-node 2`` (8 ranks) with one rank slowed
from step ``--slow-from`` on, by sleep injection (factors 1.2, 1.5, 2) and, as root, by a
cgroup CPU quota on one node's processes (its agent, spares and workers). Printed: the
ranks alerted, and the windows from the slowdown to the first alert (the minimum is
``straggler_persist_windows``, 3, plus the window the slowdown began in).

Overhead: one run of the example (1 node, 2 ranks) alternating blocks of ``--block`` steps
with section and collective timing on and off (``--timing-ab``); the ratio is the median
over "on" blocks of the block's median step time over the mean of its two neighbours'
(drift cancels, as in step_overhead.py). Two whole runs with and without the DDP timing
hook (``--no-time-ddp``) give the hook's own cost, with this VM's run-to-run drift in it.

Run: ``python benchmarks/straggler.py`` (``--json`` for one object; ``--skip-cgroup``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_overhead import step_times  # noqa: E402  (rank 0's step records of a run)

GPT = ROOT / "examples" / "gpt" / "train.py"
SMALL = ["--n-embd", "32", "--n-layer", "1", "--n-head", "2", "--block-size", "32",
         "--batch-size", "4", "--data-max-bytes", "200000"]  # fmt: skip
CONFIG = 'preflight = "off"\nheartbeat_s = 0.2\n'
WINDOW = 20
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


def _run(
    tmp: Path, name: str, run_args: list[str], script_args: list[str]
) -> subprocess.Popen[str]:
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG)
    cmd = [sys.executable, "-m", "trainguard", "run", "--run-dir", str(tmp / name),
           "--config", str(cfg), *run_args, str(GPT), *script_args]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if e["kind"] == kind:
                out.append(e)
    return out


def _step_reached(run_dir: Path, step: int) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and any(
        json.loads(x)["step"] >= step for x in path.read_text().splitlines() if x.strip()
    )


def _finish(p: subprocess.Popen[str]) -> None:
    _, err = p.communicate(timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"run failed:\n{err[-3000:]}")


def _result(run_dir: Path, slow_from: int, expect: list[int]) -> dict[str, Any]:
    alerts = _events(run_dir, "straggler")
    first = alerts[0] if alerts else None
    return {
        "alerted_ranks": sorted({a["rank"] for a in alerts}),
        "expected_ranks": expect,
        "first_alert_step": first["steps"][1] if first else None,
        "windows_to_flag": math.ceil((first["steps"][1] - (slow_from - 1)) / WINDOW)
        if first
        else None,
        "score": first["score"] if first else None,
        "node": first["node"] if first else None,
    }


def detect_sleep(tmp: Path, factor: float, steps: int, slow_from: int) -> dict[str, Any]:
    name = f"sleep{factor}"
    p = _run(tmp, name, ["--nodes", "4", "--nproc-per-node", "2", "--inject",
                         f"slow:rank=5:factor={factor}:step={slow_from}"],
             [*SMALL, "--steps", str(steps), "--ckpt-every", "10"])  # fmt: skip
    _finish(p)
    return _result(tmp / name, slow_from, [5])


def detect_cgroup(tmp: Path, steps: int, slow_from: int, quota_pct: int) -> dict[str, Any]:
    name = "cgroup"
    cg = CPU_CGROUP / f"tgbench{os.getpid()}"
    cg.mkdir()
    try:
        (cg / "cpu.cfs_quota_us").write_text(str(quota_pct * 1000))  # of a 100 ms period
        p = _run(tmp, name, ["--nodes", "4", "--nproc-per-node", "2"],
                 [*SMALL, "--steps", str(steps), "--ckpt-every", "10"])  # fmt: skip
        deadline = time.monotonic() + 600
        while not _step_reached(tmp / name, slow_from - 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        agent = next(
            q for q in psutil.process_iter(["cmdline"])
            if "--node-id" in (q.info["cmdline"] or []) and "node1" in (q.info["cmdline"] or [])
            and str(tmp / name) in " ".join(q.info["cmdline"] or [])
        )  # fmt: skip
        for q in [agent, *agent.children(recursive=True)]:
            with contextlib.suppress(OSError):
                (cg / "cgroup.procs").write_text(str(q.pid))
        _finish(p)
    finally:
        for _ in range(100):
            with contextlib.suppress(OSError):
                cg.rmdir()
                break
            time.sleep(0.1)
    return _result(tmp / name, slow_from, [2, 3])


def overhead(tmp: Path, steps: int, block: int) -> dict[str, Any]:
    p = _run(tmp, "ab", ["--nproc-per-node", "2"],
             ["--steps", str(steps), "--ckpt-every", "0", "--timing-ab", str(block)])  # fmt: skip
    _finish(p)
    blocks: dict[int, list[float]] = {}
    for step, dur in step_times(tmp / "ab"):
        b, pos = divmod(step - 1, block)
        if b >= 2 and pos > 0:
            blocks.setdefault(b, []).append(dur)
    pairs = [
        statistics.median(blocks[b]) / ((statistics.median(blocks[b - 1]) + statistics.median(blocks[b + 1])) / 2)
        for b in blocks if b % 2 == 0 and b - 1 in blocks and b + 1 in blocks
    ]  # fmt: skip
    on = [d for b, ds in blocks.items() if b % 2 == 0 for d in ds]
    off = [d for b, ds in blocks.items() if b % 2 == 1 for d in ds]
    whole = {}
    for name, extra in (("hook", []), ("no_hook", ["--no-time-ddp"])):
        p = _run(tmp, name, ["--nproc-per-node", "2"],
                 ["--steps", str(steps // 2), "--ckpt-every", "0", *extra])  # fmt: skip
        _finish(p)
        whole[name] = statistics.median(d for s, d in step_times(tmp / name) if s > 5)
    return {
        "median_step_s_timing_on": statistics.median(on),
        "median_step_s_timing_off": statistics.median(off),
        "timing_ratio": statistics.median(pairs),
        "block_ratios": [round(x, 4) for x in pairs],
        "median_step_s_ddp_hook": whole["hook"],
        "median_step_s_ddp_builtin": whole["no_hook"],
        "hook_ratio_whole_runs": whole["hook"] / whole["no_hook"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--slow-from", type=int, default=41)
    p.add_argument("--factors", default="1.2,1.5,2")
    p.add_argument("--quota-pct", type=int, default=5, help="cgroup: CPU %% of one core for node1")
    p.add_argument("--overhead-steps", type=int, default=400)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--skip-cgroup", action="store_true")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tg-straggler-"))
    out: dict[str, Any] = {}
    try:
        for f in (float(x) for x in args.factors.split(",")):
            out[f"sleep_x{f}"] = r = detect_sleep(tmp, f, args.steps, args.slow_from)
            if not args.json:
                print(f"sleep x{f}: {r}", flush=True)
        if not args.skip_cgroup and os.geteuid() == 0 and CPU_CGROUP.is_dir():
            out["cgroup"] = r = detect_cgroup(tmp, args.steps, args.slow_from, args.quota_pct)
            if not args.json:
                print(f"cgroup {args.quota_pct}% CPU on node1: {r}", flush=True)
        if args.skip_overhead:
            return 0
        out["overhead"] = r = overhead(tmp, args.overhead_steps, args.block)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"timing on vs off (alternating blocks of {args.block}): ratio {r['timing_ratio']:.4f} "
            f"(median step {r['median_step_s_timing_on'] * 1e3:.2f} ms on, "
            f"{r['median_step_s_timing_off'] * 1e3:.2f} ms off)"
        )
        print(
            f"DDP timing hook vs DDP's built-in all-reduce (whole runs): "
            f"{r['hook_ratio_whole_runs']:.3f} ({r['median_step_s_ddp_hook'] * 1e3:.2f} vs "
            f"{r['median_step_s_ddp_builtin'] * 1e3:.2f} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
