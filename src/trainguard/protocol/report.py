"""The agent ↔ controller wire protocol: what a report must hold, checked on receipt.

An agent POSTs a report (JSON) to ``/v1/report`` every heartbeat; the controller answers with
the node's desired state. ``validate_report`` checks a report's shape before anything of it is
used, so a malformed report gets HTTP 400 with the field and the problem, never a crashed
tick. Version ``PROTOCOL_VERSION`` (field ``"v"``; absent means 1); a report of a newer
version than this controller speaks is refused with 400 naming both versions.

Worker states are ``WorkerState`` values. Sizes are bounded: ``MAX_REPORT_BYTES`` per report
(larger bodies get 413 from the HTTP layer), ``MAX_ITEMS`` entries per list.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainguard.protocol.common import (
    MAX_ITEMS,
    MAX_NAME,
    PROTOCOL_VERSION,
    WorkerState,
    _need,
)


def _name(body: dict[str, Any], key: str) -> None:
    v = body.get(key)
    _need(isinstance(v, str) and 0 < len(v) <= MAX_NAME, f"{key}: a non-empty string of at most "
          f"{MAX_NAME} characters is required, got {type(v).__name__}")  # fmt: skip


def _int_or_none(body: dict[str, Any], key: str) -> None:
    v = body.get(key)
    _need(
        v is None or (isinstance(v, int) and not isinstance(v, bool)), f"{key}: an integer or null"
    )


def _items(body: dict[str, Any], key: str, kind: type) -> list[Any]:
    v = body.get(key)
    if v is None:
        return []
    _need(isinstance(v, list), f"{key}: a list is required, got {type(v).__name__}")
    _need(len(v) <= MAX_ITEMS, f"{key}: {len(v)} entries (at most {MAX_ITEMS})")
    _need(all(isinstance(x, kind) for x in v), f"{key}: every entry must be a {kind.__name__}")
    return v


def _points(body: dict[str, Any], key: str, width: int = 2) -> None:
    """``{rank: [[step, generation], ...]}`` (memory and replica indexes); ``width`` 4:
    ``[step, generation, layout, value]`` (fingerprints)."""
    v = body.get(key)
    if v is None:
        return
    _need(isinstance(v, dict) and len(v) <= MAX_ITEMS, f"{key}: a mapping rank → points")
    for r, pts in v.items():
        _need(str(r).isdigit(), f"{key}: rank {r!r} is not a number")
        _need(
            isinstance(pts, list)
            and all(
                isinstance(p, list) and len(p) == width and all(type(x) is int for x in p)
                for p in pts
            ),
            f"{key}[{r}]: a list of "
            + ("[step, generation] pairs" if width == 2 else f"{width}-integer lists"),
        )


def validate_report(body: Any) -> None:
    """Raise ProtocolError unless ``body`` (a decoded JSON value) is a report this controller
    can take. Checks types and bounds of every field the controller reads; unknown fields
    are allowed (an older controller ignores what a newer agent adds)."""
    _need(isinstance(body, dict), f"a report is a JSON object, got {type(body).__name__}")
    v = body.get("v", 1)
    _need(type(v) is int and v >= 1, "v: the protocol version, an integer >= 1")
    _need(v <= PROTOCOL_VERSION, f"protocol version {v}: this controller speaks "
          f"{PROTOCOL_VERSION}; upgrade the controller or run an agent of its version")  # fmt: skip
    for key in ("node_id", "addr", "incarnation"):
        _name(body, key)
    for key in ("generation", "stopped_generation", "fenced_generation", "desired_version"):
        _int_or_none(body, key)
    for w in _items(body, "workers", dict):
        _need(type(w.get("rank")) is int, "workers[].rank: an integer")
        _need(w.get("state") in set(WorkerState), f"workers[].state: one of "
              f"{', '.join(WorkerState)}, got {w.get('state')!r}")  # fmt: skip
    for e in _items(body, "events", dict):
        _need(isinstance(e.get("kind"), str), "events[].kind: a string")
    for b in _items(body, "steps", dict):
        _need(type(b.get("generation")) is int and type(b.get("rank")) is int,
              "steps[]: generation and rank integers")  # fmt: skip
        _items(b, "items", dict)
    _items(body, "checks", dict)
    _points(body, "memory")
    _points(body, "replicas")
    _points(body, "fingerprints", width=4)
    for key in ("time", "ckptd_at", "stopped_at"):
        t = body.get(key)
        _need(t is None or type(t) in (int, float), f"{key}: seconds since the epoch")
    store = body.get("store")
    _need(
        store is None or (isinstance(store, list) and len(store) == 2), "store: [generation, port]"
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord:
    """One finished training step of one rank, as the runtime measured it.

    Travels runtime → agent (a step datagram) → controller (a report's ``steps[].items``) →
    store, in the short keys of ``to_json`` (a report may carry 10^5 of them after an outage).
    ``t_end`` wall clock (s since the epoch) when the step ended; ``duration_s`` wall time since
    the previous step's end (s); ``loss`` the step's scalar loss; ``tokens`` tokens this rank
    processed; ``grad_norm`` the total gradient norm; ``sections`` seconds per timed section of
    the step (``"communication"``, ``"checkpoint"``, …); ``t_coll`` wall clock of the step's
    first collective issue; ``gap`` seconds from the end of this rank's previous collective to
    that first issue (the rank's own work before it waits on its peers; None when untimed).
    """

    step: int
    t_end: float
    duration_s: float
    loss: float | None = None
    tokens: int | None = None
    grad_norm: float | None = None
    sections: dict[str, float] = dataclasses.field(default_factory=dict)
    t_coll: float | None = None
    gap: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The record's wire form: ``{"step", "t_end", "dur", "loss", "tokens", "gn", "sec",
        "tc", "gap"}``."""
        return {
            "step": self.step,
            "t_end": self.t_end,
            "dur": self.duration_s,
            "loss": self.loss,
            "tokens": self.tokens,
            "gn": self.grad_norm,
            "sec": self.sections,
            "tc": self.t_coll,
            "gap": self.gap,
        }

    @classmethod
    def from_json(cls, body: Any) -> StepRecord:
        """The record ``to_json`` wrote. Raises ProtocolError naming the field when ``body`` is
        not one."""
        _need(isinstance(body, dict), "step record: a JSON object")
        _need(type(body.get("step")) is int, "step record.step: an integer")
        for key in ("t_end", "dur"):
            _need(type(body.get(key)) in (int, float), f"step record.{key}: a number")
        sec = body.get("sec") or {}
        _need(isinstance(sec, dict), "step record.sec: a mapping section → seconds")
        return cls(
            step=body["step"],
            t_end=float(body["t_end"]),
            duration_s=float(body["dur"]),
            loss=body.get("loss"),
            tokens=body.get("tokens"),
            grad_norm=body.get("gn"),
            sections={str(k): float(v) for k, v in sec.items()},
            t_coll=body.get("tc"),
            gap=body.get("gap"),
        )
