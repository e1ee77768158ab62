"""How long the pre-flight's quick level takes: ``trainguard check --nodes N --json`` (the
README's pre-flight command, simulated nodes on this machine), run ``--repeats`` times.

Issue 5's target: the quick level of 4 simulated nodes under 60 s, on this project's 2-core
machine when nothing else runs on it (the nodes share its cores; a second job beside it
doubles the time, as CI's parallel test worker does). Keys: ``total_s`` (each run's
``stage_s.total``, the checks' own time as the check reports it), ``wall_s`` (each run's wall
time, with the interpreter start and the torch imports), ``median_total_s``, ``stage_s`` (the
median run's per-stage seconds), ``target_s`` (60), ``within_target`` (median total under it),
``load_1min`` (the load average before the first run: a loaded machine's figure is not the
target's), ``cpus``, ``abnormal`` (each run's abnormal list: empty on a healthy machine).

``--smoke``: 2 nodes, one run, a 120 s timeout (the CI test of this file). ``--record`` writes
``benchmarks/results/preflight.json`` for the README's table (``table_rows``). Run from the
repository root: ``python benchmarks/preflight.py --json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common

TARGET_S = 60.0  # issue 5: the quick level of 4 simulated nodes under a minute


def _check(tmp: Path, nodes: int, i: int, timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "check", "--nodes", str(nodes), "--json",
         "--run-dir", str(tmp / f"check{i}")],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    wall = time.monotonic() - t0
    if out.returncode not in (0, 1):
        raise SystemExit(f"preflight.py: trainguard check failed: {out.stderr.strip()[-500:]}")
    result = json.loads(out.stdout)
    return {"wall_s": wall, "stage_s": result["stage_s"], "abnormal": result["lists"]["abnormal"]}


def _span(xs: list[float]) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:.1f} s" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}–{hi:.1f} s"


def table_rows(result: dict[str, Any]) -> list[common.Row]:
    """The README's "Measured" row of a full run's JSON: the checks' own time (median) against
    issue 5's target, the whole command's, and the nodes flagged."""
    n, totals = result["nodes"], result["total_s"]
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in result["stage_s"].items() if k != "total")
    flagged = sorted({node for run in result["abnormal"] for node in run})
    runs = (
        f"median of {len(totals)}: {', '.join(f'{t:.1f}' for t in totals)} s"
        if len(totals) > 1
        else "one run"
    )
    return [
        {
            "what": (
                f"pre-flight, quick level, {n} simulated nodes (`trainguard check --nodes {n}`), "
                "the checks' own time"
            ),
            "result": (
                f"{result['median_total_s']:.1f} s ({runs}; {stages} in the median run); the "
                f"whole command {_span(result['wall_s'])}; nodes flagged: "
                + (", ".join(flagged) if flagged else "none")
                + f"; 1-min load {result['load_1min']:.1f} before"
            ),
            "target": common.verdict(
                result["median_total_s"],
                result["target_s"],
                " s",
                f"{n} nodes sharing {result.get('cpus', '?')} CPUs",
            ),
        }
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes (default 4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per check")
    common.add_common(p, smoke="2 nodes, one run (CI)")
    a = p.parse_args(argv)
    nodes, repeats = (2, 1) if a.smoke else (a.nodes, a.repeats)
    timeout = min(a.timeout, 120.0) if a.smoke else a.timeout
    if nodes < 1 or repeats < 1 or timeout <= 0:
        p.error("--nodes and --repeats must be >= 1, --timeout > 0")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tg-preflight-bench-") as d:
        runs = [_check(Path(d), nodes, i, timeout) for i in range(repeats)]
    totals = [r["stage_s"]["total"] for r in runs]
    median = statistics.median(totals)
    mid = min(runs, key=lambda r: abs(r["stage_s"]["total"] - median))
    res = {
        "nodes": nodes,
        "total_s": totals,
        "wall_s": [round(r["wall_s"], 2) for r in runs],
        "median_total_s": median,
        "stage_s": mid["stage_s"],
        "target_s": TARGET_S,
        "within_target": median < TARGET_S,
        "load_1min": round(load, 2),
        "cpus": os.cpu_count(),
        "abnormal": [r["abnormal"] for r in runs],
    }
    common.finish("preflight", a, res, argv)
    if not a.json:
        print(
            f"quick level, {nodes} nodes: median {median:.1f} s of checks (target "
            f"{TARGET_S:.0f} s), runs {', '.join(f'{t:.1f}' for t in totals)} s, "
            f"load before {load:.1f}"
        )
        print(
            "stages (median run): " + ", ".join(f"{k} {v:.1f}s" for k, v in mid["stage_s"].items())
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
