"""Faults of the stores trainguard's own parts host (docs/self-faults.md §9, tables
"Controller" and "Store host"): the pre-flight TCPStore of the controller, the rendezvous
TCPStore of node rank 0's agent, and the replica groups' quorum ledger in it. Real processes
(``trainguard controller`` and one ``trainguard agent`` per node, on loopback addresses of
their own), real signals: SIGKILL and SIGSTOP (then SIGCONT) of the process that hosts the
store. Each job ends with the fault-free run's loss for every step, the right culprit (no
node for the controller's own fault, the node when a node is lost) and nothing left behind."""

from __future__ import annotations

import contextlib
import json
import os
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
    PREFLIGHT_CONFIG,
    ROOT,
    TINY,
    events,
    fault_free_losses,
    losses,
    reached_step,
    report,
    trainguard_cmd,
    wait_for,
)
from tests.helpers.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, ARGS = PACED_STEPS, PACED_ARGS  # PACE: rank 0 paced 5x (tests/conftest.py)
START_S = 360  # a controller, agents and their spares start (a torch import each), loaded;
# CI once waited over 240 s for the pre-flight's net stage (its node stage ran first)
NODE_TIMEOUT_S = 3.0  # FAST_CONFIG's
assert f"node_timeout_s = {NODE_TIMEOUT_S}" in FAST_CONFIG
# A loaded 2-core machine took over 120 s (the default) to start a generation's ranks.
CONFIG = FAST_CONFIG + "rendezvous_timeout_s = 300.0\n"
# The pre-flight's pair deadline, short: a freeze of the controller's store outlasts it.
PAIR_TIMEOUT_S = 4.0
REPLICA = ROOT / "examples" / "gpt" / "replicas.py"
REPLICA_STEPS = 400
REPLICA_ARGS = [*TINY, "--steps", str(REPLICA_STEPS), "--durable-every", "10"]


def _faults(run: Path) -> list[tuple[Any, Any]]:
    """(cause, node) of every fault, as finally attributed."""
    return [(f["cause"], f["node_id"]) for f in report(run)["faults"]]


def _kinds(run: Path, *kinds: str) -> list[dict[str, Any]]:
    return [e for e in events(run) if e["kind"] in kinds]


def _generation_started(run: Path, gen: int) -> dict[str, Any] | None:
    got = [e for e in _kinds(run, "generation_started") if e["generation"] == gen]
    return got[0] if got else None


def _to_bad_pool(run: Path) -> list[dict[str, Any]]:
    """Every move of a node into the faulty or retired pool."""
    return [e for e in _kinds(run, "pool_changed") if e["to"] in ("faulty", "retired")]


def _worker(run: Path, rank: int, generation: int = 0, timeout: float = START_S) -> int:
    """The pid of ``rank``'s worker of ``generation`` once it started (a loaded machine: a
    generation's workers can take minutes to start)."""
    ev = wait_for(
        lambda: [
            e for e in _kinds(run, "worker_started", "worker_resumed")
            if e["rank"] == rank and e["generation"] == generation
        ],
        timeout,
        f"rank {rank} of generation {generation} to start",
    )  # fmt: skip
    return int(ev[-1]["pid"])


def _gone(pid: int) -> bool:
    """``pid`` exited (a zombie not yet reaped counts: it runs nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stored(run: Path) -> dict[str, Any]:
    """The job state the controller's store holds now (read-only)."""
    db = sqlite3.connect(f"file:{run / 'job.sqlite'}?mode=ro", uri=True, timeout=10.0)
    try:
        row = db.execute("SELECT value FROM kv WHERE key = 'state'").fetchone()
    finally:
        db.close()
    return dict(json.loads(row[0])) if row else {}


def _store_of(run: Path, gen: int) -> tuple[str, str, int]:
    """(node, address, port) of generation ``gen``'s rendezvous store: its node rank 0 and
    the port that node's agent reported (what the ranks get as MASTER_ADDR:MASTER_PORT)."""

    def ask() -> tuple[str, str, int] | None:
        s = _stored(run)
        if s.get("generation") != gen or s.get("master_port") is None:
            return None
        node = next(n for n, r in s["assignment"].items() if r == 0)
        return node, f"127.0.0.{int(node.removeprefix('node')) + 2}", int(s["master_port"])

    return tuple(wait_for(ask, START_S, f"generation {gen}'s store"))  # type: ignore[return-value]


