"""``trainguard run``: controller plus one agent process per simulated node, on one machine.

Each simulated node is an agent bound to its own loopback address (127.0.0.2, .3, …)
with its own node id. An agent that dies (e.g. an injected node-down) comes back
as a fresh agent after ``reboot_delay_s``, as a rebooted host would. SIGTERM or
Ctrl-C stops the job cleanly: workers get SIGTERM and may save, then everything exits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import typing
from pathlib import Path
from typing import IO, Any

from trainguard.agent.tee import Tee, parse_ranks
from trainguard.checkpoint import storage
from trainguard.controller.api import Phase
from trainguard.controller.config import (
    COMMAND_LINE_FIELDS,
    FLAT,
    JobConfig,
    did_you_mean,
    group_fields,
    has_type,
    scaled_timing,
    toml_type,
    toml_value,
    type_text,
)
from trainguard.controller.jobstate import JobState, state_from_json
from trainguard.controller.server import Controller
from trainguard.controller.store import Store
from trainguard.faults.inject import parse_inject
from trainguard.health.judge import CheckConfig
from trainguard.observe.console import plural
from trainguard.observe.html import DASHBOARD
from trainguard.observe.statusline import StatusLine, job_line

log = logging.getLogger("trainguard.run")
AGENT_EXIT_DEADLINE_S = 30.0


def parse_nodes(text: str | None) -> tuple[int | None, int | None]:
    """``N`` or ``MIN:MAX`` → (min_nodes or None, nodes). Raises ValueError naming the fix."""
    if text is None:
        return None, None
    lo, sep, hi = str(text).partition(":")
    try:
        nmin, nmax = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(
            f"--nodes {text!r}: give a node count N or MIN:MAX, e.g. 2 or 2:3"
        ) from None
    if not sep:
        return None, nmax  # JobConfig checks the count itself
    if nmin < 1 or nmin > nmax:
        raise ValueError(f"--nodes {text}: need 1 <= MIN <= MAX")
    return nmin, nmax


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The table in the TOML file ``path``. Raises ValueError naming an unreadable file."""
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        why = e.strerror or str(e)
        raise ValueError(f"--config {path}: {why}; give a readable TOML file of {what}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--config {path}: {e}; give a readable TOML file of {what}") from None


def load_fields(path: Path | None, cls: Any) -> dict[str, Any]:
    """The fields of the flat dataclass ``cls`` set in the TOML file ``path`` ({} without
    one). Raises ValueError naming an unreadable file, unknown fields or a wrong type."""
    if path is None:
        return {}
    extra = read_toml(path, f"{cls.__name__} fields")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(
            f"--config {path}: unknown field(s) {', '.join(unknown)}"
            f"{did_you_mean(unknown, sorted(known))}; known: {', '.join(sorted(known))}"
        )
    hints = typing.get_type_hints(cls)
    for name, value in extra.items():
        want = type_text(hints[name])
        if want is not None and not has_type(value, hints[name]):
            raise ValueError(
                f"--config {path}: {name} = {toml_value(value)} is {toml_type(value)}; {name} takes {want}"
            )
    return extra


def load_job_fields(path: Path | None) -> dict[str, Any]:
    """The JobConfig fields set in the TOML file ``path``, flat or in sections, grouped by
    section (``config.group_fields``); {} without one. Raises ValueError naming an
    unreadable file, an unknown field or a wrong type."""
    if path is None:
        return {}
    data = read_toml(path, "job config fields (docs/config.md)")
    try:
        return group_fields(data, skip=COMMAND_LINE_FIELDS, check_types=True)
    except ValueError as e:
        raise ValueError(f"--config {path}: {e}") from None


