"""Relays (issue 31) under real faults: ``trainguard controller`` on 127.0.0.1, two
``trainguard relay`` processes (A on 127.0.0.20, B on 127.0.0.21), three ``trainguard agent``
processes on 127.0.0.2-4 reporting through them (node0 and node1 through A, node2 through B),
the paced GPT example. Real signals: SIGKILL and SIGSTOP/SIGCONT of a relay, a worker's
SIGKILL by a drill. Each job ends with the fault-free run's loss for every step, the right
faults (none for a relay's own) and nothing left behind.

Before any fault each test checks that the relays really carry the reports: the controller
saw both relays' uplinks (``relay_joined``), took no agent report directly (its
``trainguard_report_handling_seconds`` count is 0 while its relay-uplink count grows), and
each agent holds a TCP connection to its relay."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import (
    FAST_CONFIG,
    GPT,
    TINY,
    events,
    fault_free_losses,
    losses,
    reached_step,
    report,
    wait_for,
)
from tests.helpers.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# The paced job of tests/conftest.py (PACE, PACED_ARGS), longer and slower, so that it outlasts
# a relay's freeze and its agent's RELAY_RETRY_S (10 s, up to 25 s after a long poll's 15 s
# deadline ran out on the frozen relay) back on the relay. The pace does not change the losses.
PACE = ["--inject", "slow:rank=0:factor=8"]
STEPS = 400
ARGS = [*TINY, "--steps", str(STEPS), "--ckpt-every", "5", "--durable-every", "10"]
START_S = 240  # a controller, relays, agents and their workers start (a torch import each)
NODE_TIMEOUT_S = 3.0  # FAST_CONFIG's
assert f"node_timeout_s = {NODE_TIMEOUT_S}" in FAST_CONFIG
RELAY_LOST_S = 2.0  # the controller says a relay lost after max(2 s, 2 heartbeats) of silence
RELAY_TIMEOUT_S = 2.0  # agent/link.py: a report the relay does not answer in this goes direct
FREEZE_S = 8.0  # a relay frozen well past the node timeout
CONFIG = FAST_CONFIG + "rendezvous_timeout_s = 300.0\nrelays = 2\n"
RELAYS = {"A": "127.0.0.20", "B": "127.0.0.21"}
ROUTE = {0: "A", 1: "A", 2: "B"}  # node index → its relay
DIRECT = "trainguard_report_handling_seconds_count"  # agent reports the controller took itself
UPLINKS = "trainguard_relay_uplink_seconds_count"  # relay uplinks it took
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"  # logging's asctime (local time)
FELL_BACK = re.compile(r"relay (\S+) failed \(.*\): reporting directly to the controller")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The fault-free run's losses (three nodes, same model, data and seed; no relay)."""
    return fault_free_losses(tmp_path_factory, ["--nodes", "3"], ARGS)


@contextlib.contextmanager
def _cluster(tmp_path: Path, ctl_args: list[str]) -> Iterator[Cluster]:
    """The job, started: the controller, both relays (once the controller took an uplink of
    each: their agents find them in contact from the first report), then the agents, each
    reporting through its relay. Every process is killed and reaped on the way out."""
    job = Cluster(tmp_path / "run", CONFIG, ["--nodes", "3", *ctl_args], GPT, ARGS)
    try:
        job.start_controller()
        for rid, host in RELAYS.items():
            job.start_relay(rid, host)
        wait_for(lambda: _joined(job.run) >= set(RELAYS), 60, "both relays' first uplinks")
        for i, rid in ROUTE.items():
            job.start_agent(i, relay=job.relay_addrs[rid])
        yield job
    finally:
        job.close()


def _kinds(run: Path, *kinds: str) -> list[dict[str, Any]]:
    return [e for e in events(run) if e["kind"] in kinds]


def _joined(run: Path) -> set[str]:
    return {e["relay"] for e in _kinds(run, "relay_joined")}


def _relay_events(run: Path, kind: str, rid: str) -> list[dict[str, Any]]:
    return [e for e in _kinds(run, kind) if e["relay"] == rid]


def _step(run: Path) -> int:
    """The newest step in metrics.jsonl (0 before the first)."""
    path = run / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return max((int(json.loads(x)["step"]) for x in text.splitlines() if x.strip()), default=0)


def _faults(run: Path) -> list[tuple[Any, Any]]:
    """(cause, node) of every fault, as finally attributed."""
    return [(f["cause"], f["node_id"]) for f in report(run)["faults"]]


def _fell_back(job: Cluster, i: int, before: float | None = None) -> list[str]:
    """node<i>'s agent's warnings that its relay failed and it reports directly (those
    logged before wall clock ``before`` if given)."""
    path = job.agent_log(i)
    text = path.read_text(errors="replace") if path.exists() else ""
    return [
        line
        for line in text.splitlines()
        if FELL_BACK.search(line)
        and (before is None or datetime.strptime(line[:23], LOG_TIME).timestamp() < before)
    ]


