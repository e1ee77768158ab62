"""``trainguard relay``: one per rack (a group of nodes); its agents report to it instead of
to the controller, and the controller sees hundreds of reporters, not thousands (issue 31).

To an agent the relay is the controller's report endpoint: ``POST /v1/report`` (answered with
the node's desired state from the relay's cache) and ``GET /v1/desired`` (long poll), the job
token required. To the controller it is one reporter (``protocol/relay.py``):

- a report whose shape changed (a worker exited, an event, step records, a new generation, a
  new memory index…) is forwarded whole, within ``URGENT_S`` of its arrival: faults reach
  the controller as fast as they would directly;
- the others become one alive entry per node in the next uplink, every ``flush_s``: the
  controller's per-node deadlines see each node as often as its heartbeat;
- desired states come back in each uplink's answer and by a long poll of
  ``/v1/relay/desired``, which returns as soon as a desired state of one of its nodes changes.

Each answer to an agent carries ``upstream_age_s``: seconds since the relay's last exchange
with the controller. An agent treats the relay as its controller contact only while that is
fresh; otherwise, and when the relay does not answer, it reports directly to the controller
(``agent/link.py`` ``RoutedLink``). A relay holds nothing that is not in its agents' next
reports: killing it loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import time
from typing import Any

import aiohttp
from aiohttp import web

from trainguard import protocol
from trainguard.protocol.common import finite
from trainguard.protocol.desired import long_poll_args
from trainguard.protocol.relay import (
    NODE_VOLATILE,
    RELAY_PROTOCOL_VERSION,
    WORKER_VOLATILE,
    AliveEntry,
    alive_entry,
    check_alive,
    shape_key,
)
from trainguard.protocol.report import _WORKER_FIELDS, _fits
from trainguard.runtime import wire
from trainguard.runtime.wire import receive_buffer

log = logging.getLogger("trainguard.relay")
URGENT_S = 0.01  # a whole report waits this long for others to share its uplink
UPLINK_TIMEOUT_S = 10.0  # one uplink's deadline
UPLINK_REPORTS = 256  # whole reports in one uplink at most (more: the next one, at once)
# Step batches held per node while the controller does not answer (a training rank sends one a
# heartbeat: minutes of records of a node of 8); older ones are dropped past this.
STEP_BATCHES_KEPT = 1024


def _check_volatile(body: dict[str, Any]) -> None:
    """Raises ProtocolError naming the field unless ``body``'s fields that its shape key
    leaves out (``protocol.relay`` NODE_VOLATILE, WORKER_VOLATILE, and workers that are not
    objects) are what ``protocol.report_from_json`` takes: a report of a known shape is not
    checked whole, and its alive entry must be one the controller applies."""
    for k in NODE_VOLATILE:
        v = body.get(k)
        if v is not None and not finite(v):
            raise protocol.ProtocolError(f"{k}: seconds since the epoch")
    workers = body.get("workers")
    if workers is None:
        return
    if not isinstance(workers, list) or not all(isinstance(w, dict) for w in workers):
        raise protocol.ProtocolError("workers: a list of objects")
    for w in workers:
        for k in WORKER_VOLATILE:
            if k in w and not _fits(w[k], _WORKER_FIELDS[k]):
                kind = _WORKER_FIELDS[k].replace(" | None", " or null")
                raise protocol.ProtocolError(f"workers[].{k}: {kind}")


def _checked_steps(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A report's step batches, each checked as the controller will (ProtocolError naming the
    field otherwise): they reach it in an alive entry, not in a report it checks whole."""
    steps = body.get("steps") or []
    if not isinstance(steps, list) or len(steps) > protocol.MAX_ITEMS:
        raise protocol.ProtocolError("steps: a list of step batches")
    for b in steps:
        if not isinstance(b, dict):
            raise protocol.ProtocolError("steps[]: a step batch object")
        protocol.StepBatch.from_json(b)
    return steps


