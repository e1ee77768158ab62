"""An agent SIGKILLed or frozen while it stops, aborts, restarts or exits (docs/self-faults.md
§9, table "Agent"). Real jobs, real signals, delivered by the kernel at a chosen system call
of the agent's main thread (``strace --inject``) or at a moment read from the run's events:

- mid-stop, inside ``workers.py:kill_groups`` (its SIGTERM sent, its SIGKILL not): killed, its
  worker dies by PR_SET_PDEATHSIG; frozen, the stop waits, the node is lost and replaced, and
  woken, the agent ends its stop and never rejoins;
- mid in-process stop (``inprocess.py:InProcessStops``, an Abort sent): its aborted survivor
  dies with it;
- while its new generation's worker starts and restores;
- in its exit path (``agent.py:Agent.run``), as it tells ckptd to shut down.

Each job ends with the losses of the fault-free run for every step, the right culprit (the node
for a lost node, none for trainguard's own part) and nothing left (``no_leaks``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import (
    PACE,
    PACED_ARGS,
    PACED_STEPS,
    WARM_CONFIG,
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
    wait_for,
)
from trainguard.chaos.faults import job_id, run_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, ARGS = PACED_STEPS, PACED_ARGS  # PACE: rank 0 paced 5x (tests/conftest.py)
RUN_ARGS = ["--nodes", "2", "--standby", "1", *PACE]
# The product's default of warm spares: each kill point below is a call of the path they make
# (a rank handed to a spare by datagram), which a worker started on demand does not make.
CONFIG = WARM_CONFIG
NODE_TIMEOUT_S = 3.0  # its
assert f"node_timeout_s = {NODE_TIMEOUT_S}" in CONFIG
# A rank frozen by SIGSTOP is a hang seen in seconds (the agent sees the stopped process).
HANG_CONFIG = CONFIG + "hang_timeout_min_s = 2.0\n"
# The restart path: every rank of the faulted generation is stopped by ``kill_groups``.
RESTART_CONFIG = HANG_CONFIG + "inprocess = false\n"
PDEATHSIG_S = 10.0  # a child of a killed agent is gone by then (measured: well under 1 s)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The fault-free run's losses (two nodes, same model, data and seed)."""
    return fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)


def _pid(run: Path, rank: int, generation: int = 0) -> int:
    """The pid of ``rank``'s worker in ``generation`` (a start takes long on a loaded host)."""
    ev = wait_for(
        lambda: [
            e for e in events(run)
            if e["kind"] in ("worker_started", "worker_resumed") and e["rank"] == rank
            and e["generation"] == generation
        ],
        180,
        f"rank {rank} of generation {generation} to start",
    )  # fmt: skip
    return int(ev[-1]["pid"])


def _faults(run: Path) -> list[tuple[Any, Any, Any]]:
    """(cause, node, rank) of every fault, as finally attributed."""
    return [(f["cause"], f["node_id"], f["rank"]) for f in report(run)["faults"]]