def build_config(args: argparse.Namespace) -> JobConfig:
    """Validate flags and the config file into a JobConfig. Raises ValueError naming the fix."""
    launch, target = _launch_target(args)
    run_dir = args.run_dir or Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    fields = load_job_fields(args.config)
    min_nodes, nodes = parse_nodes(args.nodes)
    flags = {
        "nodes": nodes,
        "min_nodes": min_nodes,
        "standby": args.standby,
        "nproc_per_node": parse_nproc(args.nproc_per_node),
        "log_dir": str(args.log_dir.resolve()) if args.log_dir else None,
        "max_restarts": args.max_restarts,
        "replica_groups": args.replica_groups,
        "hang_timeout_s": args.hang_timeout,
        "preflight": getattr(args, "preflight", None),
    }
    for name, value in flags.items():  # a flag given beats the file
        if value is None:
            continue
        if name in FLAT:
            section, field = FLAT[name]
            fields.setdefault(section, {})[field] = value
        else:
            fields[name] = value
    # Timing that scales with the job unless the config sets it (config.scaled_timing).
    timeouts = fields.setdefault("timeouts", {})
    heartbeat, node_timeout = scaled_timing(
        int(fields.get("nodes", 1)) + int(fields.get("standby", 0)), int(fields.get("relays", 0))
    )
    timeouts.setdefault("heartbeat_s", heartbeat)
    timeouts.setdefault("node_timeout_s", max(node_timeout, 2.5 * float(timeouts["heartbeat_s"])))
    injects = tuple(parse_inject(text, i) for i, text in enumerate(args.inject))
    try:
        cfg = JobConfig.from_fields(
            script=target,
            launch=launch,
            script_args=tuple(args.script_args),
            run_dir=str(run_dir.resolve()),
            injects=injects,
            **fields,
        )
    except TypeError as e:
        raise ValueError(
            f"--config {args.config}: a field has the wrong type ({e}); see docs/config.md "
            "for each field's type"
        ) from None
    checks = cfg.preflight.checks
    known = [f.name for f in dataclasses.fields(CheckConfig) if f.name != "level"]
    unknown = [k for k in checks if k not in known]
    if unknown:
        raise ValueError(
            f"--config {args.config}: [preflight.checks] unknown field(s) {', '.join(unknown)}"
            f"{did_you_mean(unknown, known)}; known: {', '.join(known)} (docs/preflight.md)"
        )
    try:
        CheckConfig(**{"level": "quick", **checks})
    except (TypeError, ValueError) as e:
        raise ValueError(f"--config {args.config}: [preflight.checks] {e}") from None
    _check_writable(run_dir)
    if cfg.log_dir is not None:
        _check_writable(Path(cfg.log_dir))
    return cfg


def parse_nproc(text: str | None) -> int | None:
    """``--nproc-per-node N|auto`` (torchrun's spelling): auto = one worker per GPU when CUDA
    is there, else one per CPU core. Raises ValueError naming the form."""
    if text is None:
        return None
    if text == "auto":
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count() or 1
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--nproc-per-node {text}: give a number of workers >= 1, or auto")
    return int(text)


def _launch_target(args: argparse.Namespace) -> tuple[str, str]:
    """(launch mode, what workers run): a script's absolute path, a module name (``-m``) or
    a program (``--no-python``). Raises ValueError when it cannot be found."""
    if getattr(args, "module", False) and getattr(args, "no_python", False):
        raise ValueError("-m and --no-python exclude each other; give one")
    if getattr(args, "module", False):
        import importlib.util

        sys.path.insert(0, os.getcwd())  # python -m looks in the working directory first
        try:
            found = importlib.util.find_spec(args.script) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise ValueError(
                f"-m {args.script}: no such module from {os.getcwd()}; run from the directory "
                "that holds the package, or install it"
            )
        return "module", args.script
    if getattr(args, "no_python", False):
        exe = shutil.which(args.script)
        if exe is None:
            raise ValueError(
                f"--no-python {args.script}: not an executable on PATH or at that path"
            )
        return "exec", args.script if os.sep not in args.script else str(Path(exe).resolve())
    script = Path(args.script)
    if not script.is_file():
        raise ValueError(
            f"script {args.script!r} not found; pass the path of a Python training script "
            "(-m MODULE for a module, --no-python for a program)"
        )
    return "script", str(script.resolve())


def _check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-probe"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(
            f"run dir {run_dir} is not writable ({e.strerror}); pass --run-dir to a writable place"
        ) from None


@dataclasses.dataclass(kw_only=True, slots=True)
class SimNode:
    node_id: str
    addr: str
    proc: subprocess.Popen[bytes] | None = None
    down_since: float | None = None
    log: IO[bytes] | None = None


