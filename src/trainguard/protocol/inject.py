"""A fault drill as it travels: ``JobConfig.injects`` → the controller's ``Run`` desired state
(``Run.injects``, the drills not yet fired) → the agent, which fires the timed ones and hands
the rest to its workers (``TRAINGUARD_INJECT``); a fired drill comes back in an
``inject_fired`` event. ``faults/inject.py`` parses the ``--inject`` text into one."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainguard.protocol.common import ProtocolError

SDC_DEFAULT_BIT = 22
SDC_TARGETS = ("param", "grad", "optimizer")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class InjectSpec:
    """One injected fault. ``id`` is its index on the command line (stable across restarts)."""

    id: int
    kind: str
    rank: int | None = None
    node: int | None = None
    step: int | None = None
    code: int = 1
    factor: float = 1.0
    after: float | None = None  # seconds after the worker started (agent-fired drills)
    bit: int = SDC_DEFAULT_BIT  # sdc: the bit flipped (0 = the lowest)
    target: str = "param"  # sdc: what holds the flipped bit (SDC_TARGETS)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> InjectSpec:
        return InjectSpec(**d)

    def describe(self) -> str:
        if self.kind == "gemm-wrong":
            return f"gemm-wrong:node={self.node}" + (f":step={self.step}" if self.step else "")
        if self.kind in ("loss-spike", "nan"):
            return f"{self.kind}:step={self.step}"
        where = f"node={self.node}" if self.kind == "node-down" else f"rank={self.rank}"
        tail = f":factor={self.factor}" if self.kind == "slow" else f":step={self.step}"
        if self.after is not None:
            tail = f":after={self.after:g}"
        if self.kind == "slow" and self.step is not None:
            tail += f":step={self.step}"
        if self.kind == "sdc" and self.target != "param":
            tail += f":target={self.target}"
        if self.kind == "sdc" and self.bit != SDC_DEFAULT_BIT:
            tail += f":bit={self.bit}"
        return f"{self.kind}:{where}{tail}"


def inject_from_json(body: Any, where: str) -> InjectSpec:
    """The drill ``InjectSpec.to_json`` wrote; raises ProtocolError naming ``where`` when
    ``body`` is not one."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: an inject spec object")
    try:
        spec = InjectSpec.from_json(body)
    except TypeError as e:  # a missing or unknown field
        raise ProtocolError(f"{where}: {e}") from None
    hints = {"id": int, "kind": str, "rank": int, "node": int, "step": int, "code": int,
             "factor": float, "after": float, "bit": int, "target": str}  # fmt: skip
    for f in dataclasses.fields(spec):
        v, want = getattr(spec, f.name), hints[f.name]
        ok = (v is None and f.default is None) or (
            isinstance(v, want) and not isinstance(v, bool)
            if want is not float
            else type(v) in (int, float)
        )
        if not ok:
            raise ProtocolError(f"{where}.{f.name}: {want.__name__} expected, got {v!r:.40}")
    return spec
