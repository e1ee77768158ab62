"""The agent → worker wire: what a node agent tells a worker that recovers in process.

Two messages, each a signed UDP datagram (``runtime/wire.encode``/``decode``, the framing of
the worker → agent wire) sent to the address the worker's own datagrams come from:

- ``Abort(generation, reason)``: the generation failed; end the training function's pending
  collectives and unwind it (``runtime/inprocess.py``). Resent until the worker reports that
  it parked.
- ``Resume(generation, env, unset)``: run the training function again as ``generation``, with
  the environment changed by ``env`` (set) and ``unset`` (removed): the torchrun variables
  and trainguard's of the new generation (``agent/env.worker_env``). Resent until a datagram of
  the new generation arrives.

On the wire a JSON object whose ``"t"`` is ``"abort"`` or ``"resume"``, with ``"v"``
(``PROTOCOL_VERSION``). ``control_from_json`` refuses anything else with ``ProtocolError``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainguard.protocol.common import PROTOCOL_VERSION, ProtocolError, _need


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Abort:
    """Generation ``generation`` failed (``reason``, one line): leave the training function."""

    generation: int
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"t": "abort", "v": PROTOCOL_VERSION, "gen": self.generation, "why": self.reason}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Resume:
    """Re-enter the training function as ``generation``; ``env``: variables to set, ``unset``:
    variables to remove."""

    generation: int
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    unset: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"t": "resume", "v": PROTOCOL_VERSION, "gen": self.generation, "env": self.env,
                "unset": list(self.unset)}  # fmt: skip


Control = Abort | Resume


def control_from_json(body: Any) -> Control:
    """The message of a control datagram's (authenticated, decoded) body. Raises
    ProtocolError naming the field when it is not one."""
    _need(isinstance(body, dict), "a control message is a JSON object")
    v, gen, t = body.get("v", 1), body.get("gen"), body.get("t")
    _need(type(v) is int and 1 <= v <= PROTOCOL_VERSION, f"v: at most {PROTOCOL_VERSION}")
    _need(type(gen) is int and gen >= 0, "gen: the generation, an integer >= 0")
    if t == "abort":
        why = body.get("why", "")
        _need(isinstance(why, str), "why: a string")
        return Abort(generation=gen, reason=why)
    if t == "resume":
        env, unset = body.get("env"), body.get("unset", [])
        _need(
            isinstance(env, dict) and all(isinstance(k, str) and isinstance(x, str)
                                          for k, x in env.items()),
            "env: an object of strings",
        )  # fmt: skip
        _need(isinstance(unset, list) and all(isinstance(k, str) for k in unset),
              "unset: a list of strings")  # fmt: skip
        return Resume(generation=gen, env=env, unset=tuple(unset))
    raise ProtocolError(f"t: abort or resume, got {t!r}")
