"""The package layering (docs/architecture.md): no import cycle between ``trainguard``'s
subpackages, and each imports only the packages below it, as ``tools/structure.py`` counts
them (module-level and function-level imports alike; ``if TYPE_CHECKING`` ones never run)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]

# package -> the packages it may import. Bottom up: protocol (the wires), faults (the drills'
# specs and mechanisms), runtime (what a worker imports), checkpoint, health (pre-flight
# checks); agent and controller are peers that meet only in protocol (neither imports the
# other); observe reads the controller's store; the CLI wires everything together (it hands
# the controller observe's dashboard) and nothing imports it; chaos drives whole jobs from
# outside (the CLI's ``trainguard chaos``); dcp is the checkpoint tiers behind DCP's storage
# interfaces (``trainguard.dcp``); relay speaks only the wires and their framing (``trainguard relay``).
_BASE = {"protocol", "faults", "runtime", "checkpoint"}
LAYERS: dict[str, set[str]] = {
    "protocol": set(),
    "faults": {"protocol"},
    "runtime": {"protocol", "faults"},
    "checkpoint": {"protocol", "faults", "runtime"},
    "health": _BASE,
    "agent": _BASE | {"health"},
    "controller": _BASE | {"health"},
    "observe": _BASE | {"health", "controller"},
    "integrations": _BASE,
    "dcp": _BASE,
    "relay": {"protocol", "runtime"},
    "chaos": _BASE | {"health", "controller", "observe"},
    "cli": _BASE | {"health", "agent", "controller", "observe", "chaos", "relay"},
}


def _structure() -> ModuleType:
    spec = importlib.util.spec_from_file_location("structure", ROOT / "tools" / "structure.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("structure", mod)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycle_between_packages() -> None:
    assert _structure().measure()["import_cycles"] == []


def test_each_package_imports_only_the_packages_below_it() -> None:
    imports = _structure().measure()["imports"]
    assert isinstance(imports, dict)
    unknown = sorted(set(imports) - set(LAYERS))
    assert not unknown, f"new packages {unknown}: give each its place in LAYERS and the docs"
    wrong = {
        pkg: sorted(set(deps) - LAYERS[pkg])
        for pkg, deps in imports.items()
        if set(deps) - LAYERS[pkg]
    }
    assert wrong == {}, f"imports against the layering (package: what it may not import): {wrong}"


def test_wire_messages_are_read_typed_and_no_function_is_over_80_lines() -> None:
    """The receiving modules read typed messages (string-key reads of wire dicts below
    ``MAX_WIRE_READS``), and every function over ``MAX_FUNCTION_LINES`` lines says why
    (``# long:``) — none does today."""
    mod = _structure()
    counts = mod.measure()
    wire = counts["wire_dict_reads"]
    assert wire["total"] < mod.MAX_WIRE_READS, f"string-key reads of wire dicts: {wire}"
    assert counts["long_functions"] == [], "split these, or say why with # long: <reason>"
    assert mod.main(["--check"]) == 0


def test_ckptd_starts_without_torch() -> None:
    """ckptd's modules do not import torch: torch and DCP (checkpoint/dcp_part.py) load in one
    place, ckptd's ``main``, after its PDEATHSIG is set and before it listens."""
    code = "import sys, trainguard.checkpoint.ckptd; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
