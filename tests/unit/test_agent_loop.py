"""The agent's reconcile loop with its two seams injected: a launcher that starts no process
and a controller link that answers from the test. What goes out is checked against the
protocol the controller enforces (``report_from_json``); worker heartbeats arrive on the
agent's real UDP socket, signed as the runtime signs them."""

from __future__ import annotations

import itertools
import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard import protocol
from trainguard.agent.agent import Agent, AgentConfig
from trainguard.agent.link import HTTPStatusError
from trainguard.protocol import CkptConf, Run, Shutdown, Stop
from trainguard.protocol import worker as pw
from trainguard.runtime import wire

TOKEN = "ab" * 16
_pids = itertools.count(2**31 - 1000)  # no process has these pids: psutil finds none


class FakeProc:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.pid, self.spec, self.code = next(_pids), spec, None

    def poll(self) -> int | None:
        return self.code


class FakeLauncher:
    def __init__(self) -> None:
        self.started: list[FakeProc] = []
        self.stops: list[tuple[list[int], float]] = []
        self.filled: list[int] = []

    def fill(self, n: int) -> None:
        self.filled.append(n)

    def start(self, spec: dict[str, Any]) -> FakeProc:
        self.started.append(FakeProc(spec))
        return self.started[-1]

    def stop(self, procs: list[FakeProc], *, grace_s: float) -> None:
        self.stops.append(([p.pid for p in procs], grace_s))
        for p in procs:
            p.code = -15 if p.code is None else p.code

    def clean(self, keep: set[int]) -> list[int]:
        return []

    def stacks(self, pids: dict[int, int]) -> dict[int, str]:
        return {r: f"stack of pid {pid}" for r, pid in pids.items()}

    def kill_all(self, procs: list[FakeProc]) -> None:
        raise AssertionError("no power-off in these tests")

    @property
    def pids(self) -> set[int]:
        return set()

    def close(self) -> None:
        pass


