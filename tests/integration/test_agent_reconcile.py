"""The agent's reconcile loop driven without a controller (``Agent.want`` + ``loop_once``):
typed desired states in, real spare and worker processes out."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from trainguard.agent.agent import Agent, AgentConfig
from trainguard.protocol import CkptConf, Idle, Run, Shutdown, Stop

SCRIPT = """
import json, os, sys, time
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINGUARD_GENERATION")
with open(sys.argv[1] + f".{os.environ['RANK']}", "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
time.sleep(float(sys.argv[2]))
"""


def run_state(tmp: Path, gen: int, seconds: float) -> Run:
    return Run(
        generation=gen, node_rank=0, nnodes=1, nproc_per_node=2, world_size=2,
        master_addr="127.0.0.1", master_port=29999, host_store=False, restore_step=None,
        restore_gen=None, restore_memory=True,
        ckpt=CkptConf(dir=str(tmp / "ck"), shm_dir="/dev/shm", keep=3, memory_tier=False),
        restarts=0, max_restarts=3, injects=[], script=str(tmp / "w.py"), launch="script",
        log_dir=None, script_args=[str(tmp / f"env{gen}"), str(seconds)], hang_timeout_s=None,
        hang_timeout_min_s=120.0, hang_timeout_max_s=600.0, first_step_timeout_s=600.0,
        heartbeat_s=0.5, node_timeout_s=600.0, replica_peers=[], replica_sources={},
    )  # fmt: skip


def until(agent: Agent, done: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        agent.loop_once()
        time.sleep(0.05)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    (tmp_path / "w.py").write_text(SCRIPT)
    cfg = AgentConfig(
        controller="127.0.0.1:9", token="ab" * 16, node_id="n0", addr="127.0.0.1",
        run_dir=tmp_path / "run",
    )  # fmt: skip
    a = Agent(cfg)  # no run(): no report or poll thread, no controller
    try:
        yield a
    finally:
        a._stop_workers(grace_s=1.0)
        a.launcher.close()
        a._sock.close()
        a._spare_log.close()


def test_run_stop_idle_shutdown_with_real_processes(agent: Agent, tmp_path: Path) -> None:
    agent.want(Idle(nproc_per_node=2))
    agent.loop_once()  # warm spares for two ranks
    agent.want(run_state(tmp_path, 0, 0.0))
    until(agent, lambda: agent.workers and all(
        w.state == "succeeded" for w in agent.workers.values()), 120, "generation 0 to end")  # fmt: skip
    for rank in (0, 1):
        env = json.loads((tmp_path / f"env0.{rank}").read_text())
        assert env == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
                       "TRAINGUARD_GENERATION": "0"}  # fmt: skip
    agent.want(run_state(tmp_path, 1, 300.0))  # a new generation replaces the finished one
    until(agent, lambda: (tmp_path / "env1.1").exists(), 120, "generation 1 to start")
    pids = [w.proc.pid for w in agent.workers.values()]
    assert agent.generation == 1 and all(psutil.pid_exists(p) for p in pids)
    agent.want(Stop(generation=1, grace_s=2.0))
    agent.loop_once()
    assert agent._stopped_generation == 1
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    agent.want(Shutdown(phase="STOPPED", reason="stopped by request"))
    assert agent.loop_once() is True  # the agent exits


def test_warm_spares_sets_how_many_spares_wait_and_zero_starts_workers_on_demand(
    agent: Agent, tmp_path: Path
) -> None:
    """``warm_spares``: an idle node keeps that many spares (None: one per worker); 0 keeps
    none, and a generation's workers are spares started when it starts, handed their rank at
    once (the same path, without the head start)."""

    def spares() -> set[int]:
        return {p for p in agent.launcher.pids if psutil.pid_exists(p)}

    agent.want(Idle(nproc_per_node=2, warm_spares=1))
    agent.loop_once()
    assert len(spares()) == 1
    agent.launcher.close()
    agent.want(Idle(nproc_per_node=2, warm_spares=0))
    agent.loop_once()
    assert spares() == set()
    run = dataclasses.replace(run_state(tmp_path, 0, 3.0), warm_spares=0)
    agent.want(run)
    until(agent, lambda: (tmp_path / "env0.1").exists(), 120, "both ranks to start")
    assert len(agent.workers) == 2 and spares() == set()
    until(agent, lambda: all(w.state == "succeeded" for w in agent.workers.values()), 120,
          "generation 0 to end")  # fmt: skip
    assert spares() == set()
    agent.want(Idle(nproc_per_node=2))  # unset: one per worker
    agent.loop_once()
    assert len(spares()) == 2


def test_a_run_made_for_the_nodes_previous_agent_starts_no_worker(
    agent: Agent, tmp_path: Path
) -> None:
    """A restarted agent's first answer can be the Run its lost predecessor was given (the
    controller answers a report before its tick sees the new incarnation). Run carries the
    incarnation it was made for: another agent starts no worker of it, for as long as it
    holds it; the same Run made for this agent starts its workers."""
    run = dataclasses.replace(run_state(tmp_path, 0, 0.0), warm_spares=0)
    agent.want(dataclasses.replace(run, incarnation="lost-agent"))
    t_end = time.monotonic() + 3.0
    while time.monotonic() < t_end:
        agent.loop_once()
        time.sleep(0.05)
    assert agent.workers == {} and agent.generation is None
    assert not (tmp_path / "env0.0").exists()
    agent.want(dataclasses.replace(run, incarnation=agent.incarnation))
    until(agent, lambda: (tmp_path / "env0.1").exists(), 120, "both ranks to start")
    assert agent.generation == 0 and len(agent.workers) == 2
