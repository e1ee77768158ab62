"""The ckptd wire: each operation of a node's checkpoint daemon as a request and a reply type.

Clients (a worker's ``CkptdBackend``, the agent's ``CkptdSupervisor``) send one request per
line over ckptd's Unix socket and read one reply per line (``checkpoint/ckptd_client.py``);
``Ckptd._handle`` matches on the request type. On the wire a request is a JSON object whose
``"op"`` names its type, with ``"v"`` (``PROTOCOL_VERSION``; absent means 1) and its fields
by name; a reply is its fields by name, or ``{"error": reason}`` (``ErrorReply``).

============== =============================================== ===========================
request        what ckptd does                                 reply
============== =============================================== ===========================
``Alloc``      create the rank's two shared-memory slots       ``AllocReply``
``Staged``     take in a staged snapshot (verify, persist)     ``OkReply``
``Persist``    queue the held copies of a snapshot for the     ``PersistReply``
               durable tier (a planned stop)
``WaitDurable`` wait until a step is durable                   ``WaitDurableReply``
``Verify``     re-checksum a rank's snapshot, once per         ``VerifyReply``
               restarting generation
``Forget``     drop a slot a reader found corrupt              ``OkReply``
``Status``     what it holds, and the events it queued         ``StatusReply``
``SetPeers``   replicate verified snapshots to these ckptds    ``OkReply``
``Fetch``      pull a rank's replica from a peer's ckptd       ``FetchReply``
``Shutdown``   finish pending work (60 s at most) and exit     ``OkReply``
============== =============================================== ===========================

``request_from_json`` and ``reply_from_json`` refuse a malformed message with
``ProtocolError`` naming the field (an unknown op, a missing, extra or mistyped field, a newer
version); ckptd answers a refused request with an ``ErrorReply`` carrying that reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from trainguard.protocol.common import PROTOCOL_VERSION, ProtocolError, _need

# rank (a decimal string) → snapshots held, each [step, generation] (memory, replicas) or
# [step, generation, layout, value] (fingerprints)
Points = dict[str, list[list[int]]]


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_points(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(r, str)
        and r.isdigit()
        and isinstance(pts, list)
        and all(isinstance(p, list) and all(map(_is_int, p)) for p in pts)
        for r, pts in v.items()
    )


# A field's annotation → (what it must be, the check of its JSON value).
_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer", _is_int),
    "bool": ("true or false", lambda v: type(v) is bool),
    "float": ("a number", lambda v: type(v) in (int, float)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "str | None": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "tuple[str, ...]": (
        "a list of strings",
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    ),
    "tuple[int, ...]": (
        "a list of integers",
        lambda v: isinstance(v, list) and all(map(_is_int, v)),
    ),
    "Points": ("a mapping rank → lists of integers", _is_points),
    "tuple[dict[str, Any], ...]": (
        "a list of objects",
        lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    ),
}


def _fields_from_json(cls: type[Any], body: dict[str, Any], what: str) -> dict[str, Any]:
    """``cls``'s constructor arguments from ``body``, each checked against its annotation."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(k for k in body if k not in fields)
    _need(not extra, f"{what}: unknown field(s) {', '.join(extra)}")
    args: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in body:
            has_default = f.default is not dataclasses.MISSING
            _need(has_default or f.default_factory is not dataclasses.MISSING,
                  f"{what}.{name}: missing")  # fmt: skip
            continue
        v = body[name]
        must, ok = _CHECKS[str(f.type)]
        _need(ok(v), f"{what}.{name}: {must}, got {v!r:.80}")
        args[name] = tuple(v) if str(f.type).startswith("tuple[") else v
    return args


def _fields_to_json(msg: Any) -> dict[str, Any]:
    return {
        f.name: list(v) if isinstance(v := getattr(msg, f.name), tuple) else v
        for f in dataclasses.fields(msg)
    }


# ------------------------------------------------------------------------------------ replies
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OkReply:
    """Done (``Staged``, ``Forget``, ``SetPeers``, ``Shutdown``)."""

    ok: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AllocReply:
    """The rank's two slot paths, in slot order."""

    slots: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PersistReply:
    """The ranks whose held copy was queued for the durable tier."""

    ranks: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WaitDurableReply:
    """``durable``: the step became durable in time; ``failed``: why it never can (or None)."""

    durable: bool
    failed: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VerifyReply:
    """ckptd's verdict on a rank's snapshot: ``slot`` the path holding it (None: none here),
    ``ok`` its checksums match those of its staging, ``problem`` why not."""

    slot: str | None
    ok: bool
    problem: str | None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StatusReply:
    """What ckptd holds: ``memory`` verified snapshots per rank, ``fingerprints`` their state
    fingerprints, ``events`` it queued since the last status (drained), ``idle`` nothing staged
    is left to verify or persist, ``replica_addr`` its replica server, ``replicas`` the
    peers' snapshots it holds per source rank."""

    memory: Points
    fingerprints: Points = dataclasses.field(default_factory=dict)
    events: tuple[dict[str, Any], ...] = ()
    idle: bool = True
    replica_addr: str | None = None
    replicas: Points = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FetchReply:
    """The replica landed in ``slot`` (verified)."""

    slot: str
    ok: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ErrorReply:
    """The request failed or was refused: ``error`` says why."""

    error: str


Reply = (
    OkReply | AllocReply | PersistReply | WaitDurableReply | VerifyReply | StatusReply | FetchReply
)
R = TypeVar("R")


