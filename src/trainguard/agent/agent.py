"""The node agent: reconciles its node toward the controller's desired state.

Threads (all named, all daemon, all bounded by deadlines):

- main (``Agent.run``): every 50 ms drains worker reports (UDP), polls worker exits,
  runs the hang watchdog and reconciles: start a generation's workers from warm
  spares, stop them (SIGTERM → grace → SIGKILL of the process group), clean up.
- ``agent-poll``: long-polls ``GET /v1/desired`` so a new desired state arrives at once.
- ``agent-report``: ``POST /v1/report`` every heartbeat or when woken, carrying the
  node's observations, step records and events; its reply also carries the desired state.

When the controller is unreachable the workers keep running and both threads retry
with back-off (capped at 2 s).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import hashlib
import importlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from trainguard import protocol
from trainguard.agent import env as agent_env
from trainguard.agent import outside
from trainguard.agent import workers as wk
from trainguard.agent.checks import CheckRunner
from trainguard.agent.ckptd_sup import CkptdSupervisor
from trainguard.agent.group import Launcher, ProcessLauncher, WorkerGroup
from trainguard.agent.inprocess import InProcessStops
from trainguard.agent.link import (
    RELAY_TIMEOUT_S,
    ControllerLink,
    HTTPStatusError,
    Link,
    RoutedLink,
    backoff_after,
)
from trainguard.agent.local import LocalRecovery
from trainguard.agent.probe import GemmProbe
from trainguard.agent.tee import Tee
from trainguard.checkpoint import ckptd_client as ckptd_mod
from trainguard.checkpoint.prefetch import Prefetcher, prefetch_root
from trainguard.health.host import host_health
from trainguard.health.signals import SignalReader
from trainguard.protocol import (
    Check,
    Desired,
    Idle,
    Run,
    Shutdown,
    StepRecord,
    Stop,
    clock,
)
from trainguard.protocol import ckptd as ckptd_wire
from trainguard.protocol.worker import (
    Alive,
    Batch,
    Heartbeat,
    Sender,
    StepEnd,
    WorkerEvent,
    WorkerMessage,
)
from trainguard.runtime import api as rt_api
from trainguard.runtime import wire

log = logging.getLogger("trainguard.agent")
LOOP_S = 0.05
TEE_S = 0.25  # --tee: how often its workers' new output is printed
# Calibrated hang timeout = CALIBRATION_FACTOR × the longest recent step, clamped to
# [hang_timeout_min_s, hang_timeout_max_s]. NVIDIA's resiliency extension derives its
# heartbeat timeouts the same way, from observed intervals times a safety factor.
CALIBRATION_FACTOR = 10.0
EXIT_CONTROLLER_LOST = 3  # the agent's exit status when it gave up on its controller
EXIT_WRONG_SECRET = 2  # ... when the controller refused its derived token (a wrong secret)
# A token derived from $TRAINGUARD_SECRET (`trainguard run --rdzv-endpoint`) that the controller
# refuses this long is refused for good: the agent says why and exits.
WRONG_SECRET_S = 10.0


def _token_from_secret() -> bool:
    """Was this agent's token derived from $TRAINGUARD_SECRET by `trainguard run`?"""
    return os.environ.get(rt_api.ENV_TOKEN_SOURCE) == "secret"


SIGNALS_S = 2.0  # hardware counters (failure prediction) read at most this often


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    controller: str  # host:port of the controller
    token: str  # job token (hex)
    node_id: str  # stable id of this node (host)
    addr: str  # address workers and peers reach this node at; the report socket binds here
    run_dir: Path  # job run directory (logs, errors, checkpoints)
    exit_with_parent: bool = False  # embedded mode: stop when the launcher dies
    gloo_ifname: str | None = None  # GLOO_SOCKET_IFNAME for workers (default: lo for 127.x)
    # Exit (workers stopped, slots released) after this long without controller contact.
    give_up_s: float | None = 600.0
    relay: str | None = None  # host:port of its rack's relay (trainguard relay), if any
    tee: bool = False  # print its workers' output on stdout, prefixed [rankN]: (torchrun --tee)


def hang_limit(desired: Run, w: wk.Worker) -> float:
    """Seconds without progress after which worker ``w`` is hung (see CALIBRATION_FACTOR)."""
    if w.step is None:
        return desired.first_step_timeout_s
    if desired.hang_timeout_s is not None:
        return desired.hang_timeout_s
    longest = max(w.durations, default=0.0)
    return min(
        desired.hang_timeout_max_s,
        max(desired.hang_timeout_min_s, CALIBRATION_FACTOR * longest),
    )


def _spares(d: Run | Idle) -> int:
    """Warm spares the agent keeps for ``d``: its ``warm_spares``, else one per worker."""
    return d.warm_spares if d.warm_spares is not None else max(d.nproc_per_node, 1)


