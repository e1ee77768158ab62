"""The runtime → agent wire: what a worker's runtime tells its node agent, over UDP.

Five message types: ``Heartbeat`` (the reporter thread's beat: progress, collectives, where
the main thread is), ``StepEnd`` (one finished step, a ``StepRecord``), ``Alive`` (busy inside
trainguard, not hung), ``WorkerEvent`` (a structured event) and ``Batch`` (up to
``MAX_BATCH`` of the others in one datagram). A datagram carries one message and its
``Sender`` (rank, pid, generation); ``runtime/wire.py`` signs it (``encode_message``) and the
agent authenticates, then parses it (``decode_message``).

On the wire a message is a compact JSON object whose ``"t"`` names its type (``"hb"``,
``"step"``, ``"alive"``, ``"event"``, ``"batch"``), in short keys; the datagram adds ``"v"``
(``PROTOCOL_VERSION``; absent means 1) and the sender's ``"rank"``, ``"pid"``, ``"gen"``.
``message_from_json`` refuses a malformed message with ``ProtocolError`` naming the field; a
datagram of a newer version than this agent speaks is refused the same way. The training
thread only builds a message and queues it: the JSON is written on the reporter thread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainguard.protocol.common import PROTOCOL_VERSION, ProtocolError, _need, finite
from trainguard.protocol.inject import inject_from_json
from trainguard.protocol.report import StepRecord

MAX_BATCH = 1024  # messages in one batch (the runtime sends 64 at most)
# Keys of an event's wire form that are not its data: the type, its name and time, the
# datagram's version and sender (an event's own "rank" is its sender's, as it always was).
_EVENT_RESERVED = frozenset({"t", "kind", "ts", "v", "rank", "pid", "gen"})


def _int(v: Any) -> bool:
    return type(v) is int


def _num(v: Any) -> bool:
    return finite(v)  # every number this wire checks is a time or a count


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Sender:
    """Who sent a datagram: global ``rank``, OS ``pid``, ``generation`` it runs in."""

    rank: int
    pid: int
    generation: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat:
    """The reporter thread's periodic beat. ``ts`` wall clock; ``step`` the last step ended
    (None before the first); ``coll`` (issued, completed) collectives; ``cpu_s`` CPU seconds
    of the main thread (None where the OS cannot tell); ``fingerprint`` a hash of where the
    main thread is (None when it could not be taken); ``phase`` the innermost open
    ``rt.phase``; ``total_steps`` the step the script ends at, if it said; ``inprocess``: the
    script runs under ``trainguard.run`` (it can recover in process); ``parked``: it left its
    training function after a fault and waits for the agent's ``Resume``."""

    ts: float
    step: int | None = None
    coll: tuple[int, int] | None = None
    cpu_s: float | None = None
    fingerprint: int | None = None
    phase: str | None = None
    total_steps: int | None = None
    inprocess: bool = False
    parked: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": "hb", "ts": self.ts, "step": self.step, "cpu": self.cpu_s}
        if self.inprocess:
            out["inproc"] = 2 if self.parked else 1
        if self.coll is not None:
            out["coll"] = list(self.coll)
        if self.fingerprint is not None:
            out["fp"] = self.fingerprint
        if self.phase is not None:
            out["phase"] = self.phase
        if self.total_steps is not None:
            out["total"] = self.total_steps
        return out

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Heartbeat:
        ts, step, coll, cpu = body.get("ts"), body.get("step"), body.get("coll"), body.get("cpu")
        fp, phase, total = body.get("fp"), body.get("phase"), body.get("total")
        inproc = body.get("inproc", 0)
        _need(_num(ts), "hb.ts: seconds since the epoch")
        _need(step is None or _int(step), "hb.step: an integer or null")
        _need(
            coll is None or (isinstance(coll, list) and len(coll) == 2 and all(map(_int, coll))),
            "hb.coll: [issued, completed] integers",
        )
        _need(cpu is None or _num(cpu), "hb.cpu: CPU seconds or null")
        _need(fp is None or _int(fp), "hb.fp: an integer or absent")
        _need(phase is None or isinstance(phase, str), "hb.phase: a string or absent")
        _need(total is None or _int(total), "hb.total: an integer or absent")
        _need(inproc in (0, 1, 2) and _int(inproc), "hb.inproc: 0, 1 (in process) or 2 (parked)")
        return cls(
            ts=float(ts),
            step=step,
            coll=None if coll is None else (coll[0], coll[1]),
            cpu_s=cpu,
            fingerprint=fp,
            phase=phase,
            total_steps=total,
            inprocess=inproc > 0,
            parked=inproc == 2,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class StepEnd:
    """A step ended: its ``record``. On the wire the record's short keys beside ``"t"``."""

    record: StepRecord

    def to_json(self) -> dict[str, Any]:
        return {"t": "step", **self.record.to_json()}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> StepEnd:
        for key in ("loss", "tokens", "gn", "tc", "gap"):
            v = body.get(key)  # a loss or gradient norm may be NaN or infinite: the checks' cue
            _need(v is None or type(v) in (int, float), f"step.{key}: a number or null")
        try:
            return cls(StepRecord.from_json(body))
        except (TypeError, ValueError) as e:  # ProtocolError, or a section's seconds not a number
            raise ProtocolError(f"step: {e}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class Alive:
    """The rank is busy inside trainguard (a ckptd call, a durable wait), not hung."""

    def to_json(self) -> dict[str, Any]:
        return {"t": "alive"}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Alive:
        return cls()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEvent:
    """A structured event ``kind`` at wall clock ``ts`` with its ``data`` (JSON values; keys
    other than ``t``, ``kind``, ``ts``, ``v``, ``rank``, ``pid``, ``gen``). An
    ``inject_fired`` event carries ``step`` (the step completed) and ``inject`` (the drill's
    ``InjectSpec`` JSON), checked on receipt: ``fired_step`` and ``fired_kind`` read them."""

    kind: str
    ts: float
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def fired_step(self) -> int | None:
        """The step an ``inject_fired`` event names (None for other events)."""
        return self.data["step"] if self.kind == "inject_fired" else None

    @property
    def fired_kind(self) -> str | None:
        """The kind of drill an ``inject_fired`` event names (None for other events)."""
        return self.data["inject"]["kind"] if self.kind == "inject_fired" else None

    def to_json(self) -> dict[str, Any]:
        return {"t": "event", "kind": self.kind, "ts": self.ts, **self.data}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> WorkerEvent:
        kind, ts = body.get("kind"), body.get("ts")
        _need(isinstance(kind, str) and kind != "", "event.kind: a non-empty string")
        _need(_num(ts), f"event {kind}.ts: seconds since the epoch")
        data = {k: v for k, v in body.items() if k not in _EVENT_RESERVED}
        if kind == "inject_fired":
            inject = data.get("inject")
            _need(_int(data.get("step")), "event inject_fired.step: an integer")
            _need(isinstance(inject, dict), "event inject_fired.inject: a drill (an object)")
            inject_from_json(inject, "event inject_fired.inject")  # as the report wire reads it
        return cls(kind=kind, ts=float(ts), data=data)


Item = Heartbeat | StepEnd | Alive | WorkerEvent


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """Up to ``MAX_BATCH`` messages (never a batch) in one datagram, in the order sent."""

    items: tuple[Item, ...]

    def to_json(self) -> dict[str, Any]:
        return {"t": "batch", "items": [it.to_json() for it in self.items]}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Batch:
        items = body.get("items")
        _need(isinstance(items, list), "batch.items: a list")
        _need(len(items) <= MAX_BATCH, f"batch.items: {len(items)} (at most {MAX_BATCH})")
        return cls(tuple(_item(it, nested=True) for it in items))


WorkerMessage = Heartbeat | StepEnd | Alive | WorkerEvent | Batch
_TYPES: dict[str, Any] = {
    "hb": Heartbeat, "step": StepEnd, "alive": Alive, "event": WorkerEvent, "batch": Batch,
}  # fmt: skip


def _item(body: Any, *, nested: bool = False) -> WorkerMessage:
    _need(isinstance(body, dict), f"a worker message is a JSON object, got {type(body).__name__}")
    t = body.get("t")
    kind = _TYPES.get(t) if isinstance(t, str) and not (nested and t == "batch") else None
    names = [n for n in _TYPES if not (nested and n == "batch")]
    _need(kind is not None, f"t: one of {', '.join(names)}, got {t!r}")
    return kind.from_json(body)  # type: ignore[no-any-return]


def message_to_json(sender: Sender, msg: WorkerMessage) -> dict[str, Any]:
    """The datagram body of ``msg`` sent by ``sender`` (the sender's keys win over an
    event's own)."""
    out = msg.to_json()
    out.update(v=PROTOCOL_VERSION, rank=sender.rank, pid=sender.pid, gen=sender.generation)
    return out


def message_from_json(body: Any) -> tuple[Sender, WorkerMessage]:
    """The sender and message of a datagram's (authenticated, decoded) body. Raises
    ProtocolError naming the field when it is not one this agent takes."""
    _need(isinstance(body, dict), f"a datagram is a JSON object, got {type(body).__name__}")
    v = body.get("v", 1)
    _need(_int(v) and v >= 1, "v: the protocol version, an integer >= 1")
    _need(v <= PROTOCOL_VERSION, f"protocol version {v}: this agent speaks "
          f"{PROTOCOL_VERSION}; run workers and agent of one trainguard version")  # fmt: skip
    rank, pid, gen = body.get("rank"), body.get("pid"), body.get("gen")
    _need(_int(rank) and _int(pid) and _int(gen), "rank, pid, gen: the sender's integers")
    return Sender(rank=rank, pid=pid, generation=gen), _item(body)
