"""Render the README's "Measured" table from the recorded results (``benchmarks/results/*.json``).

Each benchmark module beside this file has ``table_rows(result) -> list[Row]``; this script
reads every recorded result, asks its benchmark for the rows and prints them (or, with
``--write``, replaces the table between the ``measured`` markers in README.md). Each row names
its command and the date of its result; a benchmark with no recorded result has no row.
``tests/unit/test_benchmark_table.py`` checks that README.md holds exactly this rendering.

Run: ``python benchmarks/table.py [--write]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
README = HERE.parent / "README.md"
BEGIN = "<!-- measured:begin (python benchmarks/table.py --write) -->"
END = "<!-- measured:end -->"
# The table's order; a recorded result of a benchmark not named here comes last.
ORDER = [
    "checkpoint", "checkpoint_sharded", "dcp_storage", "storage", "step_overhead", "recovery",
    "local_recovery", "node_recovery", "preflight", "straggler", "sdc", "controller_scale",
]  # fmt: skip


def _results(results: Path) -> list[dict[str, Any]]:
    docs = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(docs, key=lambda d: (rank.get(d["benchmark"], len(ORDER)), d["benchmark"]))


def render(results: Path = HERE / "results") -> str:
    """The Markdown table (with its markers) for the results under ``results``."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    lines = [
        BEGIN,
        "| what | result | target | command, date of the result |",
        "|---|---|---|---|",
    ]
    for doc in _results(results):
        module = importlib.import_module(doc["benchmark"])
        where = (
            f"`{doc['command']}`, {doc['date'][:10]} (commit {doc['commit']}, {doc['cpus']} CPUs, "
            f"load {doc['loadavg_before'][0]:.1f} → {doc['loadavg_after'][0]:.1f})"
        )
        for row in module.table_rows(doc["result"]):
            lines.append(f"| {row['what']} | {row['result']} | {row['target']} | {where} |")
    lines.append(END)
    return "\n".join(lines)


def readme_table(text: str) -> str:
    """The table between the markers in ``text`` (markers included). Raises ValueError when the
    markers are missing."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no '{BEGIN}' ... '{END}' block")
    return text[start : end + len(END)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="replace the table in README.md")
    a = p.parse_args(argv)
    table = render()
    if not a.write:
        print(table)
        return 0
    text = README.read_text()
    README.write_text(text.replace(readme_table(text), table))
    print(f"wrote the table into {README}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