def _ended(run: Path) -> float:
    """When the job ended (its ``job_ended`` event). The controller exits then: its relays
    lose their contact and every agent falls back, as it should, until it is told to stop."""
    (end,) = _kinds(run, "job_ended")
    return float(end["ts"])


def _metric(job: Cluster, name: str) -> float:
    """The value of an unlabelled series of the controller's ``/metrics`` (job token)."""
    token = (job.run / "token").read_text().strip()
    req = urllib.request.Request(
        f"http://{job.controller_addr()}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _connected_to(pid: int, addr: str) -> bool:
    """Process ``pid`` holds an established TCP connection to ``addr`` (host:port)."""
    host, _, port = addr.rpartition(":")
    with contextlib.suppress(psutil.Error):
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            if (
                c.status == psutil.CONN_ESTABLISHED
                and c.raddr
                and (c.raddr.ip.removeprefix("::ffff:"), c.raddr.port) == (host, int(port))
            ):
                return True
    return False


def _through_relays(job: Cluster) -> tuple[float, float]:
    """Asserts the relays carry every agent's reports: both joined at the addresses they
    listen on, no agent fell back, each agent is connected to its relay, the controller took
    no report directly and takes uplinks. Returns (uplinks, direct reports) so far."""
    joined = {e["relay"]: e["addr"] for e in _kinds(job.run, "relay_joined")}
    assert joined == job.relay_addrs, (joined, job.relay_addrs)
    for i, rid in ROUTE.items():
        assert not _fell_back(job, i), _fell_back(job, i)
        addr = job.relay_addrs[rid]
        wait_for(lambda i=i, a=addr: _connected_to(job.agents[i].pid, a), 30, f"node{i} on {rid}")
    first = _metric(job, UPLINKS)
    wait_for(lambda: _metric(job, UPLINKS) > first, 30, "more relay uplinks")
    direct = _metric(job, DIRECT)
    assert direct == 0, f"{direct} reports reached the controller directly"
    assert not any(_fell_back(job, i) for i in ROUTE)  # none fell back meanwhile either
    return _metric(job, UPLINKS), direct


def _once(run: Path) -> None:
    """Asserts no event was recorded twice: an agent's event carries the agent's time, so
    two equal lines are one event delivered twice (through a relay and directly, or by a
    relay twice)."""
    lines = [x for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    twice = [x for x, n in collections.Counter(lines).items() if n > 1]
    assert not twice, twice[:5]


def _no_false_fault(job: Cluster, reference: dict[int, float]) -> None:
    """The job trained to the end with the fault-free losses and found no fault at all; no
    event was recorded twice."""
    assert losses(job.run) == reference
    _once(job.run)
    assert not _kinds(job.run, "fault"), _kinds(job.run, "fault")
    assert _faults(job.run) == []
    assert not report(job.run)["recoveries"]


def test_a_relay_killed_mid_run_its_nodes_report_directly_and_no_node_is_lost(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """Relay A (node0's and node1's) SIGKILLed mid-training. Its agents' next report or long
    poll fails at once (connection refused) and they report directly to the controller: both
    log it; the controller says ``relay_lost`` for A (and only A) after ~2 s of silence and
    never judges node0 or node1 lost (no ``fault`` event), node2 stays behind relay B, the
    job succeeds with the fault-free loss for every step."""
    with _cluster(tmp_path, PACE) as job:
        wait_for(lambda: reached_step(job.run, 25), START_S, "step 25")
        uplinks, _ = _through_relays(job)
        relay = job.relays["A"]
        os.kill(relay.pid, signal.SIGKILL)
        t0 = time.monotonic()
        relay.wait(timeout=30)
        wait_for(lambda: _fell_back(job, 0) and _fell_back(job, 1), 30, "node0, node1 direct")
        direct_s = time.monotonic() - t0
        wait_for(lambda: _relay_events(job.run, "relay_lost", "A"), 30, "relay A lost")
        lost_s = time.monotonic() - t0
        wait_for(lambda: _metric(job, DIRECT) > 0, 10, "direct reports")
        at = _step(job.run)
        job.wait()
    _no_false_fault(job, reference)
    (lost,) = _relay_events(job.run, "relay_lost", "A")
    assert lost["addr"] == job.relay_addrs["A"] and lost["silent_s"] > RELAY_LOST_S, lost
    assert not _relay_events(job.run, "relay_lost", "B")  # B kept its uplinks going
    assert not _fell_back(job, 2, before=_ended(job.run)), _fell_back(job, 2)
    print(f"{uplinks:.0f} uplinks before the kill at ~step {at}; node0/node1 direct "
          f"{direct_s:.1f}s and relay_lost {lost_s:.1f}s after it "
          f"(silent {lost['silent_s']}s); no fault")  # fmt: skip


def test_a_relay_frozen_past_the_node_timeout_loses_no_node(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """Relay B (node2's) SIGSTOPped for 8 s (the node timeout is 3 s), then SIGCONTed. node2's
    report to it goes unanswered; within its 2 s relay timeout node2 reports directly, so
    the controller never judges it lost: no ``fault`` event, the fault-free loss for every
    step. The controller says ``relay_lost`` for B during the freeze and B joins again after
    it; node0 and node1 (relay A) never fall back; once its retry period is over node2 is
    behind its relay again (no more direct reports while the job runs)."""
    with _cluster(tmp_path, PACE) as job:
        wait_for(lambda: reached_step(job.run, 25), START_S, "step 25")
        _through_relays(job)
        relay = job.relays["B"]
        os.kill(relay.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            wait_for(lambda: _fell_back(job, 2), FREEZE_S, "node2 to report directly")
            direct_s = time.monotonic() - t0
            wait_for(lambda: _relay_events(job.run, "relay_lost", "B"), FREEZE_S, "B lost")
            lost_s = time.monotonic() - t0
            time.sleep(max(0.0, t0 + FREEZE_S - time.monotonic()))
        finally:
            os.kill(relay.pid, signal.SIGCONT)
        t1 = time.monotonic()
        wait_for(lambda: len(_relay_events(job.run, "relay_joined", "B")) == 2, 30, "B back")
        back_s = time.monotonic() - t1
        step_at_wake = _step(job.run)
        behind = _quiet_direct(job, timeout=60.0)
        step_behind = _step(job.run)
        job.wait()
    assert step_behind < STEPS, "the job ended before node2 was seen back behind its relay"
    _no_false_fault(job, reference)
    assert direct_s < NODE_TIMEOUT_S, f"node2 went direct {direct_s:.1f}s into the freeze"
    assert [e["addr"] for e in _relay_events(job.run, "relay_joined", "B")] == [
        job.relay_addrs["B"]
    ] * 2
    assert not _relay_events(job.run, "relay_lost", "A")
    end = _ended(job.run)
    assert not _fell_back(job, 0, before=end) and not _fell_back(job, 1, before=end)
    print(f"frozen {FREEZE_S:.0f}s at ~step {step_at_wake}: node2 direct {direct_s:.1f}s, "
          f"relay_lost {lost_s:.1f}s into it; B joined again {back_s:.1f}s after the wake; "
          f"no direct report from {behind:.1f}s after the wake on; no fault")  # fmt: skip


def _quiet_direct(job: Cluster, timeout: float) -> float:
    """Waits until the controller took no direct report for 2 s (every agent behind its relay
    again); seconds from now until that quiet began."""
    t0 = time.monotonic()
    last = [_metric(job, DIRECT), t0]

    def quiet() -> bool:
        time.sleep(0.5)
        n = _metric(job, DIRECT)
        if n != last[0]:
            last[:] = [n, time.monotonic()]
            return False
        return time.monotonic() - last[1] > 2.0

    wait_for(quiet, timeout, "direct reports to stop (node2 behind relay B again)")
    return last[1] - t0


def test_a_worker_killed_behind_a_relay_is_recovered_as_fast_as_directly(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """Every agent behind a relay; the drill ``kill:rank=1:step=30`` SIGKILLs rank 1's worker
    at the end of step 30. The report that carries its exit changed shape: the relay forwards
    it whole at once, so the controller finds a ``worker_crash`` of rank 1 (not a lost node)
    within the node timeout of the exit, recovers from a checkpoint, and the job ends with the
    fault-free loss for every step. Up to the recovery no report went to the controller
    directly: the exit came through the relay."""
    with _cluster(tmp_path, [*PACE, "--inject", "kill:rank=1:step=30"]) as job:
        wait_for(lambda: reached_step(job.run, 10), START_S, "step 10")
        _through_relays(job)
        gen1 = wait_for(
            lambda: [e for e in _kinds(job.run, "generation_started") if e["generation"] == 1],
            120,
            "the recovery's generation 1",
        )[0]
        direct = _metric(job, DIRECT)
        fell_back = [line for i in ROUTE for line in _fell_back(job, i)]
        job.wait()
    assert losses(job.run) == reference
    _once(job.run)
    gen0 = next(e for e in _kinds(job.run, "generation_started") if e["generation"] == 0)
    node1 = next(n for n, r in gen0["assignment"].items() if r == 1)
    assert _faults(job.run) == [("worker_crash", node1)]
    (fault,) = _kinds(job.run, "fault")  # the controller's own record, with its times
    assert fault["rank"] == 1, fault
    detect_s = fault["t_detected"] - fault["t_fault"]
    assert 0 <= detect_s < NODE_TIMEOUT_S, fault
    recoveries = report(job.run)["recoveries"]
    assert [(r["fault"], r["rank"]) for r in recoveries] == [("worker_crash", 1)], recoveries
    assert direct == 0 and not fell_back, (direct, fell_back)
    print(f"rank 1 ({node1}, relay {ROUTE[int(node1.removeprefix('node'))]}) killed: detected "
          f"{detect_s:.2f}s after its exit, generation 1 restored step "
          f"{gen1.get('restore_step')}; no direct report")  # fmt: skip