class Cluster:
    """Agent processes of the simulated nodes, restarted after a simulated reboot."""

    def __init__(self, cfg: JobConfig, controller: str, token_file: Path) -> None:
        self.cfg, self.controller, self.token_file = cfg, controller, token_file
        self.nodes = [
            SimNode(node_id=f"node{i}", addr=f"127.0.0.{i + 2}")
            for i in range(cfg.nodes + cfg.standby)
        ]
        self.stopping = False

    def _spawn(self, n: SimNode) -> None:
        run_dir = Path(self.cfg.run_dir)
        if n.log is None:
            n.log = open(run_dir / "logs" / f"agent.{n.node_id}.log", "ab")  # noqa: SIM115
        n.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainguard",
                "agent",
                "--controller",
                self.controller,
                "--token-file",
                str(self.token_file),
                "--node-id",
                n.node_id,
                "--addr",
                n.addr,
                "--run-dir",
                str(run_dir),
                "--exit-with-parent",
            ],
            stdout=n.log,
            stderr=n.log,
            start_new_session=True,
            env=self._env(),
        )
        n.down_since = None

    def _env(self) -> dict[str, str]:
        """The simulated nodes share this machine's cores: one GEMM thread each in pre-flight,
        and, unless the user set ``OMP_NUM_THREADS``, each worker this machine's cores over
        the job's workers (the agent's torchrun rule, one thread only with several workers
        per node, assumes a host of its own: two one-worker nodes here would each take every
        core)."""
        env = {**os.environ, "TRAINGUARD_CHECK_THREADS": "1"}
        if "OMP_NUM_THREADS" not in os.environ:
            workers = max(1, self.cfg.nodes * int(self.cfg.nproc_per_node))
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
        return env

    def start(self) -> None:
        (Path(self.cfg.run_dir) / "logs").mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            self._spawn(n)

    def supervise(self, store: Store) -> None:
        """Reap agents that died and bring them back after the reboot delay."""
        now = time.monotonic()
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is not None and not self.stopping:
                store.record("node_down", {"node": n.node_id, "exit_code": n.proc.returncode})
                n.proc, n.down_since = None, now
            elif (
                n.proc is None
                and n.down_since is not None
                and now - n.down_since >= self.cfg.pool.reboot_delay_s
            ):
                store.record("node_rebooted", {"node": n.node_id})
                self._spawn(n)

    async def wait_exit(self, deadline_s: float) -> None:
        """Wait for every agent to exit (they stop their workers first), then SIGKILL stragglers."""
        self.stopping = True
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and any(
            n.proc is not None and n.proc.poll() is None for n in self.nodes
        ):
            await asyncio.sleep(0.05)
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                os.killpg(n.proc.pid, signal.SIGKILL)
                n.proc.wait(timeout=5.0)
            if n.log is not None:
                n.log.close()
        # Every agent is gone: whatever segment a killed node left is this launcher's to remove.
        job = hashlib.sha1(str(Path(self.cfg.run_dir).resolve()).encode()).hexdigest()[:8]
        for path in Path(self.cfg.checkpoint.shm_dir).glob(f"trainguard-{job}-*"):
            if path.is_dir():  # a standby's prefetched step
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def previous_run(store: Store, run_dir: Path) -> JobState | None:
    """The last state a previous run of ``run_dir`` persisted, or None for a new run dir.
    Raises ValueError naming the fix when this version cannot read it."""
    saved = store.get("state")
    if saved is None:
        return None
    try:
        return state_from_json(saved)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{run_dir}/job.sqlite holds a controller state this version cannot read ({e}); "
            "pass another --run-dir"
        ) from None


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or keeps what it held: written to a temp file beside it
    and renamed over it (a kill mid-write leaves no torn file: ``controller.json``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def controller_info(run_dir: Path, host: str, port: int) -> None:
    """``RUN_DIR/controller.json``: where this controller listens, and its pid (``trainguard
    status``, agents, a restarted controller's port), written atomically."""
    write_atomic(
        run_dir / "controller.json", json.dumps({"addr": f"{host}:{port}", "pid": os.getpid()})
    )


def read_or_create_token(path: Path) -> str:
    """The job token in ``path``; a new random one is written there (0600) if it is missing:
    into a temp file first, then linked to ``path`` (a kill leaves no empty token file, and of
    two processes making one at once, the first link wins and the other reads it)."""
    if path.exists():
        token = path.read_text().strip()
        try:
            ok = len(bytes.fromhex(token)) >= 8
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"token file {path} holds no job token (16+ hex digits); delete it to have one made"
            )
        return token
    token = secrets.token_hex(16)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:  # another process made it first: its token is the job's
        return read_or_create_token(path)
    finally:
        tmp.unlink(missing_ok=True)
    return token


VIEW_TOKEN = "view-token"  # RUN_DIR/view-token: the dashboard's read-only token (0600)


