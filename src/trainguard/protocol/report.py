"""The agent → controller wire: the heartbeat report, typed both ways.

An agent POSTs a report (JSON) to ``/v1/report`` every heartbeat; the controller answers with
the node's desired state. The agent builds an ``AgentReport`` and sends ``report_to_json`` of
it; the controller takes ``report_from_json`` of what arrived, which checks the report's shape
before anything of it is used, so a malformed report gets HTTP 400 with the field and the
problem, never a crashed tick. Version ``PROTOCOL_VERSION`` (field ``"v"``; absent means 1); a
report of a newer version than this controller speaks is refused with 400 naming both
versions. Unknown fields are allowed (an older controller ignores what a newer agent adds).

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
    ProtocolError,
    WorkerState,
    _need,
    finite,
)
from trainguard.protocol.inject import InjectSpec, inject_from_json

Points = dict[int, list[tuple[int, int]]]  # rank → [(step, generation)]
# rank → [(step, generation, layout, value)]: a snapshot's fingerprint (checkpoint/fingerprint.py)
FingerprintPoints = dict[int, list[tuple[int, int, int, int]]]


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


def _points(body: dict[str, Any], key: str, width: int = 2) -> dict[int, list[tuple[int, ...]]]:
    """``{rank: [[step, generation], ...]}`` (memory and replica indexes); ``width`` 4:
    ``[step, generation, layout, value]`` (fingerprints). Ranks as integers, points as
    tuples."""
    v = body.get(key)
    if v is None:
        return {}
    _need(isinstance(v, dict) and len(v) <= MAX_ITEMS, f"{key}: a mapping rank → points")
    for r, pts in v.items():
        _need(str(r).isdigit(), f"{key}: rank {r!r} is not a number")
        _need(
            isinstance(pts, list)
            and all(
                isinstance(p, list | tuple) and len(p) == width and all(type(x) is int for x in p)
                for p in pts
            ),
            f"{key}[{r}]: a list of "
            + ("[step, generation] pairs" if width == 2 else f"{width}-integer lists"),
        )
    return {int(r): [tuple(p) for p in pts] for r, pts in v.items()}


def _points_json(points: dict[int, list[tuple[int, ...]]]) -> dict[str, list[list[int]]]:
    return {str(r): [list(p) for p in pts] for r, pts in points.items()}


def _time(body: dict[str, Any], key: str) -> float | None:
    t = body.get(key)
    _need(t is None or finite(t), f"{key}: seconds since the epoch")
    return t


@dataclasses.dataclass(kw_only=True, slots=True)
class WorkerReport:
    """A worker as its agent last saw it (the controller keeps it as ``WorkerObs``). Ages are
    seconds, measured by the agent; wall clocks are the agent's."""

    rank: int
    local_rank: int
    pid: int
    state: str  # a WorkerState value
    exit_code: int | None = None  # negative: killed by that signal
    error: str | None = None  # first failing exception and traceback (error file), or log tail
    step: int | None = None  # last step reported by the runtime
    progress_age_s: float | None = None  # since the step counter last advanced (or since start)
    heartbeat_age_s: float | None = None  # since the runtime's last heartbeat
    exited_at: float | None = None  # wall clock, when the agent saw the exit
    last_progress_at: float | None = None  # wall clock of the last step advance
    coll: list[int] | None = None  # collectives [issued, done] (runtime timing; hang localization)
    total_steps: int | None = None  # the step the script ends at (trainguard.init(total_steps=…))
    proc_state: str | None = None  # its process as the kernel has it; "stopped": SIGSTOP / ptrace
    runtime: bool = False  # its script runs trainguard's runtime (heartbeats seen)
    cpu_idle_s: float | None = None  # since its process tree last used CPU (agent/outside.py)
    in_trainguard: bool = False  # waiting inside trainguard (keep-alives): not a hang
    inprocess: bool = False  # its script runs under trainguard.run: it can recover in process
    resumed_from: int | None = None  # the generation this process ran before (in process)
    parked_at: float | None = None  # wall clock, when it parked (in process)

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in _WORKER_FIELDS}

    @classmethod
    def from_json(cls, w: dict[str, Any]) -> WorkerReport:
        """Raises ProtocolError naming the field; fields this version does not know are
        ignored."""
        _need(type(w.get("rank")) is int, "workers[].rank: an integer")
        _need(w.get("state") in set(WorkerState), f"workers[].state: one of "
              f"{', '.join(WorkerState)}, got {w.get('state')!r}")  # fmt: skip
        _need(type(w.get("local_rank")) is int and type(w.get("pid")) is int,
              "workers[].local_rank and .pid: integers")  # fmt: skip
        for k, v in w.items():
            kind = _WORKER_FIELDS.get(k)
            if kind is not None:
                _need(_fits(v, kind), f"workers[].{k}: {kind.replace(' | None', ' or null')}")
        return cls(**{k: v for k, v in w.items() if k in _WORKER_FIELDS})


