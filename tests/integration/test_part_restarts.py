"""Faults of trainguard's own agent, controller and store under a running job (issue 30, item
2; docs/self-faults.md §9, tables "Agent", "Controller", "Store host"). Real processes, real
signals: an agent frozen past the node timeout, ``trainguard run`` SIGKILLed alone, the
controller SIGKILLed mid-recovery and inside a SQLite write, readers of a frozen controller's
store, a torn last line of ``events.jsonl``, an agent SIGKILLed while its new generation
restores. Each job ends with the losses of the fault-free run for every step, the right
culprit (none for trainguard's own part, the node when a node is lost) and nothing left."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import (
    FAST_CONFIG,
    GPT,
    PACE,
    PACED_ARGS,
    PACED_STEPS,
    ROOT,
    agent_pid,
    drop_segments,
    events,
    fault_free_losses,
    finish_job,
    losses,
    reached_step,
    report,
    run_job,
    start_job,
    trainguard_cmd,
    wait_for,
    worker_pid,
)
from trainguard.chaos.faults import job_id, run_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, ARGS = PACED_STEPS, PACED_ARGS  # PACE: rank 0 paced 5x (tests/conftest.py)
NODE_TIMEOUT_S = 3.0  # FAST_CONFIG's
assert f"node_timeout_s = {NODE_TIMEOUT_S}" in FAST_CONFIG
# A torn last line, as a process killed in the middle of writing an event leaves it.
TORN = '{"ts": 1.0, "kind": "torn_by_a_ki'


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The fault-free run's losses (two nodes, same model, data and seed)."""
    return fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)


def _faults(run: Path) -> list[tuple[Any, Any, Any]]:
    """(cause, node, rank) of every fault, as finally attributed."""
    return [(f["cause"], f["node_id"], f["rank"]) for f in report(run)["faults"]]


def _generation_started(run: Path, gen: int) -> bool:
    return any(e["kind"] == "generation_started" and e["generation"] == gen for e in events(run))


def _gone(pid: int) -> bool:
    """``pid`` exited (a zombie not yet reaped counts: it runs nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_run(run: Path, procs: list[subprocess.Popen[Any]]) -> None:
    """A failed test's clean-up: SIGCONT and SIGKILL every process of the run."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.communicate()
    for p in run_processes(run):
        with contextlib.suppress(psutil.Error):
            p.resume()
            p.kill()


# --------------------------------------------------------------------------- agent frozen
def test_an_agent_frozen_past_the_node_timeout_is_replaced_and_fences_when_woken(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """node1 paused (SIGSTOP of its agent and its worker; its ckptd runs on): no heartbeat,
    so after ``node_timeout_s`` (3 s) the controller calls node1 lost and the standby takes
    its rank. The agent is woken first (SIGCONT), its worker still there: it must stop that
    worker (fencing; the job left its generation), start none of the job's, and go back to
    standby."""
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2", "--standby", "1", *PACE], ARGS)
    frozen: list[int] = []
    try:
        old = worker_pid(run, rank=1)
        wait_for(lambda: reached_step(run, 25), 120, "step 25")
        agent = agent_pid(run, "node1")
        frozen = [agent, old]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: _generation_started(run, 1), 90, "the standby's generation")
        replaced_s = time.monotonic() - t0
        # frozen for twice the node timeout at least (its agent has missed its bound for sure)
        wait_for(lambda: time.monotonic() - t0 > 2 * NODE_TIMEOUT_S, 10, "the freeze's end")
        os.kill(agent, signal.SIGCONT)  # the worker stays stopped: the agent wakes first
        t1 = time.monotonic()
        wait_for(lambda: _gone(old), 60, "node1's old worker to be stopped")
        stopped_s = time.monotonic() - t1
        wait_for(
            lambda: [
                e for e in events(run)
                if e["kind"] == "pool_changed" and e["node"] == "node1" and e["to"] == "standby"
            ],
            60,
            "node1 back to standby",
        )  # fmt: skip
        assert not _gone(agent), "the woken agent must live on (a standby)"
        code, err = finish_job(proc, timeout=300)
        assert code == 0, err[-3000:]
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            _kill_run(run, [proc])
    assert losses(run) == reference
    assert _faults(run) == [("node_lost", "node1", None)]
    # Stopped by its fencing (the usual order: the main loop fences before the report thread
    # reaches the controller again), or by the Idle the controller sent it once a report got
    # through first (a race: 2 of 4 runs here; see the report); never in a later generation.
    fenced = [e for e in events(run) if e["kind"] == "fenced" and e["node"] == "node1"]
    assert [e["generation"] for e in fenced] in ([0], []), fenced
    started = [
        e for e in events(run)
        if e["kind"] in ("worker_started", "worker_resumed") and e["node"] == "node1"
        and e["generation"] >= 1
    ]  # fmt: skip
    assert not started, f"the woken agent rejoined the job: {started}"
    how = f"fenced (silent {fenced[0]['silent_s']}s)" if fenced else "idled by the controller"
    print(f"replaced after {replaced_s:.1f}s frozen; {how}, old worker gone {stopped_s:.1f}s "
          "after the wake")  # fmt: skip


