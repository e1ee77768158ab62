"""The workers of one node's current generation (``WorkerGroup``) and what starts and stops
their processes (``Launcher``).

The agent reconciles toward the controller's desired state; the group carries out its
worker side: start a generation's ranks, poll their exits, stop them (SIGTERM → grace →
SIGKILL of each process group, then every stray descendant), power the node off (a drill).
``ProcessLauncher`` does it with real processes (warm spares, ``agent/spare.py``); a test
injects its own launcher to drive the agent's reconcile loop without processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

from trainguard.agent import workers as wk
from trainguard.protocol import clock


class Proc(Protocol):
    """A started worker process: ``subprocess.Popen`` has this shape."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


class Launcher(Protocol):
    """Starts and stops worker processes. Every method returns within its own deadline."""

    def fill(self, n: int) -> None:
        """Have ``n`` warm spares ready (started ahead: a start then skips the imports)."""

    def start(self, spec: dict[str, Any]) -> Proc:
        """Run one rank (``spec``: env, argv, mode, cwd, log, error_file; agent/spare.py)."""
        ...

    def stop(self, procs: list[Proc], *, grace_s: float) -> None:
        """SIGTERM each process group, ``grace_s`` s, SIGKILL, reap (5 s deadline)."""

    def clean(self, keep: set[int]) -> list[int]:
        """SIGKILL every descendant of the agent not in ``keep``; the pids killed."""
        ...

    def stacks(self, pids: dict[int, int]) -> dict[int, str]:
        """Rank → stack text of each process (rank → pid), within 10 s; never raises."""
        ...

    def kill_all(self, procs: list[Proc]) -> None:
        """SIGKILL every spare and each process group of ``procs``, at once (power loss)."""

    @property
    def pids(self) -> set[int]:
        """The warm spares' pids (kept by ``clean``)."""
        ...

    def close(self) -> None:
        """Kill every spare."""


class ProcessLauncher:
    """The real launcher: warm spares (``workers.SparePool``) handed a rank's spec."""

    def __init__(self, env: dict[str, str], log: IO[bytes]) -> None:
        self.spares = wk.SparePool(env, log)

    def fill(self, n: int) -> None:
        self.spares.fill(n)

    def start(self, spec: dict[str, Any]) -> Proc:
        proc = self.spares.take()
        wk.launch(proc, spec)
        return proc

    def stop(self, procs: list[Proc], *, grace_s: float) -> None:
        wk.kill_groups(procs, grace_s=grace_s)  # type: ignore[arg-type]

    def clean(self, keep: set[int]) -> list[int]:
        return wk.clean_descendants(keep=keep)

    def stacks(self, pids: dict[int, int]) -> dict[int, str]:
        return wk.dump_stacks(pids)

    def kill_all(self, procs: list[Proc]) -> None:
        self.spares.close()
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    @property
    def pids(self) -> set[int]:
        return self.spares.pids

    def close(self) -> None:
        self.spares.close()


