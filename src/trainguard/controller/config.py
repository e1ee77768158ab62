"""The job config: ``JobConfig``, the job's identity at the top and its settings in sections.

Each section is a frozen dataclass validated on its own; ``JobConfig`` checks what spans
sections (the cold tier against the durable tier, drills against the world). Every field
carries a one-line doc in its metadata (``setting``): ``docs/config.md`` is rendered from
it (``config_doc.py``, ``tools/config_doc.py``), and the config file's type errors name the
type from the same annotations.

Field names are unique across sections, so a config file may give a field flat
(``keep_checkpoints = 3``) or in its section (``[checkpoint]`` ``keep_checkpoints = 3``);
``group_fields`` maps either to the sections. The one field whose flat name differs is the
pre-flight level: flat ``preflight = "off"`` is ``[preflight]`` ``level = "off"``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from trainguard.faults.inject import InjectSpec

Launch = Literal["script", "module", "exec"]
PreflightLevel = Literal["off", "quick", "full"]
StragglerAction = Literal["alert", "replace"]
ArchiveCompress = Literal["auto", "off", "zstd", "zstd+shuf4", "zstd+shuf2"]

REPORTS_PER_S = 1000.0  # the agents' report rate the controller is sized for (see below)
# With relays: 2 s at any size (issue 31: at most 2 s), so a node is lost after 10 s, 5 missed
# heartbeats. A faster one finds no lost node sooner (the node timeout is 10 s either way) and
# doubles what the agents, relays and controller spend on heartbeats: at 4,096 simulated nodes
# with a 1 s one, this 2-core machine ran out of CPU (benchmarks/controller_scale.py).
RELAYED_HEARTBEAT_S = 2.0


def split_host_port(addr: str) -> tuple[str, str]:
    """("host", "port") of ``HOST:PORT`` or ``[V6]:PORT``."""
    host, _, port = addr.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), port


MAX_NODES = 1 << 20  # far past any job's size; keeps the scaled heartbeat finite and sane


def scaled_timing(nodes: int, relays: int = 0) -> tuple[float, float]:
    """(heartbeat_s, node_timeout_s) for a job of ``nodes`` agents, used unless the config
    sets them, and a node is lost after 5 missed heartbeats (at least 10 s).

    Agents reporting directly (``relays`` 0): the heartbeat keeps the controller's report rate
    at about ``REPORTS_PER_S`` (0.5 s up to 500 nodes, then nodes / 1000 s: 4.1 s at 4,096,
    16.4 s at 16,384). Through relays: ``RELAYED_HEARTBEAT_S`` (2 s, node timeout 10 s) at
    any size; the controller takes a few uplinks a second per relay whatever the nodes. A
    worker's crash is reported at once whatever the heartbeat (the agent reports an exit
    immediately); the heartbeat bounds only how fast a silent node (power, network) is found.
    Measured in ``benchmarks/controller_scale.py``."""
    heartbeat = RELAYED_HEARTBEAT_S if relays > 0 else max(0.5, nodes / REPORTS_PER_S)
    return round(heartbeat, 3), round(max(10.0, 5 * heartbeat), 3)


def setting(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    factory: Any = dataclasses.MISSING,
    flat: str | None = None,
    flag: str | None = None,
) -> Any:
    """A config field with its one-line ``doc``; where it differs from the field's name, the
    ``flat`` name a config file gives it outside its section; the command-line ``flag`` that
    sets it, if any (whose help is ``doc`` and the default: ``cli/main.py``)."""
    meta = {"doc": doc, **({"flat": flat} if flat else {}), **({"flag": flag} if flag else {})}
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _choices(hint: Any) -> tuple[str, ...]:
    return typing.get_args(hint)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TimeoutsConfig:
    """Deadlines and periods. Unless ``hang_timeout_s`` is set, the hang timeout is calibrated
    from step times, between ``hang_timeout_min_s`` and ``hang_timeout_max_s``.
    ``heartbeat_s`` and ``node_timeout_s`` scale with the job's
    size unless set (``scaled_timing``): about 1,000 reports a second reach the controller,
    and a node is lost after 5 missed heartbeats (at least 10 s)."""

    hang_timeout_s: float | None = setting(None, "fixed hang timeout", flag="--hang-timeout")
    hang_timeout_max_s: float = setting(300.0, "ceiling of the calibrated hang timeout")
    hang_timeout_min_s: float = setting(10.0, "floor of the calibrated hang timeout")
    first_step_timeout_s: float = setting(600.0, "allowance for the first step of a generation")
    heartbeat_s: float = setting(0.5, "agent → controller and runtime → agent period")
    node_timeout_s: float = setting(
        10.0,
        "missing agent heartbeats for this long = node lost (an agent that exits, e.g. on "
        "SIGTERM, says so in its last report: its node is lost at once)",
    )
    join_timeout_s: float = setting(
        30.0, "at start, wait this long for nodes + standby before starting with fewer"
    )
    rendezvous_timeout_s: float = setting(120.0, "from generation start to every rank running")
    stop_grace_s: float = setting(15.0, "SIGTERM → SIGKILL on a user stop (workers may save)")
    wait_for_nodes_timeout_s: float = setting(
        1800.0, "a lost node with no standby and no elasticity fails the job after this long"
    )
    exit_grace_s: float = setting(
        30.0,
        "a rank still running, idle this long after every peer exited 0, is stuck at exit: stopped",
    )
    stop_persist_timeout_s: float = setting(
        120.0, "a planned stop persists the newest snapshot in memory; how long it may take"
    )
    fault_stop_grace_s: float = setting(
        0.1, "SIGTERM → SIGKILL when stopping a faulted generation (nothing left to save)"
    )
    inprocess_abort_s: float = setting(
        10.0,
        "in-process recovery: a survivor not out of its training function this long "
        "after the abort is killed and restarted as a new process",
    )

    def __post_init__(self) -> None:
        _need(
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
            "inprocess_abort_s",
        ):
            v = getattr(self, name)
            _need(v > 0 and math.isfinite(v), f"{name}={v}: must be a finite number of seconds > 0")
        for name in ("join_timeout_s", "stop_grace_s", "fault_stop_grace_s"):
            v = getattr(self, name)
            _need(
                v >= 0 and math.isfinite(v), f"{name}={v}: must be a finite number of seconds >= 0"
            )
        _need(
            self.node_timeout_s > 2 * self.heartbeat_s,
            f"node_timeout_s must exceed 2 × heartbeat_s (they are {self.node_timeout_s:g} and "
            f"{self.heartbeat_s:g}): raise node_timeout_s or lower heartbeat_s",
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RestartConfig:
    """The restart policy: when the job stops restarting and FAILs."""

    max_restarts: int = setting(3, "restarts before the job fails", flag="--max-restarts")
    no_progress_generations: int = setting(
        3, "generations in a row without a new checkpoint → FAILED"
    )
    user_error_generations: int = setting(2, "generations in a row failing before step 1 → FAILED")
    inprocess: bool = setting(
        True,
        "recover in process where every rank's script runs under trainguard.run: the "
        "survivors keep their processes, only the failed ranks are new",
    )
    warm_spares: int | None = setting(
        None,
        "spare workers each node keeps started, torch imported, for the next restart "
        "(unset: one per worker, nproc_per_node; 0: a restart starts them, ~2-5 s of CPU "
        "each, and only the agent that hosts a store imports torch, when it does)",
    )

    def __post_init__(self) -> None:
        _need(self.max_restarts >= 0, f"--max-restarts {self.max_restarts}: must be >= 0")
        _need(
            self.warm_spares is None or self.warm_spares >= 0,
            f"warm_spares = {self.warm_spares}: must be >= 0 (unset: one per worker)",
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaConfig:
    """Local recovery (docs/local_recovery.md): the job's ranks as replica groups, each a whole
    model replica; a failed group restarts and heals from a live one while the others train."""

    groups: int = setting(
        1,
        "replica groups (1: off; every fault is a global recovery)",
        flat="replica_groups",
        flag="--replica-groups",
    )
    max_local_restarts: int = setting(
        10, "restarts of one group healed from a peer before a fault is a global recovery"
    )
    quorum_timeout_s: float = setting(
        30.0, "how long a group waits for the next quorum epoch or a peer's collective"
    )

    def __post_init__(self) -> None:
        _need(self.groups >= 1, f"--replica-groups {self.groups}: must be >= 1")
        _need(self.max_local_restarts >= 0, "max_local_restarts must be >= 0")
        _need(
            self.quorum_timeout_s > 0 and math.isfinite(self.quorum_timeout_s),
            f"quorum_timeout_s={self.quorum_timeout_s}: must be a finite number of seconds > 0",
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PoolConfig:
    """Faulty nodes: a faulty node that is still (or again) reachable is re-checked after
    ``recheck_s``, then after twice as long each time it fails (at most 600 s), and returns
    to standby when its host checks pass; a node lost ``retire_after`` times is retired.
    While the job waits for its nodes at start, a node quarantined only for silence is
    re-checked as soon as it reports again (no generation exists yet for it to break)."""

    recheck_s: float = setting(30.0, "first re-check of a faulty node after this long")
    retire_after: int = setting(3, "a node lost this many times is retired for good")
    reboot_delay_s: float = setting(
        2.0, "embedded mode (trainguard run): a killed simulated node returns after this"
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoint tiers: snapshots in node memory (ckptd), replicas in peers' memory, the
    durable tier on disk. A healthy standby keeps a verified copy of the newest durable step
    in its memory (``checkpoint/prefetch.py``, beside ckptd's slots in ``shm_dir``), so that a
    node it replaces restores from memory, not from the durable tier."""

    memory_tier: bool = setting(
        True, "snapshots in node memory (ckptd); false = synchronous DCP to disk"
    )
    replicas: bool = setting(True, "each node's snapshots also kept in other nodes' memory")
    replica_copies: int = setting(1, "how many: the next N nodes by node rank (a ring)")
    shm_dir: str = setting("/dev/shm", "where snapshot slots live")
    keep_checkpoints: int = setting(
        2, "committed durable steps retained (the newest is never deleted)"
    )
    prefetch_standby: bool = setting(
        True, "standbys hold the newest durable step in memory (one step's size each)"
    )
    checkpoint_dir: str | None = setting(None, "durable tier; default RUN_DIR/checkpoints")

    def __post_init__(self) -> None:
        _need(self.replica_copies >= 1, f"replica_copies={self.replica_copies}: must be >= 1")
        _need(
            self.keep_checkpoints >= 1,
            f"keep_checkpoints={self.keep_checkpoints}: must be >= 1 (the newest durable step "
            "is always kept)",
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ArchiveConfig:
    """The cold tier (``checkpoint/archive.py``): durable steps copied in the background to
    one URL or to each of a list (separate failure domains: buckets in other zones). A step
    counts as archived (event ``archive_durable``) once ``archive_copies`` targets verified a
    copy. A job whose hot tier has nothing newer restores the cold tier's newest step before
    it starts."""

    archive_url: str | list[str] | None = setting(
        None, "s3://bucket/prefix (s3fs), file:///path, any fsspec URL, or a list; unset = off"
    )
    archive_copies: int = setting(1, "targets that must hold a verified copy of an archived step")
    archive_endpoint_url: str | None = setting(
        None, "S3 endpoint (MinIO, moto); default AWS_ENDPOINT_URL"
    )
    archive_every: int = setting(
        0, "archive a step at least this many steps after the last archived one (0: every one)"
    )
    archive_keep: int = setting(3, "archived steps kept at each target (the newest)")
    archive_concurrency: int = setting(8, "files (and ranged reads on restore) at once")
    archive_mbps: float = setting(0.0, "MB/s at most (0: no cap)")
    archive_compress: ArchiveCompress = setting(
        "auto",
        "chunks compressed when measured to pay (auto), never (off), or always in one mode "
        "(zstd+shuf4 for fp32 state, zstd+shuf2 for bf16/fp16)",
    )
    archive_final_timeout_s: float = setting(
        600.0, "at the job's end, the last step's upload may take this long"
    )

    def __post_init__(self) -> None:
        _need(
            self.archive_every >= 0 and self.archive_keep >= 1 and self.archive_concurrency >= 1
            and self.archive_mbps >= 0 and self.archive_final_timeout_s > 0,
            "archive_every >= 0, archive_keep >= 1, archive_concurrency >= 1, archive_mbps >= 0 "
            "and archive_final_timeout_s > 0 are required",
        )  # fmt: skip
        _need(
            self.archive_compress in _choices(ArchiveCompress),
            f"archive_compress = {self.archive_compress!r}: use auto, off, zstd, zstd+shuf4 or "
            "zstd+shuf2",
        )
        if self.archive_urls:  # archive.py imports numpy: only for a job with a cold tier
            from trainguard.checkpoint.archive import check_archive_url

            for url in self.archive_urls:
                check_archive_url(url)
        norm = [u.rstrip("/") for u in self.archive_urls]
        _need(
            len(set(norm)) == len(norm),
            f"archive_url lists {sorted({u for u in norm if norm.count(u) > 1})} twice: give "
            "each copy its own target (another bucket or prefix)",
        )
        _need(
            bool(self.archive_urls) or self.archive_copies == 1,
            "archive_copies is set but archive_url is not: give the cold tier's targets",
        )
        _need(
            not self.archive_urls or 1 <= self.archive_copies <= len(self.archive_urls),
            f"archive_copies = {self.archive_copies}: between 1 and the {len(self.archive_urls)} "
            "archive_url targets",
        )

    @property
    def archive_urls(self) -> list[str]:
        """The cold tier's targets ([] = none)."""
        url = self.archive_url
        return [] if not url else [url] if isinstance(url, str) else list(url)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PreflightConfig:
    """Pre-flight checks (``health/``): a node joins the pool, and a quarantined node returns
    to standby, only after it passes them. quick takes about 30 s for 4 nodes."""

    level: PreflightLevel = setting(
        "quick", "pre-flight node checks before training", flat="preflight", flag="--preflight"
    )
    checks: dict[str, Any] = setting(
        factory=dict,
        doc="CheckConfig fields (health/judge.py): deadlines, thresholds, inconclusive back-off",
    )

    def __post_init__(self) -> None:
        _need(
            self.level in _choices(PreflightLevel),
            f"preflight={self.level!r}: use quick, full or off",
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StragglerConfig:
    """Straggler detection (``controller/analysis.py``), over windows of steps."""

    straggler_window_steps: int = setting(20, "steps per window")
    straggler_persist_windows: int = setting(3, "an alert after this many flagged windows in a row")
    straggler_action: StragglerAction = setting(
        "alert",
        "alert only, or replace: quarantine the node, a standby takes over at the next checkpoint",
    )

    def __post_init__(self) -> None:
        _need(
            self.straggler_action in _choices(StragglerAction),
            f"straggler_action={self.straggler_action!r}: use alert or replace",
        )
        _need(
            self.straggler_window_steps >= 2 and self.straggler_persist_windows >= 1,
            "straggler_window_steps must be >= 2 and straggler_persist_windows >= 1",
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SdcConfig:
    """Silent data corruption (``controller/sdc.py``). Replicas' snapshot fingerprints are
    compared; when replicas disagree and no majority names the culprit (2 replicas), the
    steps are recomputed with one disagreeing node held out (a healthy standby takes its
    rank) to name the node whose old state differs. Corruption that reaches every replica
    alike through the all-reduce is looked for in gradient norms and by a known-answer GEMM
    probe on each running node (``agent/probe.py``: about 1 ms of one core a probe)."""

    sdc_check: bool = setting(True, "compare data-parallel replicas' snapshot fingerprints")
    sdc_recompute: bool = setting(
        True, "on a 2-way disagreement, recompute to name the culprit; off: roll back only"
    )
    sdc_grad_ratio: float = setting(1000.0, "flag a gradient norm above this × its median (0: off)")
    probe_every_s: float = setting(60.0, "each running node's known-answer GEMM probe (0: off)")

    def __post_init__(self) -> None:
        _need(self.sdc_grad_ratio == 0 or self.sdc_grad_ratio > 1, "sdc_grad_ratio: 0 (off) or > 1")
        _need(self.probe_every_s >= 0, "probe_every_s must be >= 0 (0: no in-job GEMM probe)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RiskConfig:
    """Failure prediction (``controller/risk.py``): what flags a node at risk. Sudden signs
    (uncorrected errors, critical Xids, I/O errors, SMART) always do."""

    risk_ce_delta: float = setting(10.0, "corrected errors within risk_window_s")
    risk_window_s: float = setting(600.0, "the window of risk_ce_delta")
    risk_temp_margin_c: float = setting(5.0, "°C below a GPU's slowdown threshold")
    risk_temp_horizon_s: float = setting(
        600.0, "a GPU whose temperature climb reaches its slowdown this soon"
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MetricsConfig:
    """Where alerts and metrics go besides the API's own port. Metrics say nothing secret;
    an open ``metrics_bind`` should be reachable from the monitoring network only."""

    metrics_bind: str | None = setting(
        None, "/metrics also on this fixed HOST:PORT (a Prometheus scrape target)"
    )
    metrics_open: bool = setting(False, "serve metrics_bind without the job token")
    alert_webhook: str | None = setting(None, "POST each alert there as JSON (5 s timeout)")

    def __post_init__(self) -> None:
        if self.metrics_bind is not None:
            host, port = split_host_port(self.metrics_bind)
            _need(
                bool(host) and port.isdigit() and 0 < int(port) < 65536,
                f"metrics_bind = {self.metrics_bind!r}: use HOST:PORT, e.g. 0.0.0.0:9400 or "
                "[::]:9400",
            )
        _need(
            not self.metrics_open or self.metrics_bind is not None,
            "metrics_open = true needs metrics_bind = HOST:PORT (the address to serve it on)",
        )


# Section name → its class, in the order the doc lists them.
SECTIONS: dict[str, type] = {
    "timeouts": TimeoutsConfig,
    "restart": RestartConfig,
    "replica": ReplicaConfig,
    "pool": PoolConfig,
    "checkpoint": CheckpointConfig,
    "archive": ArchiveConfig,
    "preflight": PreflightConfig,
    "straggler": StragglerConfig,
    "sdc": SdcConfig,
    "risk": RiskConfig,
    "metrics": MetricsConfig,
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """A job's spec: what it runs and where (here), its settings (the sections). Every field
    but ``script``, ``script_args``, ``run_dir``, ``launch`` and ``injects`` (the command
    line's) can be set in the ``--config`` TOML file, flat or in its section."""

    script: str = setting(doc="the training script's path (Python), a module name, or a program")
    script_args: tuple[str, ...] = setting((), "its arguments")
    launch: Launch = setting(
        "script", "script (python SCRIPT), module (python -m) or exec (the program itself)"
    )
    run_dir: str = setting(doc="where store, logs, checkpoints and metrics go")
    log_dir: str | None = setting(
        None, "where the workers' logs go (default RUN_DIR/logs)", flag="--log-dir"
    )
    nodes: int = setting(1, "nodes the job runs on", flag="--nodes")
    min_nodes: int | None = setting(
        None,
        "elastic (--nodes MIN:MAX): with no standby left, go on with down to this many "
        "nodes; unset = not elastic",
    )
    standby: int = setting(0, "standby nodes kept to replace lost ones", flag="--standby")
    relays: int = setting(
        0,
        "relays the agents report through (trainguard relay, one per rack); the heartbeat "
        "then scales with what relays take, at most 2 s",
    )
    nproc_per_node: int = setting(1, "workers per node", flag="--nproc-per-node")
    injects: tuple[InjectSpec, ...] = setting((), "fault drills", flag="--inject")
    timeouts: TimeoutsConfig = setting(factory=TimeoutsConfig, doc="deadlines and periods")
    restart: RestartConfig = setting(factory=RestartConfig, doc="the restart policy")
    replica: ReplicaConfig = setting(factory=ReplicaConfig, doc="replica groups, local recovery")
    pool: PoolConfig = setting(factory=PoolConfig, doc="faulty nodes' re-checks and retirement")
    checkpoint: CheckpointConfig = setting(factory=CheckpointConfig, doc="checkpoint tiers")
    archive: ArchiveConfig = setting(factory=ArchiveConfig, doc="the cold tier")
    preflight: PreflightConfig = setting(factory=PreflightConfig, doc="pre-flight checks")
    straggler: StragglerConfig = setting(factory=StragglerConfig, doc="straggler detection")
    sdc: SdcConfig = setting(factory=SdcConfig, doc="silent data corruption")
    risk: RiskConfig = setting(factory=RiskConfig, doc="failure prediction")
    metrics: MetricsConfig = setting(factory=MetricsConfig, doc="metrics and alerts")

    def __post_init__(self) -> None:
        _need(self.nodes >= 1, f"--nodes {self.nodes}: a job needs at least 1 node")
        _need(self.nodes <= MAX_NODES, f"--nodes {self.nodes}: at most {MAX_NODES:,} nodes")
        _need(
            self.launch in _choices(Launch),
            f"launch = {self.launch!r}: use script, module (-m) or exec (--no-python)",
        )
        _need(
            self.min_nodes is None or 1 <= self.min_nodes <= self.nodes,
            f"--nodes {self.min_nodes}:{self.nodes}: need 1 <= MIN <= MAX",
        )
        _need(self.standby >= 0, f"--standby {self.standby}: must be >= 0")
        _need(self.relays >= 0, f"relays = {self.relays}: must be >= 0 (0: agents report directly)")
        _need(self.nproc_per_node >= 1, f"--nproc-per-node {self.nproc_per_node}: must be >= 1")
        self._check_cold_tier()
        self._check_injects()
        self._check_replica_groups()

    def _check_replica_groups(self) -> None:
        """Groups of equal size, none straddling two nodes (a group's store and restart are
        its node agent's)."""
        g, w, n = self.replica.groups, self.world_size, self.nproc_per_node
        if g == 1:
            return
        _need(w % g == 0, f"--replica-groups {g}: must divide the world size {w}")
        _need(
            n % (w // g) == 0,
            f"--replica-groups {g}: a group of {w // g} ranks would straddle nodes of {n} "
            f"processes; use a multiple of {w // n} groups",
        )
        _need(self.min_nodes is None, "--replica-groups: not with an elastic job (--nodes MIN:MAX)")

    def _check_cold_tier(self) -> None:
        """The cold tier must not be (or hold, or sit in) the durable tier."""
        for url in (u.rstrip("/") for u in self.archive.archive_urls):
            local = url.removeprefix("file://") if url.startswith("file://") else None
            if local is None and "://" not in url:
                local = url
            if local:
                hot = os.path.realpath(self.ckpt_dir)
                there = os.path.realpath(local)
                _need(
                    not (there == hot or there.startswith(hot + os.sep)
                         or hot.startswith(there + os.sep)),
                    f"archive_url = {url!r} overlaps the durable tier {self.ckpt_dir}: the cold "
                    "tier must be somewhere else (another disk, a bucket)",
                )  # fmt: skip

    def _check_injects(self) -> None:
        for spec in self.injects:
            if spec.rank is not None:
                _need(
                    spec.rank < self.world_size,
                    f"--inject {spec.describe()}: rank out of range 0..{self.world_size - 1}",
                )
            if spec.node is not None:
                top = self.nodes + (self.standby if spec.kind == "gemm-wrong" else 0)
                _need(
                    spec.node < top,
                    f"--inject {spec.describe()}: node out of range 0..{top - 1}",
                )

    @classmethod
    def from_fields(cls, **fields: Any) -> JobConfig:
        """A JobConfig from fields given flat (``heartbeat_s=0.2``, ``preflight="off"``) or by
        section (``timeouts={"heartbeat_s": 0.2}`` or a ``TimeoutsConfig``). Raises ValueError
        naming an unknown field or a bad value."""
        grouped = group_fields(fields)
        return cls(**{
            k: SECTIONS[k](**v) if k in SECTIONS and isinstance(v, dict) else v
            for k, v in grouped.items()
        })  # fmt: skip

    def to_flat(self) -> dict[str, Any]:
        """Every field by its flat name, as plain data (what the store keeps as "config")."""
        out = dataclasses.asdict(self)
        for name, section in SECTIONS.items():
            values = out.pop(name)
            for f in dataclasses.fields(section):
                out[flat_name(f)] = values[f.name]
        return out

    @property
    def ckpt_dir(self) -> str:
        return self.checkpoint.checkpoint_dir or f"{self.run_dir}/checkpoints"

    @property
    def world_size(self) -> int:
        """The full world (MAX nodes); an elastic job may run with fewer for a while."""
        return self.nodes * self.nproc_per_node

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nodes


def field_of(name: str) -> dataclasses.Field[Any]:
    """The field that a config file's flat ``name`` sets (top-level, or a section's)."""
    cls, field = (SECTIONS[FLAT[name][0]], FLAT[name][1]) if name in FLAT else (JobConfig, name)
    return next(f for f in dataclasses.fields(cls) if f.name == field)


def flat_name(f: dataclasses.Field[Any]) -> str:
    """The name a section's field has outside its section (in a flat config file)."""
    return str(f.metadata.get("flat", f.name))


# Flat name → (section, field name) of every section field.
FLAT: dict[str, tuple[str, str]] = {
    flat_name(f): (section, f.name)
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
}
TOP = tuple(f.name for f in dataclasses.fields(JobConfig) if f.name not in SECTIONS)


def group_fields(
    data: Mapping[str, Any], *, skip: frozenset[str] = frozenset(), check_types: bool = False
) -> dict[str, Any]:
    """``data`` (a config file's table, or keyword arguments) by section: top-level fields
    as they are, each section's fields in a dict under its name, whether ``data`` gave them
    flat or in a section table. ``skip``: top-level fields not accepted here. With
    ``check_types``, a value must fit its field's annotation (a TOML file's values).
    Raises ValueError naming an unknown field, a field given twice, or a wrong type."""
    out: dict[str, Any] = {}
    unknown: list[str] = []
    for key, value in data.items():
        if key in SECTIONS and (isinstance(value, Mapping | SECTIONS[key]) or key not in FLAT):
            if not isinstance(value, Mapping):
                _need(
                    isinstance(value, SECTIONS[key]),
                    f"{key} = {toml_value(value)} is {toml_type(value)}; {key} takes a table ([{key}] "
                    "and its fields)",
                )
                _need(key not in out, f"[{key}] is given whole and by field; give it once")
                out[key] = value
                continue
            known = {f.name for f in dataclasses.fields(SECTIONS[key])}
            unknown += [f"[{key}] {k}" for k in value if k not in known]
            for k, v in value.items():
                if k in known:
                    _put(out, key, k, v, f"[{key}] {k}", check_types)
        elif key in FLAT:
            _put(out, *FLAT[key], value, key, check_types)
        elif key in TOP and key not in skip:
            if check_types:
                _check_type(key, value, _hints(JobConfig)[key])
            out[key] = value
        else:
            unknown.append(f"[{key}]" if isinstance(value, Mapping) else key)
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(unknown)}{did_you_mean(unknown, _names(skip))}; "
            f"{_known(unknown, skip)}"
        )
    return out


def _names(skip: frozenset[str]) -> list[str]:
    """Every name a config file may give: flat fields, sections, fields in their sections."""
    names = [n for n in (*FLAT, *TOP) if n not in skip and n not in SECTIONS]
    names += [f"[{s}]" for s in SECTIONS]
    names += [f"[{s}] {f.name}" for s, c in SECTIONS.items() for f in dataclasses.fields(c)]
    return names


def did_you_mean(given: list[str], names: list[str]) -> str:
    """`` (did you mean X?)`` for the first of ``given`` close to one of ``names`` (difflib's
    ratio ≥ 0.75), else ""."""
    for g in given:
        close = difflib.get_close_matches(g, names, n=1, cutoff=0.75)
        if close:
            return f" (did you mean {close[0]}?)"
    return ""


def toml_value(value: Any) -> str:
    """``value`` as a TOML file spells it (``true``, ``"fast"``, ``[1, 2]``)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _known(unknown: list[str], skip: frozenset[str]) -> str:
    """The fields there are where ``unknown`` were given: flat, or in their sections."""
    said = []
    if any(u.startswith("[") and " " not in u for u in unknown):
        said.append(f"sections: {', '.join(f'[{s}]' for s in SECTIONS)}")
    if any(not u.startswith("[") for u in unknown):
        flat = sorted({*FLAT, *(n for n in TOP if n not in skip)})
        said.append(
            f"known: {', '.join(flat)} (or in sections: {', '.join(f'[{s}]' for s in SECTIONS)})"
        )
    given = (u for u in unknown if u.startswith("[") and " " in u)
    for section in dict.fromkeys(u[1:].split("]")[0] for u in given):
        names = ", ".join(f.name for f in dataclasses.fields(SECTIONS[section]))
        said.append(f"known in [{section}]: {names}")
    return "; ".join(said)


def _put(out: dict[str, Any], section: str, name: str, value: Any, said: str, check: bool) -> None:
    table = out.setdefault(section, {})
    _need(isinstance(table, dict), f"{said}: [{section}] is given whole and by field; give it once")
    _need(name not in table, f"{said} is set twice (flat and in [{section}]); keep one")
    if check:
        _check_type(said, value, _hints(SECTIONS[section])[name])
    table[name] = value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_type(said: str, value: Any, hint: Any) -> None:
    """``said``: the key as the file wrote it (``heartbeat_s``, ``[timeouts] heartbeat_s``)."""
    want, name = type_text(hint), said.rsplit(" ", 1)[-1]
    _need(
        want is None or has_type(value, hint),
        f"{said} = {toml_value(value)} is {toml_type(value)}; {name} takes {want}",
    )


def has_type(value: Any, hint: Any) -> bool:
    """Does a TOML value fit a dataclass field's annotation? (bool is not an int here; a
    ``Literal``'s choices are its class's own check, with its own message.)"""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(has_type(value, a) for a in args if a is not type(None))
    if origin is typing.Literal:
        return any(has_type(value, type(a)) for a in args)
    if origin is dict:
        return isinstance(value, dict)
    if origin in (tuple, list):
        return isinstance(value, list) and all(
            has_type(v, args[0]) for v in value if args and args[0] is not Ellipsis
        )
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # a type this loader does not know: the dataclass checks it


def type_text(hint: Any) -> str | None:
    """What a field takes, in words ("a number", "one of 'quick', 'full'"); None for a type
    a config file does not spell."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        names = [n for a in args if a is not type(None) and (n := type_text(a))]
        return " or ".join(names) or None
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (tuple, list):
        return "a list"
    if origin is dict:
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint)


def toml_type(value: Any) -> str:
    """A TOML value's type, in words."""
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), f"a {type(value).__name__}")  # fmt: skip


# JobConfig fields the command line sets, not the config file.
COMMAND_LINE_FIELDS = frozenset({"script", "script_args", "run_dir", "launch", "injects"})
