"""What a timed-out wait in a test shows: the state of the jobs under the test's tmp dir.

CI keeps only the output of a failed test (no run dirs), so ``wait_for`` (tests/conftest.py)
appends this to its AssertionError: each run dir's newest events, the warnings and errors of
its agents', ckptds' and spares' logs, and the test's processes still alive with their state.
Bounded (``MAX_CHARS``) so one failure's account does not push the others out of the log."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil

from trainguard.chaos import faults as chaos_faults

MAX_CHARS = 6000
EVENTS = 20  # newest events per run dir, besides the checkpoint chatter
LOG_LINES = 6  # newest WARNING/ERROR lines per log file
LOG_TAIL_BYTES = 65536

_test_dir: Path | None = None  # set by the autouse fixture for the running test


def set_test_dir(d: Path | None) -> None:
    global _test_dir
    _test_dir = d


# One per rank and step: their newest step is shown, not each of them.
CHATTER = frozenset(
    ("ckpt_staged", "ckpt_part_durable", "ckpt_durable", "replica_stored", "standby_prefetched")
)
FIELDS = ("node", "rank", "generation", "step", "to", "cause", "reason")  # of each event shown


def _event_line(e: dict[str, object], t0: float) -> str:
    keep = {k: v for k, v in e.items() if k in FIELDS}
    ts = e.get("ts")
    when = f"{float(ts) - t0:+7.1f}s" if isinstance(ts, int | float) else "      ?"
    return f"    {when} {e.get('kind')} {json.dumps(keep)[:160]}"


def _events(run: Path) -> list[str]:
    evs = chaos_faults.events(run)  # complete lines only
    if not evs:
        return ["    (no events)"]
    t0 = float(evs[0].get("ts", 0.0))
    steps = [e["step"] for e in evs if e.get("kind") in CHATTER and isinstance(e.get("step"), int)]
    control = [e for e in evs if e.get("kind") not in CHATTER]
    out = [
        f"    {len(evs)} events, newest checkpointed step {max(steps, default=None)}; newest "
        f"{EVENTS} of the others (seconds from the first):"
    ]
    return out + [_event_line(e, t0) for e in control[-EVENTS:]]


def _log_problems(logs: Path) -> list[str]:
    out = []
    for f in sorted(logs.glob("*.log")):
        if f.name.startswith("rank"):
            continue
        with open(f, "rb") as fh:
            fh.seek(max(0, f.stat().st_size - LOG_TAIL_BYTES))
            text = fh.read().decode(errors="replace")
        bad = [x for x in text.splitlines() if "WARNING" in x or "ERROR" in x or "Error" in x]
        out += [f"    {f.name}: {x[:200]}" for x in bad[-LOG_LINES:]]
    return out


def _processes(d: Path) -> list[str]:
    out = []
    for p in chaos_faults.run_processes(d):  # naming ``d`` in their command line or environment
        try:
            age = time.time() - p.create_time()
            short = " ".join(Path(a).name if a.startswith("/") else a for a in p.cmdline()[:6])
            out.append(f"    pid {p.pid} {p.status()} {age:.0f}s: {short[:150]}")
        except psutil.Error:
            continue
    return out


def account() -> str:
    """The state of the running test's jobs (empty when no test dir is known)."""
    d = _test_dir
    if d is None or not d.exists():
        return ""
    parts = [f"state under {d}:"]
    try:
        for ev in sorted(d.rglob("events.jsonl")):
            run = ev.parent
            parts.append(f"  run dir {run.relative_to(d)}:")
            parts += _events(run)
            if (run / "logs").is_dir():
                parts += _log_problems(run / "logs")
        procs = _processes(d)
        parts.append(f"  processes of this test still running: {len(procs)}")
        parts += procs
    except OSError as e:
        parts.append(f"  (could not read: {e})")
    text = "\n".join(parts)
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS] + "\n  ...(cut)"
