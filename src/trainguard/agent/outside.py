"""What the agent sees of a worker from outside the process, for any script.

A script that never calls trainguard's runtime sends no heartbeats or step reports; the agent
still sees its process: the kernel's process state (``T``: stopped by SIGSTOP or a debugger)
and the CPU time of its process tree (the worker and its data-loader children). From these:

- a rank whose process has been *stopped* for ``hang_timeout_min_s`` is hung (any script);
- each rank's CPU-idle seconds (its main thread and child processes used less than
  ``WORKING_CPU_SHARE`` of a core) go to the controller, which calls a job without the runtime wedged when *every* rank
  idled for ``hang_timeout_s`` (else ``hang_timeout_max_s``): one idle rank may just be
  waiting for a busy peer on another node (decide.py).

It also fires the drills that need no runtime (``--inject KIND:…:after=SECONDS``): SIGKILL
of the rank's worker, SIGSTOP of its process group, or power loss of the node, T seconds
after the rank's script started (its spare opened the rank's log: a spare started for the
first generation may still be importing torch when it is handed its rank).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable

import psutil

from trainguard.agent.workers import WORKING_CPU_SHARE, Worker
from trainguard.faults.inject import InjectSpec

SAMPLE_S = 1.0  # how often process state and CPU time are read (psutil, /proc)
_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def tree_cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of ``proc``'s main thread and of its live descendants (data
    loader workers), whole. The worker's other threads are left out: gloo's and NCCL's
    progress loops and trainguard's reporter poll on their own whatever the script does
    (seen: gloo's loop thread using 0.5% of a core in a rank blocked for good after its
    peers exited, which read as work and hid the stuck exit). Raises psutil.Error when
    ``proc`` itself is gone."""
    main = next((t for t in proc.threads() if t.id == proc.pid), None)
    if main is not None:
        total = main.user_time + main.system_time
    else:
        t = proc.cpu_times()
        total = t.user + t.system
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            c = child.cpu_times()
            total += c.user + c.system
    return total


def sample(w: Worker, now_mono: float) -> None:
    """Read ``w``'s process state and tree CPU time; update its outside-view fields."""
    if w.script_started_mono is None and w.log_path.exists():
        w.script_started_mono = now_mono  # a warm spare may still be importing before this
    try:
        proc = psutil.Process(w.proc.pid)
        status = proc.status()
        cpu = tree_cpu_s(proc)
    except psutil.Error:
        return  # it exited: the exit poll sees it
    stopped = status in _STOPPED
    w.proc_state = "stopped" if stopped else status
    if not stopped:
        w.stopped_since_mono = None
    elif w.stopped_since_mono is None:
        w.stopped_since_mono = now_mono
    if w.tree_cpu_s is None or w.cpu_checked_mono is None:
        w.tree_cpu_s, w.cpu_checked_mono, w.cpu_progress_mono = cpu, now_mono, now_mono
        return
    if cpu - w.tree_cpu_s >= WORKING_CPU_SHARE * (now_mono - w.cpu_checked_mono):
        w.cpu_progress_mono = now_mono
    w.tree_cpu_s, w.cpu_checked_mono = cpu, now_mono


def stalled(w: Worker, limit: float, now_mono: float) -> tuple[float, float, str] | None:
    """(stopped seconds, limit, how) when ``w``'s process has been stopped longer than
    ``limit`` seconds (the job's ``hang_timeout_min_s``), else None."""
    if w.stopped_since_mono is not None and now_mono - w.stopped_since_mono > limit:
        return now_mono - w.stopped_since_mono, limit, "its process is stopped (SIGSTOP?)"
    return None


def due_drills(
    specs: list[InjectSpec],
    fired: set[int],
    workers: dict[int, Worker],
    node_rank: int,
    now_mono: float,
) -> list[tuple[InjectSpec, Worker]]:
    """The timed drills (``after=T``) due now on this node, with the worker each targets
    (for node-down: the node's first worker)."""
    due = []
    for spec in specs:
        if spec.after is None or spec.id in fired:
            continue
        if spec.kind == "node-down":
            if spec.node != node_rank or not workers:
                continue
            w = min(workers.values(), key=lambda x: x.rank)
        else:
            w = workers.get(spec.rank if spec.rank is not None else -1)
            if w is None or w.state != "running":
                continue
        if w.script_started_mono is not None and now_mono - w.script_started_mono >= spec.after:
            due.append((spec, w))
    return due


def fire(spec: InjectSpec, w: Worker, power_off: Callable[[], None]) -> None:
    """Carry out a timed drill on ``w`` (the event is the caller's, sent before this)."""
    if spec.kind == "kill":
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.proc.pid, signal.SIGKILL)
    elif spec.kind == "hang":
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(w.proc.pid, signal.SIGSTOP)
    elif spec.kind == "node-down":
        power_off()
