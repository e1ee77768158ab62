"""Controller types: job phases, node pools, the job config, observations and records."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from typing import Any

from trainguard.checkpoint.archive import check_archive_url
from trainguard.faults.inject import InjectSpec
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


REPORTS_PER_S = 1000.0  # the agents' report rate the controller is sized for (see below)


def split_host_port(addr: str) -> tuple[str, str]:
    """("host", "port") of ``HOST:PORT`` or ``[V6]:PORT``."""
    host, _, port = addr.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), port


def scaled_timing(nodes: int) -> tuple[float, float]:
    """(heartbeat_s, node_timeout_s) for a job of ``nodes`` agents, used unless the config
    sets them: the heartbeat keeps the controller's report rate at about ``REPORTS_PER_S``
    (0.5 s up to 500 nodes, then nodes / 1000 s: 4.1 s at 4,096, 16.4 s at 16,384), and a
    node is lost after 5 missed heartbeats (at least 10 s). A worker's crash is reported at
    once whatever the heartbeat (the agent reports an exit immediately); the heartbeat bounds
    only how fast a silent node (power, network) is found. Measured in
    ``benchmarks/controller_scale.py``."""
    heartbeat = max(0.5, nodes / REPORTS_PER_S)
    return round(heartbeat, 3), round(max(10.0, 5 * heartbeat), 3)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """A job's spec. Every field can be set in the ``--config`` TOML file."""

    script: str  # path of the training script (Python); a module name, or a program
    script_args: tuple[str, ...] = ()  # its arguments
    # How a worker runs ``script``: "script" (python SCRIPT), "module" (python -m, torchrun's
    # -m) or "exec" (the program itself, torchrun's --no-python).
    launch: str = "script"
    log_dir: str | None = None  # workers' logs (default RUN_DIR/logs)
    run_dir: str  # where store, logs, checkpoints and metrics go
    nodes: int = 1  # nodes the job runs on (the most, for an elastic job)
    # Elastic (``--nodes MIN:MAX``): with no standby left, go on with fewer nodes down to this
    # many; grow back when nodes join. None = not elastic (= nodes).
    min_nodes: int | None = None
    standby: int = 0  # extra healthy nodes kept ready to replace a lost one
    nproc_per_node: int = 1  # workers (ranks) per node
    max_restarts: int = 3  # restarts after faults before the job FAILs
    hang_timeout_s: float | None = None  # fixed hang timeout; None = calibrated (see hang_timeout)
    hang_timeout_max_s: float = 300.0  # ceiling of the calibrated hang timeout
    hang_timeout_min_s: float = 10.0  # floor of the calibrated hang timeout
    first_step_timeout_s: float = 600.0  # allowance for the first step of a generation
    heartbeat_s: float = 0.5  # agent → controller and runtime → agent period
    node_timeout_s: float = 10.0  # missing agent heartbeats for this long = node lost
    join_timeout_s: float = (
        30.0  # at start, wait this long for nodes + standby before starting with fewer
    )
    rendezvous_timeout_s: float = 120.0  # from generation start to every rank running
    stop_grace_s: float = 15.0  # SIGTERM → SIGKILL on a user stop (workers may save)
    # WAITING_FOR_NODES (a lost node, no standby, not elastic) fails the job after this long.
    wait_for_nodes_timeout_s: float = 1800.0
    # A rank still running after every peer exited 0, whose processes used no CPU for this
    # long, is stuck at exit (e.g. a process-group destructor waiting on a thread): stopped.
    exit_grace_s: float = 30.0
    # A planned stop then persists the newest snapshot in memory; how long it may take.
    stop_persist_timeout_s: float = 120.0
    # SIGTERM → SIGKILL when stopping a faulted generation: nothing is left to save, and
    # ranks blocked in a collective cannot act on SIGTERM anyway.
    fault_stop_grace_s: float = 0.1
    no_progress_generations: int = 3  # generations in a row without a new checkpoint → FAILED
    user_error_generations: int = 2  # generations in a row failing before step 1 → FAILED
    memory_tier: bool = True  # snapshots in node memory (ckptd); False = synchronous DCP to disk
    replicas: bool = True  # each node's snapshots also kept in other nodes' memory
    replica_copies: int = 1  # how many: the next N nodes by node rank (a ring)
    shm_dir: str = "/dev/shm"  # where snapshot slots live
    keep_checkpoints: int = 2  # committed durable steps retained (the newest is never deleted)
    # A healthy standby keeps a verified copy of the newest durable step in its memory
    # (checkpoint/prefetch.py: shm_dir, next to ckptd's slots), so that a node it replaces
    # restores from memory, not from the durable tier. Costs one step's size per standby.
    prefetch_standby: bool = True
    checkpoint_dir: str | None = None  # durable tier; default RUN_DIR/checkpoints
    # Cold tier (checkpoint/archive.py): durable steps copied in the background to this URL
    # (s3://bucket/prefix with s3fs, file:///path, any fsspec URL), or to each URL of a list
    # (separate failure domains: buckets in other zones); None = off. A step counts as
    # archived (event archive_durable) once archive_copies of them verified a copy. A step is
    # archived when it is at least archive_every steps after the last archived one (0: every
    # durable step); the newest archive_keep are kept there. archive_concurrency files (and
    # ranged reads on restore) at once, archive_mbps MB/s at most (0: no cap). A job whose
    # hot tier has nothing newer restores the cold tier's newest step before it starts.
    archive_url: str | list[str] | None = None
    archive_copies: int = 1
    archive_endpoint_url: str | None = None  # S3 endpoint (MinIO, moto); default AWS_ENDPOINT_URL
    archive_every: int = 0
    archive_keep: int = 3
    archive_concurrency: int = 8
    archive_mbps: float = 0.0
    # Chunks compressed when measured to pay against the link (auto), never (off), or always
    # in one mode (zstd, zstd+shuf4 for fp32 state, zstd+shuf2 for bf16/fp16): codec.py.
    archive_compress: str = "auto"
    archive_final_timeout_s: float = 600.0  # at the job's end, the last step's upload may take this
    reboot_delay_s: float = 2.0  # embedded mode: a killed simulated node returns after this
    # A faulty node that is still (or again) reachable is re-checked after recheck_s, then
    # after twice as long each time it fails (at most 600 s), and returns to standby when its
    # host checks pass. A node lost retire_after times is retired for good.
    recheck_s: float = 30.0
    retire_after: int = 3
    # Pre-flight checks (health/): a node joins the pool, and a quarantined node returns to
    # standby, only after it passes them. "quick" (about 30 s for 4 nodes here), "full", "off".
    preflight: str = "quick"
    # Settings of the job's pre-flight runs (CheckConfig fields, a ``[checks]`` table in the
    # config file): deadlines, thresholds, the back-off of inconclusive runs.
    checks: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Straggler detection (controller/analysis.py): windows of this many steps; an alert after
    # this many flagged windows in a row. "alert" only, or "replace": quarantine the
    # straggler's node and replace it with a standby at the next checkpoint boundary.
    straggler_window_steps: int = 20
    straggler_persist_windows: int = 3
    straggler_action: str = "alert"
    # Compare data-parallel replicas' snapshot fingerprints (checkpoint/fingerprint.py) and
    # treat a mismatch as silent data corruption (controller/sdc.py).
    sdc_check: bool = True
    # When replicas disagree and no majority names the culprit (2 replicas): roll back and
    # recompute the steps with one of the disagreeing nodes held out (a healthy standby takes
    # its rank), then name the node whose old state differs from the recomputed one
    # (controller/sdc.py). Off: roll back without naming anyone.
    sdc_recompute: bool = True
    # Silent corruption that fingerprints cannot see (it reaches every replica alike through
    # the all-reduce): a gradient norm above sdc_grad_ratio × its median (0: off; analysis.py),
    # and each running node's known-answer GEMM probe, every probe_every_s (0: off;
    # agent/probe.py: about 1 ms of one core or a GPU's microseconds a probe).
    sdc_grad_ratio: float = 1000.0
    probe_every_s: float = 60.0
    # Failure prediction (controller/risk.py): corrected errors within risk_window_s that
    # flag a node at risk; °C below a GPU's slowdown threshold that do, and the horizon of a
    # temperature climb that does. Sudden signs (uncorrected errors, critical Xids, I/O
    # errors, SMART) always do.
    risk_ce_delta: float = 10.0
    risk_window_s: float = 600.0
    risk_temp_margin_c: float = 5.0
    risk_temp_horizon_s: float = 600.0  # a GPU whose climb reaches its slowdown this soon
    alert_webhook: str | None = None  # POST each alert there as JSON (5 s timeout)
    # /metrics also on this fixed HOST:PORT (for a Prometheus scrape config), without the
    # job token there when metrics_open (metrics say nothing secret; the address should
    # be reachable from the monitoring network only). None: only on the API's random port.
    metrics_bind: str | None = None
    metrics_open: bool = False
    injects: tuple[InjectSpec, ...] = ()  # fault drills

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.nodes >= 1, f"--nodes {self.nodes}: a job needs at least 1 node")
        need(
            self.launch in ("script", "module", "exec"),
            f"launch = {self.launch!r}: use script, module (-m) or exec (--no-python)",
        )
        need(
            self.min_nodes is None or 1 <= self.min_nodes <= self.nodes,
            f"--nodes {self.min_nodes}:{self.nodes}: need 1 <= MIN <= MAX",
        )
        need(self.standby >= 0, f"--standby {self.standby}: must be >= 0")
        need(
            self.preflight in ("quick", "full", "off"),
            f"preflight={self.preflight!r}: use quick, full or off",
        )
        need(
            self.straggler_action in ("alert", "replace"),
            f"straggler_action={self.straggler_action!r}: use alert or replace",
        )
        need(
            self.straggler_window_steps >= 2 and self.straggler_persist_windows >= 1,
            "straggler_window_steps must be >= 2 and straggler_persist_windows >= 1",
        )
        need(self.replica_copies >= 1, f"replica_copies={self.replica_copies}: must be >= 1")
        need(self.nproc_per_node >= 1, f"--nproc-per-node {self.nproc_per_node}: must be >= 1")
        need(self.max_restarts >= 0, f"--max-restarts {self.max_restarts}: must be >= 0")
        need(
            self.hang_timeout_s is None
            or (math.isfinite(self.hang_timeout_s) and self.hang_timeout_s > 0),
            f"--hang-timeout {self.hang_timeout_s}: must be a finite number of seconds > 0",
        )
        for name in (
            "heartbeat_s",
            "node_timeout_s",
            "first_step_timeout_s",
            "rendezvous_timeout_s",
            "hang_timeout_min_s",
            "hang_timeout_max_s",
            "stop_persist_timeout_s",
            "exit_grace_s",
            "wait_for_nodes_timeout_s",
        ):
            need(getattr(self, name) > 0, f"{name}={getattr(self, name)}: must be > 0")
        need(
            self.node_timeout_s > 2 * self.heartbeat_s, "node_timeout_s must exceed 2 × heartbeat_s"
        )
        need(self.sdc_grad_ratio == 0 or self.sdc_grad_ratio > 1, "sdc_grad_ratio: 0 (off) or > 1")
        need(
            self.archive_every >= 0 and self.archive_keep >= 1 and self.archive_concurrency >= 1
            and self.archive_mbps >= 0 and self.archive_final_timeout_s > 0,
            "archive_every >= 0, archive_keep >= 1, archive_concurrency >= 1, archive_mbps >= 0 "
            "and archive_final_timeout_s > 0 are required",
        )  # fmt: skip
        need(
            self.archive_compress in ("auto", "off", "zstd", "zstd+shuf4", "zstd+shuf2"),
            f"archive_compress = {self.archive_compress!r}: use auto, off, zstd, zstd+shuf4 or "
            "zstd+shuf2",
        )
        if self.metrics_bind is not None:
            host, port = split_host_port(self.metrics_bind)
            need(
                bool(host) and port.isdigit() and 0 < int(port) < 65536,
                f"metrics_bind = {self.metrics_bind!r}: use HOST:PORT, e.g. 0.0.0.0:9400 or "
                "[::]:9400",
            )
        need(
            not self.metrics_open or self.metrics_bind is not None,
            "metrics_open = true needs metrics_bind = HOST:PORT (the address to serve it on)",
        )
        for url in self.archive_urls:
            check_archive_url(url)
        norm = [u.rstrip("/") for u in self.archive_urls]
        need(
            len(set(norm)) == len(norm),
            f"archive_url lists {sorted({u for u in norm if norm.count(u) > 1})} twice: give "
            "each copy its own target (another bucket or prefix)",
        )
        for url in norm:
            local = url.removeprefix("file://") if url.startswith("file://") else None
            if local is None and "://" not in url:
                local = url
            if local:
                hot = os.path.realpath(self.ckpt_dir)
                there = os.path.realpath(local)
                need(
                    not (there == hot or there.startswith(hot + os.sep)
                         or hot.startswith(there + os.sep)),
                    f"archive_url = {url!r} overlaps the durable tier {self.ckpt_dir}: the cold "
                    "tier must be somewhere else (another disk, a bucket)",
                )  # fmt: skip
        need(
            bool(self.archive_urls) or self.archive_copies == 1,
            "archive_copies is set but archive_url is not: give the cold tier's targets",
        )
        need(
            not self.archive_urls or 1 <= self.archive_copies <= len(self.archive_urls),
            f"archive_copies = {self.archive_copies}: between 1 and the {len(self.archive_urls)} "
            "archive_url targets",
        )
        need(self.probe_every_s >= 0, "probe_every_s must be >= 0 (0: no in-job GEMM probe)")
        for spec in self.injects:
            if spec.rank is not None:
                need(
                    spec.rank < self.world_size,
                    f"--inject {spec.describe()}: rank out of range 0..{self.world_size - 1}",
                )
            if spec.node is not None:
                top = self.nodes + (self.standby if spec.kind == "gemm-wrong" else 0)
                need(
                    spec.node < top,
                    f"--inject {spec.describe()}: node out of range 0..{top - 1}",
                )

    @property
    def archive_urls(self) -> list[str]:
        """The cold tier's targets ([] = none)."""
        url = self.archive_url
        return [] if not url else [url] if isinstance(url, str) else list(url)

    @property
    def ckpt_dir(self) -> str:
        return self.checkpoint_dir or f"{self.run_dir}/checkpoints"

    @property
    def world_size(self) -> int:
        """The full world (MAX nodes); an elastic job may run with fewer for a while."""
        return self.nodes * self.nproc_per_node

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nodes


# A worker as its agent last reported it: the report's own type (one definition).
WorkerObs = WorkerReport


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
    clock_skew_s: float | None = None  # the agent's clock minus ours, at its last report
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
