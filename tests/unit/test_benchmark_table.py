"""The benchmarks as product code (issue 29): the README's "Measured" table is exactly what
``benchmarks/table.py`` renders from the recorded results; every recorded result names its
command, date, commit, torch, CPU count and load, and holds finite figures; every benchmark has
``--smoke``/``--record``, README rows, a smoke test, and reaches trainguard through public names
only."""

from __future__ import annotations

import ast
import datetime
import importlib
import json
import sys
from pathlib import Path

import trainguard
from tests.conftest import ROOT

BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
import common  # noqa: E402
import table  # noqa: E402

# Scripts a benchmark runs as its peer's side (not benchmarks of their own) and the shared code.
NOT_BENCHMARKS = {"common", "table", "torchrun_train", "torchft_replicas"}
BENCHMARKS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in NOT_BENCHMARKS)
# Private names outside trainguard that a benchmark may use, and why.
ALLOWED_PRIVATE = {
    "_exit",  # os._exit: ending a torchrun worker without torch's static destructors
}


def test_the_readme_table_is_the_rendering_of_the_recorded_results() -> None:
    text = (ROOT / "README.md").read_text()
    assert table.readme_table(text) == table.render(), (
        "README.md's Measured table differs from the recorded results: "
        "run python benchmarks/table.py --write"
    )


def test_every_recorded_result_says_where_and_when_it_was_measured() -> None:
    docs = [json.loads(p.read_text()) for p in sorted((BENCH / "results").glob("*.json"))]
    assert docs, "no recorded results: python benchmarks/NAME.py --record"
    for doc in docs:
        name = doc["benchmark"]
        assert name in BENCHMARKS, name
        assert doc["command"].startswith(f"python benchmarks/{name}.py"), doc["command"]
        assert "--smoke" not in doc["command"].split()
        datetime.datetime.fromisoformat(doc["date"])
        assert doc["commit"] and doc["torch"] and doc["cpus"] >= 1
        assert len(doc["loadavg_before"]) == 3 and len(doc["loadavg_after"]) == 3
        assert common.finite(doc["result"]) == [], (name, common.finite(doc["result"]))


def test_every_benchmark_has_smoke_record_rows_and_a_smoke_test() -> None:
    tests = "".join(p.read_text() for p in (ROOT / "tests").rglob("test_benchmarks*.py"))
    for name in BENCHMARKS:
        src = (BENCH / f"{name}.py").read_text()
        tree = ast.parse(src)
        defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "table_rows" in defs, f"{name}.py has no table_rows(result)"
        assert "add_common(" in src, f"{name}.py does not take --smoke/--json/--record"
        assert "finish(" in src, f"{name}.py does not record through common.finish"
        assert f'"{name}"' in tests or f"benchmarks/{name}.py" in tests, f"no smoke test: {name}"


def _private_uses(path: Path) -> list[str]:
    """Private names reached: ``x._y`` (not dunders), or imported from trainguard; and
    trainguard names imported without a docstring of their own (undocumented)."""
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            a = node.attr
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if (
                a.startswith("_")
                and not a.startswith("__")
                and a not in ALLOWED_PRIVATE
                and not own
            ):
                bad.append(f"{path.name}:{node.lineno}: .{a}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainguard"):
            module = __import__(node.module, fromlist=["x"])
            if any(part.startswith("_") for part in node.module.split(".")):
                bad.append(f"{path.name}:{node.lineno}: {node.module}")
            for alias in node.names:
                obj = getattr(module, alias.name, None) or importlib.import_module(
                    f"{node.module}.{alias.name}"
                )  # a submodule
                if alias.name.startswith("_"):
                    bad.append(f"{path.name}:{node.lineno}: {node.module}.{alias.name}")
                elif (callable(obj) or isinstance(obj, type(trainguard))) and not (
                    obj.__doc__ or ""
                ).strip():
                    bad.append(f"{path.name}:{node.lineno}: {alias.name} has no docstring")
    return bad


def test_benchmarks_reach_trainguard_through_public_documented_names_only() -> None:
    bad = [b for p in sorted(BENCH.glob("*.py")) for b in _private_uses(p)]
    assert bad == [], "private or undocumented names in benchmarks:\n" + "\n".join(bad)
