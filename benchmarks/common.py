"""What every benchmark shares: ``--json``, ``--smoke`` and ``--record``, and the recorded result.

``--record`` writes ``benchmarks/results/NAME.json``: the benchmark's JSON result together with
the command line, the date (UTC, ISO 8601), the commit (``-dirty`` when tracked files other than
``benchmarks/results/`` differ from it), the torch version, the CPU count and the 1/5/15-minute
load averages when the benchmark started and when it ended. ``benchmarks/table.py`` renders the
README's "Measured" table from these files through each benchmark's ``table_rows(result)``;
nothing in that table is typed in by hand. A ``--smoke`` run is never recorded: its sizes are
there to show that the benchmark runs (CI), not to measure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, TypedDict

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LOAD_AT_START = os.getloadavg()  # the load when the benchmark (this process) started


class Row(TypedDict):
    """One line of the README's "Measured" table (``table_rows`` of a benchmark): what was
    measured and on which state, the figure, and the target with whether the run met it."""

    what: str
    result: str
    target: str


def verdict(value: float, limit: float, unit: str = "×", why_not: str = "") -> str:
    """``"≤ 0.05×: met"``, or ``"≤ 0.05×: not met (why_not)"``."""
    if value <= limit:
        return f"≤ {limit:g}{unit}: met"
    return f"≤ {limit:g}{unit}: **not met**" + (f" ({why_not})" if why_not else "")


def add_common(p: argparse.ArgumentParser, *, smoke: str = "tiny sizes, one repeat (CI)") -> None:
    """Add ``--json``, ``--smoke`` and ``--record`` to a benchmark's parser."""
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--smoke", action="store_true", help=smoke)
    p.add_argument(
        "--record", action="store_true", help="also write benchmarks/results/NAME.json (table.py)"
    )


def finite(value: Any, where: str = "result") -> list[str]:
    """The paths of every number in ``value`` that is NaN or infinite (empty when all are finite)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, int | float):
        return [] if math.isfinite(value) else [where]
    if isinstance(value, dict):
        return [b for k, v in value.items() for b in finite(v, f"{where}.{k}")]
    if isinstance(value, list | tuple):
        return [b for i, v in enumerate(value) for b in finite(v, f"{where}[{i}]")]
    return []


def stop(p: subprocess.Popen[str]) -> None:
    """End a launched job: SIGTERM (``trainguard run`` stops its nodes and cleans up), then
    SIGKILL if it has not exited 30 s later; its pipes are drained."""
    if p.poll() is not None:
        return
    p.terminate()
    try:
        p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()


def _git(*args: str) -> str:
    out = subprocess.run(
        ["git", *args], cwd=HERE.parent, capture_output=True, text=True, timeout=30, check=False
    )
    return out.stdout.strip() if out.returncode == 0 else ""


def commit() -> str:
    """The checked-out commit, ``-dirty`` when tracked files (results aside) differ from it."""
    head = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = [
        line for line in _git("status", "--porcelain", "--untracked-files=no").splitlines()
        if "benchmarks/results/" not in line
    ]  # fmt: skip
    return head + ("-dirty" if dirty else "")


def record(name: str, result: dict[str, Any], argv: list[str] | None = None) -> Path:
    """Write ``benchmarks/results/NAME.json`` (see the module docstring); returns its path.

    Raises ValueError when ``result`` holds a NaN or infinite figure (named)."""
    bad = finite(result)
    if bad:
        raise ValueError(f"not recording {name}: non-finite figures at {', '.join(bad[:5])}")
    args = sys.argv[1:] if argv is None else argv
    doc = {
        "benchmark": name,
        "command": " ".join(["python", f"benchmarks/{name}.py", *args]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in LOAD_AT_START],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "result": result,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def finish(
    name: str, args: argparse.Namespace, result: dict[str, Any], argv: list[str] | None = None
) -> None:
    """Print ``result`` as JSON when ``--json``; record it when ``--record`` (not with ``--smoke``)."""
    if args.json:
        print(json.dumps(result, indent=1))
    if getattr(args, "record", False):
        if getattr(args, "smoke", False):
            print(f"{name}: --smoke results are not recorded", file=sys.stderr)
        else:
            print(f"{name}: recorded {record(name, result, argv)}", file=sys.stderr)


def one_rank_group() -> None:
    """A gloo process group of one rank on a free loopback port (DCP's async paths need one)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    )
    dist.init_process_group("gloo", rank=0, world_size=1)
