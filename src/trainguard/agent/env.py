"""The environment of the processes an agent starts: spares, pre-flight checks, workers."""

from __future__ import annotations

import json
import os
import socket
from typing import TYPE_CHECKING

import psutil

from trainguard.checkpoint import ckptd_client as ckptd_mod
from trainguard.checkpoint.prefetch import prefetch_root
from trainguard.protocol import Run
from trainguard.runtime import api as rt_api

if TYPE_CHECKING:
    from trainguard.agent.agent import AgentConfig


def interface_of(addr: str) -> str | None:
    """The network interface holding ``addr`` (gloo must use it: GLOO_SOCKET_IFNAME), or None."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == addr for a in addrs):
            return name
    return "lo" if addr.startswith("127.") else None


def base_env(cfg: AgentConfig) -> dict[str, str]:
    """The environment every process the agent starts gets: ours, with torchrun's
    ``OMP_NUM_THREADS=1`` default, gloo's interface for ``cfg.addr``, unbuffered output,
    and the node and agent that own it (leftover processes are attributed by them)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several workers per node
    ifname = cfg.gloo_ifname or interface_of(cfg.addr)
    if ifname:
        env.setdefault("GLOO_SOCKET_IFNAME", ifname)
    env["PYTHONUNBUFFERED"] = "1"
    env[rt_api.ENV_NODE_ID] = cfg.node_id  # names this node's processes (leftovers)
    env["TRAINGUARD_AGENT_PID"] = str(os.getpid())  # and their owner
    return env


def worker_env(
    cfg: AgentConfig, d: Run, local_rank: int, *, report_port: int, job_id: str
) -> dict[str, str]:
    """Local rank ``local_rank``'s environment in generation ``d``: torchrun's variables
    (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, TORCHELASTIC_*: a plain
    torchrun script runs unchanged) and the runtime's (``runtime/api.py``: where the agent
    listens on UDP ``report_port``, the restore point, the checkpoint tiers, drills)."""
    gen, nproc = d.generation, d.nproc_per_node
    rank = d.node_rank * nproc + local_rank
    run_dir = str(cfg.run_dir.resolve())
    env = base_env(cfg)
    if nproc == 1 and "OMP_NUM_THREADS" not in os.environ:
        # torchrun's rule: one thread per worker only when several share the node; a lone
        # worker keeps torch's default (every core).
        env.pop("OMP_NUM_THREADS", None)
    # As torchrun's agent sets it: NCCL errors and timeouts abort the process group (the
    # rank exits, the fault is seen) instead of leaving a collective hung. The user's wins.
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(d.world_size),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(d.node_rank),
        "GROUP_WORLD_SIZE": str(d.nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(d.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": str(d.master_addr),
        "MASTER_PORT": str(d.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(d.restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(d.max_restarts),
        "TORCHELASTIC_RUN_ID": cfg.run_dir.name,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": str(cfg.run_dir / "errors" / f"gen{gen}.rank{rank}.json"),
        rt_api.ENV_AGENT_ADDR: f"{cfg.addr}:{report_port}",
        rt_api.ENV_TOKEN: cfg.token,
        rt_api.ENV_RUN_DIR: run_dir,
        rt_api.ENV_GENERATION: str(gen),
        rt_api.ENV_RESTORE_STEP: "" if d.restore_step is None else str(d.restore_step),
        rt_api.ENV_INJECT: json.dumps([i.to_json() for i in d.injects]),
        # the runtime → agent beat stays local and fast whatever the report period
        rt_api.ENV_HEARTBEAT_S: str(min(d.heartbeat_s, rt_api.DEFAULT_HEARTBEAT_S)),
        rt_api.ENV_CKPT_DIR: str(d.ckpt.dir),
        rt_api.ENV_RESTORE_GEN: "" if d.restore_gen is None else str(d.restore_gen),
        rt_api.ENV_RESTORE_MEMORY: "1" if d.restore_memory else "0",
        rt_api.ENV_CKPTD: ckptd_mod.socket_name(job_id, cfg.node_id) if d.ckpt.memory_tier else "",
        rt_api.ENV_MEMORY_TIER: "1" if d.ckpt.memory_tier else "0",
        rt_api.ENV_SHM_DIR: str(d.ckpt.shm_dir),
        rt_api.ENV_PREFETCH_DIR: str(prefetch_root(d.ckpt.shm_dir, job_id, cfg.node_id)),
        rt_api.ENV_JOB_ID: job_id,
        rt_api.ENV_RUN_ID: d.run_id,
        rt_api.ENV_RUN_STARTED: repr(d.run_started),
        rt_api.ENV_REPLICA_SOURCE: str(d.replica_sources.get(str(rank), "")),
        rt_api.ENV_NODE_ID: cfg.node_id,
        rt_api.ENV_REPLICA_GROUPS: str(d.replica_groups),
        rt_api.ENV_REPLICA_INCARNATION: "0",
        rt_api.ENV_REPLICA_TIMEOUT_S: str(d.replica_timeout_s),
    }
