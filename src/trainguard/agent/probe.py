"""The agent's in-job GEMM probe (``health/probe.py``): as each generation starts here and then
every ``probe_every_s`` while it runs, one known-answer GEMM on each of the node's devices, in a long-lived process
(torch imported once), on a thread of its own. Silent data corruption that reaches every
replica alike through the all-reduce (a node whose GEMMs went wrong) leaves the replicas'
fingerprints in agreement; this probe still sees it, and names the node.

What the agent reports (``latest``): ``{"t"`` (wall clock), ``"generation"``, ``"step"``
(the newest step its ranks had finished when the probe ran), ``"ok"``, ``"last_ok"``
([generation, step] of the newest passing probe, or None), ``"results"`` (per device) or
``"error"`` (the probe process failed or missed its deadline: inconclusive, never a fault)}.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("trainguard.agent.probe")
PROBE_N = 256  # the known-answer matrices' size (health/probe.py: ~1 ms of one core)
PROBE_DEADLINE_S = 60.0  # one answer (the first: torch imported and the devices warmed)
RETRY_S = 5.0  # the least time between two starts of a probe process that failed

# (generation, step, drill fired) of the running generation; None: nothing runs here now.
Context = Callable[[], tuple[int, int, bool] | None]


class GemmProbe:
    """Runs the probe every ``every_s`` seconds while ``context()`` names a running
    generation. ``set_period(0)`` pauses it. ``close()`` kills the probe process."""

    def __init__(self, context: Context, env: dict[str, str]) -> None:
        self._context, self._env = context, env
        self._every = 0.0
        self._lock = threading.Lock()
        self._latest: dict[str, Any] | None = None
        self._last_ok: list[int] | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The probe process's pid (not a worker: the agent's clean-up spares it)."""
        proc = self._proc
        return proc.pid if proc is not None else None

    @property
    def latest(self) -> dict[str, Any] | None:
        with self._lock:
            return self._latest

    def set_period(self, every_s: float) -> None:
        """Probe every ``every_s`` seconds (0: not at all); starts the thread on first use."""
        self._every = every_s
        if every_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gemm-probe", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._kill()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        """Probe each generation as it starts, then every ``every_s``: a failed probe then
        always has a passing one of its own generation before it, unless the node was bad
        when the generation began."""
        next_at, probed_gen, retry_at = 0.0, None, 0.0
        while not self._stop.wait(timeout=max(0.05, min(0.5, next_at - time.monotonic()))):
            ctx = self._context() if self._every > 0 else None
            now = time.monotonic()
            if ctx is None or (ctx[0] == probed_gen and now < next_at) or now < retry_at:
                continue
            if not self._ready():  # inconclusive (recorded); a fresh process in a while
                retry_at = now + max(self._every, RETRY_S)
                continue
            ctx = self._context()  # again: the step now, not before the process started
            if ctx is not None:
                next_at, probed_gen = time.monotonic() + self._every, ctx[0]
                self._probe(*ctx)

    def _ready(self) -> bool:
        """The probe process is up (started now if needed: torch imported, devices warmed),
        so that a probe's step is the step it ran at."""
        if self._proc is not None and self._proc.poll() is None:
            return True
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "trainguard.health.probe", str(os.getpid()), str(PROBE_N)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,  # into the agent's log
                text=True, env=self._env,
            )  # fmt: skip
            self._read()
            return True
        except (OSError, ValueError, TimeoutError) as e:
            self._failed(time.time(), None, None, e)
            return False

    def _failed(self, t: float, generation: int | None, step: int | None, e: Exception) -> None:
        """The probe process failed or missed its deadline: inconclusive, never a fault."""
        self._kill()  # the next probe starts a fresh process
        if self._stop.is_set():
            return  # closing: the kill above ended it
        log.warning("GEMM probe inconclusive: %s", e)
        with self._lock:
            self._latest = {"t": t, "generation": generation, "step": step, "ok": None,
                            "error": f"{type(e).__name__}: {e}", "last_ok": self._last_ok}  # fmt: skip

    def _probe(self, generation: int, step: int, wrong: bool) -> None:
        out: dict[str, Any] = {"t": time.time(), "generation": generation, "step": step}
        try:
            reply = self._ask({"wrong": wrong})
            out.update(ok=bool(reply["ok"]), results=reply["results"])
        except (OSError, ValueError, KeyError, TimeoutError) as e:
            self._failed(out["t"], generation, step, e)
            return
        if out["ok"]:
            self._last_ok = [generation, step]
        elif out["ok"] is False:
            log.error("GEMM probe: wrong result at step %d: %s", step, out["results"])
        out["last_ok"] = self._last_ok
        with self._lock:
            self._latest = out

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise OSError("the probe process is gone")
        proc.stdin.write(json.dumps(req) + "\n")
        proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        """The probe process's next line, within PROBE_DEADLINE_S."""
        proc = self._proc
        if proc is None or proc.stdout is None:
            raise OSError("the probe process is gone")
        ready, _, _ = select.select([proc.stdout], [], [], PROBE_DEADLINE_S)
        if not ready:
            raise TimeoutError(f"no answer within {PROBE_DEADLINE_S:.0f}s")
        line = proc.stdout.readline()
        if not line:
            raise OSError(f"the probe process exited ({proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
        for f in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()
