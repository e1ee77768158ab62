"""Counts of the code's structure, printed as JSON: what the refactor of the wires is held to.

``python tools/structure.py [--check]`` prints:

- ``wire_dict_reads``: string-key reads (``d["key"]``, ``d.get("key")``) in the modules that
  receive a wire message (agent report, runtime datagrams, ckptd requests), by file. A read of
  a typed message is an attribute, so this counts the reads left untyped.
- ``import_cycles``: cycles between ``trainguard`` subpackages (``controller``, ``agent``, …) in
  the module-level and function-level imports alike (``if TYPE_CHECKING`` imports excluded:
  they never run), each as its packages.
- ``imports``: each subpackage's imports of the others (the graph the cycles are found in).
- ``long_functions``: functions over ``MAX_FUNCTION_LINES`` lines, each ``file:line name
  length``; one whose ``def`` line or the line before carries ``# long:`` (with the reason) is
  listed apart as ``long_functions_commented``.
- ``lines``: line counts of the modules the refactor shrank.

``--check`` exits 1 when a count is over its bound (wire reads ≥ 20, a cycle, an uncommented
long function), so a test can hold the line.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "trainguard"
MAX_FUNCTION_LINES = 80
MAX_WIRE_READS = 20
# The modules that take a message off a wire and act on it (the list).
WIRE_MODULES = (
    "controller/server.py",
    "controller/ingest.py",
    "agent/agent.py",
    "checkpoint/ckptd.py",
    "agent/ckptd_sup.py",
    "checkpoint/backend.py",
)
LINE_MODULES = ("controller/server.py", "checkpoint/checkpointer.py")


def _string_key_reads(tree: ast.AST) -> int:
    n = 0
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ) or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            n += 1
    return n


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "trainguard" or len(parts) < 2:
        return None
    return parts[1]


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for n in ast.walk(sub):
                    if hasattr(n, "lineno"):
                        lines.add(n.lineno)
    return lines


def _imports(path: Path, tree: ast.AST) -> set[str]:
    rel = path.relative_to(SRC.parent).with_suffix("")
    here = list(rel.parts)
    if here[-1] == "__init__":
        here = here[:-1]
    skip = _type_checking_lines(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + (1 if path.name == "__init__.py" else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _long_functions(path: Path, tree: ast.AST, lines: list[str]) -> tuple[list[str], list[str]]:
    bare: list[str] = []
    commented: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        length = (node.end_lineno or node.lineno) - start + 1
        if length <= MAX_FUNCTION_LINES:
            continue
        near = lines[max(0, node.lineno - 2) : node.lineno]
        row = f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {length}"
        (commented if any("# long:" in x for x in near) else bare).append(row)
    return bare, commented


def measure() -> dict[str, object]:
    """The counts above, as a JSON-ready mapping."""
    graph: dict[str, set[str]] = {}
    long_bare: list[str] = []
    long_commented: list[str] = []
    wire: dict[str, int] = {}
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        rel = path.relative_to(SRC).as_posix()
        if rel in WIRE_MODULES:
            wire[rel] = _string_key_reads(tree)
        pkg = _package_of(".".join(path.relative_to(SRC.parent).with_suffix("").parts))
        if pkg is not None and path.parent != SRC:
            for mod in _imports(path, tree):
                other = _package_of(mod)
                if other is not None and other != pkg and (SRC / other).is_dir():
                    graph.setdefault(pkg, set()).add(other)
        bare, commented = _long_functions(path, tree, text.splitlines())
        long_bare += bare
        long_commented += commented
    return {
        "wire_dict_reads": {"total": sum(wire.values()), **wire},
        "import_cycles": _cycles(graph),
        "imports": {pkg: sorted(graph[pkg]) for pkg in sorted(graph)},
        "long_functions": long_bare,
        "long_functions_commented": long_commented,
        "lines": {m: len((SRC / m).read_text().splitlines()) for m in LINE_MODULES},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a count is over its bound")
    args = ap.parse_args(argv)
    counts = measure()
    print(json.dumps(counts, indent=2))
    if not args.check:
        return 0
    wire = counts["wire_dict_reads"]
    assert isinstance(wire, dict)
    bad = wire["total"] >= MAX_WIRE_READS or counts["import_cycles"] or counts["long_functions"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