# ----------------------------------------------------------------------------------- requests
class Request(Generic[R]):
    """A ckptd request whose successful reply is an ``R`` (``reply`` names the type)."""

    __slots__ = ()
    op: ClassVar[str]
    reply: ClassVar[type[Any]]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Alloc(Request[AllocReply]):
    """Create (or reuse) the rank's two slots of ``nbytes`` bytes each."""

    op: ClassVar[str] = "alloc"
    reply: ClassVar[type[Any]] = AllocReply
    rank: int
    nbytes: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Staged(Request[OkReply]):
    """The rank staged (``step``, ``generation``) in ``slot``; ``durable``: persist it too.
    (The world size is in the slot's header.)"""

    op: ClassVar[str] = "staged"
    reply: ClassVar[type[Any]] = OkReply
    rank: int
    slot: str
    step: int
    generation: int
    durable: bool


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Persist(Request[PersistReply]):
    """Queue the verified copies of (``step``, ``generation``) held here for the durable tier."""

    op: ClassVar[str] = "persist"
    reply: ClassVar[type[Any]] = PersistReply
    step: int
    generation: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WaitDurable(Request[WaitDurableReply]):
    """Wait up to ``timeout_s`` for ``step`` to become durable."""

    op: ClassVar[str] = "wait_durable"
    reply: ClassVar[type[Any]] = WaitDurableReply
    step: int
    timeout_s: float


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Verify(Request[VerifyReply]):
    """Re-checksum the rank's slot holding (``step``, ``generation``), once per restarting
    generation ``for_generation`` (the agent asks as it launches the workers, so the check
    runs during the restart; the worker's ask then finds it done)."""

    op: ClassVar[str] = "verify"
    reply: ClassVar[type[Any]] = VerifyReply
    rank: int
    step: int
    generation: int
    for_generation: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Forget(Request[OkReply]):
    """Drop ``slot`` (a reader found it corrupt): out of the index, never re-adopted."""

    op: ClassVar[str] = "forget"
    reply: ClassVar[type[Any]] = OkReply
    slot: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Status(Request[StatusReply]):
    """What ckptd holds; ``rescan``: the node's workers are gone, take in any complete
    snapshot whose ``Staged`` never came."""

    op: ClassVar[str] = "status"
    reply: ClassVar[type[Any]] = StatusReply
    rescan: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SetPeers(Request[OkReply]):
    """Replicate verified snapshots to the ckptds at ``addrs`` (``host:port``)."""

    op: ClassVar[str] = "set_peers"
    reply: ClassVar[type[Any]] = OkReply
    addrs: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fetch(Request[FetchReply]):
    """Pull the rank's replica of (``step``, ``generation``) from the ckptd at ``source``
    into this node's slot (verified), for a restore on a new node."""

    op: ClassVar[str] = "fetch"
    reply: ClassVar[type[Any]] = FetchReply
    rank: int
    step: int
    generation: int
    source: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Shutdown(Request[OkReply]):
    """Finish pending work (60 s at most) and exit; ``unlink``: remove the node's slots."""

    op: ClassVar[str] = "shutdown"
    reply: ClassVar[type[Any]] = OkReply
    unlink: bool = False


CkptdRequest = (
    Alloc | Staged | Persist | WaitDurable | Verify | Forget | Status | SetPeers | Fetch | Shutdown
)
_OPS: dict[str, type[Any]] = {
    t.op: t
    for t in (
        Alloc,
        Staged,
        Persist,
        WaitDurable,
        Verify,
        Forget,
        Status,
        SetPeers,
        Fetch,
        Shutdown,
    )
}


def _version(body: dict[str, Any], what: str) -> None:
    v = body.get("v", 1)
    _need(_is_int(v) and v >= 1, f"{what}.v: the protocol version, an integer >= 1")
    _need(v <= PROTOCOL_VERSION, f"{what}: protocol version {v}, this side speaks "
          f"{PROTOCOL_VERSION}; run ckptd and its clients of one trainguard version")  # fmt: skip


def request_to_json(req: Request[Any]) -> dict[str, Any]:
    """``req`` as the wire's JSON object (``"op"`` names its type)."""
    return {"op": req.op, "v": PROTOCOL_VERSION, **_fields_to_json(req)}


def request_from_json(body: Any) -> CkptdRequest:
    """The request a client sent. Raises ProtocolError naming the field when ``body`` is not
    one (an unknown op, a missing, extra or mistyped field, a newer version)."""
    _need(isinstance(body, dict), f"a ckptd request is a JSON object, got {type(body).__name__}")
    op = body.get("op")
    kind = _OPS.get(op) if isinstance(op, str) else None
    _need(kind is not None, f"op: one of {', '.join(_OPS)}, got {op!r:.80}")
    _version(body, str(op))
    args = _fields_from_json(kind, {k: v for k, v in body.items() if k not in ("op", "v")}, str(op))
    return kind(**args)  # type: ignore[no-any-return]


def reply_to_json(reply: Reply | ErrorReply) -> dict[str, Any]:
    """``reply`` as the wire's JSON object."""
    return {"v": PROTOCOL_VERSION, **_fields_to_json(reply)}


def reply_from_json(req: Request[R], body: Any) -> R | ErrorReply:
    """The reply to ``req``: its ``reply`` type, or an ``ErrorReply``. Raises ProtocolError
    naming the field when ``body`` is neither."""
    what = f"{req.op} reply"
    _need(isinstance(body, dict), f"{what}: a JSON object, got {type(body).__name__}")
    _version(body, what)
    fields = {k: v for k, v in body.items() if k != "v"}
    kind: type[Any] = ErrorReply if "error" in fields else req.reply
    return kind(**_fields_from_json(kind, fields, what))  # type: ignore[no-any-return]


def refused(e: ProtocolError) -> ErrorReply:
    """The reply to a request refused for ``e``."""
    return ErrorReply(error=f"refused: {e}")
