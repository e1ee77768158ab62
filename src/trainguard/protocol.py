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
import enum
from typing import Any

PROTOCOL_VERSION = 1
MAX_REPORT_BYTES = 16 << 20  # a report with a long backlog of step records after an outage
MAX_ITEMS = 100_000  # workers, events, step batches or checkpoint entries in one report
MAX_NAME = 253  # a node id or address: a DNS name at most


class WorkerState(enum.StrEnum):
    """A worker process as its agent sees it."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class ProtocolError(ValueError):
    """A report that does not follow the protocol; the message names the field."""


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ProtocolError(what)


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


class FaultCause(enum.StrEnum):
    """Why a generation ended in a fault (``Fault.cause``)."""

    WORKER_CRASH = "worker_crash"  # a worker killed by a signal
    SDC = "sdc"  # silent data corruption: replicas' state fingerprints differ
    WORKER_EXIT = "worker_exit"  # a worker exited non-zero, or exited 0 while its peers ran
    HANG = "hang"  # no progress past the hang timeout
    NODE_LOST = "node_lost"  # no heartbeat for node_timeout_s, or a rebooted agent
    NODE_FENCED = "node_fenced"  # the node stopped its workers: it lost the controller
    RENDEZVOUS_TIMEOUT = "rendezvous_timeout"  # not every rank started in time


# ---------------------------------------------------------------------- desired states
# What the controller answers a report or a long poll with: one of the five types below, on
# the wire as a JSON object whose "action" names the type. ``desired_to_json`` and
# ``desired_from_json`` are inverse; the agent parses every desired state it receives.


@dataclasses.dataclass(frozen=True, kw_only=True)
class CkptConf:
    """Where the node's checkpoint tiers are: ``dir`` the durable tier, ``shm_dir`` ckptd's
    shared memory, ``keep`` durable steps retained, ``memory_tier`` on or off."""

    dir: str
    shm_dir: str
    keep: int
    memory_tier: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class Idle:
    """No workers; keep ``nproc_per_node`` warm spares and ckptd for ``ckpt`` (if given);
    ``prefetch``: keep a copy of the newest durable step in memory (a healthy standby)."""

    nproc_per_node: int = 0
    ckpt: CkptConf | None = None
    prefetch: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shutdown:
    """The job ended (``phase``, ``reason``): the agent exits."""

    phase: str
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Check:
    """Run one pre-flight task (``agent/checks.py`` reads ``task``)."""

    task: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stop:
    """Stop generation ``generation``'s workers: SIGTERM, SIGKILL after ``grace_s`` seconds;
    ``dump_stacks``: take every rank's stack first (a hang); ``persist``: (step, generation)
    the node's ckptd persists from memory (a planned stop)."""

    generation: int
    grace_s: float
    dump_stacks: bool = False
    persist: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """Run node rank ``node_rank`` of generation ``generation``: ``nproc_per_node`` workers of
    ``script`` in a world of ``world_size`` ranks over ``nnodes`` nodes, rendezvous at
    ``master_addr:master_port`` (None until node rank 0 hosts the store: ``host_store``),
    restoring ``restore_step`` written by generation ``restore_gen`` (from memory unless
    ``restore_memory`` is false: after a world change every rank reads the durable tier).
    Timeouts in seconds; ``injects``: fault drills not yet fired (``InjectSpec`` JSON);
    ``replica_peers``: ckptd replica servers to copy snapshots to; ``replica_sources``: rank →
    replica server to fetch the restore point from."""

    generation: int
    node_rank: int
    nnodes: int
    nproc_per_node: int
    world_size: int
    master_addr: str | None
    master_port: int | None
    host_store: bool
    restore_step: int | None
    restore_gen: int | None
    restore_memory: bool
    ckpt: CkptConf
    restarts: int
    max_restarts: int
    injects: list[dict[str, Any]]
    script: str
    launch: str
    log_dir: str | None
    script_args: list[str]
    hang_timeout_s: float | None
    hang_timeout_min_s: float
    hang_timeout_max_s: float
    first_step_timeout_s: float
    heartbeat_s: float
    node_timeout_s: float
    replica_peers: list[str]
    replica_sources: dict[str, str]
    probe_every_s: float = 0.0  # in-job known-answer GEMM probe period (agent/probe.py); 0: off


Desired = Run | Stop | Idle | Check | Shutdown
_ACTIONS: dict[str, type[Any]] = {
    "run": Run, "stop": Stop, "idle": Idle, "check": Check, "shutdown": Shutdown,
}  # fmt: skip
_ACTION_OF = {t: a for a, t in _ACTIONS.items()}


def desired_to_json(d: Desired) -> dict[str, Any]:
    """``d`` as the wire's JSON object (``"action"`` names its type)."""
    out: dict[str, Any] = {"action": _ACTION_OF[type(d)]}
    for f in dataclasses.fields(d):
        v = getattr(d, f.name)
        out[f.name] = dataclasses.asdict(v) if isinstance(v, CkptConf) else v
    if isinstance(d, Stop):
        if d.persist is None:
            del out["persist"]
        else:
            out["persist"] = {"step": d.persist[0], "generation": d.persist[1]}
    return out


def desired_from_json(body: Any) -> Desired:
    """The desired state a controller sent. Raises ProtocolError naming the field when
    ``body`` is not one (an unknown action, a missing or extra field)."""
    _need(isinstance(body, dict), "a desired state is a JSON object")
    kind = _ACTIONS.get(body.get("action"))  # type: ignore[arg-type]
    _need(kind is not None, f"desired.action: one of {', '.join(_ACTIONS)}, "
          f"got {body.get('action')!r}")  # fmt: skip
    args = {k: v for k, v in body.items() if k != "action"}
    if isinstance(args.get("ckpt"), dict):
        try:
            args["ckpt"] = CkptConf(**args["ckpt"])
        except TypeError as e:
            raise ProtocolError(f"desired.ckpt: {e}") from None
    if kind is Stop and isinstance(args.get("persist"), dict):
        p = args["persist"]
        try:
            args["persist"] = (int(p["step"]), int(p["generation"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"desired.persist: step and generation integers ({e!r})") from None
    try:
        return kind(**args)  # type: ignore[no-any-return]
    except TypeError as e:  # a missing or unknown field
        raise ProtocolError(f"desired {body.get('action')}: {e}") from None
