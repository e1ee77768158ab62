"""Straggler detection on the GPT example: how many windows it takes to name a slowed rank,
and what the timing costs.

Detection: ``trainguard run --nodes 4 --nproc-per-node 2`` (8 ranks) with one rank slowed
from step ``--slow-from`` on, by sleep injection (factors 1.2, 1.5, 2) and, as root, by a
cgroup CPU quota on one node's processes (its agent, spares and workers). Per case: the
ranks alerted against the ranks slowed, and the windows from the slowdown to the first alert
(the minimum is ``straggler_persist_windows``, 3, plus the window the slowdown began in).

Overhead: one run of the example (1 node, 2 ranks) alternating blocks of ``--block`` steps
with section and collective timing on and off (``--timing-ab``); the ratio is the median
over "on" blocks of the block's median step time over the mean of its two neighbours'
(drift cancels, as in step_overhead.py). Two whole runs with and without the DDP timing
hook (``--no-time-ddp``) give the hook's own cost, with this VM's run-to-run drift in it.

Keys: ``nodes``, ``nproc_per_node``, ``world``, ``window_steps``, ``steps``, ``slow_from``,
``detection`` (a list, one entry a case: ``case``, ``alerted_ranks``, ``expected_ranks``,
``right_ranks``, ``first_alert_step``, ``windows_to_flag``, ``score``, ``node``),
``right_ranks_every_case``, ``overhead`` (null with ``--skip-overhead``). Target: the right
rank(s) named, and no other, in every case.

``--smoke``: 2 nodes of 2 ranks, windows of 5 steps, one sleep case (x2), no cgroup case, a
short overhead run (CI). ``--record`` writes ``benchmarks/results/straggler.json``
(``table_rows``). Run: ``python benchmarks/straggler.py`` (``--skip-cgroup``).
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

import common
import psutil
from step_overhead import (
    GPT,
    ROOT,
    SMALL,
    ab_blocks,
    block_ratios,
    min_steps,
    model_text,
    run_to_end,
    step_times,
)

CONFIG = 'preflight = "off"\nheartbeat_s = 0.2\nstraggler_window_steps = {window}\n'
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


class Runs:
    """The benchmark's ``trainguard run`` jobs, each in a run dir under ``tmp``."""

    def __init__(self, tmp: Path, window: int, timeout: float) -> None:
        self.tmp, self.window, self.timeout = tmp, window, timeout

    def command(self, name: str, run_args: list[str], script_args: list[str]) -> list[str]:
        cfg = self.tmp / f"{name}.toml"
        cfg.write_text(CONFIG.format(window=self.window))
        return [sys.executable, "-m", "trainguard", "run", "--run-dir", str(self.tmp / name),
                "--config", str(cfg), *run_args, str(GPT), *script_args]  # fmt: skip

    def run(self, name: str, run_args: list[str], script_args: list[str]) -> Path:
        rc, err = run_to_end(self.command(name, run_args, script_args), self.timeout)
        if rc != 0:
            raise SystemExit(f"straggler.py: run {name} failed:\n{err[-3000:]}")
        return self.tmp / name


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
    if not path.exists():
        return False
    with contextlib.suppress(ValueError):  # a line being written
        return any(json.loads(x)["step"] >= step for x in path.read_text().splitlines() if x)
    return False


def _result(
    case: str, run_dir: Path, slow_from: int, window: int, expect: list[int]
) -> dict[str, Any]:
    alerts = _events(run_dir, "straggler")
    first = alerts[0] if alerts else None
    alerted = sorted({a["rank"] for a in alerts})
    return {
        "case": case,
        "alerted_ranks": alerted,
        "expected_ranks": expect,
        "right_ranks": alerted == expect,
        "first_alert_step": first["steps"][1] if first else None,
        "windows_to_flag": math.ceil((first["steps"][1] - (slow_from - 1)) / window)
        if first
        else None,
        "score": first["score"] if first else None,
        "node": first["node"] if first else None,
    }


def detect_sleep(
    runs: Runs, factor: float, a: argparse.Namespace, script: list[str]
) -> dict[str, Any]:
    name = f"sleep{factor}"
    run_args = ["--nodes", str(a.nodes), "--nproc-per-node", str(a.nproc_per_node), "--inject",
                f"slow:rank={a.slow_rank}:factor={factor}:step={a.slow_from}"]  # fmt: skip
    run = runs.run(name, run_args, script)
    return _result(f"sleep x{factor:g}", run, a.slow_from, runs.window, [a.slow_rank])


