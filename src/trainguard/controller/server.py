"""The controller's executor: HTTP API for agents, the tick loop, effects of ``decide``.

Endpoints (all require ``Authorization: Bearer <job token>``):

- ``POST /v1/report``   an agent's heartbeat and reports; answers its desired state
- ``GET  /v1/desired``  long poll: ``?node=ID&version=V&wait_s=S`` returns once the node's
                        desired state is newer than V, or after S seconds (max 30)
- ``GET  /v1/status``   job phase, pools (the seed's five lists), generation, recoveries, and
                        each node's last report (address, age, generation, workers' steps)
- ``POST /v1/stop``     request a clean stop of the job
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from trainguard.checkpoint import storage
from trainguard.controller.api import JobConfig, NodeObs, Phase, Pool, WorkerObs
from trainguard.controller.decide import JobState, decide, desired_for, world_of
from trainguard.controller.store import Store

log = logging.getLogger("trainguard.controller")
TICK_S = 0.1
MAX_WAIT_S = 30.0


def state_json(s: JobState) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    if s.recovery is not None:
        d["recovery"] = s.recovery.to_json()
    d["recoveries"] = [r.to_json() for r in s.recoveries]
    return json.loads(json.dumps(d, default=str))


def pool_lists(pools: dict[str, str]) -> dict[str, list[str]]:
    """The seed's five node lists from the pools: all, normal (healthy: running or standby),
    abnormal (faulty or retired), standby, running."""
    by = {p.value: sorted(n for n, q in pools.items() if q == p.value) for p in Pool}
    return {
        "all": sorted(pools),
        "normal": sorted(by["running"] + by["standby"]),
        "abnormal": sorted(by["faulty"] + by["retired"]),
        "standby": by["standby"],
        "running": by["running"],
    }


class Controller:
    """One job's controller. Create, ``await start()``, then ``await wait_done(deadline)``.

    ``resume``: the state a previous controller of this job persisted (its process died);
    the job goes on where it was, without restarting workers. For ``node_timeout_s`` after
    the start no decision is taken until every node of the job has reported again.
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
    ) -> None:
        self.cfg, self.store, self.host, self.port = cfg, store, host, port
        self._token = f"Bearer {token}".encode()
        self.state = resume if resume is not None else JobState(phase_since=time.time())
        self._resume_until = time.time() + cfg.node_timeout_s if resume is not None else 0.0
        # Desired-state versions grow across controller restarts (agents ignore older ones).
        self._version_base = int(time.time() * 1000)
        self.obs: dict[str, NodeObs] = {}
        self._desired: dict[str, tuple[int, dict[str, Any]]] = {}
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._done = asyncio.Event()
        self._verified: dict[int, bool] = {}
        self._marks: dict[str, dict[int, float]] = {}
        self._first_step_gen: set[int] = set()
        self._last_state = ""
        store.put(
            "config", {**dataclasses.asdict(cfg), "injects": [i.to_json() for i in cfg.injects]}
        )
        if resume is not None:
            store.record(
                "controller_restarted",
                {"phase": resume.phase.value, "generation": resume.generation},
            )
            return
        store.record(
            "job_started",
            {
                "nodes": cfg.nodes,
                "standby": cfg.standby,
                "world_size": cfg.world_size,
                "script": cfg.script,
                "args": list(cfg.script_args),
            },
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> tuple[str, int]:
        app = web.Application(middlewares=[self._auth], client_max_size=16 << 20)
        app.add_routes(
            [
                web.post("/v1/report", self._report),
                web.get("/v1/desired", self._get_desired),
                web.get("/v1/status", self._status),
                web.post("/v1/stop", self._stop),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self._tick_task = asyncio.create_task(self._tick_loop(), name="controller-tick")
        return self.host, self.port

    async def wait_done(self) -> JobState:
        await self._done.wait()
        return self.state

    def request_stop(self) -> None:
        self.state.stop_requested = True

    async def close(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------------ HTTP
    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, self._token):
            log.warning(
                "rejected unauthenticated %s %s from %s",
                request.method,
                request.path,
                request.remote,
            )
            return web.json_response({"error": "missing or wrong job token"}, status=401)
        return await handler(request)

    async def _report(self, request: web.Request) -> web.Response:
        body = await request.json()
        node_id = str(body["node_id"])
        old = self.obs.get(node_id)
        if (
            old is not None
            and old.incarnation != str(body["incarnation"])
            and time.time() - old.last_seen < 2 * self.cfg.heartbeat_s + 0.5
        ):
            # Another agent still reports under this node id (a rebooted node's old agent has
            # stopped reporting by now): two hosts share a name.
            log.warning("refused a second live agent for node %s from %s", node_id, body["addr"])
            return web.json_response(
                {
                    "error": f"node id {node_id} is in use by a live agent at {old.addr}; "
                    "give each host its own --node-id"
                },
                status=409,
            )
        self._ingest(node_id, body)
        self._tick()
        version, desired = self._desired.get(node_id, (0, {"action": "idle"}))
        return web.json_response({"version": version, "desired": desired})

    async def _get_desired(self, request: web.Request) -> web.Response:
        node_id = request.query.get("node", "")
        version = int(request.query.get("version", "0"))
        wait_s = min(MAX_WAIT_S, float(request.query.get("wait_s", "10")))

        def newer() -> bool:
            return self._desired.get(node_id, (0, {}))[0] > version

        async with self._changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(newer), timeout=wait_s)
        v, desired = self._desired.get(node_id, (0, {"action": "idle"}))
        return web.json_response({"version": v, "desired": desired})

    async def _status(self, request: web.Request) -> web.Response:
        out = state_json(self.state)
        out["lists"] = pool_lists(out["pools"])
        now = time.time()
        out["nodes"] = {
            n: {
                "addr": o.addr,
                "pool": out["pools"].get(n),
                "node_rank": self.state.assignment.get(n),
                "last_seen_s": round(now - o.last_seen, 3),
                "generation": o.generation,
                "workers": {r: {"state": w.state, "step": w.step} for r, w in o.workers.items()},
                "health": list(o.health_problems) or "ok",
            }
            for n, o in sorted(self.obs.items())
        }
        return web.json_response(out)

    async def _stop(self, request: web.Request) -> web.Response:
        self.request_stop()
        return web.json_response({"ok": True})

    # ------------------------------------------------------------------ reports
    def _ingest(self, node_id: str, body: dict[str, Any]) -> None:
        now = time.time()
        workers = {int(w["rank"]): WorkerObs(**w) for w in body.get("workers", [])}
        store = body.get("store")
        self.obs[node_id] = NodeObs(
            node_id=node_id,
            addr=str(body["addr"]),
            incarnation=str(body["incarnation"]),
            last_seen=now,
            generation=body.get("generation"),
            workers=workers,
            hang=bool(body.get("hang")),
            stopped_generation=int(body.get("stopped_generation", -1)),
            stopped_at=body.get("stopped_at"),
            cleaned_at=body.get("cleaned_at"),
            memory={int(r): [tuple(p) for p in v] for r, v in (body.get("memory") or {}).items()},
            replicas={
                int(r): [tuple(p) for p in v] for r, v in (body.get("replicas") or {}).items()
            },
            replica_addr=body.get("replica_addr"),
            fenced_generation=int(body.get("fenced_generation", -1)),
            health_ok=bool((body.get("health") or {}).get("ok", True)),
            health_problems=tuple((body.get("health") or {}).get("problems", [])),
            store=tuple(store) if store else None,  # type: ignore[arg-type]
        )
        for ev in body.get("events", []):
            ev = {**ev, "node": node_id}
            kind = ev.pop("kind")
            ts = ev.pop("ts", None)
            self.store.record(kind, ev, ts=ts)
            if kind == "inject_fired" and ev["inject"]["id"] not in self.state.fired:
                self.state.fired.append(int(ev["inject"]["id"]))
            if kind in ("ckpt_load_start", "ckpt_load_end"):
                self._mark(kind, int(ev.get("generation", -1)), int(ev["rank"]), float(ts or now))
        for batch in body.get("steps", []):
            self.store.add_steps(int(batch["generation"]), int(batch["rank"]), batch["items"])
            self._on_steps(int(batch["generation"]), int(batch["rank"]), batch["items"])

    def _mark(self, kind: str, gen: int, rank: int, ts: float) -> None:
        rec = self.state.recovery
        if rec is None or rec.to_generation != gen:
            return
        marks = self._marks.setdefault(f"{gen}:{kind}", {})
        marks[rank] = ts
        if len(marks) == world_of(self.state, self.cfg):
            if kind == "ckpt_load_start":
                rec.t_rendezvous = max(marks.values())
            else:
                rec.t_loaded = max(marks.values())

    def _on_steps(self, gen: int, rank: int, items: list[dict[str, Any]]) -> None:
        if gen in self._first_step_gen or not items:
            return
        first = min(items, key=lambda it: it["step"])
        marks = self._marks.setdefault(f"{gen}:first_step", {})
        marks.setdefault(rank, float(first["t_end"]))
        starts = self._marks.setdefault(f"{gen}:first_step_start", {})
        starts.setdefault(rank, float(first["t_end"]) - float(first["dur"]))
        if len(marks) < world_of(self.state, self.cfg):
            return
        self._first_step_gen.add(gen)
        self.store.record(
            "first_step", {"generation": gen, "step": first["step"], "t": max(marks.values())}
        )
        rec = self.state.recovery
        if rec is not None and rec.to_generation == gen:
            rec.t_first_step = max(marks.values())
            if (
                rec.t_rendezvous is None
            ):  # nothing restored: rendezvous ends when the first step starts
                rec.t_rendezvous = rec.t_loaded = max(starts.values())
            self.store.record("recovery_completed", {"generation": gen, **rec.to_json()})
            log.info(
                "[gen %d] recovered in %.2fs: %s",
                gen,
                rec.durations()["total"] or -1,
                {k: round(v, 3) for k, v in rec.durations().items() if v is not None},
            )
            self.state.recoveries.append(rec)
            self.state.recovery = None

    # ------------------------------------------------------------------ tick
    def _durable(self) -> list[tuple[int, int]]:
        """Verified committed (step, generation) pairs of the durable tier (each verified once)."""
        root = Path(self.cfg.ckpt_dir)
        out = []
        for step in storage.list_committed(root):
            if step not in self._verified:
                problems = storage.verify(root, step)
                self._verified[step] = not problems
                if problems:
                    self.store.record(
                        "checkpoint_corrupt",
                        {"step": step, "tier": "durable", "problems": problems},
                    )
            if self._verified[step]:
                out.append((step, storage.committed_generation(root, step)))
        return out

    def _tick(self) -> None:
        if self.state.phase.terminal and self._done.is_set():
            return
        needs_ckpt = self.state.phase in (
            Phase.PENDING,
            Phase.STOPPING,
            Phase.CLEANING,
            Phase.REPLACING,
            Phase.WAITING_FOR_NODES,
        )
        if self._resume_until:
            if time.time() < self._resume_until and not self._all_back():
                return  # after a controller restart: let every node report before deciding
            self._resume_until = 0.0
        ckpt = self._durable() if needs_ckpt else []
        new, events = decide(self.state, self.obs, time.time(), self.cfg, ckpt)
        for kind, data in events:
            self.store.record(kind, data)
            if kind == "fault_refined":
                log.info(
                    "[gen %s] fault re-attributed: %s",
                    data["generation"],
                    data["message"].splitlines()[0][:200],
                )
            if kind == "phase":
                log.info(
                    "[gen %s] %s → %s: %s",
                    data["generation"],
                    data["from"],
                    data["to"],
                    data["reason"],
                )
        if new.recovery is not None and self.state.recovery is None:
            self._marks.clear()
        self.state = new
        snapshot = json.dumps(state_json(new), sort_keys=True)
        if snapshot != self._last_state:
            self._last_state = snapshot
            self.store.put("state", json.loads(snapshot))
        self._publish()
        if new.phase.terminal:
            self._done.set()

    def _all_back(self) -> bool:
        want = {n for n, p in self.state.pools.items() if p in (Pool.RUNNING, Pool.STANDBY)}
        return want <= set(self.obs)

    def _publish(self) -> None:
        changed = False
        for node_id in list(self.obs):
            want = desired_for(self.state, node_id, self.obs, self.cfg)
            version, have = self._desired.get(node_id, (self._version_base, {}))
            if want != have:
                self._desired[node_id] = (version + 1, want)
                changed = True
        if changed:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _tick_loop(self) -> None:
        while True:
            try:
                self._tick()
            except Exception:  # a bug here must not silently stop the job: log and keep ticking
                log.exception("controller tick failed")
            await asyncio.sleep(TICK_S)