class FakeLink:
    """Answers each request with ``reply`` (or raises ``error``); keeps what was sent."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []
        self.reply: dict[str, Any] = {"version": 0, "desired": {"action": "idle"}}
        self.error: BaseException | None = None

    def request(
        self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float
    ) -> dict[str, Any]:
        assert (method, path) == ("POST", "/v1/report") and body is not None
        protocol.report_from_json(json.loads(json.dumps(body)))  # what the controller checks
        if self.error is not None:
            raise self.error
        self.reports.append(body)
        return dict(self.reply)

    def close(self) -> None:
        pass


def run_state(tmp: Path, gen: int, **kw: Any) -> Run:
    fields: dict[str, Any] = dict(
        generation=gen, node_rank=1, nnodes=2, nproc_per_node=2, world_size=4,
        master_addr="127.0.0.1", master_port=29999, host_store=False, restore_step=None,
        restore_gen=None, restore_memory=True,
        ckpt=CkptConf(dir=str(tmp / "ck"), shm_dir="/dev/shm", keep=3, memory_tier=False),
        restarts=0, max_restarts=3, injects=[], script="train.py", launch="script",
        log_dir=None, script_args=["--lr", "0.1"], hang_timeout_s=None, hang_timeout_min_s=120.0,
        hang_timeout_max_s=600.0, first_step_timeout_s=600.0, heartbeat_s=0.5,
        node_timeout_s=600.0, replica_peers=[], replica_sources={},
    )  # fmt: skip
    return Run(**{**fields, **kw})


def answer(link: FakeLink, version: int, desired: protocol.Desired) -> None:
    link.reply = {"version": version, "desired": protocol.desired_to_json(desired)}


def deliver(agent: Agent, link: FakeLink, version: int, desired: protocol.Desired) -> bool:
    """The controller answers a report with ``desired``; the agent reconciles once."""
    answer(link, version, desired)
    assert agent.report_once(timeout_s=1.0)
    return agent.loop_once()


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[Agent, FakeLauncher, FakeLink]]:
    launcher, link = FakeLauncher(), FakeLink()
    cfg = AgentConfig(
        controller="127.0.0.1:9", token=TOKEN, node_id="n1", addr="127.0.0.1",
        run_dir=tmp_path / "run",
    )  # fmt: skip
    agent = Agent(cfg, launcher=launcher, link=link)
    try:
        yield agent, launcher, link
    finally:
        agent.close()


def kinds(report: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in report["events"]]


def test_a_run_starts_its_ranks_and_the_report_shows_them(
    parts: tuple[Agent, FakeLauncher, FakeLink], tmp_path: Path
) -> None:
    agent, launcher, link = parts
    deliver(agent, link, 7, run_state(tmp_path, 0))
    envs = [p.spec["env"] for p in launcher.started]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["GROUP_RANK"]) for e in envs] == [
        ("2", "0", "4", "1"),
        ("3", "1", "4", "1"),
    ]
    assert all(p.spec["argv"] == ["train.py", "--lr", "0.1"] for p in launcher.started)
    link.reply = {"version": 7}  # the agent has it: the reply omits it
    assert agent.report_once(timeout_s=1.0)
    report = link.reports[-1]
    assert report["desired_version"] == 7 and report["generation"] == 0
    assert [(w["rank"], w["state"]) for w in report["workers"]] == [(2, "running"), (3, "running")]
    assert kinds(report).count("worker_started") == 2
    agent.loop_once()  # the same desired state: nothing new is started
    assert len(launcher.started) == 2


def test_a_failed_worker_is_reported_with_its_error(
    parts: tuple[Agent, FakeLauncher, FakeLink], tmp_path: Path
) -> None:
    agent, launcher, link = parts
    deliver(agent, link, 1, run_state(tmp_path, 0))
    bad = launcher.started[1]
    error = {"message": {"message": "ValueError: loss is nan", "extraInfo": {}}}
    Path(bad.spec["error_file"]).parent.mkdir(parents=True, exist_ok=True)
    Path(bad.spec["error_file"]).write_text(json.dumps(error))
    bad.code = 1
    agent.loop_once()
    agent.report_once(timeout_s=1.0)
    workers = {w["rank"]: w for w in link.reports[-1]["workers"]}
    assert workers[3]["state"] == "failed" and workers[3]["exit_code"] == 1
    assert workers[3]["error"] == "ValueError: loss is nan" and workers[2]["state"] == "running"
    exited = [e for e in link.reports[-1]["events"] if e["kind"] == "worker_exited"]
    assert [(e["rank"], e["state"]) for e in exited] == [(3, "failed")]


def test_stop_stops_the_generation_and_an_older_version_is_ignored(
    parts: tuple[Agent, FakeLauncher, FakeLink], tmp_path: Path
) -> None:
    agent, launcher, link = parts
    deliver(agent, link, 5, run_state(tmp_path, 0))
    deliver(agent, link, 6, Stop(generation=0, grace_s=3.0))
    assert launcher.stops == [([p.pid for p in launcher.started], 3.0)]
    answer(link, 4, run_state(tmp_path, 1))  # older than what it holds: a stale answer
    agent.report_once(timeout_s=1.0)
    agent.loop_once()
    assert len(launcher.started) == 2 and agent.generation is None
    report = link.reports[-1]
    assert report["stopped_generation"] == 0 and report["workers"] == []
    assert "workers_stopped" in kinds(report) and report["stopped_at"] is not None
    assert deliver(agent, link, 7, Shutdown(phase="STOPPED", reason="stopped by request"))


def test_cut_off_past_the_node_timeout_it_fences_and_delivers_what_it_kept(
    parts: tuple[Agent, FakeLauncher, FakeLink], tmp_path: Path
) -> None:
    agent, launcher, link = parts
    deliver(agent, link, 1, run_state(tmp_path, 0, node_timeout_s=0.5))
    link.error = OSError("connection refused")
    assert not agent.report_once(timeout_s=1.0)  # worker_started events kept for later
    time.sleep(0.6)
    agent.loop_once()
    assert launcher.stops and launcher.stops[0][1] == 1.0  # fenced: its workers stopped
    agent.loop_once()
    assert len(launcher.started) == 2  # the fenced generation is never started again
    link.error = None
    assert agent.report_once(timeout_s=1.0)
    report = link.reports[-1]
    assert report["fenced_generation"] == 0
    assert kinds(report).count("worker_started") == 2 and kinds(report).count("fenced") == 1
    assert agent.report_once(timeout_s=1.0)
    assert link.reports[-1]["events"] == []  # delivered once


def test_a_rejected_token_is_named_in_the_log(
    parts: tuple[Agent, FakeLauncher, FakeLink], caplog: pytest.LogCaptureFixture
) -> None:
    agent, _, link = parts
    link.error = HTTPStatusError(401, "missing or wrong job token")
    with caplog.at_level(logging.ERROR, logger="trainguard.agent"):
        assert not agent.report_once(timeout_s=1.0)
    assert "rejected our token; pass the job's token file" in caplog.text


def test_a_rank_that_stops_stepping_is_flagged_hung_with_every_stack(
    parts: tuple[Agent, FakeLauncher, FakeLink], tmp_path: Path
) -> None:
    agent, launcher, link = parts
    deliver(agent, link, 1, run_state(tmp_path, 0, hang_timeout_s=0.5, hang_timeout_min_s=0.5))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for rank, proc in zip((2, 3), launcher.started, strict=True):
            step = {"t": "step", "step": 1, "t_end": time.time(), "dur": 0.01, "loss": 2.0}
            msg = {"rank": rank, "gen": 0, "pid": proc.pid, **step}
            sock.sendto(wire.encode(bytes.fromhex(TOKEN), msg), ("127.0.0.1", agent.report_port))
    finally:
        sock.close()
    time.sleep(0.1)
    agent.loop_once()
    assert {r: w.step for r, w in agent.workers.items()} == {2: 1, 3: 1}
    time.sleep(0.6)  # no step, no heartbeat: past its 0.5 s limit
    agent.loop_once()
    agent.report_once(timeout_s=1.0)
    report = link.reports[-1]
    hang = next(e for e in report["events"] if e["kind"] == "hang_suspected")
    assert report["hang"] is True and hang["progress"] == {2: 1, 3: 1}
    pids = {2: launcher.started[0].pid, 3: launcher.started[1].pid}
    assert hang["stacks"] == {r: f"stack of pid {pid}" for r, pid in pids.items()}


def test_a_malformed_worker_datagram_is_logged_and_dropped_and_the_next_one_is_taken(
    parts: tuple[Agent, FakeLauncher, FakeLink], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent, launcher, link = parts
    deliver(agent, link, 1, run_state(tmp_path, 0))
    proc = launcher.started[0]
    sender = {"rank": 2, "gen": 0, "pid": proc.pid}
    record = protocol.StepRecord(step=4, t_end=time.time(), duration_s=0.01, loss=1.0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for body in (
            {**sender, "t": "step", "step": "four", "t_end": 1.0, "dur": 0.1},  # malformed
            {**sender, "t": "batch", "items": [{"t": "alive"}, {"t": "warp"}]},  # one bad item
        ):
            data = wire.encode(bytes.fromhex(TOKEN), body)
            sock.sendto(data, ("127.0.0.1", agent.report_port))
        good = wire.encode_message(
            bytes.fromhex(TOKEN),
            pw.Sender(rank=2, pid=proc.pid, generation=0),
            pw.Batch((pw.StepEnd(record), pw.Alive())),
        )
        sock.sendto(good, ("127.0.0.1", agent.report_port))
    finally:
        sock.close()
    time.sleep(0.1)
    with caplog.at_level(logging.WARNING, logger="trainguard.agent"):
        agent.loop_once()
    assert "dropped a malformed worker report: step: step record.step: an integer" in caplog.text
    assert "dropped a malformed worker report: t: one of hb, step, alive, event" in caplog.text
    w = agent.workers[2]
    assert w.step == 4 and w.in_trainguard_mono is not None  # the whole good batch was taken
    agent.report_once(timeout_s=1.0)
    steps = link.reports[-1]["steps"]
    assert steps == [{"generation": 0, "rank": 2, "items": [record.to_json()]}]


def test_with_no_warm_spares_only_the_store_host_imports_torch_and_its_loop_never_waits(
    parts: tuple[Agent, FakeLauncher, FakeLink], tmp_path: Path
) -> None:
    """warm_spares = 0: an agent that hosts no store starts no torch import (the 2-3 s of CPU
    a loaded 2-core host spent in every agent); the one that hosts it imports on a thread
    and hosts the store on a later pass, its loop never blocked on the import."""
    agent, launcher, link = parts
    deliver(agent, link, 1, run_state(tmp_path, 0, warm_spares=0))
    assert agent._warm is None and len(launcher.started) == 2
    deliver(agent, link, 2, run_state(tmp_path, 1, warm_spares=0, host_store=True))
    assert agent._warm is not None
    deadline = time.monotonic() + 60
    while agent._store is None and time.monotonic() < deadline:
        t0 = time.monotonic()
        agent.loop_once()
        assert time.monotonic() - t0 < 1.0  # a pass, not the import
        time.sleep(0.05)
    assert agent._store is not None and agent._store[0] == 1
    assert len(launcher.started) == 4  # generation 1's ranks, once its store is up
    deliver(agent, link, 3, run_state(tmp_path, 2))  # warm spares (unset: one per worker)
    assert agent._warm is not None and agent._warm.is_set()
