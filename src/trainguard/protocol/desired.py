"""The controller → agent wire: the desired state of a node.

What the controller answers a report or a long poll with: one of the five types below, on the
wire as a JSON object whose ``"action"`` names the type. ``desired_to_json`` and
``desired_from_json`` are inverse; the agent parses every desired state it receives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from trainguard.protocol.common import ProtocolError, _need
from trainguard.protocol.inject import InjectSpec, inject_from_json


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
    """No workers; keep ``warm_spares`` warm spares (agent/spare.py; None: ``nproc_per_node``)
    and ckptd for ``ckpt`` (if given); ``prefetch``: keep a copy of the newest durable step in
    memory (a healthy standby)."""

    nproc_per_node: int = 0
    warm_spares: int | None = None
    ckpt: CkptConf | None = None
    prefetch: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shutdown:
    """The job ended (``phase``, ``reason``): the agent exits."""

    phase: str
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckTask:
    """One pre-flight task for one node: ``id`` (``"<run>-<stage>"``, its results are reported
    under it), pre-flight run ``run``, ``stage`` (``"node"``: the node's own checks; ``"net"``:
    pairwise bandwidth and a short simulated training run), ``node_id`` the node that runs it,
    ``level`` (``"quick"`` or ``"full"``), ``deadline_s`` seconds the agent lets it run.
    ``params``: the stage's own inputs, read by ``health/node.py`` (sizes, the rendezvous
    store's port, injected faults, …). On the wire one flat JSON object: the task file the
    agent writes for ``health/node.py`` is that object."""

    id: str
    run: int
    stage: str
    node_id: str
    level: str
    deadline_s: float
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The flat wire form: the named fields and ``params``' entries side by side."""
        head = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**head.pop("params"), **head}

    @classmethod
    def from_json(cls, body: Any) -> CheckTask:
        """The task ``to_json`` wrote. Raises ProtocolError naming the field when ``body`` is
        not one."""
        _need(isinstance(body, dict), "desired.task: a JSON object")
        for key, kind in (("id", str), ("run", int), ("stage", str), ("node_id", str),
                          ("level", str)):  # fmt: skip
            _need(isinstance(body.get(key), kind), f"desired.task.{key}: a {kind.__name__}")
        _need(type(body.get("deadline_s")) in (int, float), "desired.task.deadline_s: a number")
        named = {f.name for f in dataclasses.fields(cls)} - {"params"}
        return cls(
            **{k: body[k] for k in named},
            params={k: v for k, v in body.items() if k not in named},
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Check:
    """Run one pre-flight task (``agent/checks.py`` runs it)."""

    task: CheckTask


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stop:
    """Stop generation ``generation``'s workers: SIGTERM, SIGKILL after ``grace_s`` seconds;
    ``dump_stacks``: take every rank's stack first (a hang); ``persist``: (step, generation)
    the node's ckptd persists from memory (a planned stop); ``keep``: ranks whose processes
    survive (in-process recovery: aborted, parked, resumed by the next ``Run``; the others are
    killed at once), each killed if it has not parked within ``abort_timeout_s``."""

    generation: int
    grace_s: float
    dump_stacks: bool = False
    persist: tuple[int, int] | None = None
    keep: list[int] = dataclasses.field(default_factory=list)
    abort_timeout_s: float = 10.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """Run node rank ``node_rank`` of generation ``generation``: ``nproc_per_node`` workers of
    ``script`` in a world of ``world_size`` ranks over ``nnodes`` nodes, rendezvous at
    ``master_addr:master_port`` (None until node rank 0 hosts the store: ``host_store``),
    restoring ``restore_step`` written by generation ``restore_gen`` (from memory unless
    ``restore_memory`` is false: after a world change every rank reads the durable tier).
    Timeouts in seconds; ``injects``: fault drills not yet fired;
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
    injects: list[InjectSpec]
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
    # Spares the agent keeps started once training is under way (None: nproc_per_node)
    warm_spares: int | None = None
    # Local recovery (runtime/replica.py): replica groups (1: off), restarts of one group the
    # agent heals from a peer before a fault is the controller's, the groups' quorum deadline
    replica_groups: int = 1
    replica_max_local_restarts: int = 10
    replica_timeout_s: float = 30.0
    # The run (this run of the run dir) whose checkpoint parts the workers write, and when the
    # controller drew it (Unix seconds): checkpoint/runid.py
    run_id: str = ""
    run_started: float = 0.0
    # The agent incarnation (its report's ``incarnation``) this Run was made for; another agent
    # of the node (restarted: its predecessor was lost) ignores it and waits for a newer desired
    # state. None: for whichever agent holds it.
    incarnation: str | None = None


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
    if isinstance(d, Check):
        out["task"] = d.task.to_json()
    if isinstance(d, Run):
        out["injects"] = [i.to_json() for i in d.injects]
    if isinstance(d, Stop):
        if not d.keep:  # a restart of every rank: the wire form as before in-process recovery
            del out["keep"], out["abort_timeout_s"]
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
    if kind is Stop:
        keep, t = args.get("keep", []), args.get("abort_timeout_s", 10.0)
        _need(isinstance(keep, list) and all(type(r) is int for r in keep),
              "desired.keep: a list of ranks (integers)")  # fmt: skip
        _need(type(t) in (int, float) and 0 < t < 86400, "desired.abort_timeout_s: 0 < s < 1 day")
    if kind in (Run, Idle):
        w = args.get("warm_spares")
        _need(w is None or (type(w) is int and w >= 0),
              "desired.warm_spares: null or an integer >= 0")  # fmt: skip
    if kind is Run:
        inc = args.get("incarnation")
        _need(inc is None or isinstance(inc, str), "desired.incarnation: null or a string")
    if kind is Check and "task" in args:
        args["task"] = CheckTask.from_json(args["task"])
    if kind is Run and isinstance(args.get("injects"), list):
        args["injects"] = [
            inject_from_json(i, f"desired.injects[{n}]") for n, i in enumerate(args["injects"])
        ]
    try:
        return kind(**args)  # type: ignore[no-any-return]
    except TypeError as e:  # a missing or unknown field
        raise ProtocolError(f"desired {body.get('action')}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DesiredReply:
    """The controller's answer to a report or a long poll: the node's desired state at
    ``version`` (versions only grow); ``desired`` None when the report said the agent holds
    that version already."""

    version: int
    desired: Desired | None = None


def reply_to_json(r: DesiredReply) -> dict[str, Any]:
    out: dict[str, Any] = {"version": r.version}
    if r.desired is not None:
        out["desired"] = desired_to_json(r.desired)
    return out


def reply_from_json(body: Any) -> DesiredReply:
    """The reply ``reply_to_json`` wrote. Raises ProtocolError naming the field."""
    _need(isinstance(body, dict) and type(body.get("version")) is int,
          "reply.version: an integer")  # fmt: skip
    d = body.get("desired")
    return DesiredReply(
        version=body["version"], desired=None if d is None else desired_from_json(d)
    )


MAX_WAIT_S = 30.0  # the longest long poll of desired states anyone may ask for


def long_poll_args(query: Mapping[str, str], key: str) -> tuple[int, float]:
    """A desired-state long poll's arguments (``/v1/desired``: ``version``; a relay's
    ``/v1/relay/desired``: ``since``): the integer ``key`` (default 0) and ``wait_s`` (default
    10, finite, clamped to 0..``MAX_WAIT_S`` seconds). Raises ProtocolError naming them."""
    try:
        mark, wait_s = int(query.get(key, "0")), float(query.get("wait_s", "10"))
    except ValueError:
        raise ProtocolError(f"{key} and wait_s: numbers") from None
    _need(math.isfinite(wait_s), "wait_s: a finite number of seconds")
    return mark, min(MAX_WAIT_S, max(0.0, wait_s))