def _gone(pid: int) -> bool:
    """``pid`` exited (a zombie not yet reaped counts: it runs nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _frozen(pid: int) -> bool:
    """``pid`` is in a group stop (SIGSTOP): its threads other than the main one (the one
    strace traces, in a tracing stop at each of its system calls) are stopped."""
    states = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        if task.name != str(pid):
            with contextlib.suppress(OSError):
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(x == "T" for x in states)


def _traced_by(pid: int, tracer: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return f"\nTracerPid:\t{tracer}\n" in status


def _strace(pid: int, syscall: str, signame: str, when: int, out: Path) -> subprocess.Popen[bytes]:
    """Attach strace to ``pid``'s main thread (the agent's reconcile loop: its stops, aborts,
    resumes and exit path run there) and have the kernel deliver ``signame`` to it on entry
    to its ``when``-th ``syscall`` from then on (the call itself not made). Returns strace
    once attached; its log (``-o out``) shows every such call."""
    if shutil.which("strace") is None or os.geteuid() != 0:
        pytest.skip("needs strace and root (ptrace)")
    st = subprocess.Popen(
        ["strace", "-qq", "-s", "256", "-p", str(pid), "-e", f"trace={syscall}",
         "-e", f"inject={syscall}:signal={signame}:when={when}", "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for(lambda: _traced_by(pid, st.pid) or st.poll() is not None, 30, "strace to attach")
    assert st.poll() is None, f"strace could not attach to {pid}"
    return st


def _calls(out: Path, syscall: str) -> list[str]:
    """The ``syscall`` lines of a strace log."""
    return [x for x in out.read_text().splitlines() if x.startswith(f"{syscall}(")]


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
    drop_segments(f"trainguard-{job_id(run)}-*")


def _lost_and_replaced(run: Path, node: str) -> None:
    """``node`` was lost and the standby, node2, took its place (the report's recoveries)."""
    replaced = [r["replaced"] for r in report(run)["recoveries"] if r.get("replaced")]
    assert {node: "node2"} in replaced, replaced


def _lost_mid_stop(run: Path, node: str) -> None:
    """Rank 1's hang is the one fault; ``node``, lost during the stop for its recovery, is
    marked faulty ("lost during generation") and replaced by node2 in that same recovery."""
    assert _faults(run) == [("hang", "node1", 1)]
    (rec,) = report(run)["recoveries"]
    assert rec["replaced"] == {node: "node2"}, rec
    faulty = [
        e for e in events(run)
        if e["kind"] == "pool_changed" and e["node"] == node and e["to"] == "faulty"
    ]  # fmt: skip
    assert [e["reason"].split(";")[0] for e in faulty] == ["lost during generation"], faulty


def _rejoined(run: Path, node: str, since_generation: int) -> list[dict[str, Any]]:
    """Workers ``node`` started or resumed in a generation from ``since_generation`` on."""
    return [
        e for e in events(run)
        if e["kind"] in ("worker_started", "worker_resumed") and e["node"] == node
        and e["generation"] >= since_generation
    ]  # fmt: skip


# --------------------------------------------------------------------------- kill_groups
def test_an_agent_killed_mid_stop_takes_its_worker_with_it_and_its_node_is_replaced(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """Restart path (``inprocess = false``). Rank 1 (node1) frozen: a hang; every agent stops
    its workers. node0's agent is SIGKILLed by the kernel inside ``kill_groups``, at its
    second ``kill``: rank 0's group has its SIGTERM (which the script only notes: rank 0 waits
    in its all-reduce), not its SIGCONT or SIGKILL. Rank 0 must die by PR_SET_PDEATHSIG at
    once; node0 is lost and node2 (the standby) takes its rank; the job succeeds with the
    fault-free losses; the faults are rank 1's hang and node0's loss."""
    run = tmp_path / "run"
    proc = start_job(run, RUN_ARGS, ARGS, config=RESTART_CONFIG)
    st: subprocess.Popen[bytes] | None = None
    frozen = 0
    try:
        r0, r1 = _pid(run, 0), _pid(run, 1)
        wait_for(lambda: reached_step(run, 25), 300, "step 25")
        agent = agent_pid(run, "node0")
        trace = tmp_path / "strace.out"
        st = _strace(agent, "kill", "SIGKILL", 2, trace)
        frozen = r1
        os.kill(r1, signal.SIGSTOP)
        wait_for(lambda: _gone(agent), 90, "node0's agent to be killed at its stop")
        t0 = time.monotonic()
        wait_for(lambda: _gone(r0), PDEATHSIG_S, "rank 0 to die with its agent")
        died_s = time.monotonic() - t0
        st.wait(timeout=30)
        calls = _calls(trace, "kill")
        assert calls[0].startswith(f"kill(-{r0}, SIGTERM)"), calls
        assert calls[1].startswith(f"kill(-{r0}, SIGCONT)"), calls  # entered, never made
        assert "+++ killed by SIGKILL +++" in trace.read_text()
        code, err = finish_job(proc, timeout=300)
        assert code == 0, err[-3000:]
    finally:
        if frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
        if st is not None and st.poll() is None:
            st.kill()
            st.wait()
        if proc.poll() is None:
            _kill_run(run, [proc])
    assert losses(run) == reference
    _lost_mid_stop(run, "node0")
    print(f"rank 0 gone {died_s:.2f}s after its agent's SIGKILL mid-stop")


def test_an_agent_frozen_mid_stop_is_replaced_and_woken_ends_its_stop_without_rejoining(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """Restart path. Rank 1 frozen (a hang); node0's agent SIGSTOPped by the kernel inside
    ``kill_groups`` (rank 0's SIGTERM sent, its SIGKILL not): the stop waits, no heartbeat,
    node0 is lost after ``node_timeout_s`` and node2 takes its rank. Woken (SIGCONT) after
    the new generation started, the agent ends its stop (rank 0 killed) and never starts or
    resumes a worker of a later generation; the job succeeds with the fault-free losses."""
    run = tmp_path / "run"
    proc = start_job(run, RUN_ARGS, ARGS, config=RESTART_CONFIG)
    st: subprocess.Popen[bytes] | None = None
    frozen: list[int] = []
    try:
        r0, r1 = _pid(run, 0), _pid(run, 1)
        wait_for(lambda: reached_step(run, 25), 300, "step 25")
        agent = agent_pid(run, "node0")
        trace = tmp_path / "strace.out"
        st = _strace(agent, "kill", "SIGSTOP", 2, trace)
        frozen = [r1, agent]
        os.kill(r1, signal.SIGSTOP)
        wait_for(lambda: _frozen(agent), 90, "node0's agent to be frozen at its stop")
        t0 = time.monotonic()
        wait_for(
            lambda: [e for e in events(run) if e["kind"] == "generation_started"
                     and e["generation"] >= 1],
            90,
            "a generation without node0",
        )  # fmt: skip
        replaced_s = time.monotonic() - t0
        assert not _gone(r0), "rank 0 must wait for its frozen agent's stop"
        wait_for(lambda: time.monotonic() - t0 > 2 * NODE_TIMEOUT_S, 10, "the freeze's end")
        os.kill(agent, signal.SIGCONT)
        st.terminate()  # detaches (and writes its log out)
        st.wait(timeout=30)
        t1 = time.monotonic()
        calls = _calls(trace, "kill")
        assert calls[0].startswith(f"kill(-{r0}, SIGTERM)"), calls
        assert calls[1].startswith(f"kill(-{r0}, SIGCONT)"), calls  # frozen on entry
        wait_for(lambda: _gone(r0), 60, "the woken agent to end its stop")
        stopped_s = time.monotonic() - t1
        code, err = finish_job(proc, timeout=300)
        assert code == 0, err[-3000:]
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if st is not None and st.poll() is None:
            st.kill()
            st.wait()
        if proc.poll() is None:
            _kill_run(run, [proc])
    assert losses(run) == reference
    _lost_mid_stop(run, "node0")
    assert not _rejoined(run, "node0", 1), "the woken agent rejoined the job"
    print(f"replaced {replaced_s:.1f}s into the freeze; rank 0 stopped {stopped_s:.2f}s "
          "after the wake")  # fmt: skip


# --------------------------------------------------------------------------- InProcessStops
def test_an_agent_killed_mid_abort_takes_its_aborted_survivor_with_it(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """In-process recovery (the default). Rank 0 (node0) frozen: a hang; rank 1 (node1) is
    the survivor to keep: node1's agent sends it an Abort datagram. The kernel SIGKILLs that
    agent on entry to its next datagram (a second Abort, or the Resume into generation 1 if
    rank 1 parked within the 0.2 s resend). The aborted survivor must die with it
    (PR_SET_PDEATHSIG), node1 is lost and node2 takes rank 1; the job succeeds with the
    fault-free losses; the faults are rank 0's hang and node1's loss."""
    run = tmp_path / "run"
    proc = start_job(run, RUN_ARGS, ARGS, config=HANG_CONFIG)
    st: subprocess.Popen[bytes] | None = None
    frozen = 0
    try:
        r0, r1 = _pid(run, 0), _pid(run, 1)
        wait_for(lambda: reached_step(run, 25), 300, "step 25")
        agent = agent_pid(run, "node1")
        trace = tmp_path / "strace.out"
        st = _strace(agent, "sendto", "SIGKILL", 2, trace)
        frozen = r0
        os.kill(r0, signal.SIGSTOP)
        wait_for(lambda: _gone(agent), 90, "node1's agent to be killed mid-abort")
        t0 = time.monotonic()
        wait_for(lambda: _gone(r1), PDEATHSIG_S, "the survivor to die with its agent")
        died_s = time.monotonic() - t0
        st.wait(timeout=30)
        sent = _calls(trace, "sendto")
        assert len(sent) == 2, sent
        assert '\\"t\\":\\"abort\\",\\"v\\":1,\\"gen\\":0' in sent[0], sent[0]
        # On entry to its next one: a second Abort, the netlink lookup of generation 1's
        # environment, or the Resume (the survivor parked meanwhile); never made.
        assert sent[1].endswith("= ?"), sent[1]
        what = re.search(r'\\"t\\":\\"(abort|resume)\\"|(RTM_GETLINK)', sent[1])
        assert what is not None, sent[1]
        killed_at = what.group(1) or what.group(2)
        assert "+++ killed by SIGKILL +++" in trace.read_text()
        code, err = finish_job(proc, timeout=300)
        assert code == 0, err[-3000:]
    finally:
        if frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
        if st is not None and st.poll() is None:
            st.kill()
            st.wait()
        if proc.poll() is None:
            _kill_run(run, [proc])
    assert losses(run) == reference
    assert _faults(run) == [("hang", "node0", 0), ("node_lost", "node1", None)]
    _lost_and_replaced(run, "node1")
    assert not [e for e in _rejoined(run, "node1", 1) if e["kind"] == "worker_started"]
    print(f"killed at its {killed_at} call after its Abort; the survivor gone {died_s:.2f}s later")


# --------------------------------------------------------------------------- restore
def test_an_agent_killed_while_its_new_generation_restores_leads_to_a_second_recovery(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """Rank 1 (node1) SIGKILLed: a crash; generation 1 starts a new rank 1 on node1. As soon
    as that worker started (before generation 1's first step: it imports, meets its peers
    and restores), node1's agent is SIGKILLed. The new worker dies with it; node1 is lost;
    a second recovery puts rank 1 on node2 (the standby); the job succeeds with the
    fault-free losses, and the report counts both faults."""
    run = tmp_path / "run"
    proc = start_job(run, RUN_ARGS, ARGS, config=CONFIG)
    try:
        r1 = _pid(run, 1)
        wait_for(lambda: reached_step(run, 25), 300, "step 25")
        agent = agent_pid(run, "node1")
        os.kill(r1, signal.SIGKILL)
        new = _pid(run, 1, generation=1)
        os.kill(agent, signal.SIGKILL)
        killed = time.time()
        t0 = time.monotonic()
        wait_for(lambda: _gone(new), PDEATHSIG_S, "generation 1's rank 1 to die with its agent")
        died_s = time.monotonic() - t0
        code, err = finish_job(proc, timeout=300)
        assert code == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            _kill_run(run, [proc])
    evs = events(run)
    # the restarted agent of node1 (a standby now) never started a worker (it did, of
    # generation 1, after a 15 s ckptd start: it acted on the Run its node was lost from)
    late = [e for e in evs if e["kind"] in ("worker_started", "worker_resumed")
            and e["node"] == "node1" and e["ts"] > killed]  # fmt: skip
    assert not late, late
    (started,) = [e for e in evs if e["kind"] == "worker_started" and e["generation"] == 1
                  and e["rank"] == 1]  # fmt: skip
    assert started["node"] == "node1" and started["pid"] == new, started
    # killed before generation 1 took a step: it never did
    assert not [e for e in evs if e["kind"] == "first_step" and e["generation"] == 1]
    loads = [e["ts"] - killed for e in evs if e["kind"] == "ckpt_load_start"
             and e["generation"] == 1 and e["rank"] == 1]  # fmt: skip
    assert losses(run) == reference
    assert _faults(run) == [("worker_crash", "node1", 1), ("node_lost", "node1", None)]
    # the first recovery never completed (generation 1 took no step): the one listed is the
    # second, from generation 1, with node1 replaced
    (rec,) = report(run)["recoveries"]
    assert rec["fault"] == "node_lost" and rec["from_generation"] == 1, rec
    assert rec["replaced"] == {"node1": "node2"}, rec
    gens = [e["generation"] for e in evs if e["kind"] == "generation_started"]
    assert gens == [0, 1, 2], gens
    print(f"generation 1's rank 1 gone {died_s:.2f}s after its agent's SIGKILL; its restore "
          f"had started: {bool(loads)}")  # fmt: skip


# --------------------------------------------------------------------------- exit path
def test_an_agent_killed_in_its_exit_path_loses_nothing_and_a_rerun_succeeds(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """No fault until the job's last step. node0's agent is then SIGKILLed by the kernel in
    its exit path (``Agent.run``'s ``finally``: workers stopped, the last ckptd refresh
    made), on entry to its ``Shutdown`` order to ckptd: ckptd dies with it (PDEATHSIG), never
    told to shut down. The job still succeeds, nobody blamed, the last durable step
    committed (each rank waited for it before exiting), nothing left in memory or
    processes; a re-run of the run dir with the same command succeeds with the same
    losses, again leaving nothing."""
    run = tmp_path / "run"
    proc = start_job(run, RUN_ARGS, ARGS, config=CONFIG)
    st: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: reached_step(run, 25), 300, "step 25")
        agent = agent_pid(run, "node0")
        trace = tmp_path / "strace.out"
        # The main thread's sendto calls: none while training (its ckptd thread asks ckptd),
        # then the exit's status refresh, then the shutdown order.
        st = _strace(agent, "sendto", "SIGKILL", 2, trace)
        code, err = finish_job(proc, timeout=300)
        assert code == 0, err[-3000:]
        st.wait(timeout=30)
        sent = _calls(trace, "sendto")
        assert len(sent) == 2, sent
        assert '"op\\": \\"status' in sent[0], sent[0]
        assert '"op\\": \\"shutdown' in sent[1], sent[1]
        assert "+++ killed by SIGKILL +++" in trace.read_text()
    finally:
        if st is not None and st.poll() is None:
            st.kill()
            st.wait()
        if proc.poll() is None:
            _kill_run(run, [proc])
    assert losses(run) == reference
    rep = report(run)
    assert rep["phase"] == "SUCCEEDED" and rep["faults"] == [], rep["faults"]
    assert (run / "checkpoints" / f"step_{STEPS}").is_dir()
    assert not list(Path("/dev/shm").glob(f"trainguard-{job_id(run)}-*"))
    assert not run_processes(run)

    res = run_job(run, RUN_ARGS, ARGS, timeout=300, config=CONFIG)
    assert res.returncode == 0, res.stderr[-3000:]
    assert losses(run) == reference
    rep = report(run)
    assert rep["phase"] == "SUCCEEDED" and rep["faults"] == [], rep["faults"]
    evs = events(run)
    (rerun,) = [e for e in evs if e["kind"] == "rerun"]
    assert rerun["previous_phase"] == "SUCCEEDED", rerun
    first = next(e for e in evs[evs.index(rerun) :] if e["kind"] == "generation_started")
    assert first["restore_step"] == STEPS, first  # it restored the last step, and ended
    print(f"re-run restored step {first['restore_step']} and succeeded")
