"""The agent's link to its controller: HTTP/1.1 with a kept-alive connection per thread (the
report thread and the long-poll thread each hold one), and jittered back-off.

One connection per heartbeat would cost the controller a TCP handshake per report; a
thousand agents retrying in lockstep after a controller restart would arrive as one burst.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import socket
import threading
import time
from typing import Any, Protocol

from trainguard.protocol.relay import alive_entry, shape_key
from trainguard.runtime import wire

log = logging.getLogger("trainguard.agent")


class HTTPStatusError(OSError):
    """The controller answered with an error status. ``code``: the HTTP status; ``text``:
    the reason the controller gave (its ``{"error": ...}``) or the body."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"HTTP {code}: {text}")
        self.code, self.text = code, text


def jittered(seconds: float) -> float:
    """``seconds`` spread uniformly over ±50% (so retries of many agents do not align)."""
    return seconds * random.uniform(0.5, 1.5)


def backoff_after(seconds: float, cap_s: float = 2.0) -> float:
    """The next retry delay after a failed one of ``seconds``: doubled, jittered, at most
    ``cap_s`` (0.1 s → ~0.2 → ~0.4 … ~2 s: a restarted controller sees agents return over
    about a second, not in one burst)."""
    return min(cap_s, jittered(seconds * 2))


class Link(Protocol):
    """Requests to the controller (``ControllerLink``; a test's fake). ``request`` returns
    the reply's JSON object, or raises OSError (unreachable, timed out), HTTPStatusError (an
    error status) or ValueError (a reply that is not JSON) within ``timeout_s``."""

    def request(
        self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float
    ) -> dict[str, Any]: ...

    def close(self) -> None: ...