# field → its annotation as written ("int | None", "list[int] | None", …): what _fits checks
_WORKER_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(WorkerReport)}


def _fits(v: Any, kind: str) -> bool:
    """Does the JSON value ``v`` fit the annotation ``kind`` (a WorkerReport field's)?"""
    if v is None:
        return kind.endswith("| None")
    base = kind.removesuffix(" | None")
    if base == "bool":
        return type(v) is bool
    if base == "int":
        return type(v) is int
    if base == "float":
        return type(v) in (int, float)
    if base == "str":
        return isinstance(v, str)
    if base == "list[int]":
        return isinstance(v, list) and all(type(x) is int for x in v)
    return True  # a type this check does not spell: the receiver reads it as it is


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReportEvent:
    """Something that happened on the node (``kind``: ``worker_exited``, ``inject_fired``,
    ``ckpt_durable``, …) at agent wall clock ``ts``. ``fields``: everything else it carries,
    recorded as is; the fields the controller acts on are also typed: ``generation``,
    ``rank``, ``step``, ``point_generation`` (the generation that wrote a checkpoint point)
    and ``inject`` (the drill an ``inject_fired`` event fired)."""

    kind: str
    ts: float | None = None
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    generation: int | None = None
    rank: int | None = None
    step: int | None = None
    point_generation: int | None = None
    inject: InjectSpec | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"kind": self.kind, **self.fields}
        if self.ts is not None:
            out["ts"] = self.ts
        return out

    @classmethod
    def from_json(cls, e: dict[str, Any]) -> ReportEvent:
        """Raises ProtocolError naming the field."""
        _need(isinstance(e.get("kind"), str), "events[].kind: a string")
        fields = {k: v for k, v in e.items() if k not in ("kind", "ts")}
        # Typed where they are integers (an event's own fields are not checked: it is recorded
        # as it came, and one the controller cannot act on is only recorded).
        ints = {k: fields.get(k) for k in ("generation", "rank", "step", "point_generation")}
        ints = {k: v if type(v) is int else None for k, v in ints.items()}
        ts = e.get("ts") if finite(e.get("ts")) else None
        inj = fields.get("inject")
        inject = inject_from_json(inj, "events[].inject") if isinstance(inj, dict) else None
        return cls(kind=e["kind"], ts=ts, fields=fields, inject=inject, **ints)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepBatch:
    """One rank's step records of one generation, oldest first as the agent got them."""

    generation: int
    rank: int
    items: list[StepRecord]

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "rank": self.rank,
            "items": [it.to_json() for it in self.items],
        }

    @classmethod
    def from_json(cls, b: dict[str, Any]) -> StepBatch:
        _need(type(b.get("generation")) is int and type(b.get("rank")) is int,
              "steps[]: generation and rank integers")  # fmt: skip
        items = [StepRecord.from_json(it) for it in _items(b, "items", dict)]
        return cls(generation=b["generation"], rank=b["rank"], items=items)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CkptdStatus:
    """What the node's ckptd holds, as the agent last asked it: ``memory`` rank → verified
    (step, generation) snapshots in shared memory; ``replicas`` source rank → the replicas it
    holds for peers; ``fingerprints`` rank → (step, generation, layout, value) of its
    snapshots; ``idle``: nothing queued (every staged snapshot verified, the memory index is
    whole); ``at`` agent wall clock when that was asked; ``replica_addr`` its replica server.
    On the wire these are the report's ``memory``, ``replicas``, ``fingerprints``,
    ``ckptd_idle``, ``ckptd_at`` and ``replica_addr``."""

    memory: Points = dataclasses.field(default_factory=dict)
    replicas: Points = dataclasses.field(default_factory=dict)
    fingerprints: FingerprintPoints = dataclasses.field(default_factory=dict)
    idle: bool = True
    at: float | None = None
    replica_addr: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "memory": _points_json(self.memory),  # type: ignore[arg-type]
            "replicas": _points_json(self.replicas),  # type: ignore[arg-type]
            "fingerprints": _points_json(self.fingerprints),  # type: ignore[arg-type]
            "ckptd_idle": self.idle,
            "ckptd_at": self.at,
            "replica_addr": self.replica_addr,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> CkptdStatus:
        """From a report's (or a ckptd status reply's) flat fields."""
        addr = body.get("replica_addr")
        _need(addr is None or isinstance(addr, str), "replica_addr: host:port or null")
        return cls(
            memory=_points(body, "memory"),  # type: ignore[arg-type]
            replicas=_points(body, "replicas"),  # type: ignore[arg-type]
            fingerprints=_points(body, "fingerprints", width=4),  # type: ignore[arg-type]
            idle=bool(body.get("ckptd_idle", True)),
            at=_time(body, "ckptd_at"),
            replica_addr=addr,
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProbeDevice:
    """One device's known-answer GEMM: ``mismatches`` wrong elements, the first at
    ``first_bad``."""

    device: str
    mismatches: int = 0
    first_bad: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProbeReport:
    """The node's newest in-job GEMM probe (agent/probe.py): run at agent wall clock ``t`` in
    ``generation`` after its ranks finished ``step``; ``ok`` None when inconclusive (``error``
    says why); ``last_ok`` (generation, step) of the newest passing probe; ``results`` per
    device. ``raw``: the probe as reported (the wire form)."""

    t: float | None
    generation: int | None
    step: int | None
    ok: bool | None
    last_ok: tuple[int, int] | None
    results: list[ProbeDevice]
    error: str | None
    raw: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return self.raw

    @classmethod
    def from_json(cls, p: dict[str, Any]) -> ProbeReport:
        last_ok = p.get("last_ok")
        _need(last_ok is None or (isinstance(last_ok, list) and len(last_ok) == 2
              and all(type(x) is int for x in last_ok)), "health.probe.last_ok: [generation, step]")  # fmt: skip
        results = p.get("results") or []
        _need(isinstance(results, list) and all(isinstance(r, dict) for r in results),
              "health.probe.results: a list of objects")  # fmt: skip
        try:
            devices = [ProbeDevice(device=str(r.get("device")), mismatches=int(r.get("mismatches")
                       or 0), first_bad=r.get("first_bad")) for r in results]  # fmt: skip
        except (TypeError, ValueError):
            raise ProtocolError("health.probe.results[].mismatches: an integer") from None
        return cls(
            t=p.get("t"), generation=p.get("generation"), step=p.get("step"), ok=p.get("ok"),
            last_ok=(last_ok[0], last_ok[1]) if last_ok else None, results=devices,
            error=p.get("error"), raw=p,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HealthReport:
    """The node's health as its agent sees it: ``ok`` and ``problems`` of its host checks
    (memory, disk, /dev/shm); ``signals`` hardware counters (health/signals.py: ECC errors,
    temperatures, …) for failure prediction; ``probe`` its newest in-job GEMM probe."""

    ok: bool = True
    problems: tuple[str, ...] = ()
    signals: dict[str, Any] | None = None
    probe: ProbeReport | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "problems": list(self.problems),
                               "signals": self.signals}  # fmt: skip
        if self.probe is not None:
            out["probe"] = self.probe.to_json()
        return out

    @classmethod
    def from_json(cls, h: Any) -> HealthReport:
        if h is None:
            return cls()
        _need(isinstance(h, dict), "health: an object")
        problems = h.get("problems") or []
        _need(isinstance(problems, list), "health.problems: a list")
        signals = h.get("signals")
        _need(signals is None or isinstance(signals, dict), "health.signals: an object")
        probe = h.get("probe")
        return cls(
            ok=bool(h.get("ok", True)),
            problems=tuple(str(p) for p in problems),
            signals=signals,
            probe=ProbeReport.from_json(probe) if isinstance(probe, dict) else None,
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckResult:
    """A finished pre-flight task's result (health/node.py's JSON), under its task id."""

    task: str
    result: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "result": self.result}

    @classmethod
    def from_json(cls, c: dict[str, Any]) -> CheckResult:
        _need(isinstance(c.get("task"), str) and isinstance(c.get("result"), dict),
              "checks[]: a task id and a result object")  # fmt: skip
        return cls(task=c["task"], result=c["result"])


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AgentReport:
    """One heartbeat of one node's agent.

    ``node_id`` the node, reachable at ``addr``; ``incarnation`` changes when the agent process
    restarts (a rebooted host). ``generation`` its workers' generation; ``desired_version`` the
    desired state it holds (the reply omits one it has). ``hang``: its hang watch fired;
    ``stopped_generation`` newest generation fully stopped and cleaned here (-1: none), at
    agent wall clocks ``stopped_at`` / ``cleaned_at``; ``fenced_generation`` the generation
    whose workers it stopped on losing the controller (-1: none). ``leaving``: the agent's
    last report, sent as it exits (its workers stopped): the node is gone from now on, not
    back. ``store``: (generation,
    port) of the TCPStore it hosts. ``time`` its wall clock when sent (the controller measures
    clock skew from it). ``events`` and ``steps`` since its last delivered report."""

    node_id: str
    addr: str
    incarnation: str
    v: int = PROTOCOL_VERSION
    generation: int | None = None
    desired_version: int | None = None
    workers: list[WorkerReport] = dataclasses.field(default_factory=list)
    hang: bool = False
    stopped_generation: int = -1
    fenced_generation: int = -1
    stopped_at: float | None = None
    cleaned_at: float | None = None
    store: tuple[int, int] | None = None
    events: list[ReportEvent] = dataclasses.field(default_factory=list)
    steps: list[StepBatch] = dataclasses.field(default_factory=list)
    ckptd: CkptdStatus = dataclasses.field(default_factory=CkptdStatus)
    health: HealthReport = dataclasses.field(default_factory=HealthReport)
    checks: list[CheckResult] = dataclasses.field(default_factory=list)
    time: float | None = None
    leaving: bool = False


def report_to_json(r: AgentReport) -> dict[str, Any]:
    """``r`` as the wire's JSON object (``report_from_json``'s inverse)."""
    return {
        "v": r.v,
        "node_id": r.node_id,
        "addr": r.addr,
        "incarnation": r.incarnation,
        "generation": r.generation,
        "desired_version": r.desired_version,
        "workers": [w.to_json() for w in r.workers],
        "hang": r.hang,
        "stopped_generation": r.stopped_generation,
        "fenced_generation": r.fenced_generation,
        "stopped_at": r.stopped_at,
        "cleaned_at": r.cleaned_at,
        "store": None if r.store is None else list(r.store),
        "events": [e.to_json() for e in r.events],
        **r.ckptd.to_json(),
        "health": r.health.to_json(),
        "checks": [c.to_json() for c in r.checks],
        "time": r.time,
        "steps": [b.to_json() for b in r.steps],
        **({"leaving": True} if r.leaving else {}),
    }


def report_from_json(body: Any) -> AgentReport:
    """The report ``body`` (a decoded JSON value) holds. Raises ProtocolError naming the field
    and the problem unless it is a report this controller can take: checks the types and
    bounds of every field the controller reads; unknown fields are allowed."""
    _need(isinstance(body, dict), f"a report is a JSON object, got {type(body).__name__}")
    v = body.get("v", 1)
    _need(type(v) is int and v >= 1, "v: the protocol version, an integer >= 1")
    _need(v <= PROTOCOL_VERSION, f"protocol version {v}: this controller speaks "
          f"{PROTOCOL_VERSION}; upgrade the controller or run an agent of its version")  # fmt: skip
    for key in ("node_id", "addr", "incarnation"):
        _name(body, key)
    for key in ("generation", "stopped_generation", "fenced_generation", "desired_version"):
        _int_or_none(body, key)
    workers = [WorkerReport.from_json(w) for w in _items(body, "workers", dict)]
    events = [ReportEvent.from_json(e) for e in _items(body, "events", dict)]
    steps = [StepBatch.from_json(b) for b in _items(body, "steps", dict)]
    checks = [CheckResult.from_json(c) for c in _items(body, "checks", dict)]
    ckptd = CkptdStatus.from_json(body)
    times = {key: _time(body, key) for key in ("time", "stopped_at", "cleaned_at")}
    store = body.get("store")
    _need(
        store is None
        or (isinstance(store, list) and len(store) == 2 and all(type(x) is int for x in store)),
        "store: [generation, port]",
    )
    stopped, fenced = body.get("stopped_generation"), body.get("fenced_generation")
    return AgentReport(
        v=v,
        node_id=body["node_id"],
        addr=body["addr"],
        incarnation=body["incarnation"],
        generation=body.get("generation"),
        desired_version=body.get("desired_version"),
        workers=workers,
        hang=bool(body.get("hang")),
        stopped_generation=-1 if stopped is None else stopped,
        fenced_generation=-1 if fenced is None else fenced,
        store=(store[0], store[1]) if store else None,
        events=events,
        steps=steps,
        ckptd=ckptd,
        health=HealthReport.from_json(body.get("health")),
        checks=checks,
        leaving=body.get("leaving") is True,
        **times,
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
            _need(finite(body.get(key)), f"step record.{key}: a finite number")
        sec = body.get("sec") or {}
        _need(
            isinstance(sec, dict) and all(type(x) in (int, float) for x in sec.values()),
            "step record.sec: a mapping section → seconds",
        )
        for key in ("loss", "gn", "tc", "gap"):
            x = body.get(key)
            _need(x is None or type(x) in (int, float), f"step record.{key}: a number or null")
        _need(
            body.get("tokens") is None or type(body.get("tokens")) is int,
            "step record.tokens: an integer or null",
        )
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
