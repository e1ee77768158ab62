"""Host checks (NHC-style): CPU load, free memory, disk, /dev/shm, leftover processes, GPUs.

The agent also reports ``host_health`` with every heartbeat: a faulty node returns to
standby only when it passes. Floors, not ratios: below these a restart would fail anyway
(a worker and its warm spare need about 1 GiB here; a durable step of the example is
about 40 MiB, a 7B model's shard several GiB, so raise them for big models).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import psutil

from trainguard.runtime import api as rt_api

MIN_FREE_MEMORY = 1 << 30  # bytes available (MemAvailable)
MIN_FREE_DISK = 1 << 30  # bytes free where checkpoints go
MIN_FREE_SHM = 256 << 20  # bytes free in the snapshot directory (/dev/shm)


def host_health(run_dir: Path, shm_dir: Path) -> tuple[bool, list[str]]:
    """(ok, problems): available memory, free disk under ``run_dir``, free ``shm_dir``.

    Each problem is one line naming the measurement and the floor. Never raises: an
    unreadable path is itself a problem.
    """
    problems = []
    mem = psutil.virtual_memory().available
    if mem < MIN_FREE_MEMORY:
        problems.append(f"memory: {mem >> 20} MiB available < {MIN_FREE_MEMORY >> 20} MiB")
    for what, path, floor in (("disk", run_dir, MIN_FREE_DISK), ("shm", shm_dir, MIN_FREE_SHM)):
        free = _free(path)
        if isinstance(free, str):
            problems.append(f"{what}: {path}: {free}")
        elif free < floor:
            problems.append(f"{what}: {free >> 20} MiB free at {path} < {floor >> 20} MiB")
    return not problems, problems


def _free(path: Path) -> int | str:
    """Free bytes of the file system holding ``path`` (its nearest existing parent), or why not."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError as e:
        return e.strerror or str(e)


def leftover_processes(node_id: str, agent_pid: int) -> list[dict[str, Any]]:
    """Processes of an earlier job on this node: their environment names this node
    (``TRAINGUARD_NODE_ID``, set for every worker, spare and ckptd an agent starts) but the
    agent that started them (``TRAINGUARD_AGENT_PID``) is gone: orphans that still hold
    memory, ports, GPUs. Each: ``{"pid", "cmd"}`` (command line, 200 characters at most).

    Processes of another *live* agent are not leftovers: hosts simulated on one machine
    share a process table, and two simulated jobs may both have a "node0".
    """
    try:
        mine = {agent_pid, *(c.pid for c in psutil.Process(agent_pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        mine = {agent_pid}
    mine.add(os.getpid())
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
        if p.pid in mine:
            continue
        try:
            env = p.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
            continue
        if env.get(rt_api.ENV_NODE_ID) != node_id or _owner_alive(env, p.info["create_time"]):
            continue
        cmd = " ".join(p.info.get("cmdline") or [])[:200]
        out.append({"pid": p.pid, "cmd": cmd})
    return out


def _owner_alive(env: dict[str, str], created: float) -> bool:
    """The agent named in ``env`` still runs (and is not a newer process reusing its pid)."""
    try:
        pid = int(env.get("TRAINGUARD_AGENT_PID", "0"))
        if pid <= 0:
            return False
        owner = psutil.Process(pid)
        return owner.create_time() <= created and owner.is_running()
    except (ValueError, psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def measure(
    *, ckpt_dir: Path, shm_dir: Path, node_id: str, agent_pid: int, clock_skew_s: float | None
) -> dict[str, Any]:
    """Everything the host check measures, for ``judge``. Sizes in bytes, load per core
    (1-minute load average / logical CPUs), ``gpus`` from ``gpu.measure`` (empty without
    NVML)."""
    from trainguard.health import gpu

    cores = os.cpu_count() or 1
    return {
        "cores": cores,
        "load_per_core": round(os.getloadavg()[0] / cores, 3),
        "memory_available": psutil.virtual_memory().available,
        "disk_free": _free(ckpt_dir),
        "disk_path": str(ckpt_dir),
        "shm_free": _free(shm_dir),
        "shm_path": str(shm_dir),
        "leftovers": leftover_processes(node_id, agent_pid),
        "clock_skew_s": clock_skew_s,
        "gpus": gpu.measure(),
    }