def _connected(pid: int, addr: str, port: int) -> bool:
    """Process ``pid`` (a rank) has a TCP connection to ``addr:port`` (its store)."""
    with contextlib.suppress(psutil.Error):
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            if c.raddr and c.raddr.ip.removeprefix("::ffff:") == addr and c.raddr.port == port:
                return True
    return False


def _listens(pid: int, addr: str, port: int) -> bool:
    """Process ``pid`` has a TCP socket listening on ``addr:port`` (its store's)."""
    with contextlib.suppress(psutil.Error):
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            ip = c.laddr.ip.removeprefix("::ffff:")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and ip in (addr, "::"):
                return True
    return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The fault-free run's losses (two nodes, same model, data and seed)."""
    return fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)


@contextlib.contextmanager
def _cluster(
    tmp_path: Path,
    config: str,
    ctl_args: list[str],
    script: Path = GPT,
    script_args: list[str] = ARGS,
) -> Iterator[Cluster]:
    job = Cluster(tmp_path / "run", config, ctl_args, script, script_args)
    try:
        yield job
    finally:
        job.close()


# --------------------------------------------------------------------------- pre-flight store
PREFLIGHT = (
    PREFLIGHT_CONFIG
    + "rendezvous_timeout_s = 300.0\n"
    + f"\n[checks]\npair_timeout_s = {PAIR_TIMEOUT_S}\n"
)


def _net_stage(run: Path) -> dict[str, Any]:
    """The first pre-flight run's net stage once it started (its TCPStore in use)."""
    return dict(
        wait_for(
            lambda: [e for e in _kinds(run, "preflight_stage") if e["stage"] == "net"],
            START_S,
            "the pre-flight's net stage",
        )[0]
    )


def _check_preflight_blamed_nobody(run: Path) -> list[dict[str, Any]]:
    """Every pre-flight run that finished; asserts none put a node in a bad pool, the job
    started with both nodes and found no fault. Returns the runs."""
    assert not _to_bad_pool(run), _to_bad_pool(run)
    joined = _kinds(run, "node_joined")
    assert {(e["node"], e["pool"]) for e in joined} == {("node0", "standby"), ("node1", "standby")}
    assert _faults(run) == []
    gen0 = _generation_started(run, 0)
    assert gen0 is not None and gen0["assignment"] == {"node0": 0, "node1": 1}, gen0
    return _kinds(run, "preflight_finished")