async def _run(
    cfg: JobConfig, token: str, token_file: Path, tee: Tee, status: StatusLine
) -> tuple[JobState, int]:
    store = Store(Path(cfg.run_dir))
    # A re-run: every process of the previous run died with it (agents and daemons die with
    # their parent), so what it left half-written in the durable tier is removed before any
    # writer of this run starts, and this run numbers its generations after the old ones.
    prev = previous_run(store, Path(cfg.run_dir))
    leftovers = storage.clean_leftovers(Path(cfg.ckpt_dir)) if prev is not None else {}
    view = read_or_create_token(Path(cfg.run_dir) / VIEW_TOKEN)
    controller = Controller(
        cfg, token, store, rerun_of=prev, leftovers=leftovers, view_token=view, dashboard=DASHBOARD
    )
    host, port = await controller.start()
    cluster = Cluster(cfg, f"{host}:{port}", token_file)
    got_signal: list[int] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(
            sig, lambda s=sig: (got_signal.append(s), controller.request_stop())
        )
    controller_info(Path(cfg.run_dir), host, port)  # status, check
    log.info("controller on %s:%d; run dir %s", host, port, cfg.run_dir)
    log.info("dashboard: http://%s:%d/ (token: %s/%s)", host, port, cfg.run_dir, VIEW_TOKEN)
    if cfg.preflight.level != "off":
        log.info(
            "pre-flight checks (%s level: host health, GEMM speed and correctness, collective "
            "bandwidth, a short training run) on every node before the first step, typically "
            '15-20 s; skip them with --preflight off or preflight = "off" in the config',
            cfg.preflight.level,
        )
    cluster.start()
    done = asyncio.ensure_future(controller.wait_done())
    shown = 0.0
    while not done.done():
        cluster.supervise(store)
        tee.poll()
        if time.monotonic() - shown >= 1.0:
            status.show(job_line(controller))
            shown = time.monotonic()
        await asyncio.wait([done], timeout=0.2)
    status.close()
    state = done.result()
    await cluster.wait_exit(AGENT_EXIT_DEADLINE_S + cfg.timeouts.stop_grace_s)
    tee.poll(final=True)
    store.record("job_ended", {"phase": state.phase.value, "reason": state.reason})
    await controller.close()
    store.close()
    return state, (got_signal[0] if got_signal else 0)


def _lock_run_dir(run_dir: Path) -> IO[str]:
    """Hold RUN_DIR/.lock for this process's life: two jobs must not share a run dir (store,
    token, checkpoints). Raises ValueError naming the fix."""
    f = open(run_dir / ".lock", "a+")  # noqa: SIM115 - held open until the process exits
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(
            f"run dir {run_dir} is in use by another trainguard run; "
            "pass another --run-dir, or wait for that job to end"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def run_command(args: argparse.Namespace) -> int:
    if args.rdzv_endpoint is not None:  # the same command on every host
        from trainguard.cli.hosts import run_on_hosts

        argv = list(args.argv)
        return run_on_hosts(args, argv[argv.index("run") + 1 :])
    for flag, value in (("--node-rank", args.node_rank), ("--local-addr", args.local_addr)):
        if value is not None:
            raise ValueError(
                f"{flag} is for a job across hosts: give --rdzv-endpoint HOST:PORT too "
                "(without it, trainguard run starts every node on this machine)"
            )
    cfg = build_config(args)
    ranks = parse_ranks(args.tee, args.local_ranks_filter)
    lock = _lock_run_dir(Path(cfg.run_dir))  # noqa: F841 - released when this process exits
    status = StatusLine(sys.stderr)  # log and worker lines clear it first on a terminal
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=status.prefix + "%(asctime)s trainguard %(message)s",
    )
    token = secrets.token_hex(16)
    token_file = Path(cfg.run_dir) / "token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    tee = Tee(Path(cfg.log_dir or Path(cfg.run_dir) / "logs"), ranks, prefix=status.prefix)
    state, sig = asyncio.run(_run(cfg, token, token_file, tee, status))
    return finish(cfg, state, sig)


def finish(cfg: JobConfig, state: JobState, sig: int) -> int:
    """Print the report and the outcome; returns the exit status (0, 128+signal, or 1)."""
    from trainguard.observe.report import build_report, show_report

    rep = build_report(Path(cfg.run_dir))
    show_report(rep)
    if state.phase == Phase.SUCCEEDED:
        n, faults = len(rep["recoveries"]), len(rep["faults"])
        local = len(rep["local"]["recoveries"])
        how = plural(n, "recovery", "recoveries")
        if faults > n:  # a fault during a recovery: one recovery answered both
            how += f" from {faults} faults"
        if local:
            how += f" and {plural(local, 'replica group restart')} (local recovery)"
        print(
            f"trainguard: job succeeded after {how}; report: trainguard report --run-dir "
            f"{cfg.run_dir}",
            file=sys.stderr,
        )
        return 0
    if state.phase == Phase.STOPPED:
        print(
            f"trainguard: job stopped by {signal.Signals(sig).name if sig else 'request'}; "
            f"resume from its last checkpoint by running again with --run-dir {cfg.run_dir}",
            file=sys.stderr,
        )
        return 128 + sig if sig else 1
    last = state.recoveries[-1].fault if state.recoveries else None
    if last is not None and "\n" in last.message:
        print(
            f"trainguard: last error (rank {last.rank}, node {last.node_id}):\n{last.message}",
            file=sys.stderr,
        )
    print(f"trainguard: job failed: {state.reason}", file=sys.stderr)
    return 1
