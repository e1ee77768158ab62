"""Environment contract between the agent and a worker's runtime.

The agent sets the standard torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT,
TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_ERROR_FILE) plus the ones named here.
"""

from __future__ import annotations

ENV_AGENT_ADDR = "TRAINGUARD_AGENT_ADDR"  # host:port of the agent's UDP report socket
ENV_TOKEN = "TRAINGUARD_TOKEN"  # hex job token, signs reports (wire.py)
# the shared secret every host of `trainguard run --rdzv-endpoint` derives the job token from
ENV_SECRET = "TRAINGUARD_SECRET"
# "secret": the agent's token was derived from ENV_SECRET (cli/hosts.py), so a refusal is final
ENV_TOKEN_SOURCE = "TRAINGUARD_TOKEN_SOURCE"
ENV_RUN_DIR = "TRAINGUARD_RUN_DIR"  # the job's run directory
ENV_GENERATION = "TRAINGUARD_GENERATION"  # rendezvous epoch, 0-based
ENV_RESTORE_STEP = "TRAINGUARD_RESTORE_STEP"  # step every rank restores, "" for none
ENV_CKPT_DIR = "TRAINGUARD_CKPT_DIR"  # durable checkpoint directory
ENV_INJECT = "TRAINGUARD_INJECT"  # JSON list of armed InjectSpec (faults/inject.py)
ENV_HEARTBEAT_S = "TRAINGUARD_HEARTBEAT_S"  # runtime heartbeat period in seconds
ENV_RESTORE_GEN = "TRAINGUARD_RESTORE_GEN"  # generation that wrote the agreed restore step
# "0": the world changed since the restore point was written; memory snapshots are of the old
# world's ranks (their per-rank and per-shard state differ): every rank reads the durable tier
ENV_RESTORE_MEMORY = "TRAINGUARD_RESTORE_MEMORY"
ENV_CKPTD = (
    "TRAINGUARD_CKPTD"  # abstract socket name of the node's ckptd ("" = in-process persister)
)
ENV_SHM_DIR = "TRAINGUARD_SHM_DIR"  # where snapshot slots live (default /dev/shm)
ENV_PREFETCH_DIR = "TRAINGUARD_PREFETCH_DIR"  # this node's prefetched durable step, if any
ENV_MEMORY_TIER = "TRAINGUARD_MEMORY_TIER"  # "0" = durable-only checkpoints
ENV_JOB_ID = "TRAINGUARD_JOB_ID"  # short job id (names shm slots)
# The run that writes checkpoint parts (checkpoint/runid.py): the controller draws one per run
# of a run dir; Unix seconds it was drawn
ENV_RUN_ID = "TRAINGUARD_RUN_ID"
ENV_RUN_STARTED = "TRAINGUARD_RUN_STARTED"
ENV_NODE_ID = "TRAINGUARD_NODE_ID"  # this node's id
ENV_REPLICA_SOURCE = "TRAINGUARD_REPLICA_SOURCE"  # host:port of a ckptd holding our replica
# Local recovery (runtime/replica.py): G replica groups ("1": off); which restart of its group
# this process is ("0": the generation's start); the quorum's and cross-group collectives'
# deadline in seconds
ENV_REPLICA_GROUPS = "TRAINGUARD_REPLICA_GROUPS"
ENV_REPLICA_INCARNATION = "TRAINGUARD_REPLICA_INCARNATION"
ENV_REPLICA_TIMEOUT_S = "TRAINGUARD_REPLICA_TIMEOUT_S"

DEFAULT_HEARTBEAT_S = 0.5
