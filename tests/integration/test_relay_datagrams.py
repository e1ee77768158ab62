"""The alive datagram path of relays (issue 31), with real processes: ``trainguard controller``
and ``trainguard relay``, and the agent's own ``RoutedLink`` in this process sending a node's
reports. A report of a shape the relay holds goes as one signed UDP datagram; the controller
sees the node's counters move; a relay SIGKILLed leaves the datagram unanswered and the
report goes to the controller directly within the relay timeout, nothing lost."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST_CONFIG, GPT, wait_for
from tests.helpers.cluster import Cluster
from trainguard.agent.link import RELAY_TIMEOUT_S, RoutedLink
from trainguard.controller.store import open_readonly


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path / "run", FAST_CONFIG, ["--nodes", "1"], GPT, ["--steps", "5"])
    try:
        yield c
    finally:
        c.close()


def _report(step: int, *, event: bool = False) -> dict[str, Any]:
    """A report of node ``n0`` (idle: no workers), its clock and ``step``-th heartbeat."""
    return {
        "v": 1, "node_id": "n0", "addr": "127.0.0.9", "incarnation": "inc-datagrams",
        "generation": None, "desired_version": 0, "workers": [], "stopped_generation": -1,
        "events": [{"kind": "note", "ts": time.time(), "n": step}] if event else [],
        "steps": [], "memory": {}, "replicas": {}, "time": time.time(),
    }  # fmt: skip


def _status(c: Cluster) -> dict[str, Any]:
    token = (c.run / "token").read_text().strip()
    req = urllib.request.Request(
        f"http://{c.controller_addr()}/v1/status", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return dict(json.loads(r.read()))


def _age(c: Cluster) -> float:
    """Seconds since the controller last heard of n0 (its report or its alive entry)."""
    return float(_status(c)["nodes"]["n0"]["last_seen_s"])


def test_alive_datagrams_through_a_relay_then_directly_once_it_is_killed(cluster: Cluster) -> None:
    """Real fault: SIGKILL of the relay process. Before it: the first report goes whole over
    HTTP, the next ones (same shape) as datagrams, answered and forwarded (the controller's
    last report of n0 stays fresh for longer than the node timeout); a report with an event
    goes whole again; step records go in the datagrams (or over HTTP when they do not fit in
    one) and reach the controller's store in alive entries. After it: the datagram times out, the report goes directly."""
    cluster.start_controller()
    relay = cluster.start_relay("r0", "127.0.0.30")
    token = (cluster.run / "token").read_text().strip()
    link = RoutedLink(cluster.controller_addr(), relay, token)
    try:
        # The relay needs its first uplink answered before it vouches for the controller.
        wait_for(lambda: _try(link, _report(0)), 60, "the relay's first answer")
        link.failures = 0
        for step in range(1, 9):  # 4 s at 0.5 s: longer than FAST_CONFIG's 3 s node timeout
            reply = link.report(_report(step), timeout_s=5.0)
            assert "version" in reply and reply["upstream_age_s"] <= 3.0
            time.sleep(0.5)
        assert link.datagrams >= 7 and link.failures == 0, (link.datagrams, link.failures)
        assert _age(cluster) < 2.0  # the alive entries reached the controller
        sent = link.datagrams
        link.report(_report(9, event=True), timeout_s=5.0)  # an event: whole, over HTTP
        assert link.datagrams == sent and link.failures == 0
        link.report(_report(10), timeout_s=5.0)  # the shape the relay holds: a datagram
        assert link.datagrams == sent + 1

        # Step records (a training node's every report), the shape unchanged: in the alive
        # datagram while it fits in one Ethernet frame, else over HTTP to the relay; either
        # way to the controller in the node's alive entry, stored as a whole report's are.
        def with_steps(first: int, n: int) -> dict[str, Any]:
            body = _report(11)
            body["steps"] = [{"generation": 0, "rank": 0, "items": [
                {"step": st, "t_end": time.time(), "dur": 0.25, "loss": 1.0 / st}
                for st in range(first, first + n)]}]  # fmt: skip
            return body

        for step in range(41, 49):  # 4 s: the entries with steps keep the node alive too
            link.report(with_steps(step, 1), timeout_s=5.0)
            time.sleep(0.5)
        assert link.datagrams == sent + 9 and link.failures == 0
        assert _age(cluster) < 2.0
        link.report(with_steps(49, 40), timeout_s=5.0)  # 40 records: over 1472 bytes, HTTP
        assert link.datagrams == sent + 9 and link.failures == 0
        wait_for(lambda: _stored_steps(cluster) == list(range(41, 89)), 30, "the steps stored")
        link.report(_report(11), timeout_s=5.0)  # a datagram again
        assert link.datagrams == sent + 10
        cluster.relays["r0"].send_signal(signal.SIGKILL)
        cluster.relays["r0"].wait(timeout=30)
        t0 = time.monotonic()
        reply = link.report(_report(12), timeout_s=5.0)  # datagram unanswered → directly
        took = time.monotonic() - t0
        assert link.failures == 1 and "version" in reply
        assert took < RELAY_TIMEOUT_S + 2.0, took
        assert _age(cluster) < 2.0
    finally:
        link.close()


def _stored_steps(c: Cluster) -> list[int]:
    """Steps of generation 0, rank 0 in the controller's store."""
    db = open_readonly(c.run)
    try:
        rows = db.execute("SELECT step FROM steps WHERE generation = 0 AND rank = 0 ORDER BY step")
        return [int(r[0]) for r in rows]
    finally:
        db.close()


def _try(link: RoutedLink, body: dict[str, Any]) -> bool:
    """One report; True once it went to the relay (its answer vouched for the controller)."""
    before = link.failures
    link.report(body, timeout_s=5.0)
    ok = link.failures == before
    link._bad_until = 0.0  # try the relay again at once (the test's wait, not the agent's)
    return ok
