"""The controller's HTTP API (aiohttp). Every endpoint requires ``Authorization: Bearer <job
token>`` (401 otherwise); the read-only **view token** (``RUN_DIR/view-token``) is accepted
for the reading ``GET`` endpoints (``/v1/view``, ``/v1/status``, ``/metrics``) only. The page
``/`` and its script are public: they hold no data, the page asks for a token (a login form,
or ``#token=…`` in the URL: a fragment, never sent to the server nor logged).

- ``GET  /``            the dashboard (``observe/static/view.html``), polling ``/v1/view``
- ``GET  /v1/view``     what the dashboard shows (``observe/view.py``)

(These two and the page's script are the ``Dashboard`` the controller is handed, by the CLI:
``observe.html.DASHBOARD``. The controller never imports observe, which reads the
controller's store; without a dashboard they answer 404.)

- ``POST /v1/report``   an agent's heartbeat and reports; answers its desired state
- ``GET  /v1/desired``  long poll: ``?node=ID&version=V&wait_s=S`` returns once the node's
                        desired state is newer than V, or after S seconds (max 30)
- ``GET  /v1/status``   job phase, pools (the seed's five lists), generation, recoveries, and
                        each node's last report (address, age, generation, workers' steps)
- ``POST /v1/relay``    a relay's uplink: its nodes' changed reports and alive entries
                        (``protocol/relay.py``); answers its nodes' new desired states
- ``GET  /v1/relay/desired``  a relay's long poll: ``?relay=ID&since=S&wait_s=W``
- ``POST /v1/stop``     request a clean stop of the job
- ``GET  /metrics``     Prometheus metrics (steps, step/compute/communication seconds and
                        straggler score per rank, alerts, phase, pools)
- ``POST /v1/check``    start a pre-flight run on the idle nodes (``{"level": "quick"|"full"}``);
                        409 while one runs. ``GET /v1/check?run=N``: its progress and verdicts

A handler only reads the controller and hands it what arrived (``Controller.ingest``,
``request_stop``, ``publish``): decisions are the tick's (``server.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from trainguard import protocol
from trainguard.controller.api import Pool
from trainguard.controller.jobstate import pool_lists, state_json
from trainguard.health.coordinator import Preflight
from trainguard.health.judge import CheckConfig
from trainguard.protocol import clock
from trainguard.protocol import relay as relay_wire
from trainguard.protocol.desired import long_poll_args

if TYPE_CHECKING:
    from trainguard.controller.server import Controller

log = logging.getLogger("trainguard.controller")
# The page, its script and the health probe: no job data in them.
PUBLIC = frozenset({"/", "/favicon.ico", "/healthz"})
# A controller whose decision loop has not ticked for this long is not live (it ticks every
# 0.1-1 s; a tick at 16,384 nodes takes well under a second: benchmarks/decide_scale.py).
HEALTH_TICK_S = 60.0
READ_ONLY = frozenset({"/v1/view", "/v1/status", "/metrics"})  # the view token's reach


class Dashboard(Protocol):
    """The job's page: served at ``/``, its script at ``script_path``, its data at
    ``/v1/view`` (``observe.html.DASHBOARD``)."""

    script_path: str

    def page(self) -> str: ...
    def script(self) -> bytes: ...
    def view(self, run_dir: Path) -> dict[str, Any]: ...


class HttpApi:
    """The endpoints of one controller (``ctl``), authenticated by ``token`` (hex); the
    dashboard's are ``ctl.dashboard``'s (none: 404)."""

    def __init__(self, ctl: Controller, token: str, view_token: str | None = None) -> None:
        self.ctl = ctl
        self._token = f"Bearer {token}".encode()
        self._view = f"Bearer {view_token}".encode() if view_token else None
        self._dash: Dashboard | None = ctl.dashboard
        self._public = PUBLIC | ({self._dash.script_path} if self._dash else set())

    def app(self) -> web.Application:
        """The aiohttp application: routes, the token check, the report size limit (413)."""
        app = web.Application(middlewares=[self._auth], client_max_size=protocol.MAX_REPORT_BYTES)
        app.add_routes(
            [
                web.post("/v1/report", self._report),
                web.post("/v1/relay", self._relay),
                web.get("/v1/relay/desired", self._relay_desired),
                web.get("/v1/desired", self._get_desired),
                web.get("/v1/status", self._status),
                web.post("/v1/stop", self._stop),
                web.post("/v1/check", self._check_start),
                web.get("/v1/check", self._check_get),
                web.get("/metrics", self._metrics),
                web.get("/favicon.ico", self._no_icon),
                web.get("/healthz", self._healthz),
            ]
        )
        if self._dash is not None:
            app.add_routes(
                [
                    web.get("/v1/view", self._view_json),
                    web.get("/", self._page),
                    web.get(self._dash.script_path, self._script),
                ]
            )
        return app

    def metrics_app(self, open_: bool) -> web.Application:
        """``/metrics`` alone, for ``metrics_bind``: without a token when ``open_``."""
        app = web.Application(middlewares=[] if open_ else [self._auth])
        app.add_routes([web.get("/metrics", self._metrics)])
        return app

    def _allowed(self, request: web.Request) -> bool:
        got = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(got, self._token):
            return True
        return (
            self._view is not None
            and request.method == "GET"
            and request.path in READ_ONLY
            and hmac.compare_digest(got, self._view)
        )

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "GET" and request.path in self._public:
            return await handler(request)
        if not self._allowed(request):
            log.warning(
                "rejected unauthenticated %s %s from %s",
                request.method,
                request.path,
                request.remote,
            )
            return web.json_response({"error": "missing or wrong job token"}, status=401)
        timed = {"/v1/report": self.ctl.monitor.h_report, "/v1/relay": self.ctl.monitor.h_uplink}
        hist = timed.get(request.path)
        if hist is None:
            return await handler(request)
        t0 = time.perf_counter()
        try:
            return await handler(request)
        finally:
            hist.observe(time.perf_counter() - t0)

    async def _report(self, request: web.Request) -> web.Response:
        """Take one agent report: validated (400 with the reason when it does not follow the
        protocol, 413 past MAX_REPORT_BYTES), folded into the observations, answered with the
        node's current desired state (its version alone when the report's ``desired_version``
        says the agent holds it already). No decision is taken here: decisions run on the
        coalesced tick (``_tick_loop``), so a report costs work proportional to itself, not
        to the job; a desired state the next tick changes reaches the agent by its long poll."""
        try:
            report = protocol.report_from_json(await request.json(loads=protocol.loads))
        except ValueError as e:  # bad JSON (json.JSONDecodeError) or a ProtocolError
            log.warning("refused a malformed report from %s: %s", request.remote, e)
            return web.json_response({"error": f"malformed report: {e}"}, status=400)
        node_id = report.node_id
        clash = self.ctl.clash(report)
        if clash is not None:
            return web.json_response({"error": clash}, status=409)
        try:
            self.ctl.ingest(report)
        except (KeyError, TypeError, ValueError) as e:  # a shape report_from_json let through
            log.warning("refused a report of %s: %s: %s", node_id, type(e).__name__, e)
            return web.json_response({"error": f"malformed report: {e!r}"}, status=400)
        self.ctl.relays.through(node_id, None)  # it reports directly now
        version, desired = self.ctl.desired.get(node_id, (0, protocol.Idle()))
        if report.desired_version == version:  # the agent has it: no body to send
            return web.json_response(protocol.reply_to_json(protocol.DesiredReply(version=version)))
        reply = protocol.DesiredReply(version=version, desired=desired)
        return web.json_response(protocol.reply_to_json(reply))

    async def _relay(self, request: web.Request) -> web.Response:
        """A relay's uplink (``protocol/relay.py``): its whole reports and alive entries, taken
        as reports are (``Controller.relay_uplink``); answered with its nodes' new desired
        states. 400 for a body that is not an uplink; a report inside it that would get 400 or
        409 alone is named in the answer's ``refused`` and the rest is taken."""
        try:
            body = relay_wire.check_uplink(await request.json(loads=protocol.loads))
        except ValueError as e:
            log.warning("refused a malformed relay uplink from %s: %s", request.remote, e)
            return web.json_response({"error": f"malformed relay uplink: {e}"}, status=400)
        return web.json_response(self.ctl.relay_uplink(body))

    async def _relay_desired(self, request: web.Request) -> web.Response:
        """Long poll of a relay: ``?relay=ID&since=S&wait_s=W`` returns once a desired state of
        one of its nodes changed after ``S`` (the answer's ``seq``), or after W s (max 30)."""
        rid = request.query.get("relay", "")
        try:
            since, wait_s = long_poll_args(request.query, "since")
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)

        def newer() -> bool:
            return self.ctl.closing or bool(self.ctl.relays.newer(rid, since))

        async with self.ctl.changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctl.changed.wait_for(newer), timeout=wait_s)
        return web.json_response(self.ctl.relay_desired(rid, since))

    async def _get_desired(self, request: web.Request) -> web.Response:
        node_id = request.query.get("node", "")
        try:
            version, wait_s = long_poll_args(request.query, "version")
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)

        def newer() -> bool:
            return self.ctl.closing or self.ctl.desired.get(node_id, (0, None))[0] > version

        async with self.ctl.changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctl.changed.wait_for(newer), timeout=wait_s)
        v, desired = self.ctl.desired.get(node_id, (0, protocol.Idle()))
        return web.json_response(
            protocol.reply_to_json(protocol.DesiredReply(version=v, desired=desired))
        )

    async def _status(self, request: web.Request) -> web.Response:
        out = state_json(self.ctl.state)
        out["lists"] = pool_lists(out["pools"])
        now = clock.wall()
        out["nodes"] = {
            n: {
                "addr": o.addr,
                "pool": out["pools"].get(n),
                "node_rank": self.ctl.state.assignment.get(n),
                "last_seen_s": round(now - o.last_seen, 3),
                "generation": o.generation,
                "workers": {
                    r: {"state": w.state, "step": w.step, "pid": w.pid}
                    for r, w in o.workers.items()
                },
                "health": list(o.health_problems) or "ok",
                "preflight": (
                    None
                    if n not in self.ctl.state.checked_at
                    else self.ctl.state.check_problems[n] or "ok"
                ),
                "clock_skew_s": o.clock_skew_s,
            }
            for n, o in sorted(self.ctl.obs.items())
        }
        out["alerts"] = list(self.ctl.monitor.alerts)[-10:]
        pf = self.ctl.preflight
        out["preflight"] = (
            None
            if pf is None
            else pf.active.to_json()
            if pf.active
            else self.ctl.store.get("preflight_last")
        )
        return web.json_response(out)

    async def _page(self, request: web.Request) -> web.Response:
        assert self._dash is not None  # routed only with a dashboard
        return web.Response(text=self._dash.page(), content_type="text/html", charset="utf-8")

    async def _healthz(self, request: web.Request) -> web.Response:
        """Liveness and readiness (Kubernetes probes; no token): 200 while decisions are being
        taken (the last tick less than ``HEALTH_TICK_S`` ago, or the job ended), else 503.
        Answering at all says the event loop runs; the tick's age, that the decision loop
        does."""
        age = self.ctl.tick_age_s()
        ok = age < HEALTH_TICK_S or self.ctl.state.phase.terminal
        body = {"ok": ok, "phase": self.ctl.state.phase.value, "tick_age_s": round(age, 3)}
        return web.json_response(body, status=200 if ok else 503)

    async def _no_icon(self, request: web.Request) -> web.Response:
        return web.Response(status=204)  # browsers ask; nothing to log

    async def _script(self, request: web.Request) -> web.Response:
        assert self._dash is not None
        return web.Response(
            body=self._dash.script(),
            content_type="application/javascript",
            headers={"Cache-Control": "max-age=86400"},
        )

    async def _view_json(self, request: web.Request) -> web.Response:
        """The dashboard's data, built from the store off the event loop."""
        assert self._dash is not None
        view = await asyncio.to_thread(self._dash.view, Path(self.ctl.cfg.run_dir))
        return web.json_response(view, dumps=lambda v: json.dumps(v, default=str))

    async def _metrics(self, request: web.Request) -> web.Response:
        s = self.ctl.state
        pools = {n: p.value for n, p in s.pools.items()}
        body = self.ctl.monitor.metrics(s.phase.value, s.generation, pools)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def _check_start(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        level = body.get("level") or None
        if level not in (None, "quick", "full"):
            return web.json_response({"error": f"level {level!r}: use quick or full"}, status=400)
        if self.ctl.preflight is None:
            self.ctl.preflight = Preflight(
                CheckConfig(),
                self.ctl.store,
                ckpt_dir=self.ctl.cfg.ckpt_dir,
                shm_dir=self.ctl.cfg.checkpoint.shm_dir,
            )
        if self.ctl.preflight.active is not None:
            return web.json_response(
                {"error": "a pre-flight run is in progress", "run": self.ctl.preflight.active.id},
                status=409,
            )
        now = clock.wall()
        busy = sorted(n for n, p in self.ctl.state.pools.items() if p == Pool.RUNNING)
        idle = [n for n in sorted(self.ctl.obs) if self.ctl.alive(n, now) and n not in busy]
        if not idle:
            why = (
                "no agent reports to this controller"
                if not busy
                else "every node is training (nodes are not checked while they train)"
            )
            return web.json_response({"error": f"no idle node to check: {why}"}, status=409)
        run = self.ctl.preflight.start(idle, "requested (trainguard check)", now, level)
        self.ctl.publish()
        return web.json_response({"run": run.id, "nodes": idle, "not_checked": busy})

    async def _check_get(self, request: web.Request) -> web.Response:
        pf = self.ctl.preflight
        try:
            run = pf.runs.get(int(request.query.get("run", "0"))) if pf else None
        except ValueError:
            run = None
        if run is None:
            return web.json_response({"error": "no such pre-flight run"}, status=404)
        pools = {n: p.value for n, p in self.ctl.state.pools.items()}
        return web.json_response({**run.to_json(), "lists": pool_lists(pools)})

    async def _stop(self, request: web.Request) -> web.Response:
        self.ctl.request_stop()
        return web.json_response({"ok": True})