class ControllerLink:
    """Requests to the controller at ``HOST:PORT`` with the job token. Thread-safe: each
    thread uses its own kept-alive connection. ``request`` raises OSError (unreachable,
    timed out, connection dropped), HTTPStatusError (an error status) or ValueError (a
    reply that is not JSON)."""

    def __init__(self, controller: str, token: str) -> None:
        host, _, port = controller.rpartition(":")
        self.host, self.port = host or controller, int(port or 80)
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._local = threading.local()

    def request(
        self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        for attempt in (0, 1):
            conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
                self._local.conn = conn
            conn.timeout = timeout_s
            if conn.sock is not None:
                conn.sock.settimeout(timeout_s)
            try:
                conn.request(method, path, body=data, headers=self._headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._local.conn = None
                # A kept-alive connection the server closed meanwhile: one fresh attempt.
                if reused and attempt == 0 and not isinstance(e, TimeoutError):
                    continue
                raise OSError(f"{type(e).__name__}: {e}") from e
            if resp.status >= 400:
                try:
                    text = str(json.loads(raw).get("error", raw[:300]))
                except (ValueError, AttributeError):
                    text = raw[:300].decode(errors="replace")
                raise HTTPStatusError(resp.status, text)
            return dict(json.loads(raw))
        raise AssertionError("unreachable")

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


RELAY_TIMEOUT_S = 2.0  # a report to the relay: past this, the controller directly
RELAY_RETRY_S = 10.0  # after a relay failed, reports go directly this long, then to it again
# An alive datagram's largest size: one Ethernet frame's payload less IP and UDP headers
# (1500 - 20 - 8), so no datagram is fragmented (a lost fragment loses it whole). A node's
# heartbeat of step records (8 ranks, a step or two each) fits; more goes over HTTP.
MAX_DATAGRAM_BYTES = 1472


class RoutedLink:
    """Reports and long polls through the rack's relay (``trainguard relay``, issue 31) while
    it answers within ``RELAY_TIMEOUT_S`` (a first timeout is retried by the caller, a second
    in a row or a refused connection fails it); otherwise directly to the controller, for
    ``RELAY_RETRY_S``, then the relay is tried again. Other requests go directly. The relay's
    answers carry ``upstream_age_s``, which the agent subtracts from its controller contact
    time (fencing): a relay that answers but cannot reach the controller is not left for
    it. When the controller is only slow (a generation start at 16,384 nodes sends every
    node's report whole at once), sending every node of every rack to it directly would bury
    it; a relay cut off from the controller takes its rack with it after the node timeout, as
    the rack's switch would. Raises what ``ControllerLink.request`` raises."""

    ROUTED = ("/v1/report", "/v1/desired")

    def __init__(self, controller: str, relay: str, token: str) -> None:
        self.direct = ControllerLink(controller, token)
        self.relay = ControllerLink(relay, token)
        self.relay_addr = relay
        self._bad_until = 0.0
        self.failures = 0  # relay attempts that fell back to the controller
        self._key = bytes.fromhex(token)
        self._via = threading.local()  # whether this thread's last request went to the relay
        # The report thread's: the shape the relay holds for this node (None: send it whole),
        # the UDP socket of the alive datagrams, their sequence number.
        self._acked: str | None = None
        self._udp: socket.socket | None = None
        self._seq = 0
        self.datagrams = 0  # reports sent as alive datagrams
        self._timeouts = 0  # relay attempts in a row that timed out
        # One relay attempt's deadline: the agent sets a fifth of the job's node timeout when
        # that is shorter, so two timeouts and a direct report fit well within it.
        self.relay_timeout_s = RELAY_TIMEOUT_S

    def report(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One report (``POST /v1/report``'s body), the cheapest way that carries it: an
        alive datagram to the relay when only its volatile fields changed since the relay
        took it whole (``protocol/relay.py``), with its step records if they fit in
        MAX_DATAGRAM_BYTES, else the whole report over HTTP (the relay, or the controller).
        The answer as ``request``'s; raises as it does. (A datagram that arrived but whose
        ack was lost is sent again over HTTP: its step records may reach the controller
        twice, stored once.)"""
        data = None
        if (self._use_relay("/v1/report") and self._acked is not None
                and not body.get("events") and shape_key(body) == self._acked):  # fmt: skip
            self._seq += 1
            entry = alive_entry(body, 0.0, body.get("steps") or None)
            data = wire.encode(self._key, {"alive": entry, "seq": self._seq})
            if len(data) > MAX_DATAGRAM_BYTES:  # many step records: whole, over HTTP
                data = None
        if data is not None:
            try:
                ack = self._alive(data)
                self._timeouts = 0
                if ack.get("known"):
                    self.datagrams += 1
                    return {"version": ack["version"], "upstream_age_s": ack["upstream_age_s"]}
                self._acked = None  # the relay lacks this node's shape (it restarted)
            except (OSError, ValueError, KeyError) as e:
                self._slow_or_failed(e)
        reply = self.request("POST", "/v1/report", body, timeout_s)
        self._acked = shape_key(body) if getattr(self._via, "relay", False) else None
        return reply

    def _alive(self, data: bytes) -> dict[str, Any]:
        """Send ``data`` (a signed alive datagram, sequence number ``self._seq``); its ack
        within ``relay_timeout_s`` (TimeoutError past it)."""
        if self._udp is None:
            host, _, port = self.relay_addr.rpartition(":")
            self._udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._udp.connect((host, int(port)))
        self._udp.send(data)
        deadline = time.monotonic() + self.relay_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"relay {self.relay_addr} did not answer an alive datagram")
            self._udp.settimeout(left)
            try:
                ack = wire.decode(self._key, self._udp.recv(65536))
            except ValueError:  # not signed with the job token: not our relay's answer
                continue
            if ack.get("seq") == self._seq:
                break
        if not isinstance(ack.get("upstream_age_s"), int | float):
            raise ValueError(f"relay {self.relay_addr}: an ack without upstream_age_s")
        return ack

    def _use_relay(self, path: str) -> bool:
        return path.startswith(self.ROUTED) and time.monotonic() >= self._bad_until

    def request(
        self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float
    ) -> dict[str, Any]:
        if self._use_relay(path):
            poll = path.startswith("/v1/desired")
            try:
                reply = self.relay.request(
                    method, path, body, timeout_s if poll else min(timeout_s, self.relay_timeout_s)
                )
                self._via.relay, self._timeouts = True, 0
                return reply
            except HTTPStatusError as e:
                if e.code == 400:  # the report itself is refused: the controller would too
                    raise
                self._failed(e)
            except (OSError, ValueError) as e:
                self._slow_or_failed(e)
        self._via.relay = False
        return self.direct.request(method, path, body, timeout_s)

    def _slow_or_failed(self, e: BaseException) -> None:
        """A relay attempt that failed with ``e``. A first timeout is raised to the caller
        (who retries after its back-off): a relay busy for a moment (a burst of its rack's
        reports) must not send its whole rack to the controller at once. A second one in a
        row, or any other failure (refused, reset: the relay is gone), is a failed relay."""
        timed_out = isinstance(e, TimeoutError) or isinstance(e.__cause__, TimeoutError)
        if timed_out and self._timeouts < 1:
            self._timeouts += 1
            raise e
        self._failed(e)

    def _failed(self, e: BaseException) -> None:
        self.failures += 1
        self._bad_until = time.monotonic() + RELAY_RETRY_S
        self.relay.close()
        log.warning("relay %s failed (%s): reporting directly to the controller for %gs",
                    self.relay_addr, e, RELAY_RETRY_S)  # fmt: skip

    def close(self) -> None:
        self.direct.close()
        self.relay.close()
        if self._udp is not None:
            self._udp.close()