class WorkerGroup:
    """The generation whose workers run on this node, and its workers by global rank.

    ``on_event(kind, **data)`` records what happened (``worker_started``, ``worker_exited``,
    ``workers_stopped``) for the agent's next report.
    """

    def __init__(self, launcher: Launcher, on_event: Callable[..., None]) -> None:
        self.launcher = launcher
        self._on_event = on_event
        self.generation: int | None = None
        self.workers: dict[int, wk.Worker] = {}
        # Survivors of the last stopped generation whose processes wait to resume, by rank
        # (in-process recovery: agent/inprocess.py), and the world size they ran in.
        self.parked: dict[int, wk.Worker] = {}
        self.parked_world: int | None = None
        self.stopped_at: float | None = None  # wall clock of the last stop's kill
        self.cleaned_at: float | None = None  # ... and of its stray clean-up

    def running(self) -> list[wk.Worker]:
        return [w for w in self.workers.values() if w.state == "running"]

    def start(
        self,
        generation: int,
        ranks: list[tuple[int, int, dict[str, Any]]],
        resume: Callable[[wk.Worker, dict[str, Any]], bool] | None = None,
    ) -> None:
        """Start ``generation``'s ranks, each (rank, local rank, spec) (see ``Launcher.start``;
        the spec's ``log`` and ``error_file`` are the worker's). A rank whose process is
        parked is handed to ``resume(parked worker, spec)`` first (in-process recovery); when
        that returns False, or without it, the rank gets a new process and the parked one is
        killed. Raises OSError if a process cannot be started (the caller stops those that
        were)."""
        self.generation, self.workers = generation, {}
        parked, self.parked = self.parked, {}
        for rank, local_rank, spec in ranks:
            old = parked.pop(rank, None)
            alive = old is not None and old.proc.poll() is None
            if old is not None and alive and resume is not None and resume(old, spec):
                self.workers[rank] = wk.Worker(
                    rank=rank, local_rank=local_rank, proc=old.proc, log_path=old.log_path,
                    error_file=Path(spec["error_file"]), started_mono=time.monotonic(),
                    inprocess=True, addr=old.addr, env=dict(spec["env"]),
                    resumed_from=old.resumed_from,  # the generation it ran in
                )  # fmt: skip
                self._on_event("worker_resumed", generation=generation, rank=rank,
                               pid=old.proc.pid, from_generation=old.resumed_from)  # fmt: skip
                continue
            if old is not None:
                parked[rank] = old
            proc = self.launcher.start(spec)
            self.workers[rank] = wk.Worker(
                rank=rank,
                local_rank=local_rank,
                proc=proc,  # type: ignore[arg-type]
                log_path=Path(spec["log"]),
                error_file=Path(spec["error_file"]),
                started_mono=time.monotonic(),
                env=dict(spec["env"]),
            )
            self._on_event(
                "worker_started", generation=generation, rank=rank, pid=proc.pid, log=spec["log"]
            )
        self._kill_parked(parked, "the next generation did not resume it (another world size, "
                          "or no checkpoint to restore)")  # fmt: skip

    def replace(self, rank: int, local_rank: int, spec: dict[str, Any], **why: Any) -> None:
        """A new process for ``rank`` in the running generation (local recovery: its replica
        group restarts while the others train; ``agent/local.py``). ``why``: the event's
        further fields. Raises OSError if it cannot be started."""
        proc = self.launcher.start(spec)
        self.workers[rank] = wk.Worker(
            rank=rank, local_rank=local_rank, proc=proc,  # type: ignore[arg-type]
            log_path=Path(spec["log"]), error_file=Path(spec["error_file"]),
            started_mono=time.monotonic(), env=dict(spec["env"]),
        )  # fmt: skip
        self._on_event("worker_started", generation=self.generation, rank=rank, pid=proc.pid,
                       log=spec["log"], **why)  # fmt: skip

    def _kill_parked(self, parked: dict[int, wk.Worker], why: str) -> None:
        """Kill parked processes that will not be resumed (an ``inprocess_escalated`` each)."""
        if not parked:
            return
        self.launcher.stop([w.proc for w in parked.values()], grace_s=0.0)
        for w in parked.values():
            self._on_event("inprocess_escalated", generation=w.resumed_from, rank=w.rank,
                           pid=w.proc.pid, reason=why)  # fmt: skip

    def poll(self, *, stopping: bool = False) -> bool:
        """Note the running workers that exited (``stopped`` while ``stopping``, else
        ``succeeded`` or ``failed`` with the error it left). Returns whether any did."""
        exited = False
        for rank, w in list(self.parked.items()):  # parked between generations: died?
            if w.proc.poll() is not None:
                del self.parked[rank]
                self._on_event("inprocess_escalated", generation=w.resumed_from, rank=rank,
                               pid=w.proc.pid, reason="its process exited while parked")  # fmt: skip
        for w in self.workers.values():
            if w.state not in ("running", "parked"):
                continue
            code = w.proc.poll()
            if code is None:
                continue
            exited = True
            w.exit_code, w.exited_at = code, clock.wall()
            if stopping:
                w.state = "stopped"
            elif code == 0:
                w.state = "succeeded"
            else:
                w.state = "failed"
                w.error = w.read_error()
            self._on_event(
                "worker_exited",
                generation=self.generation,
                rank=w.rank,
                pid=w.proc.pid,
                exit_code=code,
                state=w.state,
                error=w.error,
            )
        return exited

    def kill(self, ranks: set[int], *, grace_s: float) -> None:
        """Stop the workers of ``ranks`` now (``Launcher.stop``); they count as stopped."""
        procs = [w.proc for r, w in self.workers.items() if r in ranks]
        if procs:
            self.launcher.stop(procs, grace_s=grace_s)
            self.poll(stopping=True)

    def stop(self, *, grace_s: float, keep: set[int], park: set[int] | None = None) -> None:
        """Stop every worker (``Launcher.stop``) but the parked ones of ``park`` (ranks: kept
        for the next generation, ``self.parked``), then every stray descendant of the agent
        except the spares, ``keep`` (its ckptd) and the parked processes with their children;
        the group is then empty. Without ``park``, processes parked before are killed too."""
        park = park or set()
        self._kill_parked(self.parked, "the job did not resume it")  # left from before
        self.parked = {}
        if not self.workers and self.generation is None:
            return
        kept = {r: w for r, w in self.workers.items() if r in park and w.state == "parked"}
        self.launcher.stop(
            [w.proc for r, w in self.workers.items() if r not in kept], grace_s=grace_s
        )
        self.stopped_at = clock.wall()
        self.poll(stopping=True)
        pids = {w.proc.pid for w in kept.values()}
        killed = self.launcher.clean(self.launcher.pids | keep | pids)
        wk.drop_orphan_semaphores()  # the killed ranks' (their resource trackers died too)
        self.cleaned_at = clock.wall()
        self._on_event(
            "workers_stopped",
            generation=self.generation,
            grace_s=grace_s,
            stray_killed=killed,
            exit_codes={w.rank: w.exit_code for r, w in self.workers.items() if r not in kept},
            kept={r: w.proc.pid for r, w in kept.items()},
        )
        for w in kept.values():
            w.resumed_from = self.generation  # while parked: the generation it ran in
        self.parked = kept
        self.workers, self.generation = {}, None

    def stacks(self) -> dict[int, str]:
        """Rank → stack of every running worker (``Launcher.stacks``)."""
        return self.launcher.stacks({w.rank: w.proc.pid for w in self.running()})

    def power_off(self) -> None:
        """SIGKILL every worker and spare at once (a node-down drill; the agent follows)."""
        procs = [w.proc for w in (*self.workers.values(), *self.parked.values())]
        self.launcher.kill_all(procs)