def detect_cgroup(runs: Runs, a: argparse.Namespace, script: list[str]) -> dict[str, Any]:
    """node1's agent and everything under it in a cgroup with ``--quota-pct`` of one core,
    from step ``--slow-from`` on: its ranks are the expected ones."""
    name, run_dir = "cgroup", runs.tmp / "cgroup"
    cmd = runs.command(name, ["--nodes", str(a.nodes), "--nproc-per-node", str(a.nproc_per_node)],
                       script)  # fmt: skip
    cg = CPU_CGROUP / f"tgbench{os.getpid()}"
    cg.mkdir()
    p: subprocess.Popen[str] | None = None
    try:
        (cg / "cpu.cfs_quota_us").write_text(str(a.quota_pct * 1000))  # of a 100 ms period
        p = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        deadline = time.monotonic() + runs.timeout
        while not _step_reached(run_dir, a.slow_from - 1) and time.monotonic() < deadline:
            if p.poll() is not None:
                break
            time.sleep(0.05)
        agent = next(
            (q for q in psutil.process_iter(["cmdline"])
             if "--node-id" in (q.info["cmdline"] or []) and "node1" in (q.info["cmdline"] or [])
             and str(run_dir) in " ".join(q.info["cmdline"] or [])),
            None,
        )  # fmt: skip
        if agent is not None:
            for q in [agent, *agent.children(recursive=True)]:
                with contextlib.suppress(OSError):
                    (cg / "cgroup.procs").write_text(str(q.pid))
        _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if p.returncode != 0:
            raise SystemExit(f"straggler.py: the cgroup run failed:\n{err[-3000:]}")
    finally:
        if p is not None:
            common.stop(p)
        for _ in range(100):  # its processes leave the cgroup as they exit
            with contextlib.suppress(OSError):
                cg.rmdir()
                break
            time.sleep(0.1)
    ranks = list(range(a.nproc_per_node, 2 * a.nproc_per_node))  # node1's
    return _result(f"cgroup {a.quota_pct}% of a core on node1", run_dir, a.slow_from,
                   runs.window, ranks)  # fmt: skip