class Agent:
    """One node's agent. ``run()`` returns the process exit status.

    ``launcher`` starts and stops worker processes (default: real ones from warm spares,
    ``group.ProcessLauncher``); ``link`` carries requests to the controller (default: a
    kept-alive HTTP connection per thread). Both are seams: a test drives the reconcile loop
    (``want`` or ``report_once``, then ``loop_once``) with its own, without processes.
    """

    def __init__(
        self, cfg: AgentConfig, *, launcher: Launcher | None = None, link: Link | None = None
    ) -> None:
        self._last_report_ok = time.monotonic()  # of the last report the controller took
        self._last_warned = -1e9  # when we last logged that the controller is unreachable
        self._fenced_generation = -1  # never restart these workers: the job moved on
        self._refused_since: float | None = None  # the controller refuses our node id (409)
        self._unauthorized_since: float | None = None  # ... or our token (401)
        self._exit_code = 0  # a reason of our own to exit non-zero (a token that cannot work)
        self._leaving = False  # set for the last report, as the agent exits
        self.cfg = cfg
        self._link = link or (  # kept-alive, per thread; through the rack's relay if any
            RoutedLink(cfg.controller, cfg.relay, cfg.token)
            if cfg.relay
            else ControllerLink(cfg.controller, cfg.token)
        )
        self.incarnation = uuid.uuid4().hex[:12]
        self._token = bytes.fromhex(cfg.token)
        self._lock = threading.Lock()
        self._workers_lock = threading.Lock()  # a poll (and a group's restart) vs a report
        self._wake = threading.Event()
        self._report_now = threading.Event()
        self._shutdown = threading.Event()
        self._ckptd_off = threading.Event()  # set when the agent stopped its ckptd for good
        self._ckptd_now = threading.Event()  # refresh ckptd's status now (workers stopped)
        # No spares before the controller says how many (a node may be checked first).
        self._desired: tuple[int, Desired] = (0, Idle())
        self._run_desired: Run | None = None  # the generation whose workers run here
        self._hang = False
        self._hang_mono = 0.0  # when the hang was flagged
        self._drills_fired: set[int] = set()  # timed drills (after=T) fired by this agent
        self._sampled_mono = 0.0  # when the outside view was last read
        self._signals: dict[str, Any] = {}  # hardware counters (health/signals.py)
        self._signal_reader = SignalReader(cfg.node_id)
        self._signals_mono = -1e9
        self._stopped_generation = -1
        self._store: tuple[int, Any] | None = None
        self._warm: threading.Event | None = None  # set once torch.distributed is in
        self._events: list[protocol.ReportEvent] = []
        self._steps: dict[tuple[int, int], list[StepRecord]] = {}
        (cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / "errors").mkdir(parents=True, exist_ok=True)
        self._teed: set[Path] = set()  # the logs of the workers it started (--tee)
        # made now: a log its workers write later is followed from its first byte
        logs = cfg.run_dir / "logs"
        self._tees = {logs: Tee(logs, None, only=self._teed.__contains__)}
        self._tee_done, self._tee_lock = threading.Event(), threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((cfg.addr, 0))
        self._sock.setblocking(False)
        wire.receive_buffer(self._sock, 4 << 20)  # its workers' beats and messages
        self.report_port = self._sock.getsockname()[1]
        self._spare_log = open(cfg.run_dir / "logs" / f"spares.{cfg.node_id}.log", "ab")  # noqa: SIM115
        self.job_id = hashlib.sha1(str(cfg.run_dir.resolve()).encode()).hexdigest()[:8]
        self.ckptd = CkptdSupervisor(
            job_id=self.job_id, node_id=cfg.node_id, token=cfg.token, bind=cfg.addr,
            run_dir=cfg.run_dir, on_event=self._event,
            idle=self._drain_udp,  # workers' heartbeats and keep-alives go on arriving
        )  # fmt: skip
        # Spares carry the run dir so that every process of a job can be attributed to it.
        spare_env = {**self._base_env(), rt_api.ENV_RUN_DIR: str(cfg.run_dir.resolve())}
        if "OMP_NUM_THREADS" not in os.environ:  # a spare imports torch with its own default;
            spare_env.pop("OMP_NUM_THREADS", None)  # the rank's environment sets it (spare.py)
        self.launcher = launcher or ProcessLauncher(spare_env, self._spare_log)
        self.group = WorkerGroup(self.launcher, self._event)
        self.inproc = InProcessStops(self.group, self._sock, self._token, self._event)
        self.local = LocalRecovery(self.group, self._spec, self._event)
        self._stacks_generation = -1  # a hang's stacks were taken for this generation
        self.checks = CheckRunner(cfg.run_dir, cfg.node_id, cfg.controller.rsplit(":", 1)[0])
        self._gemm_wrong = False  # the gemm-wrong drill fired here: this node's GEMMs are bad
        self.probe = GemmProbe(self._probe_context, self._base_env())
        self.prefetch = Prefetcher(self._event)  # a standby's copy of the newest durable step

    @property
    def generation(self) -> int | None:
        """The generation whose workers run here (None: none)."""
        return self.group.generation

    @property
    def workers(self) -> dict[int, wk.Worker]:
        """This node's workers of that generation, by global rank."""
        return self.group.workers

    def close(self) -> None:
        """Stop the workers, kill the spares, close sockets and files (``run`` does this on
        its way out; for an agent driven by ``loop_once``)."""
        self._stop_workers(grace_s=1.0)
        self.prefetch.close(remove=True)
        self.probe.close()
        self.local.close()
        self._signal_reader.close()
        self.launcher.close()
        self._link.close()
        self._sock.close()
        self._spare_log.close()

    # ------------------------------------------------------------------ environment
    def _base_env(self) -> dict[str, str]:
        return agent_env.base_env(self.cfg)

    def _worker_env(self, d: Run, local_rank: int) -> dict[str, str]:
        return agent_env.worker_env(
            self.cfg, d, local_rank, report_port=self.report_port, job_id=self.job_id
        )

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        wk.become_subreaper()
        parent = os.getppid()
        if self.cfg.exit_with_parent:
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._shutdown.set())
        threading.Thread(target=self._poll_loop, name="agent-poll", daemon=True).start()
        threading.Thread(target=self._report_loop, name="agent-report", daemon=True).start()
        threading.Thread(target=self._ckptd_loop, name="agent-ckptd", daemon=True).start()
        if self.cfg.tee:
            threading.Thread(target=self._tee_loop, name="agent-tee", daemon=True).start()
        log.info(
            "agent %s (%s) up at %s, reports on udp %d",
            self.cfg.node_id,
            self.incarnation,
            self.cfg.addr,
            self.report_port,
        )
        code = 0
        try:
            while not self._shutdown.is_set():
                if self.cfg.exit_with_parent and os.getppid() != parent:
                    break
                silent = time.monotonic() - self._last_report_ok
                if self.cfg.give_up_s is not None and silent > self.cfg.give_up_s:
                    log.error(
                        "no contact with controller %s for %.0fs (--give-up-after %.0f): "
                        "stopping workers, releasing memory slots, exiting; start the agent "
                        "again once the controller is back",
                        self.cfg.controller, silent, self.cfg.give_up_s,
                    )  # fmt: skip
                    code = EXIT_CONTROLLER_LOST
                    break
                if self.loop_once():
                    break
                self._wake.wait(LOOP_S)
                self._wake.clear()
        finally:
            self.checks.stop()
            self._stop_workers(grace_s=15.0)
            if self.cfg.tee:
                self._tee_done.set()
                self._tee_poll(final=True)
            self.launcher.close()
            self.prefetch.close(remove=True)  # a standby's copy is memory too: freed, not left
            self.ckptd.stopping = True  # its status thread must not kill it mid-final-persist
            with contextlib.suppress(Exception):
                self.refresh_ckptd()  # what it queued (the final step's durable event)
            self.ckptd.stop()
            self._ckptd_off.set()
            self._ckptd_now.set()
            self._leaving = True  # this last report: the node is gone, not back
            self.report_once(timeout_s=2.0)
        return code or self._exit_code

    def loop_once(self) -> bool:
        """One pass of the main loop (``run`` repeats it every LOOP_S s or on a wake-up):
        worker reports drained, workers polled, the outside view and hang watch, fencing,
        then one reconcile toward the desired state. Returns True when the agent should
        exit. With ``want`` it is the seam that drives an agent without a controller."""
        self._drain_udp()
        self._poll_workers()
        self.inproc.retransmit()
        self._watch_outside()
        self._watch_hangs()
        self._fence()
        return self._reconcile()

    def want(self, desired: Desired) -> None:
        """Take ``desired`` as the newest desired state, as a controller's answer would
        (its version one above the current)."""
        with self._lock:
            self._desired = (self._desired[0] + 1, desired)
        self._wake.set()

    def _health(self) -> protocol.HealthReport:
        shm = Path(self.ckptd.ckpt.shm_dir if self.ckptd.ckpt else "/dev/shm")
        ok, problems = host_health(self.cfg.run_dir, shm)
        now = time.monotonic()
        if now - self._signals_mono >= SIGNALS_S:  # NVML calls: not on every heartbeat
            self._signals, self._signals_mono = self._signal_reader.read(), now
        probe = self.probe.latest
        return protocol.HealthReport(
            ok=ok,
            problems=tuple(problems),
            signals=self._signals,
            probe=None if probe is None else protocol.ProbeReport.from_json(probe),
        )

    def _probe_context(self) -> tuple[int, int, bool] | None:
        """(generation, newest step its ranks here finished or the restore step before the
        first, gemm-wrong fired) while workers of a generation run here; None otherwise (the
        GEMM probe waits). Probe thread."""
        d, gen = self._run_desired, self.generation
        try:
            steps = [w.step for w in list(self.workers.values()) if w.step is not None]
        except RuntimeError:  # the reconcile loop changed the group meanwhile: next time
            return None
        if d is None or gen is None or d.generation != gen:
            return None
        step = max(steps) if steps else (d.restore_step or 0)  # before its first step
        for spec in d.injects:  # the drill: this node's GEMMs go wrong from step S on
            if spec.kind == "gemm-wrong" and f"node{spec.node}" == self.cfg.node_id:
                self._gemm_wrong |= step + 1 >= (spec.step or 0)
        return gen, step, self._gemm_wrong

    def _fence(self) -> None:
        """Cut off from the controller for longer than it waits before declaring this node lost:
        the job has moved on without us, so our workers must not go on (nor checkpoint)."""
        d = self._run_desired
        if not self.group.running() or d is None:
            return
        silent = time.monotonic() - self._last_report_ok
        if silent > d.node_timeout_s:
            log.warning("no controller contact for %.1fs: stopping our workers (fencing)", silent)
            self._event("fenced", generation=self.generation, silent_s=round(silent, 1))
            self._fenced_generation = self.generation if self.generation is not None else -1
            with self._lock:  # idle until the controller says otherwise (a newer version)
                self._desired = (
                    self._desired[0],
                    Idle(nproc_per_node=d.nproc_per_node, warm_spares=d.warm_spares, ckpt=d.ckpt),
                )
            self._stop_workers(grace_s=1.0)
            self._run_desired = None

    def _torch_ready(self) -> bool:
        """Has torch.distributed (the store's, ``_host_store``) been imported? The first call
        starts the import on a thread of its own, so the main loop never waits on it (~2-3 s
        of CPU on a loaded 2-core host)."""
        if self._warm is None:
            self._warm = threading.Event()
            threading.Thread(target=self._import_torch, name="agent-warm", daemon=True).start()
        return self._warm.is_set()

    def _import_torch(self) -> None:
        assert self._warm is not None
        try:
            importlib.import_module("torch.distributed")
        finally:
            self._warm.set()  # a failed import fails again, with its error, in _host_store

    # ------------------------------------------------------------------ reconcile
    def _reconcile(self) -> bool:
        """Act on the desired state. Returns True when the agent should exit."""
        version, d = self._desired
        if isinstance(d, Shutdown):
            log.info("job ended (%s: %s); agent exiting", d.phase, d.reason)
            return True
        if isinstance(d, Check):
            env = self._base_env()
            if "OMP_NUM_THREADS" not in os.environ:  # GEMM measures with every core it has
                env.pop("OMP_NUM_THREADS", None)
            self.checks.run(d.task, env)
            return False
        self.checks.stop()
        if isinstance(d, Run | Idle) and _spares(d) > 0:
            # A job that keeps warm spares pays imports ahead for fast restarts: the store's
            # too, on every node. With none, only a node that hosts a store imports it.
            self._torch_ready()
        ckpt = d.ckpt if isinstance(d, Run | Idle) else None
        if ckpt is not None:
            self.ckptd.ensure(ckpt)  # waits until it listens (30 s stalled, 120 s starting)
            if self._desired[0] != version:
                # A newer desired state came meanwhile: act on that one, never on this (a
                # restarted agent's first reply can be the Run its node was lost from; acted
                # on after a slow ckptd start, it started a worker of a finished generation).
                return False
        if isinstance(d, Idle) and d.prefetch and ckpt is not None:
            self.prefetch.follow(
                Path(ckpt.dir), prefetch_root(ckpt.shm_dir, self.job_id, self.cfg.node_id)
            )
        else:
            # a node that took a rank keeps its copy for the restore, checked for it
            self.prefetch.pause(d.generation if isinstance(d, Run) else None)
        if isinstance(d, Run):
            if d.incarnation is not None and d.incarnation != self.incarnation:
                # Made for this node's previous agent, which was lost: its generation is not
                # this agent's to join (the controller stops it once it sees this incarnation).
                return False
            gen = d.generation
            if self.generation is not None and self.generation != gen:
                self._stop_workers(grace_s=1.0)
            if d.host_store and (self._store is None or self._store[0] != gen):
                if not self._torch_ready():
                    return False  # the import goes on; the next pass (LOOP_S) hosts the store
                self._host_store(gen)
            if self.generation != gen and d.master_port is not None:
                if gen == self._fenced_generation:
                    return False  # reported as fenced; the controller starts a new generation
                self._start_generation(d)
            elif self.generation == gen and all(w.step is not None for w in self.workers.values()):
                self.launcher.fill(_spares(d))  # replenish once training is under way
        elif isinstance(d, Stop):
            gen = d.generation
            if self._stopped_generation < gen:
                hang = d.dump_stacks and self.generation == gen and bool(self.workers)
                if hang and self._stacks_generation < gen:
                    # A hang: every rank's stack, victims' too, before the kill (localization).
                    self._stacks_generation = gen
                    self._event(
                        "stacks",
                        generation=gen,
                        progress={w.rank: w.step for w in self.workers.values()},
                        stacks=self.group.stacks(),
                    )
                park: set[int] = set()
                if d.keep and self.generation == gen:  # in-process: survivors park first
                    why = "the generation failed; its other ranks are being replaced"
                    if not self.inproc.abort_done(d, why):
                        return False  # again on the next pass (every LOOP_S)
                    park = self.inproc.parked()
                    d_run = self._run_desired
                    self.group.parked_world = d_run.world_size if d_run is not None else None
                self._stop_workers(grace_s=d.grace_s, park=park)
                self._stopped_generation = gen
                self._report_now.set()
        else:  # Idle
            if self.workers:
                self._stop_workers(grace_s=15.0)
            self.launcher.fill(_spares(d))
        return False

    def _host_store(self, gen: int) -> None:
        from torch.distributed import TCPStore

        self._store = None  # the previous generation's store closes with it
        store = TCPStore(
            self.cfg.addr,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=300),
        )
        self._store = (gen, store)
        self._report_now.set()

    def _start_generation(self, d: Run) -> None:
        gen = d.generation
        self._run_desired, self._hang = d, False
        if isinstance(self._link, RoutedLink):  # two relay timeouts well within a node timeout
            self._link.relay_timeout_s = min(RELAY_TIMEOUT_S, d.node_timeout_s / 5)
        self.probe.set_period(d.probe_every_s)
        ranks = []
        for local_rank in range(d.nproc_per_node):
            spec = self._spec(d, local_rank)
            ranks.append((int(spec["env"]["RANK"]), local_rank, spec))
        self.local.start(d)
        # A parked process resumes into the same rank of a world of the same size, restoring a
        # checkpoint: without a restore point it would keep the state it trained past step 0.
        resumable = self.group.parked_world == d.world_size and d.restore_step is not None
        self.group.start(gen, ranks, resume=self.inproc.resume(gen) if resumable else None)
        log.info("[gen %d node %s] started ranks %s", gen, self.cfg.node_id, sorted(self.workers))
        self._report_now.set()
        if d.restore_step is not None and d.restore_gen is not None and d.ckpt.memory_tier:
            threading.Thread(
                target=self._preverify,
                args=(sorted(self.workers), d.restore_step, d.restore_gen, gen),
                name="agent-preverify",
                daemon=True,
            ).start()

    def _tee_loop(self) -> None:
        """``--tee``: its workers' new lines on stdout every TEE_S (the rest when it exits,
        ``_tee_poll(final=True)``). A log directory shared with other hosts' agents holds
        their ranks' logs too: only the files of the workers started here are followed."""
        while not self._tee_done.wait(TEE_S):
            self._tee_poll(final=False)

    def _tee_poll(self, *, final: bool) -> None:
        with self._tee_lock:
            for d in {p.parent for p in list(self._teed)} - set(self._tees):
                tee = Tee(d, None, only=self._teed.__contains__)  # the job's --log-dir
                tee.rewind(set(self._teed))
                self._tees[d] = tee
            for tee in list(self._tees.values()):
                tee.poll(final=final)

    def _spec(self, d: Run, local_rank: int, incarnation: int = 0) -> dict[str, Any]:
        """How to start local rank ``local_rank`` of generation ``d`` (``Launcher.start``);
        ``incarnation``: its replica group's restart (local recovery), 0 at the start."""
        env = self._worker_env(d, local_rank)
        rank, gen = int(env["RANK"]), d.generation
        name = f"rank{rank}.gen{gen}" + (f".inc{incarnation}" if incarnation else "")
        if incarnation:
            env[rt_api.ENV_REPLICA_INCARNATION] = str(incarnation)
            stem = env["TORCHELASTIC_ERROR_FILE"].removesuffix(".json")
            env["TORCHELASTIC_ERROR_FILE"] = f"{stem}.inc{incarnation}.json"
        log_path = Path(d.log_dir or self.cfg.run_dir / "logs") / f"{name}.log"
        self._teed.add(log_path)
        return {
            "env": env,
            "argv": [d.script, *d.script_args],
            "mode": d.launch,
            "cwd": os.getcwd(),
            "log": str(log_path),
            "error_file": env["TORCHELASTIC_ERROR_FILE"],
        }

    def _preverify(self, ranks: list[int], step: int, snap_gen: int, gen: int) -> None:
        """Have ckptd re-checksum the snapshots the new workers will restore, while they start
        (their restore then only copies). Best effort: a worker asks again if this fails."""
        try:
            c = ckptd_mod.CkptdClient(ckptd_mod.socket_name(self.job_id, self.cfg.node_id))
        except OSError:
            return
        try:
            for rank in ranks:
                req = ckptd_wire.Verify(
                    rank=rank, step=step, generation=snap_gen, for_generation=gen
                )
                c.call(req, timeout_s=300.0)
        except (OSError, ValueError, ckptd_mod.CheckpointError) as e:
            log.warning("pre-verifying snapshots for generation %d failed: %s", gen, e)
        finally:
            c.close()

    def _stop_workers(self, *, grace_s: float, park: set[int] | None = None) -> None:
        had = bool(self.workers)
        ckptd = self.ckptd.pid
        keep = {p for p in (ckptd, self.probe.pid) if p is not None}  # daemons, not workers
        self.group.stop(grace_s=grace_s, keep=keep, park=park)
        self._store = None
        if had:
            self._ckptd_now.set()  # the memory index as of after the stop, for the restore
            self._report_now.set()

    # ------------------------------------------------------------------ observation
    def _poll_workers(self) -> None:
        # Under _workers_lock: a report never shows a worker that failed in the moment before
        # its replica group's restart replaced it (the controller would recover globally).
        with self._workers_lock:
            exited = self.group.poll()
            d = self._run_desired
            if exited and d is not None and self.generation == d.generation:
                self.local.failed(d)  # replica groups: restart here, heal from a peer
        if exited:
            self._ckptd_now.set()
            self._report_now.set()

    def _watch_outside(self) -> None:
        """Once a second: each worker's process state and CPU time, and the timed drills."""
        now = time.monotonic()
        if not self.workers or now - self._sampled_mono < outside.SAMPLE_S:
            return
        self._sampled_mono = now
        for w in self.workers.values():
            if w.state == "running":
                outside.sample(w, now)
        d = self._run_desired
        if d is None:
            return
        due = outside.due_drills(d.injects, self._drills_fired, self.workers, d.node_rank, now)
        for spec, w in due:
            self._drills_fired.add(spec.id)
            self._event(
                "inject_fired",
                generation=self.generation,
                rank=w.rank,
                inject=spec.to_json(),
                step=w.step,
                after_s=round(now - (w.script_started_mono or w.started_mono), 3),
            )
            log.warning("drill %s fired on rank %d", spec.describe(), w.rank)
            outside.fire(spec, w, self._power_off)

    def _watch_hangs(self) -> None:
        d = self._run_desired
        if not self.workers or d is None:
            return
        now = time.monotonic()
        if self._hang:
            running = self.group.running()
            if running and all((w.last_progress_mono or 0.0) > self._hang_mono for w in running):
                # every rank moved on (the wait was inside trainguard, under its deadlines)
                self._hang = False
                self._event("hang_cleared", generation=self.generation)
            return
        for w in self.workers.values():
            if w.state != "running":
                continue
            ref = w.last_progress_mono if w.last_progress_mono is not None else w.started_mono
            limit = hang_limit(d, w)
            # Local recovery: a stopped rank is its group's fault, killed here at half the hang
            # floor, before the controller would call the job hung on the same sign; killed,
            # it closes its sockets, the other groups' all-reduce fails at once, and its group
            # restarts.
            local = d.replica_groups > 1
            seen = outside.stalled(w, d.hang_timeout_min_s / (2.0 if local else 1.0), now)
            if seen is not None and local:
                self._event("group_rank_killed", generation=self.generation, rank=w.rank,
                            stalled_s=round(seen[0], 3), how=seen[2])  # fmt: skip
                self.group.launcher.stop([w.proc], grace_s=0.0)
                continue
            if seen is not None:
                stalled_s, limit, how = seen
                ref = now - stalled_s
            elif w.last_hb_mono is None:
                continue  # no runtime: the controller judges its CPU idleness (all ranks)
            else:
                how = "no step or heartbeat progress"
            if now - ref > limit:
                self._hang, self._hang_mono = True, now
                self._report_now.set()
                stacks = self.group.stacks()
                self._event(
                    "hang_suspected",
                    generation=self.generation,
                    rank=w.rank,
                    step=w.step,
                    stalled_s=round(now - ref, 3),
                    limit_s=round(limit, 3),
                    how=how,
                    progress={x.rank: x.step for x in self.workers.values()},
                    stacks=stacks,
                )
                self._report_now.set()
                return

    def _drain_udp(self, limit: int = 10_000) -> None:
        """Handle pending worker reports, at most ``limit`` per loop so a flood cannot starve
        reconcile. An unauthenticated or malformed datagram is logged and dropped."""
        for _ in range(limit):
            try:
                data, addr = self._sock.recvfrom(65536)
            except BlockingIOError:
                return
            try:
                sender, msg = wire.decode_message(self._token, data)
            except wire.WireAuthError as e:
                log.warning("dropped an unauthenticated worker report: %s", e)
                continue
            except ValueError as e:  # ProtocolError: signed, but not a message we take
                log.warning("dropped a malformed worker report: %s", e)
                continue
            try:
                self._on_message(sender, msg, addr)
            except ValueError as e:  # ProtocolError: its content does not fit the report wire
                log.warning("dropped a worker report from rank %d: %s", sender.rank, e)

    def _on_message(
        self, sender: Sender, msg: WorkerMessage, addr: tuple[str, int] | None = None
    ) -> None:
        w = self.workers.get(sender.rank)
        if w is None or sender.generation != self.generation or sender.pid != w.proc.pid:
            return
        now = time.monotonic()
        w.addr = addr or w.addr  # where an Abort or Resume reaches it (agent/inprocess.py)
        for it in msg.items if isinstance(msg, Batch) else (msg,):
            match it:
                case Heartbeat():
                    since = now - w.last_hb_mono if w.last_hb_mono is not None else None
                    w.last_hb_mono = now
                    if it.coll is not None:
                        w.coll = it.coll
                    if it.total_steps is not None:
                        w.total_steps = it.total_steps
                    if it.inprocess and not w.inprocess:  # the controller plans by it
                        w.inprocess = True
                        self._report_now.set()
                    if it.parked and w.state == "running":
                        w.state, w.parked_at = "parked", clock.wall()
                        self._report_now.set()
                    if it.phase or (since is not None and wk.working(w, it, since)):
                        w.last_progress_mono = now
                case Alive():
                    w.last_hb_mono = w.last_progress_mono = w.in_trainguard_mono = now
                case StepEnd(record=rec):
                    w.last_hb_mono = now
                    if w.step is None or rec.step > w.step:
                        w.last_progress_mono, w.last_progress_at = now, rec.t_end
                    w.step = rec.step
                    w.durations.append(rec.duration_s)
                    with self._lock:
                        steps = self._steps.setdefault((self.generation, w.rank), [])
                        steps.append(rec)
                case WorkerEvent():
                    fired = it.fired_step
                    if fired is not None and (w.step is None or fired > w.step):
                        w.step = fired  # the step it completed; its record may not have left
                    data = {**it.data, "ts": it.ts, "generation": self.generation, "rank": w.rank}
                    if it.kind == "inprocess_parked":  # sent again each second while parked
                        if w.state != "running":
                            continue
                        w.state, w.inprocess, w.parked_at = "parked", True, it.ts
                        w.error = str(it.data.get("reason") or "")[:2000] or None
                        self._report_now.set()
                    self._event(it.kind, **data)
                    if it.fired_kind == "node-down":
                        self._power_off()

    def _power_off(self) -> None:
        """Injected node-down: SIGKILL every worker, spare and this agent, as a power loss would."""
        self.report_once(timeout_s=2.0)  # so the controller knows the drill fired
        self.group.power_off()
        os.kill(os.getpid(), signal.SIGKILL)

    def _event(self, kind: str, **data: Any) -> None:
        data.setdefault("ts", clock.wall())
        event = protocol.ReportEvent.from_json({"kind": kind, **data})
        with self._lock:
            self._events.append(event)

    # ------------------------------------------------------------------ controller I/O
    def refresh_ckptd(self) -> None:
        """Read what the node's ckptd holds and hand it the controller's orders (its own
        thread in ``run``; a test driving the seam calls it before ``report_once``). The
        next report carries the result: the heartbeat never waits on ckptd."""
        workers = list(self.group.workers.values())  # one C-level copy: no torn iteration
        idle = not any(w.state == "running" for w in workers)
        events = [
            protocol.ReportEvent.from_json(e)
            for e in self.ckptd.refresh(self._desired[1], rescan=idle)
        ]
        if events:
            with self._lock:
                self._events.extend(events)

    def _snapshot(self) -> protocol.AgentReport:
        now = time.monotonic()
        # What may raise first: the events and step records are taken last, so none is lost.
        with self._workers_lock:
            workers = [w.observe(now) for w in list(self.workers.values())]
        ckptd, health, checks = self._ckptd_status(), self._health(), self.checks.report()
        with self._lock:
            events, self._events = self._events, []
            steps, self._steps = self._steps, {}
        return protocol.AgentReport(
            node_id=self.cfg.node_id,
            addr=self.cfg.addr,
            incarnation=self.incarnation,
            generation=self.generation,
            desired_version=self._desired[0],  # the reply then omits a desired state it has
            workers=workers,
            hang=self._hang,
            stopped_generation=self._stopped_generation,
            fenced_generation=self._fenced_generation,
            stopped_at=self.group.stopped_at,
            cleaned_at=self.group.cleaned_at,
            store=None if self._store is None else (self._store[0], self._store[1].port),
            events=events,
            ckptd=ckptd,
            health=health,
            checks=checks,
            time=clock.wall(),  # the controller measures clock skew from it
            leaving=self._leaving,
            steps=[
                protocol.StepBatch(generation=g, rank=r, items=its) for (g, r), its in steps.items()
            ],
        )

    def _ckptd_status(self) -> protocol.CkptdStatus:
        """What the node's ckptd held when ``refresh_ckptd`` last asked it."""
        c = self.ckptd
        return protocol.CkptdStatus.from_json(
            {"memory": c.memory, "replicas": c.replicas, "fingerprints": c.fingerprints,
             "ckptd_idle": c.idle, "ckptd_at": c.refreshed_at, "replica_addr": c.replica_addr}
        )  # fmt: skip

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float
    ) -> dict[str, Any]:
        return self._link.request(method, path, body, timeout_s)

    def _accept(self, body: dict[str, Any]) -> None:
        reply = protocol.reply_from_json(body)
        with self._lock:
            if reply.version > self._desired[0] and reply.desired is not None:
                self._desired = (reply.version, reply.desired)
                self._wake.set()

    def _unreachable(self, e: BaseException) -> None:
        """Say why the controller does not answer: at once, then every 10 s while it lasts."""
        now = time.monotonic()
        if now - self._last_warned < 10.0:
            return
        self._last_warned = now
        if isinstance(e, HTTPStatusError) and e.code in (400, 409):
            log.error("controller %s: %s", self.cfg.controller, e.text)
        elif isinstance(e, HTTPStatusError) and e.code == 401 and _token_from_secret():
            log.error(
                "controller %s rejected our token: $%s on this host differs from the one on "
                "the controller's host (or that is another job's controller); export the "
                "same secret on every host",
                self.cfg.controller, rt_api.ENV_SECRET,
            )  # fmt: skip
        elif isinstance(e, HTTPStatusError) and e.code == 401:
            log.error(
                "controller %s rejected our token; pass the job's token file (RUN_DIR/token)",
                self.cfg.controller,
            )
        else:
            reason = getattr(e, "reason", e)
            log.warning("cannot reach controller %s (%s); retrying", self.cfg.controller, reason)

    def report_once(self, timeout_s: float) -> bool:
        """Send one report (``POST /v1/report``) and take the desired state its reply
        carries. Returns whether the controller took it; if not, its events and step records
        are kept for the next report."""
        snap = self._snapshot()
        try:
            body = protocol.report_to_json(snap)
            reply = (  # through a relay: an alive datagram when only counters moved
                self._link.report(body, timeout_s)
                if isinstance(self._link, RoutedLink)
                else self._request("POST", "/v1/report", body, timeout_s)
            )
            self._accept(reply)
            self._refused_since = self._unauthorized_since = None
            # Through a relay: its own last exchange with the controller is the contact.
            self._last_report_ok = time.monotonic() - float(reply.get("upstream_age_s") or 0.0)
            return True
        except (OSError, ValueError) as e:
            self._unreachable(e)
            if isinstance(e, HTTPStatusError) and e.code == 409:
                first = self._refused_since = self._refused_since or time.monotonic()
                if time.monotonic() - first > 30.0:  # not a reboot race: a name clash
                    log.error("giving up: another live agent uses node id %s", self.cfg.node_id)
                    self._shutdown.set()
            if isinstance(e, HTTPStatusError) and e.code == 401 and _token_from_secret():
                first = self._unauthorized_since = self._unauthorized_since or time.monotonic()
                if time.monotonic() - first > WRONG_SECRET_S:  # a derived token never changes
                    log.error("giving up: the controller refuses the token derived from $%s; "
                              "export the same secret on every host", rt_api.ENV_SECRET)  # fmt: skip
                    self._exit_code = EXIT_WRONG_SECRET
                    self._shutdown.set()
            with self._lock:  # keep what was not delivered for the next attempt (bounded)
                self._events[:0] = snap.events[-10_000:]
                for b in snap.steps:
                    self._steps.setdefault((b.generation, b.rank), [])[:0] = b.items
            return False

    def _report_loop(self) -> None:
        backoff = 0.1
        while not self._shutdown.is_set():
            hb = self._run_desired.heartbeat_s if self._run_desired is not None else 0.5
            self._report_now.wait(hb if backoff <= 0.1 else backoff)
            self._report_now.clear()
            try:
                ok = self.report_once(timeout_s=5.0)
            except (
                Exception
            ):  # the heartbeat is this node's life to the controller: never let it die
                log.exception("building a report failed; retrying")
                ok = False
            backoff = 0.1 if ok else backoff_after(backoff)

    def _ckptd_loop(self) -> None:
        while not self._ckptd_off.is_set():
            hb = self._run_desired.heartbeat_s if self._run_desired is not None else 0.5
            asked = self._ckptd_now.wait(hb)
            self._ckptd_now.clear()
            if self._ckptd_off.is_set():
                return
            try:
                self.refresh_ckptd()
            except Exception:  # the memory index goes stale, the node stays alive
                log.exception("reading ckptd's status failed; retrying")
            if asked:  # after a stop: the controller waits on this index to pick a restore point
                self._report_now.set()

    def _poll_loop(self) -> None:
        backoff = 0.1
        while not self._shutdown.is_set():
            try:
                reply = self._request(
                    "GET",
                    f"/v1/desired?node={self.cfg.node_id}&version={self._desired[0]}&wait_s=10",
                    None,
                    timeout_s=15.0,
                )
                self._accept(reply)
                backoff = 0.1
            except (OSError, ValueError):
                time.sleep(backoff)
                backoff = backoff_after(backoff)


def main(cfg: AgentConfig) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s agent[{cfg.node_id}] %(levelname)s %(message)s",
    )
    return Agent(cfg).run()
