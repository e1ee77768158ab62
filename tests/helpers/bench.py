"""The benchmarks' smoke runs, shared by ``tests/integration/test_benchmarks*.py``: run one with
``--smoke --json`` and check what every benchmark must give (finite figures, README rows)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from typing import Any

from tests.conftest import ROOT

if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
common = importlib.import_module("common")


def checked(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` of ``benchmarks/NAME.py``, asserted finite everywhere and rendered into its
    README rows (each with a non-empty what, result and target)."""
    assert common.finite(result) == [], common.finite(result)
    rows = importlib.import_module(name).table_rows(result)
    assert rows, f"{name}: no rows"
    for row in rows:
        assert set(row) == {"what", "result", "target"}, row
        assert all(isinstance(v, str) and v for v in row.values()), row
    return result


def smoke(name: str, *args: str, timeout: float) -> dict[str, Any]:
    """Run ``benchmarks/NAME.py --smoke --json ARGS`` (``timeout`` seconds); its checked JSON."""
    out = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", "--smoke", "--json", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return checked(name, json.loads(out.stdout))
