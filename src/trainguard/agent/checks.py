"""The agent's pre-flight runner: one check task at a time, as a subprocess with a deadline.

The controller names the task in the desired state (``{"action": "check", "task": …}``);
the runner starts ``python -m trainguard.health.node`` in its own process group, kills the
group when the task's deadline passes or the desired state moves on, and keeps the results
of finished tasks for the agent's next reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from trainguard.protocol import CheckResult, CheckTask

KEEP_RESULTS = 4  # results reported with every heartbeat until the task is this old


@dataclasses.dataclass(kw_only=True, slots=True)
class _Running:
    id: str
    proc: subprocess.Popen[bytes]
    out: Path
    log: IO[bytes]
    deadline: float  # monotonic
    started: float


class CheckRunner:
    def __init__(self, run_dir: Path, node_id: str, controller_host: str) -> None:
        self.dir = run_dir / "checks"
        self.node_id, self.controller_host = node_id, controller_host
        self._running: _Running | None = None
        self.results: dict[str, dict[str, Any]] = {}  # task id → result, newest last
        self._lock = threading.Lock()  # results are read by the agent's report thread

    def run(self, task: CheckTask, env: dict[str, str]) -> None:
        """Make ``task`` the one running (or finished); call every agent loop."""
        if task.id in self.results:
            return
        r = self._running
        if r is not None and r.id != task.id:
            self.stop()
            r = None
        if r is None:
            self._start(task, env)
            return
        if r.proc.poll() is not None:
            self._collect(r)
        elif time.monotonic() > r.deadline:
            self.stop()
            self._done(r.id, {"error": f"check did not finish within {task.deadline_s:.0f} s"})

    def _start(self, task: CheckTask, env: dict[str, str]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = self.dir / f"{self.node_id}.{task.id}"
        body = {**task.to_json(), "agent_pid": os.getpid(), "store_host": self.controller_host}
        Path(f"{stem}.task.json").write_text(json.dumps(body))
        out = Path(f"{stem}.result.json")
        out.unlink(missing_ok=True)
        log = open(f"{stem}.log", "ab")  # noqa: SIM115 - closed when the task ends
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.health.node", f"{stem}.task.json", str(out)],
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        now = time.monotonic()
        self._running = _Running(
            id=task.id, proc=proc, out=out, log=log, deadline=now + float(task.deadline_s),
            started=now,
        )  # fmt: skip

    def _collect(self, r: _Running) -> None:
        self._running = None
        r.log.close()
        try:
            result = json.loads(r.out.read_text())
        except (OSError, ValueError):
            tail = Path(r.log.name).read_bytes()[-400:].decode(errors="replace").strip()
            result = {"error": f"check process exited with status {r.proc.returncode}: {tail}"}
        result["wall_s"] = round(time.monotonic() - r.started, 3)
        self._done(r.id, result)

    def _done(self, task_id: str, result: dict[str, Any]) -> None:
        with self._lock:
            self.results[task_id] = result
            while len(self.results) > KEEP_RESULTS:
                self.results.pop(next(iter(self.results)))

    def stop(self) -> None:
        """Kill the running task's process group, if any (deadline 5 s). A check still running
        (past its deadline, or cut off by the controller's stage deadline) first gets its
        stack, native frames included, written to its log (``workers.dump_stacks``, at most
        5 s): what it was stuck in is the next question."""
        r, self._running = self._running, None
        if r is None:
            return
        if r.proc.poll() is None:
            from trainguard.agent.workers import dump_stacks

            stack = dump_stacks({0: r.proc.pid}, timeout_s=5.0)[0]
            with contextlib.suppress(OSError, ValueError):
                took = time.monotonic() - r.started
                r.log.write(f"\ntrainguard: check stopped after {took:.0f} s while running; "
                            f"its stack:\n{stack}\n".encode())  # fmt: skip
                r.log.flush()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(r.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.proc.wait(timeout=5.0)
        r.log.close()

    def report(self) -> list[CheckResult]:
        with self._lock:
            return [CheckResult(task=k, result=v) for k, v in self.results.items()]
