"""The state machine of ``trainguard check`` (a controller with no job): one pre-flight run
over the nodes that joined, then the end. Pure, like ``decide``: the executor starts the run
it asks for and records the events."""

from __future__ import annotations

from typing import Any

from trainguard.controller.api import Phase, Pool
from trainguard.controller.config import JobConfig
from trainguard.controller.jobstate import Inputs, JobState, copy_state
from trainguard.health.coordinator import CheckRun

Event = tuple[str, dict[str, Any]]


def decide_check(
    s0: JobState,
    alive: list[str],
    checking: bool,
    last_run: CheckRun | None,
    now: float,
    cfg: JobConfig,
    inputs: Inputs,
) -> tuple[JobState, list[Event], list[str]]:
    """One step: ``alive``, the nodes reporting now (sorted); ``checking``, a pre-flight run
    is in progress; ``last_run``, the newest finished or running one. Returns the new state
    (``s0`` unchanged), the events, and the nodes to start the run on (empty: none to start).

    PENDING → RUNNING once ``cfg.nodes`` agents reported (or some, after
    ``cfg.timeouts.join_timeout_s``; none by then: FAILED); RUNNING → SUCCEEDED when the run is over,
    each node in standby (passed) or faulty (failed or inconclusive); a stop request: STOPPED.
    """
    s = copy_state(s0)
    events: list[Event] = []
    start: list[str] = []
    s.stop_requested = s.stop_requested or inputs.stop_requested
    waited = now - s.phase_since
    if s.phase.terminal:
        pass
    elif s.stop_requested:
        s.phase, s.reason = Phase.STOPPED, "stopped by request"
    elif not checking and s.phase == Phase.PENDING:
        if len(alive) >= cfg.nodes or (alive and waited > cfg.timeouts.join_timeout_s):
            start = list(alive)
            s.phase = Phase.RUNNING
        elif waited > cfg.timeouts.join_timeout_s:
            s.phase, s.reason = Phase.FAILED, f"no agent joined in {cfg.timeouts.join_timeout_s}s"
    elif not checking and s.phase == Phase.RUNNING and last_run is not None:
        for n in last_run.nodes:
            bad = last_run.problems.get(n)
            s.pools[n] = Pool.FAULTY if bad else Pool.STANDBY
            how = "inconclusive (the check itself failed)" if n in last_run.unsure else "failed"
            why = f"{how} pre-flight: " + "; ".join(bad) if bad else "passed pre-flight"
            events.append(
                ("pool_changed", {"node": n, "from": None, "to": s.pools[n].value, "reason": why})
            )
        passed = sum(1 for n in last_run.nodes if not last_run.problems.get(n))
        s.phase, s.reason = Phase.SUCCEEDED, f"{passed} of {len(last_run.nodes)} nodes passed"
        if last_run.unsure:
            s.reason += f", {len(last_run.unsure)} inconclusive (run the check again)"
    return s, events, start