# --------------------------------------------------------------------------- run killed alone
def test_trainguard_run_killed_alone_leaves_nothing_and_a_rerun_resumes(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """SIGKILL of the ``trainguard run`` process only (it hosts the controller): its agents
    (``--exit-with-parent``, PR_SET_PDEATHSIG) stop their workers, shut their ckptds down,
    free the node's memory and exit within their deadline, no process left. The killed
    controller may leave a torn last line in ``events.jsonl``; a re-run of the run dir
    resumes from the durable tier and ends with the fault-free losses."""
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2", "--standby", "1", *PACE], ARGS)
    try:
        worker_pid(run, rank=1)
        wait_for(lambda: reached_step(run, 25), 120, "step 25")
        # the standby holds its prefetched copy of a durable step (a directory in /dev/shm)
        shm = Path("/dev/shm")
        wait_for(
            lambda: list(shm.glob(f"trainguard-{job_id(run)}-node2-prefetch/*")),
            60,
            "the standby's prefetched step",
        )
        agents = [agent_pid(run, f"node{i}") for i in range(3)]
        proc.kill()
        proc.communicate(timeout=30)
        t0 = time.monotonic()
        # The deadline the agents give themselves: AGENT_EXIT_DEADLINE_S (30 s), loaded machine.
        wait_for(lambda: not run_processes(run), 60, "every process of the run to exit")
        exit_s = time.monotonic() - t0
        left = sorted(p.name for p in shm.glob(f"trainguard-{job_id(run)}-*"))
        assert not left, f"the agents left memory segments: {left}"
    finally:
        _kill_run(run, [proc])
        drop_segments(f"trainguard-{job_id(run)}-*")  # a failed test's
    for i in range(len(agents)):  # each exited on its own, cleanly
        log = (run / "logs" / f"agent.node{i}.log").read_text()
        assert "Traceback" not in log, log[-3000:]
    stopped_at = max(losses(run))
    assert stopped_at < STEPS
    durable = max(int(d.name.removeprefix("step_")) for d in (run / "checkpoints").glob("step_*"))
    with open(run / "events.jsonl", "a") as f:  # as a kill mid-event leaves it
        f.write(TORN)

    res = run_job(run, ["--nodes", "2"], ARGS)
    assert res.returncode == 0, res.stderr[-3000:]
    assert losses(run) == reference  # every step, across the two runs
    evs = events(run)
    (rerun,) = [e for e in evs if e["kind"] == "rerun"]  # the line after the torn one is whole
    assert rerun["previous_phase"] == "RUNNING", rerun
    first = next(e for e in evs[evs.index(rerun) :] if e["kind"] == "generation_started")
    assert first["restore_step"] is not None and first["restore_step"] >= durable, first
    rep = report(run)
    assert rep["phase"] == "SUCCEEDED" and rep["faults"] == [], rep["faults"]
    listed = _events_cli(run)
    assert [e for e in listed if e["kind"] == "rerun"], "trainguard events lost the re-run"
    print(f"agents and everything under them gone {exit_s:.1f}s after the kill; stopped at "
          f"step {stopped_at}, durable {durable}, re-run restored {first['restore_step']}")  # fmt: skip


def _events_cli(run: Path, timeout: float = 60.0) -> list[dict[str, Any]]:
    """``trainguard events --json`` (exit 0, every line an event)."""
    out = subprocess.run(
        trainguard_cmd("events", "--run-dir", run, "--json"),
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [json.loads(x) for x in out.stdout.splitlines()]


# --------------------------------------------------------------------------- controller restarts
class Split:
    """``trainguard controller`` on 127.0.0.1 and one ``trainguard agent`` per node on its own
    loopback address (127.0.0.2, .3): the controller can be killed and started again while
    the agents and their workers run on."""

    def __init__(self, run: Path, config: str, nodes: int = 2) -> None:
        self.run, self.nodes = run, nodes
        run.mkdir()
        self.cfg = run.parent / "job.toml"
        self.cfg.write_text(config)
        self.controller: subprocess.Popen[str] | None = None
        self.agents: list[subprocess.Popen[bytes]] = []

    def start_controller(self, wrap: list[str] | None = None) -> subprocess.Popen[str]:
        """Start (or restart: the same command) the controller, under ``wrap`` (e.g. strace);
        waits until it listens when not wrapped."""
        cmd = trainguard_cmd(
            "controller", "--bind", "127.0.0.1:0", "--run-dir", self.run, "--config", self.cfg,
            "--nodes", str(self.nodes), *PACE, GPT, *ARGS,
        )  # fmt: skip
        self.controller = subprocess.Popen(
            [*(wrap or []), *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            cwd=ROOT,
        )  # fmt: skip
        if wrap is None:
            pid = self.controller.pid
            wait_for(lambda: (_info(self.run) or {}).get("pid") == pid, 60, "the controller")
        else:
            wait_for(lambda: _info(self.run), 60, "the controller")
        return self.controller

    def start_agents(self) -> None:
        addr = str((_info(self.run) or {})["addr"])
        for i in range(self.nodes):
            log = open(self.run / f"agent-node{i}.out", "ab")  # noqa: SIM115
            cmd = trainguard_cmd(
                "agent", "--controller", addr, "--token-file", self.run / "token",
                "--node-id", f"node{i}", "--addr", f"127.0.0.{i + 2}", "--run-dir", self.run,
            )  # fmt: skip
            self.agents.append(subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT))
            log.close()

    def wait(self, timeout: float = 300) -> None:
        """Until the controller ends with exit 0 and every agent exited."""
        assert self.controller is not None
        _, err = self.controller.communicate(timeout=timeout)
        assert self.controller.returncode == 0, err[-3000:]
        for a in self.agents:
            a.wait(timeout=90)

    def close(self) -> None:
        procs: list[subprocess.Popen[Any]] = [*self.agents]
        if self.controller is not None:
            procs.append(self.controller)
        _kill_run(self.run, procs)
        drop_segments(f"trainguard-{job_id(self.run)}-*")  # a failed test's


def _info(run: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((run / "controller.json").read_text()))
    except (OSError, ValueError):
        return None


@pytest.fixture
def split(tmp_path: Path) -> Iterator[Split]:
    # The restarted controller must be back before the agents fence (node_timeout_s): a new
    # controller takes seconds to start on a loaded 2-core machine.
    config = FAST_CONFIG.replace("node_timeout_s = 3.0", "node_timeout_s = 15.0")
    assert config != FAST_CONFIG
    job = Split(tmp_path / "run", config)
    try:
        yield job
    finally:
        job.close()


def _stored(run: Path) -> dict[str, Any]:
    """The job state the store holds now (read-only, as ``trainguard status`` reads it)."""
    db = sqlite3.connect(f"file:{run / 'job.sqlite'}?mode=ro", uri=True, timeout=10.0)
    try:
        row = db.execute("SELECT value FROM kv WHERE key = 'state'").fetchone()
    finally:
        db.close()
    return dict(json.loads(row[0])) if row else {}


def _check_store_after_kill(run: Path) -> int:
    """A killed controller's store: intact (``integrity_check``), and every event that reached
    ``events.jsonl`` (written after its row's autocommit) is a row of ``job.sqlite``: nothing
    committed was lost. Returns the number of event rows."""
    db = sqlite3.connect(f"file:{run / 'job.sqlite'}?mode=ro", uri=True, timeout=10.0)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        rows = {(ts, kind) for ts, kind in db.execute("SELECT ts, kind FROM events")}
    finally:
        db.close()
    lines = [(e["ts"], e["kind"]) for e in events(run)]
    missing = [x for x in lines if x not in rows]
    assert not missing, f"events in events.jsonl but not in job.sqlite: {missing[:5]}"
    return len(rows)


def test_the_controller_killed_mid_recovery_resumes_the_stored_phase(
    split: Split, reference: dict[int, float]
) -> None:
    """Rank 1 SIGKILLed; while the job is STOPPING (its survivor, rank 0, held frozen so that
    the stop cannot finish: the agent waits for it to abort), the controller is SIGKILLed. Its
    store is intact and holds STOPPING; a torn last line is left in ``events.jsonl``. The
    restarted controller resumes STOPPING (``controller_restarted``), the recovery goes on as
    without the kill: one fault, rank 1's, and the fault-free losses."""
    run = split.run
    split.start_controller()
    split.start_agents()
    frozen = 0
    try:
        wait_for(lambda: reached_step(run, 25), 120, "step 25")
        pids = {r: worker_pid(run, rank=r) for r in (0, 1)}
        frozen = pids[0]
        os.kill(frozen, signal.SIGSTOP)
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: _stored(run).get("phase") == "STOPPING", 60, "STOPPING stored")
        assert split.controller is not None
        split.controller.kill()
        split.controller.communicate(timeout=30)
        stored = _stored(run)
        assert stored["phase"] == "STOPPING" and stored["generation"] == 0, stored
        rows = _check_store_after_kill(run)
        with open(run / "events.jsonl", "a") as f:
            f.write(TORN)
        t0 = time.monotonic()
        split.start_controller()
        (back,) = wait_for(
            lambda: [e for e in events(run) if e["kind"] == "controller_restarted"],
            60,
            "controller_restarted in events.jsonl",
        )
        assert back["phase"] == "STOPPING" and back["generation"] == 0, back
        os.kill(frozen, signal.SIGCONT)  # the survivor aborts and parks: the stop completes
        frozen = 0
        wait_for(lambda: _generation_started(run, 1), 90, "the restart")
        recovered_s = time.monotonic() - t0
        split.wait()
    finally:
        if frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
    assert losses(run) == reference
    assert _faults(run) == [("worker_crash", "node1", 1)]
    listed = _events_cli(run)
    assert len(listed) > rows and [e for e in listed if e["kind"] == "controller_restarted"]
    phases = [e["to"] for e in events(run) if e["kind"] == "phase"]
    assert phases.count("STOPPING") == 1, phases  # resumed, not started again
    print(f"killed in STOPPING with {rows} events stored; restarted controller started "
          f"generation 1 {recovered_s:.1f}s later")  # fmt: skip


# --------------------------------------------------------------------------- the SQLite store
def _strace(pid: int, signame: str, run: Path) -> subprocess.Popen[bytes]:
    """Attach strace to ``pid``'s main thread (the controller's event loop, the store's only
    writer) and have the kernel deliver ``signame`` to it at its first ``pwrite64`` from
    then on: a write of a SQLite WAL frame, inside a write transaction. Returns strace."""
    if shutil.which("strace") is None or os.geteuid() != 0:
        pytest.skip("needs strace and root (ptrace)")
    st = subprocess.Popen(
        ["strace", "-qq", "-p", str(pid), "-e", "trace=pwrite64",
         "-e", f"inject=pwrite64:signal={signame}:when=1", "-o", str(run.parent / "strace.out")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return st


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.NoSuchProcess:
        return False


def _timed(*args: str | Path) -> tuple[float, subprocess.CompletedProcess[str]]:
    t = time.monotonic()
    out = subprocess.run(
        trainguard_cmd(*args), capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    return time.monotonic() - t, out


def test_readers_of_a_controller_frozen_inside_a_sqlite_write_answer_in_bounded_time(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """``trainguard run`` frozen (SIGSTOP) at a write of its SQLite store, inside the write
    transaction: ``trainguard events``, ``report`` and ``status`` still answer (WAL: readers
    never wait on the writer), ``status`` from the store once its HTTP call times out. Woken,
    the job goes on: no fault (the freeze is shorter than the node timeout), the fault-free
    losses."""
    run = tmp_path / "run"
    # Agents must not fence during the freeze: a node timeout far longer than it.
    config = FAST_CONFIG.replace("node_timeout_s = 3.0", "node_timeout_s = 90.0")
    proc = start_job(run, ["--nodes", "2", *PACE], ARGS, config=config)
    st: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: reached_step(run, 25), 120, "step 25")
        st = _strace(proc.pid, "SIGSTOP", run)
        wait_for(lambda: _stopped(proc.pid), 60, "the controller stopped at a SQLite write")
        took: dict[str, float] = {}
        took["events"], out = _timed("events", "--run-dir", run, "--json")
        assert out.returncode == 0, out.stderr
        assert [json.loads(x)["kind"] for x in out.stdout.splitlines()][0] == "job_started"
        took["report"], out = _timed("report", "--run-dir", run, "--json")
        assert out.returncode == 0 and json.loads(out.stdout)["phase"] == "RUNNING", out.stderr
        took["status"], out = _timed("status", "--run-dir", run)
        assert out.returncode == 0, out.stderr
        assert "source: store (no controller answered)" in out.stdout, out.stdout
        assert _stopped(proc.pid), "the controller must have stayed frozen throughout"
        # Bounded: the store's busy timeout is 10 s, status's HTTP call 5 s (plus the start
        # of an interpreter on a loaded machine).
        assert max(took.values()) < 45, took
        os.kill(proc.pid, signal.SIGCONT)
        st.terminate()  # detaches
        st.wait(timeout=30)
        code, err = finish_job(proc, timeout=300)
        assert code == 0, err[-3000:]
    finally:
        if st is not None and st.poll() is None:
            st.kill()
            st.wait()
        if proc.poll() is None:
            _kill_run(run, [proc])
    assert losses(run) == reference
    assert _faults(run) == []
    rounded = {k: round(v, 1) for k, v in took.items()}
    print(f"readers of the frozen store: {rounded}")


def test_a_controller_killed_inside_a_sqlite_write_loses_nothing_committed(
    split: Split, reference: dict[int, float]
) -> None:
    """The controller SIGKILLed by the kernel at a write of a WAL frame (inside a SQLite
    write transaction) mid-run: the store is intact, every event it wrote to
    ``events.jsonl`` is in it, its state reads back; the restarted controller resumes
    RUNNING with the workers it had (no fault), and the job ends with the fault-free
    losses."""
    run = split.run
    ctl = split.start_controller()
    split.start_agents()
    wait_for(lambda: reached_step(run, 25), 120, "step 25")
    pids = {r: worker_pid(run, rank=r) for r in (0, 1)}
    st = _strace(ctl.pid, "SIGKILL", run)
    ctl.communicate(timeout=60)
    st.wait(timeout=30)
    assert ctl.returncode == -signal.SIGKILL, ctl.returncode
    trace = (run.parent / "strace.out").read_text()
    assert "pwrite64(" in trace and "SIGKILL" in trace, trace
    rows = _check_store_after_kill(run)
    stored = _stored(run)
    assert stored["phase"] == "RUNNING" and stored["generation"] == 0, stored
    split.start_controller()
    split.wait()
    assert losses(run) == reference
    assert _faults(run) == []
    evs = events(run)
    (back,) = [e for e in evs if e["kind"] == "controller_restarted"]
    assert back["phase"] == "RUNNING", back
    kept = {e["rank"]: e["pid"] for e in evs if e["kind"] == "worker_started"}
    assert kept == pids, "the workers ran on through the controller's restart"
    print(f"killed at a WAL write with {rows} events stored: {trace.strip()[-200:]}")
