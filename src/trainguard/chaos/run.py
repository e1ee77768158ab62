"""A chaos run: the GPT example under random faults for minutes, the same job without faults
beside it (niced, so it takes only the CPU the paced job leaves idle), and the comparison
(``trainguard chaos``).

``ChaosSpec`` is what to run, ``ChaosRun`` runs it (``ChaosRun(spec).run()`` returns the
summary dict that ``trainguard chaos --json`` prints). Layout of ``spec.out_dir``:
``job/`` the run under chaos, ``reference/`` the fault-free run, ``*.toml`` their configs,
``*.log`` their console output. Every process of both runs is killed and their /dev/shm
segments removed on every way out (an error, a deadline, KeyboardInterrupt).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from trainguard.chaos.faults import (
    ChaosError,
    Fault,
    FaultMenu,
    drop_segments,
    events,
    kill_everything,
    losses,
    metrics,
)

# A GPT small enough for a 2-core machine: ~30 ms a step with 2 ranks.
TINY = (
    "--n-embd", "32", "--n-layer", "1", "--n-head", "2", "--block-size", "32",
    "--batch-size", "4", "--data-max-bytes", "200000", "--dropout", "0.1",
)  # fmt: skip
DURABLE_EVERY = 10  # steps between durable checkpoints (a snapshot every step)
KEEP_CHECKPOINTS = 4  # durable steps retained: corrupt copies leave older good ones
# Short timeouts so that faults are seen in seconds (JobConfig fields, docs/config.md).
FAST_CONFIG = """
heartbeat_s = 0.2
node_timeout_s = 3.0
reboot_delay_s = 1.0
fault_stop_grace_s = 0.1
stop_grace_s = 10.0
recheck_s = 1.0
preflight = "off"
probe_every_s = 0
"""
# The guards against scripts that never progress judge generations; chaos ends many of them
# early on purpose.
CHAOS_CONFIG = FAST_CONFIG + (
    "max_restarts = 1000\nno_progress_generations = 50\nuser_error_generations = 50\n"
    f"keep_checkpoints = {KEEP_CHECKPOINTS}\n"
)
PACE_FACTOR = 16  # rank 0's steps take 16x their compute time (a sleep): minutes of training
# Measured on 2 CPUs: 55–190 paced steps a minute under chaos (recoveries, frozen ckptds), 3–4 a
# second without faults. Sized so that the job outlasts the faults by a short tail.
STEPS_PER_MINUTE = 120
START_S = 15.0  # no fault before the first checkpoints exist
FAULT_GAP_S = (4.0, 10.0)  # seconds between faults
# A job ahead of its schedule (a larger share of its steps done than of the minutes) would end
# before the minutes do, and the faults with it: faults then come every 2-4 s (recoveries and
# the steps they redo slow it) until it is back on schedule.
AHEAD_GAP_S = (2.0, 4.0)
# The longest a fault waits for the job to make a step after the last one (_await_progress).
PROGRESS_WAIT_S = 30.0
LAUNCH_TIMEOUT_S = 30.0  # a killed launcher is reaped
REFERENCE_NICE = 10  # the fault-free run's niceness: it yields the CPU to the job under faults


def redo_bound(keep_checkpoints: int = KEEP_CHECKPOINTS, durable_every: int = DURABLE_EVERY) -> int:
    """Steps a recovery may redo at most: the step reached before the fault minus the step
    restored. A restore reads the newest copy that verifies, in memory, a peer's replica or
    the durable tier; the oldest it can fall back to is the oldest retained durable step.
    The run keeps ``keep_checkpoints`` durable steps ``durable_every`` apart, the newest of
    them at most ``durable_every`` steps (one persist in flight) behind the step reached:
    ``keep_checkpoints * durable_every + durable_every``."""
    return keep_checkpoints * durable_every + durable_every


def default_steps(minutes: float) -> int:
    """Steps of a job that is still training when ``minutes`` of faults end (measured on 2
    CPUs: ``STEPS_PER_MINUTE`` paced steps a minute under chaos, with margin)."""
    return max(200, round(minutes * STEPS_PER_MINUTE))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ChaosSpec:
    """What a chaos run runs."""

    script: Path  # the GPT example, examples/gpt/train.py
    out_dir: Path  # holds job/ and reference/; must not exist or be empty
    minutes: float  # how long faults are injected (from the job's start), > 0
    seed: int  # seeds the choice of fault, target and gap
    steps: int  # the job's optimizer steps, >= 1

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"--minutes {self.minutes}: must be > 0; e.g. --minutes 10")
        if self.steps < 1:
            raise ValueError(f"--steps {self.steps}: must be >= 1; or leave it out (sized to "
                             "outlast the faults)")  # fmt: skip
        if not self.script.is_file():
            raise FileNotFoundError(
                f"{self.script}: the GPT example is missing; pass --script "
                "PATH/TO/examples/gpt/train.py (it is in a checkout of trainguard)"
            )
        if self.out_dir.exists() and (not self.out_dir.is_dir() or any(self.out_dir.iterdir())):
            raise ValueError(f"--run-dir {self.out_dir}: exists and is not empty; pass a new "
                             "directory (chaos writes two runs into it)")  # fmt: skip

    def script_args(self) -> list[str]:
        return [*TINY, "--steps", str(self.steps), "--ckpt-every", "1",
                "--durable-every", str(DURABLE_EVERY)]  # fmt: skip


class Job:
    """One ``trainguard run`` of the example as a subprocess in its own session (a Ctrl-C at
    the terminal reaches the chaos command, which kills it), its console in ``<name>.log``."""

    def __init__(
        self, spec: ChaosSpec, name: str, run_args: list[str], config: str, *, nice: int = 0
    ) -> None:
        self.run_dir = spec.out_dir / name
        self.nice = nice  # added to the launcher's niceness (inherited by all it starts)
        self.config = spec.out_dir / f"{name}.toml"
        self.config.write_text(config)
        self.log_path = spec.out_dir / f"{name}.log"
        self.cmd = [
            sys.executable, "-m", "trainguard", "run", "--run-dir", str(self.run_dir),
            "--config", str(self.config), *run_args, str(spec.script), *spec.script_args(),
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.started_at = self.ended_at = 0.0  # time.monotonic(); ended_at: first seen ended

    def start(self) -> None:
        if self._log is None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in close())
        nice = self.nice
        self.started_at, self.ended_at = time.monotonic(), 0.0
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )  # fmt: skip

    def launcher_pid(self) -> int | None:
        return None if self.proc is None or self.proc.poll() is not None else self.proc.pid

    def seconds(self) -> float:
        """From its start to when its end was first seen (now while it runs)."""
        if not self.ended_at and self.proc is not None and self.proc.poll() is not None:
            self.ended_at = time.monotonic()
        return (self.ended_at or time.monotonic()) - self.started_at

    def rerun(self) -> None:
        if self.proc is not None:  # killed: reap it
            self.proc.wait(timeout=LAUNCH_TIMEOUT_S)
        self.start()

    def wait(self, timeout_s: float) -> int:
        """The launcher's exit status. Raises ChaosError past ``timeout_s`` seconds."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ChaosError(f"{self.run_dir}: the job did not end in {timeout_s:.0f}s") from None

    def tail(self, chars: int = 2000) -> str:
        """The end of its console output."""
        try:
            return self.log_path.read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Kill every process of the run, reap the launcher, drop its /dev/shm segments."""
        try:
            kill_everything(self.run_dir)
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
            if self.proc is not None:
                self.proc.wait(timeout=LAUNCH_TIMEOUT_S)
            drop_segments(self.run_dir)
            if self._log is not None:
                self._log.close()
                self._log = None


class ChaosRun:
    """Runs a ChaosSpec: the job under faults and, beside it (niced), the fault-free reference;
    ``run()`` returns the summary. Progress lines go to ``log`` (stderr)."""

    def __init__(self, spec: ChaosSpec, log: IO[str] = sys.stderr) -> None:
        self.spec, self.out = spec, log
        self.faults: list[Fault] = []
        self.faults_s = 0.0  # seconds from the job's start to the end of the faults
        pace = ["--inject", f"slow:rank=0:factor={PACE_FACTOR}"]
        run = ["--nodes", "2", "--standby", "1", "--hang-timeout", "3", *pace]
        spec.out_dir.mkdir(parents=True, exist_ok=True)
        self.job = Job(spec, "job", run, CHAOS_CONFIG)
        # The fault-free run goes on beside the job, niced: it takes the CPU the paced job
        # leaves idle, not the job's (whose losses do not depend on its pace or its neighbours).
        self.reference = Job(spec, "reference", ["--nodes", "2"], FAST_CONFIG, nice=REFERENCE_NICE)

    def say(self, msg: str) -> None:
        print(f"[chaos] {msg}", file=self.out, flush=True)

    def run(self) -> dict[str, Any]:
        """Both runs, then the summary. Raises ChaosError (a job past its deadline, processes
        that outlive SIGKILL) and KeyboardInterrupt; both runs are torn down either way."""
        t0 = time.monotonic()
        menu = FaultMenu(self.job, random.Random(self.spec.seed))
        try:
            self.say(f"seed {self.spec.seed}; {self.spec.minutes:g} min of faults on "
                     f"{self.spec.steps} steps in {self.job.run_dir}")  # fmt: skip
            self.job.start()
            self.reference.start()
            self._drive(menu)
            self.say(f"{len(self.faults)} faults; waiting for the job to end")
            job_code = self.job.wait(self._tail_timeout_s())
            self.reference.seconds()
            job_s = time.monotonic() - t0
            menu.close()
            self.job.close()
            self.say(f"job exited {job_code} after {job_s:.0f}s; waiting for the fault-free "
                     "reference run beside it")  # fmt: skip
            ref_code = self.reference.wait(self._reference_timeout_s())
            ref_s = self.reference.seconds()
        finally:
            menu.close()
            for j in (self.job, self.reference):
                j.close()
        summary = self.summary(job_code, job_s, ref_code, ref_s, menu.reruns)
        summary["seconds"] = round(time.monotonic() - t0, 1)
        return summary

    def _tail_timeout_s(self) -> float:
        """The job's end after the last fault: every step at 2.5 steps/s at the least."""
        return 60.0 + 0.4 * self.spec.steps

    def _reference_timeout_s(self) -> float:
        return 120.0 + 0.2 * self.spec.steps  # 5 steps/s unpaced at the least, start-up

    def _drive(self, menu: FaultMenu) -> None:
        """Faults every 4–10 s (2–4 s while the job is ahead of schedule) from START_S until
        ``minutes`` pass or the job ends, each once the job made a step since the last
        (``_await_progress``, at most PROGRESS_WAIT_S later)."""
        t0 = time.monotonic()
        end = t0 + 60.0 * self.spec.minutes
        rng = menu.rng
        next_at = t0 + min(START_S, 60.0 * self.spec.minutes / 4)
        step_at_fault = 0
        while time.monotonic() < end and self.job.launcher_pid() is not None:
            time.sleep(max(0.0, min(next_at, end) - time.monotonic()))
            self._await_progress(step_at_fault, min(end, time.monotonic() + PROGRESS_WAIT_S))
            if time.monotonic() >= end or self.job.launcher_pid() is None:
                break
            step_at_fault = self._step()
            self.reference.seconds()  # notes when the reference ended
            got = menu.inject()
            if got is not None:
                fault = Fault(t_s=round(time.monotonic() - t0, 1), kind=got[0], what=got[1])
                self.faults.append(fault)
                self.say(f"{fault.t_s:6.1f}s {fault.what}")
            ahead = self._done_fraction() > (time.monotonic() - t0) / (end - t0)
            next_at = time.monotonic() + rng.uniform(*(AHEAD_GAP_S if ahead else FAULT_GAP_S))
        self.faults_s = time.monotonic() - t0

    def _step(self) -> int:
        """The job's highest step reached (0 before any)."""
        return max((s for s, _, _ in metrics(self.job.run_dir)), default=0)

    def _done_fraction(self) -> float:
        """The job's highest step reached over its steps (0.0 before any)."""
        return self._step() / self.spec.steps

    def _await_progress(self, step: int, deadline: float) -> None:
        """Until the job reaches a step beyond ``step`` (the one it had at the last fault), the
        launcher exits, or ``deadline`` (time.monotonic()). Faults faster than a loaded machine
        recovers would keep a job at its first steps for the whole run (CI: five generations
        at step 1 in two minutes, the same copies corrupted again and again): each fault
        lands on a job that moved since the last one."""
        while time.monotonic() < deadline and self.job.launcher_pid() is not None:
            if self._step() > step:
                return
            time.sleep(0.5)

    # ------------------------------------------------------------------ the summary
    def summary(
        self, job_code: int, job_s: float, ref_code: int, ref_s: float, reruns: int
    ) -> dict[str, Any]:
        """The outcome as a JSON-able dict; ``ok`` and ``reasons`` are the verdict."""
        from trainguard.observe.report import build_report

        steps = self.spec.steps
        got, want = losses(self.job.run_dir), losses(self.reference.run_dir)
        missing = [s for s in range(1, steps + 1) if s not in got]
        differ = [s for s in range(1, steps + 1) if s in got and got[s] != want.get(s)]
        redone = redo_per_restart(metrics(self.job.run_dir), events(self.job.run_dir))
        bound = redo_bound()
        beyond = [r for r in redone if r["redone"] > bound]
        try:
            rep = build_report(self.job.run_dir)
        except (FileNotFoundError, ValueError) as e:
            rep = {"phase": None, "reason": f"no report: {e}", "recoveries": [], "local": {}}
        recoveries = len(rep["recoveries"]) + len(rep.get("local", {}).get("recoveries", []))
        reasons = []
        if job_code != 0 or rep["phase"] != "SUCCEEDED":
            reasons.append(f"the job failed (exit {job_code}, phase {rep['phase']}: "
                           f"{rep['reason']}): see {self.job.log_path}")  # fmt: skip
        if ref_code != 0:
            reasons.append(f"the fault-free run failed (exit {ref_code}): see "
                           f"{self.reference.log_path}")  # fmt: skip
        if missing:
            reasons.append(f"{len(missing)} steps lost, first {missing[:10]}")
        if beyond:
            reasons.append(f"{len(beyond)} recoveries redid more than {bound} steps: {beyond[:5]}")
        if ref_code == 0 and differ:
            reasons.append(f"{len(differ)} steps' losses differ from the fault-free run's, "
                           f"first {differ[:10]}")  # fmt: skip
        kinds = collections.Counter(f.kind for f in self.faults)
        return {
            "seed": self.spec.seed,
            "minutes": self.spec.minutes,
            "steps": steps,
            "run_dir": str(self.spec.out_dir),
            "faults": {
                "total": len(self.faults),
                "kinds": dict(sorted(kinds.items())),
                "list": [dataclasses.asdict(f) for f in self.faults],
                # how long faults went on: less than the minutes when the job ended first
                "seconds": round(self.faults_s, 1),
            },
            "recoveries": recoveries,
            "reruns": reruns,
            "steps_lost": len(missing),
            "steps_redone": {
                "bound": bound,
                "max": max((r["redone"] for r in redone), default=0),
                "total": sum(r["redone"] for r in redone),
                "restarts": redone,
                "beyond_bound": len(beyond),
            },
            "losses_equal": ref_code == 0 and not differ and not missing,
            "steps_differing": len(differ),
            "job": {"exit_code": job_code, "phase": rep["phase"], "seconds": round(job_s, 1)},
            "reference": {"exit_code": ref_code, "seconds": round(ref_s, 1)},
            "ok": not reasons,
            "reasons": reasons,
        }


def redo_per_restart(
    lines: list[tuple[int, float, float]], evs: list[dict[str, Any]]
) -> list[dict[str, int]]:
    """Each restart (a ``generation_started`` with a restore, a re-run's first included): its
    generation, the highest step reached before it (metrics.jsonl lines written before the
    event), the step restored and the steps redone (reached - restored, 0 at the least)."""
    out = []
    for e in evs:
        if e["kind"] != "generation_started" or e.get("restore_step") is None:
            continue
        reached = max((step for step, _, t in lines if t <= e["ts"]), default=0)
        restored = int(e["restore_step"])
        out.append({"generation": int(e["generation"]), "reached": reached,
                    "restored": restored, "redone": max(0, reached - restored)})  # fmt: skip
    return out