def overhead(runs: Runs, steps: int, block: int, model: list[str]) -> dict[str, Any]:
    """The timing's cost: one run of ``steps`` alternating blocks of ``block`` steps with
    timing on and off, and two whole runs of ``steps // 2`` with and without the DDP timing
    hook; 1 node of 2 ranks, the example's ``model`` flags."""
    two = ["--nproc-per-node", "2"]
    jobs = [
        ("ab", two, [*model, "--steps", str(steps), "--ckpt-every", "0", "--timing-ab", str(block)]),
        ("hook", two, [*model, "--steps", str(steps // 2), "--ckpt-every", "0"]),
        ("no_hook", two, [*model, "--steps", str(steps // 2), "--ckpt-every", "0", "--no-time-ddp"]),
    ]  # fmt: skip
    dirs = [runs.run(*job) for job in jobs]
    blocks = ab_blocks(step_times(dirs[0]), block, 0)
    pairs = block_ratios(blocks)
    on = [d for b, ds in blocks.items() if b % 2 == 0 for d in ds]
    off = [d for b, ds in blocks.items() if b % 2 == 1 for d in ds]
    hook, builtin = (statistics.median(d for s, d in step_times(r) if s > 5) for r in dirs[1:])
    if not pairs or not on or not off:
        raise SystemExit("straggler.py: the timing run logged too few steps for a block ratio")
    return {
        "block": block,
        "steps": steps,
        "model_args": model,
        "median_step_s_timing_on": statistics.median(on),
        "median_step_s_timing_off": statistics.median(off),
        "timing_ratio": statistics.median(pairs),
        "block_ratios": [round(x, 4) for x in pairs],
        "median_step_s_ddp_hook": hook,
        "median_step_s_ddp_builtin": builtin,
        "hook_ratio_whole_runs": hook / builtin if builtin > 0 else 0.0,
    }


def _case_text(c: dict[str, Any]) -> str:
    if not c["alerted_ranks"]:
        return f"{c['case']}: no alert"
    ranks = ", ".join(str(r) for r in c["alerted_ranks"])
    return f"{c['case']}: rank{'s' if len(c['alerted_ranks']) > 1 else ''} {ranks} after {c['windows_to_flag']} windows"


def table_rows(result: dict[str, Any]) -> list[common.Row]:
    """The README's rows: the ranks named per case against the target (the right ones, no
    other), and the timing's overhead."""
    cases = result["detection"]
    wrong = [c["case"] for c in cases if not c["right_ranks"]]
    rows: list[common.Row] = [
        {
            "what": (
                f"straggler, one rank (or node) of {result['world']} slowed from step "
                f"{result['slow_from']} ({result['nodes']} simulated nodes, tiny GPT, windows "
                f"of {result['window_steps']} steps)"
            ),
            "result": "; ".join(_case_text(c) for c in cases),
            "target": "right rank(s) named, no other: "
            + ("met" if not wrong and cases else f"**not met** ({', '.join(wrong) or 'no case'})"),
        }
    ]
    o = result["overhead"]
    if o is not None:
        rows.append(
            {
                "what": (
                    "timing overhead: section + collective timing on vs off (GPT example, "
                    f"{model_text(o['model_args'])}; 1 node × 2 ranks, "
                    f"alternating blocks of {o['block']} steps); DDP timing hook vs "
                    "DDP's built-in all-reduce (whole runs)"
                ),
                "result": (
                    f"step time ratio {o['timing_ratio']:.4f} "
                    f"({o['median_step_s_timing_on'] * 1e3:.2f} vs "
                    f"{o['median_step_s_timing_off'] * 1e3:.2f} ms); hook "
                    f"{o['hook_ratio_whole_runs']:.3f}×"
                ),
                "target": "—",
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--slow-from", type=int, default=41)
    p.add_argument("--factors", default="1.2,1.5,2")
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes of the detection runs")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--slow-rank", type=int, default=5, help="the rank the sleep cases slow")
    p.add_argument("--window", type=int, default=20, help="straggler_window_steps")
    p.add_argument("--quota-pct", type=int, default=5, help="cgroup: CPU %% of one core for node1")
    p.add_argument("--overhead-steps", type=int, default=400)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--skip-cgroup", action="store_true")
    p.add_argument("--skip-overhead", action="store_true")
    common.add_common(p, smoke="4 ranks, windows of 5 steps, one sleep case, a short overhead run")
    a = p.parse_args(argv)
    if a.smoke:
        a.nodes, a.slow_rank, a.window, a.slow_from, a.steps = 2, 1, 5, 16, 46
        a.factors, a.skip_cgroup, a.overhead_steps, a.block = "2", True, 24, 4
    world = a.nodes * a.nproc_per_node
    if world < 3 or not 0 <= a.slow_rank < world or a.window < 2:
        p.error("--nodes x --nproc-per-node must be >= 3 (the detector compares a rank with "
                "the others), --slow-rank within the world, --window >= 2")  # fmt: skip
    if not a.skip_overhead and a.overhead_steps < max(min_steps(a.block, 0), 12):
        p.error(f"--overhead-steps must be >= {max(min_steps(a.block, 0), 12)}")
    script = [*SMALL, "--steps", str(a.steps), "--ckpt-every", "10"]
    tmp = Path(tempfile.mkdtemp(prefix="tg-straggler-"))
    runs = Runs(tmp, a.window, 600 if a.smoke else 1800)
    cases: list[dict[str, Any]] = []
    over: dict[str, Any] | None = None
    try:
        for f in (float(x) for x in a.factors.split(",")):
            cases.append(r := detect_sleep(runs, f, a, script))
            if not a.json:
                print(_case_text(r), flush=True)
        if not a.skip_cgroup and os.geteuid() == 0 and (CPU_CGROUP / "cgroup.procs").exists():
            cases.append(r := detect_cgroup(runs, a, script))
            if not a.json:
                print(_case_text(r), flush=True)
        if not a.skip_overhead:
            over = overhead(runs, a.overhead_steps, a.block, [*SMALL] if a.smoke else [])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {
        "nodes": a.nodes,
        "nproc_per_node": a.nproc_per_node,
        "world": world,
        "window_steps": a.window,
        "steps": a.steps,
        "slow_from": a.slow_from,
        "detection": cases,
        "right_ranks_every_case": all(c["right_ranks"] for c in cases),
        "overhead": over,
    }
    common.finish("straggler", a, out, argv)
    if not a.json and over is not None:
        print(
            f"timing on vs off (alternating blocks of {a.block}): ratio "
            f"{over['timing_ratio']:.4f} (median step {over['median_step_s_timing_on'] * 1e3:.2f}"
            f" ms on, {over['median_step_s_timing_off'] * 1e3:.2f} ms off)"
        )
        print(
            f"DDP timing hook vs DDP's built-in all-reduce (whole runs): "
            f"{over['hook_ratio_whole_runs']:.3f} ({over['median_step_s_ddp_hook'] * 1e3:.2f} vs "
            f"{over['median_step_s_ddp_builtin'] * 1e3:.2f} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
