"""The controller's executor: the coalesced tick loop that runs ``decide`` over what the
agents reported (``ingest``), and the effects of its decisions: events recorded, the state
persisted, desired states published to the agents' long polls. Its HTTP endpoints are in
``http.py``; ``trainguard check``'s mode (``check_only``) ticks ``checkonly.decide_check``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from trainguard import protocol
from trainguard.checkpoint import fingerprint, storage
from trainguard.controller.api import NodeObs, Phase, Pool
from trainguard.controller.checking import PreflightDriver
from trainguard.controller.checkonly import decide_check
from trainguard.controller.cold import ColdTier
from trainguard.controller.config import JobConfig, split_host_port
from trainguard.controller.decide import JobState, decide, desired_for
from trainguard.controller.eventlog import record_decided
from trainguard.controller.http import Dashboard, HttpApi
from trainguard.controller.ingest import Intake
from trainguard.controller.jobmetrics import JobCollector
from trainguard.controller.jobstate import (
    Inputs,
    StateEncoder,
    merge_inputs,
    next_incarnation,
)
from trainguard.controller.monitor import Monitor
from trainguard.controller.policy import Reaction, react
from trainguard.controller.pools import is_alive, world_of
from trainguard.controller.relays import RelayBook, apply_alive, desired_batch, superseded
from trainguard.controller.restore import ring_of
from trainguard.controller.store import Store
from trainguard.health.coordinator import Preflight
from trainguard.health.judge import CheckConfig
from trainguard.protocol import clock
from trainguard.protocol import relay as relay_wire

log = logging.getLogger("trainguard.controller")
Event = tuple[str, dict[str, Any]]
TICK_S = 0.1
PERSIST_S = 1.0  # the state is persisted on every transition, else at most this often
# Every node's desired state is recomputed at least this often, or every 2 heartbeats if
# longer (a safety net: what desired states read changes the state signature or flags the
# node; at 16,384 nodes one full pass costs ~0.5 s).
FULL_PUBLISH_S = 2.0
SWITCH_INTERVAL_S = 0.001
# The collector's thresholds (CPython's default: 700, 10, 10). With tens of thousands of
# observations alive, each tick allocates enough to start collections that traverse the whole
# heap; that cost was a quarter of the controller's CPU at 4,096 nodes.
GC_THRESHOLDS = (50_000, 20, 100)
LISTEN_BACKLOG = 4096  # pending connections (the kernel caps it at net.core.somaxconn)


def _signature(s: JobState) -> tuple[Any, ...]:
    """What of the state the desired states read, cheaply compared tick to tick (changes
    that come with no event, e.g. the rendezvous port, still reach every node at once)."""
    return (
        s.phase, s.generation, s.master_port, s.restore_step, s.restore_gen, len(s.fired),
        s.restarts, s.persist is not None, len(s.pools), len(s.assignment),
    )  # fmt: skip


def _preflight(
    cfg: JobConfig, store: Store, check_only: bool, check_cfg: CheckConfig | None
) -> Preflight | None:
    """The pre-flight coordinator, unless pre-flight is off (``trainguard check`` always has
    one)."""
    if not check_only and cfg.preflight.level == "off":
        return None
    level = cfg.preflight.level if cfg.preflight.level != "off" else "quick"
    injects: dict[str, list[str]] = {}
    for spec in cfg.injects:  # gemm-wrong:…:step=S goes wrong in training (ingest.py)
        if spec.kind == "gemm-wrong" and not spec.step:
            injects.setdefault(f"node{spec.node}", []).append(spec.kind)
    return Preflight(
        check_cfg or CheckConfig(**{"level": level, **cfg.preflight.checks}), store, ckpt_dir=cfg.ckpt_dir,
        shm_dir=cfg.checkpoint.shm_dir, injects=injects,
    )  # fmt: skip


RELAY_UPLINKS_PER_S = 200.0  # relay uplinks a second the controller is sized for (issue 31)
RELAY_FLUSH_MIN_S = 0.25  # the shortest uplink period a relay is told


class Controller:
    """One job's controller. Create, ``await start()``, then ``await wait_done(deadline)``.

    ``resume``: the state a previous controller of this job persisted (its process died);
    the job goes on where it was, without restarting workers. For ``node_timeout_s`` after
    the start no decision is taken until every node of the job has reported again.

    ``rerun_of``: the last state of a previous run of this run dir that is over (ended, or
    died with its agents): this run is its next incarnation (``next_incarnation``) and
    records a ``rerun`` event with ``leftovers`` (what ``storage.clean_leftovers`` removed).

    ``check_only``: no job; run one pre-flight over the first ``cfg.nodes`` agents that report
    (or those there after ``join_timeout_s``), then end (``trainguard check``).
    """

    def __init__(
        self,
        cfg: JobConfig,
        token: str,
        store: Store,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        resume: JobState | None = None,
        rerun_of: JobState | None = None,
        leftovers: dict[str, list[str]] | None = None,
        check_only: bool = False,
        check_cfg: CheckConfig | None = None,
        view_token: str | None = None,
        dashboard: Dashboard | None = None,
    ) -> None:
        self.cfg, self.store, self.host, self.port = cfg, store, host, port
        self.dashboard = dashboard  # the page HttpApi serves (observe's, handed in by the CLI)
        self.check_only = check_only
        self._token, self._view_token = token, view_token
        if resume is not None:
            self.state = resume
        elif rerun_of is not None:
            self.state = next_incarnation(rerun_of, clock.wall())
        else:
            self.state = JobState(phase_since=clock.wall())
        self._resume_until = (
            clock.wall() + cfg.timeouts.node_timeout_s if resume is not None else 0.0
        )
        self._back_since = 0.0  # reports older than this are stale (a freeze of this process)
        self._dirty: set[str] = set()  # nodes that reported since the last publish
        self._full_publish = True
        self._last_full_publish = 0.0
        self._last_persist = 0.0
        self._signature: tuple[Any, ...] = ()
        self._last_tick = time.monotonic()
        self._last_cpu = time.process_time()  # this process's CPU seconds at the last tick
        # Desired-state versions grow across controller restarts (agents ignore older ones).
        self._version_base = int(clock.wall() * 1000)
        self._inputs = Inputs()  # for the next decide (the executor never edits the state)
        self.desired: dict[str, tuple[int, protocol.Desired]] = {}
        self.changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._cold: asyncio.Task[None] | None = None  # the cold tier's restore, then archivers
        self._done = asyncio.Event()
        self._verified: dict[tuple[int, int], bool] = {}
        self._last_state = ""
        self._encoder = StateEncoder()
        self._checking = PreflightDriver()
        self.closing = False
        self.monitor = Monitor(cfg.metrics.alert_webhook)
        self.monitor.registry.register(JobCollector(self._metric_state, self.monitor.figures))
        self.preflight = _preflight(cfg, store, check_only, check_cfg)
        self.intake = Intake(cfg, store, self.monitor, lambda: self.preflight, self._checking.seen)
        self.obs: dict[str, NodeObs] = self.intake.obs  # each node's latest observation
        self.relays = RelayBook()  # relays, the nodes behind each (issue 31)
        self.cold_tier = (
            ColdTier(cfg, store, self.monitor)
            if cfg.archive.archive_urls and not check_only
            else None
        )
        self._record_start(resume, rerun_of, leftovers)

    def _record_start(
        self,
        resume: JobState | None,
        rerun_of: JobState | None,
        leftovers: dict[str, list[str]] | None,
    ) -> None:
        """The config and the start's events: a check, a controller restart, a rerun, a job."""
        cfg, store = self.cfg, self.store
        if self.check_only:
            store.record("check_started", {"nodes": cfg.nodes})
            return
        store.put("config", {**cfg.to_flat(), "injects": [i.to_json() for i in cfg.injects]})
        if resume is not None:
            store.record(
                "controller_restarted",
                {"phase": resume.phase.value, "generation": resume.generation},
            )
            return
        if rerun_of is not None:
            store.record(
                "rerun",
                {
                    "incarnation": self.state.incarnation,
                    "previous_phase": rerun_of.phase.value,
                    "previous_generation": rerun_of.generation,
                    "previous_reason": rerun_of.reason,
                    "leftovers": leftovers or {},
                },
            )
        store.record(
            "job_started",
            {
                "incarnation": self.state.incarnation,
                "nodes": cfg.nodes,
                "standby": cfg.standby,
                "world_size": cfg.world_size,
                "script": cfg.script,
                "args": list(cfg.script_args),
            },
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> tuple[str, int]:
        api = HttpApi(self, self._token, self._view_token)
        self._runner = web.AppRunner(api.app(), access_log=None)
        await self._runner.setup()
        # Every agent connects at once at the start and after a controller restart: with
        # aiohttp's default backlog (128) the kernel drops SYNs past it and each dropped
        # client waits the 1 s SYN retransmit (seen as a 1 s p99 at 1,024 agents).
        site = web.TCPSite(self._runner, self.host, self.port, backlog=LISTEN_BACKLOG)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        if self.cfg.metrics.metrics_bind:  # a fixed address for Prometheus, open if metrics_open
            mhost, mport = split_host_port(self.cfg.metrics.metrics_bind)
            self._metrics_runner = web.AppRunner(
                api.metrics_app(self.cfg.metrics.metrics_open), access_log=None
            )
            await self._metrics_runner.setup()
            try:
                await web.TCPSite(self._metrics_runner, mhost, int(mport)).start()
            except OSError as e:  # in use, or not an address of this host
                await self.close()
                raise ValueError(
                    f"metrics_bind = {self.cfg.metrics.metrics_bind!r}: cannot listen there "
                    f"({e.strerror or e}); pick a free port on an address of this host"
                ) from None
        # The tick's thread hands the GIL to the loop's reports within 1 ms, not Python's
        # default 5 ms (a report needs it several times: at thousands of nodes that was the
        # report latency's tail).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        gc.set_threshold(*GC_THRESHOLDS)
        if self.cold_tier is not None:
            self._cold = asyncio.create_task(self.cold_tier.start(), name="cold-tier")
        self._tick_task = asyncio.create_task(self._tick_loop(), name="controller-tick")
        return self.host, self.port

    def _metric_state(self) -> tuple[int, list[dict[str, Any]]]:
        s = self.state
        recs = [*s.recoveries, *([s.recovery] if s.recovery is not None else [])]
        return s.restarts, [r.to_json() for r in recs]

    async def wait_done(self) -> JobState:
        await self._done.wait()
        return self.state

    def request_stop(self) -> None:
        self._inputs.stop_requested = True

    async def close(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
        if self._cold is not None and not self._cold.done():
            self._cold.cancel()  # a restore in flight finishes in its thread, unused
        if self.cold_tier is not None:
            await self.cold_tier.close()
        self.closing = True  # long polls answer now, so the HTTP server stops at once
        await self._notify()
        for runner in (self._runner, self._metrics_runner):
            if runner is not None:
                await runner.cleanup()

    # ------------------------------------------------------------------ reports
    def ingest(self, report: protocol.AgentReport, *, flush: bool = True) -> None:
        """Take one report (validated): the intake's facts go to the next tick's inputs, and
        what the policy does about its detectors' findings with them. ``flush``: its step
        records are written now (a relay uplink writes all of its own once, at its end)."""
        try:
            self._ingest(report)
        finally:
            if flush:
                self.store.flush_steps()

    def _ingest(self, report: protocol.AgentReport) -> None:
        now = clock.wall()
        moved, findings = self.intake.take(report, self.state, self._inputs, now)
        if moved:
            self._full_publish = True  # peers' desired states name this node's addresses
        self._dirty.add(report.node_id)
        for f in findings:
            self._apply_reaction(react(f, self.state, self.obs, now, self.cfg))

    def take_steps(self, node_id: str, batches: list[protocol.StepBatch]) -> None:
        """Step records that came without a whole report (a relay's alive entry): stored and
        seen by the step detectors as a report's are (``ingest``)."""
        now = clock.wall()
        for f in self.intake.take_steps(node_id, batches, self.state, self._inputs, now):
            self._apply_reaction(react(f, self.state, self.obs, now, self.cfg))

    def _apply_reaction(self, r: Reaction) -> None:
        self._inputs.evict.update(r.evict)
        self._inputs.quarantine.update(r.quarantine)
        for kind, data in r.record:
            self.store.record(kind, data)
        for kind, data in r.alert:
            self.store.record(kind, data)
            self.monitor.alert(kind, data)
            log.warning("%s: %s", kind, data)

    def clash(self, report: protocol.AgentReport) -> str | None:
        """Why ``report`` is refused (409) though well formed: another agent still reports
        under its node id (a rebooted node's old agent has stopped reporting by now: two
        hosts share a name); None if it may be taken."""
        old = self.obs.get(report.node_id)
        if (
            old is not None
            and old.incarnation != report.incarnation
            and clock.wall() - old.last_seen < 2 * self.cfg.timeouts.heartbeat_s + 0.5
        ):
            log.warning(
                "refused a second live agent for node %s from %s", report.node_id, report.addr
            )
            return (
                f"node id {report.node_id} is in use by a live agent at {old.addr}; "
                "give each host its own --node-id"
            )
        return None

    def relay_uplink(self, body: dict[str, Any]) -> dict[str, Any]:
        """One relay uplink (checked by ``protocol.relay.check_uplink``): each whole report
        taken as a direct one is (``ingest``), each alive entry folded into its node's
        observation (``relays.apply_alive``). Answers ``seq``, the relay's nodes' desired
        states newer than its ``since``, ``resend`` (nodes this controller has no current
        observation of: their next report must come whole) and ``refused`` (node → why)."""
        try:
            return self._relay_uplink(body)
        finally:
            self.store.flush_steps()  # the uplink's step records, in one transaction

    def _relay_uplink(self, body: dict[str, Any]) -> dict[str, Any]:
        now = clock.wall()
        rid = str(body["relay"])
        if self.relays.seen(rid, str(body["addr"]), now):
            self.store.record("relay_joined", {"relay": rid, "addr": body["addr"]})
        refused: dict[str, str] = {}
        stale = 0
        for raw in body.get("reports", []):
            node = str(raw.get("node_id")) if isinstance(raw, dict) else "?"
            try:
                report = protocol.report_from_json(raw)
                if superseded(self.obs.get(report.node_id), report.incarnation, report.time):
                    stale += 1  # a late copy of what the agent sent again since (directly)
                    continue
                why = self.clash(report)
                if why is None:
                    self.ingest(report, flush=False)
                    self.relays.through(report.node_id, rid)
            except (KeyError, TypeError, ValueError) as e:
                why = f"malformed report: {e}"
            if why is not None:
                refused[node] = why
        resend = []
        for raw in body.get("alive", []):
            try:
                entry = relay_wire.check_alive(raw)
                if len(entry) > 5:  # step records: facts of their own, whatever the shape
                    batches = [protocol.StepBatch.from_json(b) for b in entry[5]]
                    self.take_steps(entry[0], batches)
                o = self.obs.get(entry[0])
                # No observation, another incarnation, or reports that came another way since
                # this relay's last whole one: an alive entry would refresh the wrong shape.
                if (
                    o is None
                    or o.incarnation != entry[1]
                    or self.relays.route.get(o.node_id) != rid
                ):
                    resend.append(entry[0])
                    continue
                apply_alive(o, entry, now)
            except (KeyError, TypeError, ValueError) as e:
                refused[str(raw[0]) if isinstance(raw, list) and raw else "?"] = str(e)
                continue
            self._checking.seen(o.node_id, o.last_seen)
        if refused:
            log.warning("relay %s: refused %d node report(s), e.g. %s", rid, len(refused),
                        next(iter(refused.items())))  # fmt: skip
        if stale:
            log.info("relay %s: dropped %d late report copies (newer ones were taken)", rid,
                     stale)  # fmt: skip
        return {**self.relay_desired(rid, int(body.get("since", 0))), "resend": resend,
                "refused": refused, "flush_s": self._relay_flush_s()}  # fmt: skip

    def _relay_flush_s(self) -> float:
        """The uplink period relays are told: ``RELAY_UPLINKS_PER_S`` uplinks a second reach
        this controller whatever the number of relays, at least ``RELAY_FLUSH_MIN_S`` and at
        most half a heartbeat apart (alive entries carry their age: the period delays the
        news, never the judged time)."""
        live = sum(1 for r in self.relays.relays.values() if not r.lost)
        hb = self.cfg.timeouts.heartbeat_s
        return round(min(max(hb / 2, RELAY_FLUSH_MIN_S),
                         max(RELAY_FLUSH_MIN_S, live / RELAY_UPLINKS_PER_S)), 3)  # fmt: skip

    def relay_desired(self, relay: str, since: int) -> dict[str, Any]:
        """``seq`` and the desired states of ``relay``'s nodes changed after ``since``."""
        return desired_batch(self.relays, relay, since, self.desired, protocol.desired_to_json)

    # ------------------------------------------------------------------ tick
    def _durable(
        self, unusable: list[list[int]]
    ) -> tuple[list[tuple[int, int]], list[Event], list[tuple[int, int]]]:
        """Verified committed (step, generation) pairs of the durable tier, the events to
        record, and the pairs whose ranks' fingerprints agree (``fingerprint.durable_verdict``).
        Each copy is verified once (a copy = a step and the generation that committed it); a
        copy a rank could not read later is left out (``unusable``). Reads files: runs off the
        event loop."""
        root = Path(self.cfg.ckpt_dir)
        out, events, agreed = [], [], []
        for step in storage.list_committed(root):
            copy = (step, storage.committed_generation(root, step))
            if copy not in self._verified:
                problems = storage.verify(root, step)
                self._verified[copy] = not problems
                if not problems and fingerprint.durable_verdict(storage.step_dir(root, step)):
                    agreed.append(copy)
                if problems:
                    events.append(
                        (
                            "checkpoint_corrupt",
                            {"step": step, "tier": "durable", "problems": problems},
                        )
                    )
            if self._verified[copy] and list(copy) not in unusable:
                out.append(copy)
        return out, events, agreed

    def _gate(self) -> bool:
        """Whether this tick may decide: not after the end, not on stale observations (after
        a controller restart or a freeze of this process, until every node reported again or
        ``node_timeout_s`` passed)."""
        if self.state.phase.terminal and self._done.is_set():
            return False
        mono, cpu = time.monotonic(), time.process_time()
        gap, self._last_tick = mono - self._last_tick, mono
        busy, self._last_cpu = cpu - self._last_cpu, cpu
        # Late but running all along (CPU used for most of the gap: a burst of reports, a long
        # tick at scale): the reports it holds are fresh, and pausing decisions on every such
        # gap would keep a loaded controller from ever deciding. Frozen: it did not run.
        if gap > max(2.0, self.cfg.timeouts.node_timeout_s / 2) and busy < gap / 2:
            # This process was frozen (SIGSTOP, a stalled VM, swapping): every report it holds
            # is old, so no node is lost by its clock until each has reported again.
            self._back_since = clock.wall()
            self._resume_until = self._back_since + self.cfg.timeouts.node_timeout_s
            self.store.record("controller_paused", {"gap_s": round(gap, 2)})
            log.warning("controller was frozen for %.1fs: waiting for fresh reports", gap)
        if self._resume_until:
            if clock.wall() < self._resume_until and not self._all_back():
                return False  # after a controller restart: let every node report first
            self._resume_until = 0.0
        return True

    async def _tick(self) -> None:
        """One coalesced decision over every report since the last: the pre-flight advanced,
        then ``decide`` (with the durable tier's scan and the desired states it changes, in a
        worker thread over a snapshot of the observations, so reports are answered while it
        runs), then its effects: events recorded, state persisted, long polls woken."""
        # A relay sends an uplink every quarter second or so; silent for two heartbeats, it
        # is said lost (its agents report directly meanwhile: agent/link.py RoutedLink).
        for rid in self.relays.lost(clock.wall(), max(2.0, 2 * self.cfg.timeouts.heartbeat_s)):
            info = self.relays.relays[rid]
            self.store.record("relay_lost", {"relay": rid, "addr": info.addr,
                                             "silent_s": round(clock.wall() - info.last_seen, 2)})  # fmt: skip
            log.warning("relay %s (%s) fell silent; its nodes report directly", rid, info.addr)
        if not self._gate():
            return
        t0 = time.perf_counter()
        try:
            await self._decide_tick()
        finally:
            self.monitor.h_tick.observe(time.perf_counter() - t0)

    async def _decide_tick(self) -> None:
        if self.preflight is not None:
            try:
                now = clock.wall()
                verdicts = self._checking.tick(
                    self.preflight, now, self.obs, self.state, self.cfg, self.store, self.check_only
                )
                self._inputs.verdicts.update(verdicts)
            except Exception:  # a bug in the checks must not stop the job's decisions
                log.exception("pre-flight tick failed; the run is abandoned")
                self.preflight.abandon(clock.wall(), "pre-flight failed internally (see log)")
        if self.check_only:
            self._check_only_tick(clock.wall())
            return
        obs = dict(self.obs)  # reports that arrive meanwhile go to the next tick
        inputs, self._inputs = self._inputs, Inputs()
        if self.state.phase == Phase.RUNNING:
            world = world_of(self.state, self.cfg)
            inputs.fingerprints = self.intake.fingerprints.complete(self.state.generation, world)
        full = self._full_publish_due()
        nodes = list(obs) if full else [n for n in self._dirty if n in obs]
        self._dirty = set()
        try:
            new, events, wants = await asyncio.to_thread(
                self._decide, self.state, obs, inputs, nodes
            )
        except BaseException:
            self._inputs = merge_inputs(inputs, self._inputs)  # nothing learned is dropped
            self._full_publish = True
            raise
        for kind, data in events:
            record_decided(self.store, self.monitor, kind, data)
        if new.recovery is not None and self.state.recovery is None:
            self.intake.milestones.clear()  # a new recovery: its milestones are counted afresh
        self.state = new
        sig = _signature(new)
        changed, self._signature = bool(events) or sig != self._signature, sig
        if changed and not full:  # the state changed: every node's desired state may have
            wants = await asyncio.to_thread(self._wants, new, obs, list(obs))
        self._persist(changed)
        self._apply_wants(wants)

    def _decide(
        self, s: JobState, obs: dict[str, NodeObs], inputs: Inputs, nodes: list[str]
    ) -> tuple[JobState, list[Event], dict[str, protocol.Desired]]:
        """decide and the desired states of ``nodes`` after it (in a worker thread: reads
        only its arguments, ``self.cfg`` and the durable tier's files)."""
        needs_ckpt = s.phase in (
            Phase.PENDING,
            Phase.STOPPING,
            Phase.CLEANING,
            Phase.REPLACING,
            Phase.WAITING_FOR_NODES,
        )
        unusable = s.unusable + [list(p) for p in inputs.unusable]
        ckpt, events, agreed = self._durable(unusable) if needs_ckpt else ([], [], [])
        inputs.agreed += agreed  # this tick's own inputs (merged back if the tick fails)
        new, decided = decide(s, obs, clock.wall(), self.cfg, ckpt, inputs, self.intake.liveness)
        return new, events + decided, self._wants(new, obs, nodes)

    def _wants(
        self, s: JobState, obs: dict[str, NodeObs], nodes: list[str]
    ) -> dict[str, protocol.Desired]:
        ring = ring_of(s)
        return {n: desired_for(s, n, obs, self.cfg, ring) for n in nodes if n in obs}

    def _persist(self, changed: bool) -> None:
        """Persist the state if it changed (checked on every transition, else at most once
        per PERSIST_S: step counters move every tick), re-encoding only the fields that
        changed (``StateEncoder``); set done at the end."""
        now = time.monotonic()
        if changed or self.state.phase.terminal or now - self._last_persist >= PERSIST_S:
            self._last_persist = now
            snapshot = self._encoder.encode(self.state)  # re-encodes changed fields only
            if snapshot != self._last_state:
                self._last_state = snapshot
                self.store.put_text("state", snapshot)
        if self.state.phase.terminal:
            self._done.set()

    def _persist_and_publish(self, changed: bool = True) -> None:
        """Persist (``_persist``) and publish every node's desired state (on the loop: the
        pre-flight's and trainguard check's path, a few nodes)."""
        self._persist(changed)
        self._full_publish = True
        self.publish()

    def tick_age_s(self) -> float:
        """Seconds since the decision loop last ticked (monotonic clock)."""
        return time.monotonic() - self._last_tick

    def alive(self, node_id: str, now: float) -> bool:
        o = self.obs.get(node_id)
        return o is not None and is_alive(o, now, self.cfg)  # the rule decide uses

    def _check_only_tick(self, now: float) -> None:
        pf = self.preflight
        assert pf is not None
        alive = [n for n in sorted(self.obs) if self.alive(n, now)]
        last = pf.runs[max(pf.runs)] if pf.runs else None
        inputs, self._inputs = self._inputs, Inputs()
        new, events, start = decide_check(
            self.state, alive, pf.active is not None, last, now, self.cfg, inputs
        )
        if start:
            pf.start(start, f"trainguard check ({len(start)} of {self.cfg.nodes} nodes)", now)
        for kind, data in events:
            self.store.record(kind, data)
        self.state = new
        self._persist_and_publish()

    def _all_back(self) -> bool:
        """Every node of the job reported since the controller (re)started or woke up."""
        want = {n for n, p in self.state.pools.items() if p in (Pool.RUNNING, Pool.STANDBY)}
        if self.preflight is not None and self.preflight.active is not None:
            # nodes in no pool yet, being checked: a stale report would fail them ("lost")
            want |= set(self.preflight.active.nodes)
        return all(n in self.obs and self.obs[n].last_seen >= self._back_since for n in want)

    def _full_publish_due(self) -> bool:
        """Whether this tick recomputes every node's desired state: a node's address changed,
        a pre-flight runs, trainguard check, or FULL_PUBLISH_S (or 2 heartbeats) passed.
        Otherwise only the nodes that reported since the last tick (and all of them if the
        job state changes): a tick then costs what changed, not the cluster."""
        now = time.monotonic()
        full = (
            self._full_publish
            or self.check_only
            or (self.preflight is not None and self.preflight.active is not None)
            or now - self._last_full_publish
            > max(FULL_PUBLISH_S, 2 * self.cfg.timeouts.heartbeat_s)
        )
        if full:
            self._last_full_publish, self._full_publish = now, False
        return full

    def publish(self) -> None:
        """Recompute the desired states due (``_full_publish_due``) here on the loop."""
        full = self._full_publish_due()
        nodes = list(self.obs) if full else [n for n in self._dirty if n in self.obs]
        self._dirty = set()
        if self.check_only and not self.state.phase.terminal:
            wants: dict[str, protocol.Desired] = {n: protocol.Idle() for n in nodes}
        else:
            wants = self._wants(self.state, self.obs, nodes)
        self._apply_wants(wants)

    def _apply_wants(self, wants: dict[str, protocol.Desired]) -> None:
        """Give each node its desired state (a pre-flight task replaces an idle one), with a
        new version where it changed, and wake the long polls if any did."""
        changed = False
        for node_id, want in wants.items():
            task = None
            idle = isinstance(want, protocol.Idle)
            if self.preflight is not None and idle and node_id in self.obs:
                task = self.preflight.task_for(node_id, self.obs[node_id].clock_skew_s)
            if task is not None:
                want = protocol.Check(task=task)
            version, have = self.desired.get(node_id, (self._version_base, None))
            if want != have:
                self.desired[node_id] = (version + 1, want)
                self.relays.changed(node_id)
                changed = True
        if changed:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _tick_loop(self) -> None:
        # A tenth of the heartbeat, between TICK_S and 1 s: decisions lag a report by at most
        # that, and a lost node is decided within node_timeout_s + 1 s at any size.
        interval = min(1.0, max(TICK_S, self.cfg.timeouts.heartbeat_s / 10))
        if self._cold is not None:  # no generation starts before the cold tier's restore
            try:
                await self._cold
            except Exception:
                log.exception("cold tier: could not start; the job goes on without it")
        while True:
            try:
                await self._tick()
            except Exception:  # a bug here must not silently stop the job: log and keep ticking
                log.exception("controller tick failed")
            await asyncio.sleep(interval)