def test_the_controller_killed_mid_preflight_redoes_it_and_blames_no_node(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """The controller (``trainguard controller``, pre-flight on) SIGKILLed while its
    pre-flight's net stage runs on the TCPStore it hosts (the agents' check processes are
    connected to it), then started again on the same run dir. The restarted controller has
    no run in progress: it checks both nodes again under a new run (the killed run's late
    results are not taken), both pass, neither goes to a bad pool, the job trains to the end
    with no fault and the fault-free losses."""
    with _cluster(tmp_path, PREFLIGHT, ["--nodes", "2", *PACE]) as job:
        job.start_controller()
        for i in (0, 1):
            job.start_agent(i)
        net = _net_stage(job.run)
        assert job.controller is not None
        job.controller.kill()
        job.controller.communicate(timeout=30)
        assert not _kinds(job.run, "preflight_finished"), "the kill came after the run ended"
        t0 = time.monotonic()
        job.start_controller()
        wait_for(lambda: _generation_started(job.run, 0), START_S, "the first generation")
        started_s = time.monotonic() - t0
        job.wait()
    assert losses(job.run) == reference
    runs = _check_preflight_blamed_nobody(job.run)
    # The killed run never ended; the restarted controller checked its nodes again (in one
    # run, or one a node when the nodes' first reports came apart on a loaded machine).
    assert runs and all(r["run"] > net["run"] for r in runs), runs
    assert all(v["ok"] for r in runs for v in r["verdicts"].values()), runs
    assert set(net["nodes"]) <= {n for r in runs for n in r["verdicts"]}, (net, runs)
    (back,) = _kinds(job.run, "controller_restarted")
    assert back["phase"] == "PENDING", back
    print(f"killed in run {net['run']}'s net stage on {net['nodes']}; runs "
          f"{[(r['run'], sorted(r['verdicts'])) for r in runs]} passed, "
          f"generation 0 started {started_s:.1f}s after the restart")  # fmt: skip


def test_the_controller_frozen_mid_preflight_lets_the_checks_time_out_and_blames_no_node(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """The controller SIGSTOPped while its pre-flight's net stage runs, for twice the pair
    deadline (``pair_timeout_s`` 4 s), then SIGCONTed. Its TCPStore froze with it: the
    agents' pair checks wait out their deadline and fail on it; the verdicts are
    inconclusive (the check's machinery failed, not a node), so both nodes are checked again
    and pass; no node goes to a bad pool, no fault, the fault-free losses."""
    with _cluster(tmp_path, PREFLIGHT, ["--nodes", "2", *PACE]) as job:
        ctl = job.start_controller()
        for i in (0, 1):
            job.start_agent(i)
        net = _net_stage(job.run)
        os.kill(ctl.pid, signal.SIGSTOP)
        try:
            time.sleep(2 * PAIR_TIMEOUT_S)
        finally:
            os.kill(ctl.pid, signal.SIGCONT)
        t0 = time.monotonic()
        wait_for(lambda: _generation_started(job.run, 0), START_S, "the first generation")
        started_s = time.monotonic() - t0
        job.wait()
    assert losses(job.run) == reference
    runs = _check_preflight_blamed_nobody(job.run)
    first = next(r for r in runs if r["run"] == net["run"])
    unsure = _kinds(job.run, "preflight_inconclusive")
    verdicts = first["verdicts"]
    print(f"frozen {2 * PAIR_TIMEOUT_S:.0f}s in run {net['run']}'s net stage: {verdicts}; "
          f"inconclusive events {[(e['node'], e['run']) for e in unsure]}; "
          f"{len(runs)} runs; generation 0 started {started_s:.1f}s after the wake")  # fmt: skip
    for n, v in verdicts.items():  # failed on the freeze, if at all: never a node's fault
        assert v["ok"] or v["inconclusive"], (n, v)


# --------------------------------------------------------------------------- rendezvous store
def test_the_store_hosts_agent_frozen_is_lost_and_the_next_store_is_on_the_new_rank_0(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """node0's agent (node rank 0: it hosts generation 0's rendezvous TCPStore) SIGSTOPped
    mid-training; its worker runs on. The store freezes with the agent, its heartbeat stops:
    node0 is lost after the node timeout and the standby takes a rank. Generation 1's store
    is hosted by generation 1's node rank 0 (its workers' MASTER_ADDR:MASTER_PORT is a
    socket that agent listens on). Woken, the old agent stops its worker (fencing or the
    controller's Idle) and none of its workers joins a later generation. One fault, node0's;
    the fault-free losses."""
    with _cluster(tmp_path, CONFIG, ["--nodes", "2", "--standby", "1", *PACE]) as job:
        job.start_controller()
        for i in (0, 1, 2):
            job.start_agent(i)
        old = _worker(job.run, 0)
        store0 = _store_of(job.run, 0)
        assert store0[:2] == ("node0", "127.0.0.2"), store0
        assert _listens(job.agents[0].pid, *store0[1:]), store0
        assert wait_for(lambda: _connected(old, *store0[1:]), 60, "rank 0 on the store")
        wait_for(lambda: reached_step(job.run, 25), START_S, "step 25")
        agent = job.agents[0].pid
        os.kill(agent, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            gen1 = wait_for(lambda: _generation_started(job.run, 1), 90, "generation 1")
            lost_s = time.monotonic() - t0
            assert "node0" not in gen1["assignment"], gen1
            new = _worker(job.run, 0, 1)
            store1 = _store_of(job.run, 1)
            rank0 = store1[0]
            assert gen1["assignment"][rank0] == 0, (gen1, store1)
            host = job.agents[int(rank0.removeprefix("node"))].pid
            assert _listens(host, *store1[1:]), store1
            assert wait_for(lambda: _connected(new, *store1[1:]), 60, "rank 0 on the new store")
            wait_for(lambda: time.monotonic() - t0 > 2 * NODE_TIMEOUT_S, 10, "the freeze")
        finally:
            os.kill(agent, signal.SIGCONT)
        t1 = time.monotonic()
        wait_for(lambda: _gone(old), 60, "node0's old worker to be stopped")
        stopped_s = time.monotonic() - t1
        job.wait()
    assert losses(job.run) == reference
    assert _faults(job.run) == [("node_lost", "node0")]
    rejoined = [
        e for e in _kinds(job.run, "worker_started", "worker_resumed")
        if e["node"] == "node0" and e["generation"] >= 1
    ]  # fmt: skip
    assert not rejoined, rejoined
    fenced = [e for e in _kinds(job.run, "fenced") if e["node"] == "node0"]
    assert [e["generation"] for e in fenced] in ([0], []), fenced
    print(f"node0 lost and generation 1 started {lost_s:.1f}s into the freeze; store "
          f"{store0} -> {store1} on {rank0}; old worker gone {stopped_s:.1f}s after the wake; "
          f"{'fenced' if fenced else 'idled by the controller'}")  # fmt: skip


def test_the_store_hosts_agent_started_again_gives_the_next_generation_a_new_store(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """node0's agent (node rank 0, host of generation 0's rendezvous TCPStore) SIGKILLed
    mid-training, no standby; its worker and ckptd die with it. A fresh ``trainguard agent``
    of node0 is started (as after a reboot): it takes node rank 0 again and hosts a new store
    for generation 1 (a new port, on the new agent), the job resumes and ends with the
    fault-free losses. One fault, node0's."""
    with _cluster(tmp_path, CONFIG, ["--nodes", "2", *PACE]) as job:
        job.start_controller()
        for i in (0, 1):
            job.start_agent(i)
        old = _worker(job.run, 0)
        store0 = _store_of(job.run, 0)
        assert store0[:2] == ("node0", "127.0.0.2"), store0
        wait_for(lambda: reached_step(job.run, 25), START_S, "step 25")
        job.agents[0].kill()
        job.agents[0].wait(timeout=30)
        wait_for(lambda: _gone(old), 30, "node0's worker to die with its agent")
        t0 = time.monotonic()
        fresh = job.start_agent(0)
        gen1 = wait_for(lambda: _generation_started(job.run, 1), 120, "generation 1")
        back_s = time.monotonic() - t0
        assert gen1["assignment"] == {"node0": 0, "node1": 1}, gen1
        new = _worker(job.run, 0, 1)
        store1 = _store_of(job.run, 1)
        assert store1[:2] == ("node0", "127.0.0.2") and store1 != store0, (store0, store1)
        assert _listens(fresh.pid, *store1[1:]), store1
        assert wait_for(lambda: _connected(new, *store1[1:]), 60, "rank 0 on the new store")
        job.wait()
    assert losses(job.run) == reference
    assert _faults(job.run) == [("node_lost", "node0")]
    print(f"store {store0} -> {store1} on node0's fresh agent; generation 1 started "
          f"{back_s:.1f}s after it")  # fmt: skip


# --------------------------------------------------------------------------- quorum ledger
@pytest.fixture(scope="module")
def replica_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The fault-free losses of the replica groups' example (two groups, one a node)."""
    run = tmp_path_factory.mktemp("replica-reference") / "run"
    cfg = run.parent / "job.toml"
    cfg.write_text(FAST_CONFIG)
    cmd = trainguard_cmd(
        "run", "--run-dir", run, "--config", cfg, "--nodes", "2", "--replica-groups", "2",
        REPLICA, *REPLICA_ARGS,
    )  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return _replica_losses(run, require_full=True)


def _replica_losses(run: Path, require_full: bool = False) -> dict[int, float]:
    """Per-step loss of the replica groups' metrics, the last line of a step counting;
    asserts every line is a step both groups took (``width`` 2): no group stepped alone."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    alone = [m for m in lines if m["width"] != 2]
    assert not alone, alone[:5]
    out = {m["step"]: m["loss"] for m in lines}
    if require_full:
        assert sorted(out) == list(range(1, REPLICA_STEPS + 1))
    return out


def _quorum_host_fault(tmp_path: Path, reference: dict[int, float], sig: int) -> None:
    """Replica groups (2, one a node) and a standby; ``sig`` to node0's agent (node rank 0:
    it hosts the generation's TCPStore and in it the quorum ledger) mid-training."""
    config = CONFIG
    ctl = ["--nodes", "2", "--standby", "1", "--replica-groups", "2"]
    with _cluster(tmp_path, config, ctl, REPLICA, REPLICA_ARGS) as job:
        job.start_controller()
        for i in (0, 1, 2):
            job.start_agent(i)
        old = _worker(job.run, 0)
        wait_for(lambda: reached_step(job.run, 60), START_S, "step 60")
        agent = job.agents[0].pid
        os.kill(agent, sig)
        t0 = time.monotonic()
        try:
            wait_for(lambda: _generation_started(job.run, 1), 120, "generation 1")
            recovered_s = time.monotonic() - t0
            wait_for(lambda: time.monotonic() - t0 > 2 * NODE_TIMEOUT_S, 10, "the freeze")
        finally:
            if sig == signal.SIGSTOP:
                os.kill(agent, signal.SIGCONT)
        wait_for(lambda: _gone(old), 60, "node0's old worker to be stopped")
        job.wait()
    got = _replica_losses(job.run)
    assert got == reference
    assert _faults(job.run) == [("node_lost", "node0")]
    evs = events(job.run)
    restarted = [e for e in evs if e["kind"] in ("group_restarted", "group_fallback")]
    epochs = [(e["group"], e["epoch"], e["members"]) for e in evs if e["kind"] == "quorum_epoch"]
    gen1 = _generation_started(job.run, 1)
    assert gen1 is not None and "node0" not in gen1["assignment"], gen1
    rejoined = [
        e for e in evs
        if e["kind"] in ("worker_started", "worker_resumed") and e["node"] == "node0"
        and e["generation"] >= 1
    ]  # fmt: skip
    assert not rejoined, rejoined
    print(f"{signal.Signals(sig).name}: generation 1 {recovered_s:.1f}s later, restore "
          f"{gen1['restore_step']} ({gen1['restore_tiers']}); local: "
          f"{[(e['kind'], e['group'], e.get('store_reached')) for e in restarted]}; "
          f"epochs {epochs[-6:]}")  # fmt: skip


def test_the_quorum_stores_host_killed_loses_no_step(
    tmp_path: Path, replica_reference: dict[int, float]
) -> None:
    """Replica groups: node0's agent, host of the TCPStore that holds the quorum ledger,
    SIGKILLed mid-training (its group 0 ranks and ckptd die with it). The survivors' group
    cannot write a new epoch without the store, so it never steps alone (every step of the
    run is one both groups took); node0 is lost, global recovery restarts on the standby
    from a checkpoint, and every step's loss is the fault-free run's."""
    _quorum_host_fault(tmp_path, replica_reference, signal.SIGKILL)


def test_the_quorum_stores_host_frozen_loses_no_step(
    tmp_path: Path, replica_reference: dict[int, float]
) -> None:
    """Replica groups: node0's agent, host of the quorum ledger's TCPStore, SIGSTOPped
    mid-training (its group 0 ranks run on), woken after the recovery. Every rank's quorum
    read waits on the frozen store; node0 is lost, global recovery restarts on the standby
    from a checkpoint; woken, the old agent's ranks are stopped and never rejoin. Every step
    was one both groups took, with the fault-free loss."""
    _quorum_host_fault(tmp_path, replica_reference, signal.SIGSTOP)
