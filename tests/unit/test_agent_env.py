"""A worker's environment from its desired state (agent/env.py): torchrun's variables, so a
plain torchrun script runs unchanged, and the runtime's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainguard.agent.agent import AgentConfig
from trainguard.agent.env import worker_env
from trainguard.protocol import CkptConf, Run
from trainguard.runtime import api as rt_api

RUN = Run(
    generation=3, node_rank=1, nnodes=2, nproc_per_node=4, world_size=8,
    master_addr="127.0.0.2", master_port=29555, host_store=False, restore_step=40,
    restore_gen=2, restore_memory=False,
    ckpt=CkptConf(dir="/ck", shm_dir="/dev/shm", keep=3, memory_tier=True),
    restarts=1, max_restarts=3, injects=[], script="train.py", launch="script", log_dir=None,
    script_args=[], hang_timeout_s=None, hang_timeout_min_s=30.0, hang_timeout_max_s=600.0,
    first_step_timeout_s=600.0, heartbeat_s=4.0, node_timeout_s=20.0, replica_peers=[],
    replica_sources={"6": "127.0.0.3:4100"},
)  # fmt: skip


def test_a_worker_gets_torchrun_s_variables_and_the_runtime_s(tmp_path: Path) -> None:
    cfg = AgentConfig(
        controller="127.0.0.1:1", token="ab", node_id="node1", addr="127.0.0.3", run_dir=tmp_path
    )
    env = worker_env(cfg, RUN, 2, report_port=4242, job_id="j1")
    torchrun = {
        "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "6", "ROLE_WORLD_SIZE": "8",
        "MASTER_ADDR": "127.0.0.2", "MASTER_PORT": "29555", "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": tmp_path.name,
    }  # fmt: skip
    assert {k: env[k] for k in torchrun} == torchrun
    assert env["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "errors" / "gen3.rank6.json")
    assert env["GLOO_SOCKET_IFNAME"] == os.environ.get("GLOO_SOCKET_IFNAME", "lo")  # 127.x
    assert env[rt_api.ENV_AGENT_ADDR] == "127.0.0.3:4242"
    assert (env[rt_api.ENV_RESTORE_STEP], env[rt_api.ENV_RESTORE_GEN]) == ("40", "2")
    assert env[rt_api.ENV_RESTORE_MEMORY] == "0"  # after a world change: the durable tier
    assert env[rt_api.ENV_HEARTBEAT_S] == str(rt_api.DEFAULT_HEARTBEAT_S)  # local beat stays fast
    assert env[rt_api.ENV_REPLICA_SOURCE] == "127.0.0.3:4100"
    assert env[rt_api.ENV_MEMORY_TIER] == "1" and env[rt_api.ENV_CKPTD]


def test_one_thread_per_worker_only_when_several_share_the_node_and_nccl_errors_abort(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's rules: ``OMP_NUM_THREADS=1`` for several workers per node, torch's default
    for a lone one; ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` unless the user set it. The user's
    own ``OMP_NUM_THREADS`` always wins."""
    import dataclasses

    cfg = AgentConfig(
        controller="127.0.0.1:1", token="ab", node_id="node1", addr="127.0.0.3", run_dir=tmp_path
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    alone = dataclasses.replace(RUN, nproc_per_node=1, node_rank=0, world_size=2)
    assert worker_env(cfg, RUN, 0, report_port=1, job_id="j")["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in worker_env(cfg, alone, 0, report_port=1, job_id="j")
    assert (
        worker_env(cfg, RUN, 0, report_port=1, job_id="j")["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    for run in (RUN, alone):
        env = worker_env(cfg, run, 0, report_port=1, job_id="j")
        assert env["OMP_NUM_THREADS"] == "3" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_simulated_nodes_on_one_machine_share_its_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``trainguard run --nodes N`` simulates N hosts on this one: the agent's torchrun rule
    (a lone worker takes every core) would oversubscribe it, so the agents it starts get
    ``OMP_NUM_THREADS`` = cores over workers, unless the user set it."""
    from trainguard.cli.run import Cluster
    from trainguard.controller.config import JobConfig

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)

    def omp(nodes: int, nproc: int) -> str:
        cfg = JobConfig.from_fields(script="x.py", run_dir=str(tmp_path), nodes=nodes,
                                    nproc_per_node=nproc)  # fmt: skip
        return Cluster(cfg, "127.0.0.1:1", tmp_path / "token")._env()["OMP_NUM_THREADS"]

    assert (omp(1, 1), omp(2, 1), omp(2, 2), omp(4, 4)) == ("8", "4", "2", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert omp(2, 1) == "3"
