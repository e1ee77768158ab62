"""Controller types: job phases, node pools, observations and records (the config: config.py)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from trainguard.protocol import FaultCause
from trainguard.protocol.report import WorkerReport

# Phases of a recovery, in order, each timed from the end of the previous one; then the sum.
RECOVERY_PHASES = (
    "detect",
    "stop",
    "clean",
    "replace",
    "rendezvous",
    "load_checkpoint",
    "first_step",
    "total",
)


class Phase(enum.StrEnum):
    """Job states (ARCHITECTURE §2). Transitions, all made by ``decide``:

    PENDING → RENDEZVOUS                 enough healthy nodes joined
    RENDEZVOUS → RUNNING                 every rank of the generation started
    RENDEZVOUS|RUNNING → FAULTED         worker crash/exit, hang, node lost
    RUNNING → SUCCEEDED                  every rank exited 0
    FAULTED → STOPPING → CLEANING → REPLACING
    REPLACING → RENDEZVOUS               next generation, lost nodes replaced by standby
    REPLACING → WAITING_FOR_NODES        not enough healthy nodes
    WAITING_FOR_NODES → REPLACING        a node joined or returned
    REPLACING → FAILED                   budget spent, no progress, user error
    any active → STOPPING → STOPPED      user stop (SIGTERM / Ctrl-C)
    """

    PENDING = "PENDING"
    RENDEZVOUS = "RENDEZVOUS"
    RUNNING = "RUNNING"
    FAULTED = "FAULTED"
    STOPPING = "STOPPING"
    CLEANING = "CLEANING"
    REPLACING = "REPLACING"
    WAITING_FOR_NODES = "WAITING_FOR_NODES"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED, Phase.STOPPED)


class Pool(enum.StrEnum):
    """Node pools (the seed's lists): healthy = running ∪ standby; all = healthy ∪ faulty ∪ retired."""

    RUNNING = "running"
    STANDBY = "standby"
    FAULTY = "faulty"
    RETIRED = "retired"


# A worker as its agent last reported it: the report's own type (one definition).
WorkerObs = WorkerReport

NO_STEP = -(2**63)  # ``NodeSummary.max_step`` of a node none of whose workers reported a step


@dataclasses.dataclass(kw_only=True, slots=True)
class NodeSummary:
    """One node's workers in a few numbers (``summary.summarize``), so that a decision tick
    reads nodes, not workers. Counts are of workers; "running" ones are those in state
    ``running``. Ages are seconds, as the agent measured them (``WorkerReport``).

    ``quiet``: nothing a tick must look at on this node while its generation runs: it is not
    hung, not fenced for its generation, and it has workers, every one running with the
    runtime. ``max_step``: the newest step of the node's generation, its workers' or
    ``steps_seen``'s. ``calm``: (the node's generation when quiet, else None; ``workers``;
    ``max_step``), what a tick reads of every node of a running job, in one tuple. ``idle_min_s``: the least idle time of a running worker (``summary.idle_s``:
    since its last step with the runtime, else since its processes used CPU; inf when none
    runs); ``cpu_idle_min_s``: the least ``cpu_idle_s`` of a running worker (-inf when one
    has none, inf when none runs)."""

    workers: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0  # failed or parked (in process): the ones fault detection reads
    runtime_running: int = 0  # running with the runtime
    max_step: int = NO_STEP  # NO_STEP: none
    in_trainguard: bool = False  # a running worker waits inside trainguard
    idle_min_s: float = float("inf")
    cpu_idle_min_s: float = float("inf")
    quiet: bool = False
    calm: tuple[int | None, int, int] = (None, 0, NO_STEP)


@dataclasses.dataclass(kw_only=True, slots=True)
class NodeObs:
    """The latest report of one node's agent, stamped with the controller's receipt time."""

    node_id: str
    addr: str
    incarnation: str  # changes when the agent process restarts (a rebooted host)
    last_seen: float  # controller wall clock of the last report
    generation: int | None = None  # generation its workers belong to
    workers: dict[int, WorkerObs] = dataclasses.field(default_factory=dict)
    hang: bool = False
    fenced_generation: int = -1  # the generation whose workers the agent stopped (fencing)
    health_ok: bool = True  # the agent's host checks (memory, disk, /dev/shm) pass
    health_problems: tuple[str, ...] = ()  # the host checks that fail
    leaving: bool = False  # its last report said the agent is exiting: gone, not back
    clock_skew_s: float | None = None  # the agent's clock minus ours, at its last report
    reported_at: float | None = None  # the agent's clock when it made that report (its time)
    stopped_generation: int = -1  # newest generation fully stopped and cleaned here
    stopped_at: float | None = None
    cleaned_at: float | None = None
    store: tuple[int, int] | None = None  # (generation, port) of the TCPStore it hosts
    memory: dict[int, list[tuple[int, int]]] = dataclasses.field(
        default_factory=dict
    )  # rank → verified (step, gen) in ckptd
    ckptd_idle: bool = True  # its ckptd has nothing queued (every staged snapshot verified)
    ckptd_at: float | None = None  # agent wall clock when that status (and memory) was asked
    replicas: dict[int, list[tuple[int, int]]] = dataclasses.field(
        default_factory=dict
    )  # source rank → verified (step, gen) replicas this node holds for peers
    replica_addr: str | None = None  # host:port of this node's ckptd replica server
    # generation → newest step any report of this node showed for it (folded across reports:
    # decisions run on a coalesced tick, and a report after a stop lists no workers); the
    # newest STEPS_SEEN_GENERATIONS generations only, so memory per node stays bounded.
    steps_seen: dict[int, int] = dataclasses.field(default_factory=dict)
    # Its workers in a few numbers (``summary.summarize``; ``observe`` makes it): whoever
    # changes ``workers`` or the node's fields in place calls ``summarize`` again. None: not
    # made (an observation built by hand); readers then compute it (``summary.summary_of``).
    summary: NodeSummary | None = None


STEPS_SEEN_GENERATIONS = 4


@dataclasses.dataclass(kw_only=True, slots=True)
class Fault:
    """A detected fault; ``cause`` says what kind (``protocol.FaultCause``)."""

    cause: FaultCause
    generation: int
    rank: int | None
    node_id: str | None
    step: int | None
    t_fault: float
    t_detected: float
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(kw_only=True, slots=True)
class Recovery:
    """One recovery's phase boundaries (wall clock); see ``durations``."""

    fault: Fault
    from_generation: int
    to_generation: int | None = None
    restore_step: int | None = None
    restore_tiers: dict[str, int] = dataclasses.field(
        default_factory=dict
    )  # tier → ranks restored from it
    steps_lost: int | None = None
    replaced: dict[str, str] = dataclasses.field(default_factory=dict)  # lost node → standby
    # "inprocess": the ranks of ``kept`` keep their processes (aborted, parked, resumed), the
    # others are new; "restart": every rank is a new process. ``mode_reason`` says why.
    mode: str = "restart"
    mode_reason: str = ""
    kept: list[int] = dataclasses.field(default_factory=list)
    t_stopped: float | None = None
    t_cleaned: float | None = None
    t_replaced: float | None = None
    t_rendezvous: float | None = None
    t_loaded: float | None = None
    t_first_step: float | None = None

    def durations(self) -> dict[str, float | None]:
        """Seconds per phase: detect, stop, clean, replace, rendezvous, load_checkpoint, first_step, total."""
        marks = [
            self.fault.t_fault,
            self.fault.t_detected,
            self.t_stopped,
            self.t_cleaned,
            self.t_replaced,
            self.t_rendezvous,
            self.t_loaded,
            self.t_first_step,
        ]
        out: dict[str, float | None] = {}
        names = RECOVERY_PHASES[:-1]
        for name, a, b in zip(names, marks, marks[1:], strict=False):
            out[name] = None if a is None or b is None else max(0.0, b - a)
        out["total"] = None if self.t_first_step is None else self.t_first_step - self.fault.t_fault
        return out

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["durations_s"] = self.durations()
        return d
