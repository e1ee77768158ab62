"""Each node's desired state (``protocol.Run | Stop | Idle | Shutdown``) from the job state:
what the agent reconciles toward. Pure."""

from __future__ import annotations

from trainguard.controller.api import (
    NodeObs,
    Phase,
    Pool,
)
from trainguard.controller.config import JobConfig
from trainguard.controller.jobstate import (
    ACTIVE_PHASES,
    JobState,
)
from trainguard.controller.pools import rebooted, world_of
from trainguard.controller.restore import replica_peers, ring_of
from trainguard.protocol import CkptConf, Desired, FaultCause, Idle, Run, Shutdown, Stop


def desired_for(
    s: JobState,
    node_id: str,
    obs: dict[str, NodeObs],
    cfg: JobConfig,
    ring: list[str] | None = None,
) -> Desired:
    """The state a node's agent must reach (level-triggered; the agent reconciles toward it).
    ``ring``: ``restore.ring_of(s)``; a caller computing every node's desired state passes it
    once (each call is then O(1) in the number of nodes)."""
    if s.phase.terminal:
        return Shutdown(reason=s.reason, phase=s.phase.value)
    rank = s.assignment.get(node_id)
    ckpt = CkptConf(
        dir=cfg.ckpt_dir,
        shm_dir=cfg.checkpoint.shm_dir,
        keep=cfg.checkpoint.keep_checkpoints,
        memory_tier=cfg.checkpoint.memory_tier,
    )
    standby = (
        s.pools.get(node_id) == Pool.STANDBY
        and cfg.checkpoint.prefetch_standby
        and cfg.checkpoint.memory_tier
    )
    idle = Idle(
        nproc_per_node=cfg.nproc_per_node,
        warm_spares=cfg.restart.warm_spares,
        ckpt=ckpt,
        prefetch=standby,
    )
    if rank is None or rebooted(s, node_id, obs):
        return idle  # a rebooted node never rejoins the generation it was lost from
    if s.phase in (Phase.STOPPING, Phase.CLEANING, Phase.FAULTED):
        return _stop(s, cfg)
    if s.phase not in ACTIVE_PHASES:
        return idle
    ring = ring if ring is not None else ring_of(s)
    master = ring[0]
    # Each drill fires once per job, but a node whose GEMMs went wrong stays wrong (a defect).
    injects = [i for i in cfg.injects if i.id not in s.fired or i.kind == "gemm-wrong"]
    return Run(
        generation=s.generation,
        node_rank=rank,
        nnodes=len(s.assignment),
        nproc_per_node=cfg.nproc_per_node,
        world_size=world_of(s, cfg),
        master_addr=obs[master].addr if master in obs else None,
        master_port=s.master_port,
        host_store=rank == 0,
        restore_step=s.restore_step,
        restore_gen=s.restore_gen,
        restore_memory=s.restore_memory,
        ckpt=ckpt,
        restarts=s.restarts,
        max_restarts=cfg.restart.max_restarts,
        injects=injects,
        script=cfg.script,
        launch=cfg.launch,
        log_dir=cfg.log_dir,
        script_args=list(cfg.script_args),
        hang_timeout_s=cfg.timeouts.hang_timeout_s,
        hang_timeout_min_s=cfg.timeouts.hang_timeout_min_s,
        hang_timeout_max_s=cfg.timeouts.hang_timeout_max_s,
        first_step_timeout_s=cfg.timeouts.first_step_timeout_s,
        heartbeat_s=cfg.timeouts.heartbeat_s,
        node_timeout_s=cfg.timeouts.node_timeout_s,
        replica_peers=replica_peers(s, node_id, obs, cfg, ring),
        replica_sources=s.restore_sources,
        probe_every_s=cfg.sdc.probe_every_s if cfg.sdc.sdc_check else 0.0,
        warm_spares=cfg.restart.warm_spares,
        replica_groups=cfg.replica.groups,
        replica_max_local_restarts=cfg.replica.max_local_restarts,
        replica_timeout_s=cfg.replica.quorum_timeout_s,
        run_id=s.run_id,
        run_started=s.run_started,
        incarnation=obs[node_id].incarnation if node_id in obs else None,
    )


def _stop(s: JobState, cfg: JobConfig) -> Stop:
    """A stopping generation's ``Stop``: the grace before SIGKILL, a hang's stacks, a planned
    stop's persist, the ranks an in-process recovery keeps."""
    faulted = s.recovery is not None and not s.growing  # growth: workers save, then exit
    grace = cfg.timeouts.fault_stop_grace_s if faulted else cfg.timeouts.stop_grace_s
    cause = s.recovery.fault.cause if faulted and s.recovery is not None else None
    if cause == FaultCause.SDC:
        # Corrupt state: SIGKILL at once. A script that saves on SIGTERM would persist
        # it, and retention would drop the good step the rollback needs to make room.
        grace = 0.0
    hang = cause == FaultCause.HANG
    persist = None
    if s.persist is not None:  # persist this snapshot from memory (a planned stop)
        persist = (int(s.persist["step"]), int(s.persist["generation"]))
    keep = s.recovery.kept if faulted and s.recovery is not None else []
    if keep:
        grace = 0.0  # the failed ranks: nothing to save, their survivors wait on them
    return Stop(
        generation=s.generation, grace_s=grace, dump_stacks=hang, persist=persist,
        keep=list(keep), abort_timeout_s=cfg.timeouts.inprocess_abort_s,
    )  # fmt: skip