class _Node:
    """One node as the relay holds it: its latest report, when it came (monotonic), the shape
    of the last report forwarded whole, whether its latest went in an uplink yet."""

    __slots__ = ("report", "t", "key", "sent", "alive", "steps")

    def __init__(self) -> None:
        self.report: dict[str, Any] = {}
        self.t = 0.0
        self.key: str | None = None
        self.sent = True
        self.alive: AliveEntry | None = None  # its latest alive datagram's entry, if newer
        # step batches of reports not forwarded whole, for its next alive entry (oldest first)
        self.steps: list[dict[str, Any]] = []

    def gather(self, steps: list[dict[str, Any]], *, older: bool = False) -> None:
        """Keep ``steps`` for the next alive entry (``older``: batches of an uplink that
        failed, put back before the newer ones); past STEP_BATCHES_KEPT the oldest go."""
        self.steps = [*steps, *self.steps] if older else [*self.steps, *steps]
        if len(self.steps) > STEP_BATCHES_KEPT:
            dropped = len(self.steps) - STEP_BATCHES_KEPT
            del self.steps[:dropped]
            log.warning("dropped %d step batch(es) of a node the controller did not take", dropped)


class Relay:
    """A relay for job ``token`` in front of the controller at ``controller`` (host:port).
    ``relay_id``: its name in the controller's events; ``addr``: host:port agents reach it at
    (what it tells the controller); ``flush_s``: the alive entries' period (seconds)."""

    def __init__(
        self, *, controller: str, token: str, relay_id: str, addr: str, flush_s: float = 0.25
    ) -> None:
        self.controller, self.relay_id, self.addr, self.flush_s = (
            controller,
            relay_id,
            addr,
            flush_s,
        )
        self._auth = f"Bearer {token}".encode()
        self._key = bytes.fromhex(token)  # signs the alive datagrams (runtime/wire.py)
        self._headers = {"Authorization": f"Bearer {token}"}
        self.nodes: dict[str, _Node] = {}
        self.desired: dict[str, tuple[int, dict[str, Any]]] = {}  # node → (version, JSON)
        self.since = 0  # the controller's desired-state sequence number last applied
        # Monotonic time of the last answered uplink; its start until the first: a relay
        # just started is not cut off yet (its agents stay), one never answered soon is.
        self.upstream_ok = time.monotonic()
        # node → its whole report to forward: one per node, the newest, carrying the events
        # and step records of any older one not yet delivered (bounded by the nodes)
        self._pending: dict[str, dict[str, Any]] = {}
        self._urgent = asyncio.Event()
        self.changed = asyncio.Condition()
        self._session: aiohttp.ClientSession | None = None
        self.uplinks = 0

    # ------------------------------------------------------------------ agents' side
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._check], client_max_size=protocol.MAX_REPORT_BYTES)
        app.add_routes([web.post("/v1/report", self._report), web.get("/v1/desired", self._poll)])
        return app

    @web.middleware
    async def _check(self, request: web.Request, handler: Any) -> web.StreamResponse:
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, self._auth):
            return web.json_response({"error": "missing or wrong job token"}, status=401)
        return await handler(request)

    def upstream_age(self) -> float | None:
        return None if not self.upstream_ok else round(time.monotonic() - self.upstream_ok, 3)

    def take(self, body: Any) -> dict[str, Any]:
        """One agent report (decoded JSON): kept, queued whole if its shape changed, answered
        with the node's desired state. Raises ProtocolError (400) for a report the controller
        would refuse."""
        if not isinstance(body, dict) or not isinstance(body.get("node_id"), str):
            raise protocol.ProtocolError("a report is a JSON object with a node_id")
        node = self.nodes.get(body["node_id"])
        if node is None:
            node = self.nodes[body["node_id"]] = _Node()
        key = shape_key(body)
        whole = key != node.key or bool(body.get("events"))
        if whole:
            protocol.report_from_json(body)  # what the controller checks: refused here already
            node.key = key
            if node.steps:  # gathered for an alive entry: they go first, with this report
                body = {**body, "steps": [*node.steps, *(body.get("steps") or [])]}
                node.steps = []
            self._queue(body)
            self._urgent.set()
        else:  # the shape of a report checked whole already: its alive entry's fields left
            _check_volatile(body)
            steps = _checked_steps(body)
            if steps:
                node.gather(steps)
        node.report, node.t, node.sent, node.alive = body, time.monotonic(), whole, None
        version, desired = self.desired.get(body["node_id"], (0, None))
        out: dict[str, Any] = {"version": version, "upstream_age_s": self.upstream_age()}
        if desired is not None and body.get("desired_version") != version:
            out["desired"] = desired
        return out

    def _queue(self, report: dict[str, Any], *, older: bool = False) -> None:
        """Queue ``report`` to be forwarded whole. One per node: the newest report wins and
        carries the events and step records of the one it replaces (``older``: ``report`` is
        an undelivered one put back, older than any queued for its node)."""
        node = report["node_id"]
        other = self._pending.pop(node, None)
        if other is not None:
            old, new = (report, other) if older else (other, report)
            report = {**new, "events": [*(old.get("events") or []), *(new.get("events") or [])],
                      "steps": [*(old.get("steps") or []), *(new.get("steps") or [])]}  # fmt: skip
        self._pending[node] = report

    def alive_datagram(self, data: bytes) -> bytes | None:
        """One alive datagram (``protocol/relay.py``: ``{"alive": entry, "seq": n}``, signed
        with the job token): taken as an HTTP report of an unchanged shape is, if the relay
        holds the node's shape and has fresh controller contact. Returns the signed ack
        (``{"node", "seq", "known", "version", "upstream_age_s"}``; ``known`` false: send the
        next report whole), or None for a datagram that is not one (dropped unanswered)."""
        try:
            msg = wire.decode(self._key, data)
            entry = check_alive(msg.get("alive"))
            steps = _checked_steps({"steps": entry[5]}) if len(entry) > 5 else []
        except ValueError:  # unauthenticated, not JSON, not an alive entry
            return None
        node = self.nodes.get(entry[0])
        age = self.upstream_age()
        known = (
            node is not None and node.key is not None and node.report.get("incarnation") == entry[1]
        )
        if known and node is not None:
            node.alive, node.t, node.sent = entry[:5], time.monotonic(), False
            if steps:
                node.gather(steps)
        version = self.desired.get(entry[0], (0, None))[0]
        ack = {"node": entry[0], "seq": msg.get("seq"), "known": known, "version": version,
               "upstream_age_s": age}  # fmt: skip
        return wire.encode(self._key, ack)

    async def _report(self, request: web.Request) -> web.Response:
        try:
            # The wire's strict loads, as the controller's: a report it would refuse is refused
            # here, never forwarded into an uplink the controller refuses whole.
            return web.json_response(self.take(await request.json(loads=protocol.loads)))
        except ValueError as e:
            return web.json_response({"error": f"malformed report: {e}"}, status=400)

    async def _poll(self, request: web.Request) -> web.Response:
        node = request.query.get("node", "")
        try:
            version, wait_s = long_poll_args(request.query, "version")
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)

        def newer() -> bool:
            return self.desired.get(node, (0, None))[0] > version

        async with self.changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait_for(newer), timeout=wait_s)
        v, desired = self.desired.get(node, (0, None))
        out = {"version": v, "upstream_age_s": self.upstream_age()}
        return web.json_response({**out, **({"desired": desired} if desired else {})})

    # ------------------------------------------------------------------ controller's side
    def uplink_body(self) -> dict[str, Any]:
        """The next uplink: the queued whole reports, an alive entry for each node whose
        latest report arrived since the last uplink and was not forwarded whole."""
        now = time.monotonic()
        reports = [self._pending.pop(node) for node in list(self._pending)[:UPLINK_REPORTS]]
        alive = []
        for nid, n in self.nodes.items():
            # A node whose whole report waits for a later uplink (more than UPLINK_REPORTS
            # queued: a stop acked by the whole rack) sends no alive entry before it: the
            # controller would take the entry's newer time, then drop the whole report as a
            # late copy, and never see what changed (its stop acked). Its step records wait.
            if not n.sent and nid not in self._pending:
                if n.alive is not None:  # from a datagram: its own numbers, its age now
                    entry = [*n.alive[:2], round(now - n.t, 3), *n.alive[3:5]]
                    alive.append([*entry, n.steps] if n.steps else entry)
                else:
                    alive.append(alive_entry(n.report, now - n.t, n.steps))
                n.sent, n.steps = True, []
        if self._pending:
            self._urgent.set()  # the rest in the next uplink, at once
        return {"v": RELAY_PROTOCOL_VERSION, "relay": self.relay_id, "addr": self.addr,
                "since": self.since, "reports": reports, "alive": alive}  # fmt: skip

    async def apply(self, answer: dict[str, Any]) -> None:
        """The controller's answer: new desired states (agents' long polls woken), and the
        nodes it wants whole (their latest report is queued again)."""
        self.upstream_ok = time.monotonic()
        changed = False
        for node, d in (answer.get("desired") or {}).items():
            version = int(d["version"])
            if version > self.desired.get(node, (0, None))[0]:
                self.desired[node] = (version, d["desired"])
                changed = True
        self.since = max(self.since, int(answer.get("seq", 0)))
        if isinstance(answer.get("flush_s"), int | float) and answer["flush_s"] > 0:
            self.flush_s = float(answer["flush_s"])  # the controller's, for its uplink rate
        for node in answer.get("resend") or []:
            n = self.nodes.get(node)
            if n is not None and n.report:
                n.key = None  # its next report goes whole, and its latest now
                self._queue(n.report)
                n.sent = True
        if changed:
            async with self.changed:
                self.changed.notify_all()

    async def _post(self, body: dict[str, Any]) -> None:
        assert self._session is not None
        url = f"http://{self.controller}/v1/relay"
        data = json.dumps(body).encode()
        timeout = aiohttp.ClientTimeout(total=UPLINK_TIMEOUT_S)
        async with self._session.post(url, data=data, timeout=timeout) as r:
            answer = await r.json(loads=protocol.loads)
            if r.status >= 400:
                raise OSError(f"controller answered {r.status}: {answer.get('error')}")
        await self.apply(answer)

    async def uplink_loop(self) -> None:
        """Every ``flush_s`` (at once after a whole report): one uplink. A failed one keeps
        its whole reports for the next (alive entries are made afresh each time)."""
        backoff = 0.1
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), self.flush_s)
            if self._urgent.is_set():
                await asyncio.sleep(URGENT_S)
                self._urgent.clear()
            body = self.uplink_body()
            try:
                await self._post(body)
                self.uplinks += 1
                backoff = 0.1
            except (TimeoutError, OSError, aiohttp.ClientError, ValueError) as e:
                for r in body["reports"]:  # kept for the next uplink (a newer one merged in)
                    self._queue(r, older=True)
                for entry in body["alive"]:  # their step records too (the numbers are redone)
                    n = self.nodes.get(entry[0])
                    if len(entry) > 5 and n is not None:
                        n.gather(entry[5], older=True)
                        n.sent = False
                log.warning("uplink to %s failed (%s); retrying", self.controller, e)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)

    async def desired_loop(self) -> None:
        """Long-polls the controller for its nodes' desired states (returns at once on one)."""
        assert self._session is not None
        while True:
            url = (f"http://{self.controller}/v1/relay/desired?relay={self.relay_id}"
                   f"&since={self.since}&wait_s=10")  # fmt: skip
            try:
                async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=15)) as r:
                    answer = await r.json(loads=protocol.loads)
                    if r.status < 400:
                        await self.apply(answer)
                        continue
            except (TimeoutError, OSError, aiohttp.ClientError, ValueError):
                pass
            await asyncio.sleep(0.5)

    async def serve(self, host: str, port: int, stop: asyncio.Event) -> None:
        """Serve agents on ``host:port`` (0: any free port; ``self.addr`` is then the one
        bound, printed as ``relay listening on HOST:PORT``) and talk to the controller until
        ``stop`` is set."""
        self._session = aiohttp.ClientSession(headers=self._headers)
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, backlog=4096).start()
        bound = runner.addresses[0]
        self.addr = f"{bound[0]}:{bound[1]}"
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((bound[0], bound[1]))  # alive datagrams on the same port number, UDP
        receive_buffer(sock)
        udp, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Datagrams(self), sock=sock
        )
        print(f"relay listening on {self.addr}", flush=True)
        tasks = [asyncio.create_task(self.uplink_loop()), asyncio.create_task(self.desired_loop())]
        log.info("relay %s serving %s for controller %s", self.relay_id, self.addr, self.controller)
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._session.close()
            await runner.cleanup()
            udp.close()


class _Datagrams(asyncio.DatagramProtocol):
    """The relay's UDP socket: each alive datagram answered with its ack."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        ack = self.relay.alive_datagram(data)
        if ack is not None and self.transport is not None:
            self.transport.sendto(ack, addr)


def main(*, controller: str, token: str, relay_id: str, bind: str, flush_s: float) -> int:
    """``trainguard relay``: serve until SIGTERM/SIGINT. ``bind``: host:port (port 0: any).
    Raises ValueError for a ``bind`` that is not host:port."""
    host, _, port_s = bind.rpartition(":")
    if not host or not port_s.isdigit():
        raise ValueError(f"--bind {bind}: give HOST:PORT (port 0: any free one)")
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s relay[{relay_id}] %(levelname)s %(message)s")  # fmt: skip

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        relay = Relay(controller=controller, token=token, relay_id=relay_id, addr=bind,
                      flush_s=flush_s)  # fmt: skip
        await relay.serve(host, int(port_s), stop)

    asyncio.run(run())
    return 0
