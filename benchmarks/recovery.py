"""Recovery time of trainguard vs ``torchrun --max-restarts``, same job, same fault, one run.

Modes (``--mode``):

- ``inprocess`` (the default): world 4 (2 simulated nodes x 2 ranks), three sides per repeat:
  trainguard with in-process recovery (the example runs under ``trainguard.run``: the three
  survivors keep their processes, only rank 1 is new), trainguard's restart path (the same
  job with ``inprocess = false``: every rank a new process), and torchrun (4 ranks). Prints
  ``trainguard_s``, ``torchrun_s``, ``ratio``, ``restart_path_s``, ``survivors_kept`` (every
  survivor's pid unchanged, in every repeat) and ``trainguard_phases_s``. Targets: ratio <=
  0.25 and trainguard_s < 1.0 s (median, idle machine).
- ``restart``: world 2 (2 nodes x 1 rank), trainguard's restart path against torchrun (the
  benchmark as it was before in-process recovery; target ratio <= 0.5, trainguard_s < 5 s).

``--worlds 2,4,8,16`` adds ``scaling``: in-process recovery and torchrun at each world size
(2 ranks a simulated node), target: the time at 16 ranks <= 1.5x the time at 2. A world whose
launches would be the main comparison's own (world 4 with the tiny model, as ``--smoke``
has) takes that comparison's first repeat (``from_main_run``) instead of launching again.
``--smoke``: the smallest model and corpus, one repeat, an early fault, shorter timeouts (the
CI test of this file, ``--smoke --worlds 4``: three launches, about 50 s on 2 idle cores).
Its figures show that the benchmark runs, not what recovery costs (the new rank starts cold,
before its node's spare is warm).
``--record`` writes ``benchmarks/results/recovery.json`` for the README's table (``table_rows``).
Pre-flight checks are off for every trainguard launch (they run before training, not in a
recovery).

What is measured: seconds from the fault (a worker SIGKILLed at the end of a step)
to the end of the first resumed step on all ranks, i.e. detect + stop + restart +
reload the checkpoint + redo one step. Both sides train the GPT of ``examples/gpt``
with identical flags, world size 2, a checkpoint after every step, and lose rank 1
at the end of step ``--kill-step`` (after the step's all-reduce, before its
checkpoint), so both resume from step ``kill_step - 1`` and redo step ``kill_step``.

The default fault is at step 30 (~9 s into training): trainguard's agents refill their warm
spare workers (pre-imported torch and DCP) once a generation's first step is done, which
takes a few seconds on a loaded 2-core machine. A fault before that (``--kill-step 5``)
measures a partly cold restart: 2.5 s instead of 1.2 s here, still under torchrun.

- trainguard: ``python -m trainguard run --nodes 2 --inject kill:rank=1:step=S
  examples/gpt/train.py --ckpt-every 1 ...`` (1 worker per simulated node, a
  ``trainguard.Checkpointer`` checkpoint every step). The fault instant is the
  ``inject_fired`` event (the worker's ``time.time()`` just before it SIGKILLs
  itself); the end is the controller's ``first_step`` mark of the new generation
  (latest end of the first step over ranks). ``trainguard report`` measures its
  ``total`` from when the agent *saw* the exit, a few tens of ms later; both are
  reported, the first is ``trainguard_s``.
- torchrun: ``python -m torch.distributed.run --standalone --nnodes 1
  --nproc-per-node 2 --max-restarts 1 benchmarks/torchrun_train.py ...``: the same
  model and loop checkpointing with ``torch.save`` / ``torch.load`` (see that file).
  The fault instant is the ``time.time()`` rank 1 writes just before SIGKILLing
  itself; the end is the latest, over ranks, wall time at the end of the first
  step after the restart. ``--monitor-interval`` is torchrun's default (0.1 s).
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set for torchrun: with the shared
  rendezvous store (the default) a restarted group can read the previous attempt's
  gloo addresses and fail to connect (pytorch/pytorch#135712; seen here about one
  restart in three).

Each repeat runs both sides, alternating which goes first; the result is the
median of each side and ``ratio = trainguard_s / torchrun_s`` (target: ratio <= 0.5
and trainguard_s < 5 s for the default sizes on a 2-core machine). Everything
runs in a temporary directory that is removed at the end; every launch has a
timeout after which its whole process tree is killed, and any process left
behind by a launch (found by an environment marker) is killed and reported.
CPU time used by other processes during each launch is sampled and reported
(``foreign_cpu_share``); a run where it exceeds 5 % of the machine is flagged as
skewed, since both sides are CPU-bound on a small machine.

Run from the repository root::

    python benchmarks/recovery.py                  # table, 3 repeats
    python benchmarks/recovery.py --json           # one JSON object
    python benchmarks/recovery.py --n-embd 512 --n-layer 8 --kill-step 3 --repeats 5
    python benchmarks/recovery.py --json --record  # also benchmarks/results/recovery.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import common
import psutil

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "gpt" / "train.py"
BASELINE = Path(__file__).resolve().parent / "torchrun_train.py"
MARKER_ENV = "TRAINGUARD_BENCH_MARKER"
FOREIGN_CPU_WARN = 0.05  # warn when other processes used this share of the CPUs during a launch
TARGETS = {  # mode → (ratio_max, trainguard_s_max)
    "inprocess": (0.25, 1.0),
    "restart": (0.5, 5.0),
}
TARGET_SCALING = 1.5  # in-process recovery at 16 ranks vs at 2
# A recovery's phases in the order they happen (``trainguard report``'s columns; its JSON
# sorts them by name), then their sum; any other phase the report gives comes after them.
PHASES = ("detect", "stop", "clean", "replace", "rendezvous", "load_checkpoint", "first_step",
          "total")  # fmt: skip
KILL_RANK = 1
DATA_MAX_BYTES = 4 << 20  # the example's default corpus size
SMOKE = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
         "--batch-size", "4", "--kill-step", "3", "--repeats", "1",
         "--data-max-bytes", str(64 << 10), "--timeout", "120"]  # fmt: skip
TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32, "batch_size": 4}


class BenchError(RuntimeError):
    """A launch failed, timed out, or did not recover as expected."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument(
        "--data-max-bytes",
        type=int,
        default=DATA_MAX_BYTES,
        help="corpus bytes each rank reads at its start (the example's default: 4 MiB)",
    )
    p.add_argument(
        "--kill-step", type=int, default=30, help="rank 1 is killed at the end of this step"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="steps in total (default: kill step + 1)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of each side (median reported)")
    p.add_argument(
        "--monitor-interval",
        type=float,
        default=0.1,
        help="torchrun --monitor-interval in seconds (default 0.1, torchrun's own default)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per launch before it is killed"
    )
    p.add_argument("--check", action="store_true", help="exit 1 when the target is not met")
    p.add_argument("--mode", choices=sorted(TARGETS), default="inprocess")
    p.add_argument(
        "--worlds", default="", help="comma-separated world sizes for the scaling (tiny model)"
    )
    common.add_common(p, smoke="smallest sizes, one repeat, early fault (CI)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in argv:
        argv = [*SMOKE, *argv]
    args = p.parse_args(argv)
    args.nodes, args.nproc = (2, 2) if args.mode == "inprocess" else (2, 1)
    try:
        args.world_list = [int(w) for w in args.worlds.split(",") if w.strip()]
    except ValueError:
        p.error(f"--worlds {args.worlds!r}: comma-separated even integers, e.g. 2,4,8,16")
    if any(w < 2 or w % 2 for w in args.world_list):
        p.error(f"--worlds {args.worlds}: each world size even and >= 2 (2 ranks a node)")
    if args.steps is None:
        args.steps = args.kill_step + 1
    if args.kill_step < 2 or args.steps <= args.kill_step:
        p.error("--kill-step must be >= 2 (a checkpoint must exist) and --steps > --kill-step")
    if args.repeats < 1 or args.timeout <= 0 or args.monitor_interval <= 0:
        p.error("--repeats must be >= 1, --timeout and --monitor-interval > 0")
    if args.data_max_bytes < 1024:
        p.error("--data-max-bytes must be >= 1024 (the example needs 1 KiB of text)")
    return args


# ---------------------------------------------------------------------- processes
def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` and every descendant it has now."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    for p in [*family]:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)


def _sweep(marker: str) -> int:
    """SIGKILL processes started by this benchmark that outlived their launch; return how many."""
    me = os.getpid()
    found: list[psutil.Process] = []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        with contextlib.suppress(psutil.Error):
            if p.environ().get(MARKER_ENV) == marker:
                found.append(p)
    for p in found:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(found, timeout=5.0)
    return len(found)


def _run(cmd: list[str], *, env: dict[str, str], log: Path, timeout: float) -> int:
    """Run ``cmd`` with output to ``log``; kill its process tree after ``timeout`` seconds."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            raise BenchError(f"timed out after {timeout:.0f}s: {' '.join(cmd)}") from None
        except BaseException:
            _kill_tree(proc)
            raise


def _capture(cmd: list[str], *, env: dict[str, str], timeout: float) -> str:
    try:
        res = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"timed out after {timeout:.0f}s: {' '.join(cmd)}") from None
    if res.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()[-2000:]}")
    return res.stdout


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class ForeignCpu:
    """CPU seconds used by processes that are not this benchmark's, sampled while it runs.

    A background thread reads every process's CPU time each ``interval_s``; processes
    carrying the benchmark's environment marker (and this process) are ours. Processes
    that live shorter than one interval are missed, so this is a lower bound.
    """

    def __init__(self, marker: str, interval_s: float = 0.25) -> None:
        self.marker, self.interval_s = marker, interval_s
        self._ours: dict[int, bool] = {os.getpid(): True}
        self._last: dict[int, float] = {}
        self._total = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="foreign-cpu", daemon=True)

    def _is_ours(self, p: psutil.Process) -> bool:
        if p.pid not in self._ours:
            try:
                self._ours[p.pid] = p.environ().get(MARKER_ENV) == self.marker
            except psutil.Error:
                self._ours[p.pid] = False
        return self._ours[p.pid]

    def _sample(self, *, baseline: bool) -> None:
        for p in psutil.process_iter():
            try:
                t = p.cpu_times()
                cpu = t.user + t.system
            except psutil.Error:
                continue
            if self._is_ours(p):
                continue
            if not baseline:
                self._total += max(0.0, cpu - self._last.get(p.pid, 0.0))
            self._last[p.pid] = cpu

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample(baseline=False)

    def __enter__(self) -> ForeignCpu:
        self._sample(baseline=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(baseline=False)

    @property
    def seconds(self) -> float:
        return self._total


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------------- the two sides
def _model_flags(args: argparse.Namespace, model: dict[str, int] | None = None) -> list[str]:
    m = {k: getattr(args, k) for k in TINY} | (model or {})
    return [
        "--steps", str(args.steps), "--ckpt-every", "1",
        "--n-layer", str(m["n_layer"]), "--n-head", str(m["n_head"]),
        "--n-embd", str(m["n_embd"]), "--block-size", str(m["block_size"]),
        "--batch-size", str(m["batch_size"]), "--data-max-bytes", str(args.data_max_bytes),
    ]  # fmt: skip


class Side:
    """One launch's shape: ``nodes`` x ``nproc`` ranks, in-process recovery on or off, the
    model (``TINY``'s keys, default: the command line's)."""

    def __init__(
        self, nodes: int, nproc: int, *, inprocess: bool, model: dict[str, int] | None = None
    ) -> None:
        self.nodes, self.nproc, self.inprocess, self.model = nodes, nproc, inprocess, model

    @property
    def world(self) -> int:
        return self.nodes * self.nproc


def run_trainguard(
    args: argparse.Namespace, work: Path, env: dict[str, str], side: Side
) -> dict[str, Any]:
    run_dir = work / "run"
    log = work / "launcher.log"
    config = work / "job.toml"
    config.write_text(f'preflight = "off"\ninprocess = {str(side.inprocess).lower()}\n')
    cmd = [
        sys.executable, "-m", "trainguard", "run", "--config", str(config),
        "--nodes", str(side.nodes), "--nproc-per-node", str(side.nproc),
        "--run-dir", str(run_dir), "--inject", f"kill:rank={KILL_RANK}:step={args.kill_step}",
        str(EXAMPLE), *_model_flags(args, side.model),
    ]  # fmt: skip
    rc = _run(cmd, env=env, log=log, timeout=args.timeout)
    if rc != 0:
        ranks = "".join(
            f"\n--- {f.name}\n{_tail(f, 1500)}"
            for f in sorted((run_dir / "logs").glob("rank*.log"))
        )
        raise BenchError(f"trainguard run exited {rc}:\n{_tail(log)}{ranks}")
    tg = [sys.executable, "-m", "trainguard"]
    report = json.loads(
        _capture([*tg, "report", "--run-dir", str(run_dir), "--json"], env=env, timeout=60.0)
    )
    events = [
        json.loads(line)
        for line in _capture(
            [*tg, "events", "--run-dir", str(run_dir), "--json"], env=env, timeout=60.0
        ).splitlines()
        if line.strip()
    ]
    recs = report["recoveries"]
    if str(report["phase"]).lower() != "succeeded" or not recs:
        raise BenchError(
            f"trainguard: expected a succeeded job with a recovery, got phase={report['phase']} "
            f"recoveries={len(recs)}:\n{_tail(log)}"
        )
    rec = recs[0]
    if rec["fault"] != "worker_crash" or rec["restore_step"] != args.kill_step - 1:
        raise BenchError(
            f"trainguard: first recovery is {rec['fault']} resumed from step "
            f"{rec['restore_step']}; expected worker_crash from step {args.kill_step - 1}"
        )
    fired = [e["ts"] for e in events if e["kind"] == "inject_fired"]
    done = [
        e
        for e in events
        if e["kind"] == "recovery_completed" and e.get("to_generation") == rec["to_generation"]
    ]
    if len(fired) != 1 or len(done) != 1 or done[0].get("t_first_step") is None:
        raise BenchError("trainguard: events lack one inject_fired and its recovery_completed")
    t_fault, t_first = float(fired[0]), float(done[0]["t_first_step"])
    # Recoveries beyond the injected one are anomalies of trainguard: keep what explains them.
    anomalies = [
        {
            "fault": f["cause"],
            "generation": f["generation"],
            "rank": f["rank"],
            "step": f["step"],
            "message": f["message"],
        }
        for f in report["faults"][1:]
    ]
    if anomalies:
        anomalies.extend(
            {
                "hang_suspected": {
                    k: e.get(k) for k in ("generation", "rank", "step", "stalled_s")
                },
                "stacks": {str(r): str(st)[-2000:] for r, st in (e.get("stacks") or {}).items()},
            }
            for e in events
            if e["kind"] == "hang_suspected"
        )
    ckpts = sorted(
        (d for d in (run_dir / "checkpoints").glob("step_*") if d.is_dir()),
        key=lambda d: int(d.name.removeprefix("step_")),
    )
    first = {e["rank"]: e["pid"] for e in events
             if e["kind"] == "worker_started" and e["generation"] == 0}  # fmt: skip
    survivors = {str(r): pid for r, pid in first.items() if r != KILL_RANK}
    if side.inprocess and (rec.get("mode") != "inprocess" or rec.get("kept") != survivors):
        raise BenchError(
            f"trainguard: expected an in-process recovery keeping {survivors}, got mode "
            f"{rec.get('mode')} kept {rec.get('kept')} ({rec.get('mode_reason')}); escalated: "
            f"{rec.get('escalated')}; new: {rec.get('new')}:\n{_tail(log)}"
        )
    return {
        "mode": rec.get("mode"),
        "survivors_kept": rec.get("kept") == survivors,
        "seconds": t_first - t_fault,
        "report_total_s": float(rec["phases_s"]["total"]),
        "exit_seen_s": float(done[0]["fault"]["t_fault"]) - t_fault,
        "phases_s": rec["phases_s"],
        "state_bytes": _dir_bytes(ckpts[-1]) if ckpts else 0,
        "anomalies": anomalies,
    }


def run_torchrun(
    args: argparse.Namespace, work: Path, env: dict[str, str], side: Side
) -> dict[str, Any]:
    ckpt, timing, logs = work / "ckpt", work / "timing", work / "logs"
    for d in (timing, logs):
        d.mkdir(parents=True)
    log = work / "launcher.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(side.world),
        "--max-restarts",
        "1",
        "--monitor-interval",
        str(args.monitor_interval),
        "--log-dir",
        str(logs),
        str(BASELINE),
        *_model_flags(args, side.model),
        "--ckpt-dir",
        str(ckpt),
        "--timing-dir",
        str(timing),
        "--kill-rank",
        str(KILL_RANK),
        "--kill-step",
        str(args.kill_step),
    ]
    # Without this, a restarted worker group reuses the agent's TCPStore and gloo may
    # read the previous attempt's peer addresses (connectFullMesh: Connection refused);
    # see pytorch/pytorch#135712. Opting out is the upstream workaround.
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    rc = _run(cmd, env=env, log=log, timeout=args.timeout)
    if rc != 0:
        raise BenchError(f"torchrun exited {rc}:\n{_tail(log)}")
    try:
        fault = json.loads((timing / "fault").read_text())
        firsts = [json.loads((timing / f"first_step.{r}").read_text()) for r in range(side.world)]
    except (OSError, ValueError) as e:
        raise BenchError(f"torchrun: missing timing files ({e}):\n{_tail(log)}") from None
    for f in firsts:
        if f["restored"] != args.kill_step - 1 or f["step"] != args.kill_step:
            raise BenchError(f"torchrun resumed wrongly: {f}, expected step {args.kill_step}")
    return {
        "seconds": max(float(f["t"]) for f in firsts) - float(fault["t"]),
        "state_bytes": _dir_bytes(ckpt),
    }


# ---------------------------------------------------------------------- main
Launch = tuple[Any, Side]  # (run_trainguard or run_torchrun, its shape)


def _repeats(
    args: argparse.Namespace,
    root: Path,
    env: dict[str, str],
    marker: str,
    sides: dict[str, Launch],
    repeats: int,
) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Each side ``repeats`` times, the order rotating each repeat; (side → its runs, the
    leftover processes killed)."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    leaked = 0
    names = list(sides)
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            fn, side = sides[name]
            work = root / f"{name}.{i}"
            work.mkdir(parents=True)
            t0 = time.monotonic()
            with ForeignCpu(marker) as other:
                res = fn(args, work, env, side)
            res["launch_wall_s"] = time.monotonic() - t0
            res["foreign_cpu_share"] = (
                ratio(other.seconds, res["launch_wall_s"] * (os.cpu_count() or 1)) or 0.0
            )
            runs[name].append(res)
            leaked += _sweep(marker)
            if not args.json:
                print(
                    f"  repeat {i + 1}/{repeats} {name:<14} {res['seconds']:6.2f} s  (launch "
                    f"{res['launch_wall_s']:.1f} s, other processes "
                    f"{res['foreign_cpu_share']:.0%} of CPU)",
                    file=sys.stderr,
                    flush=True,
                )
    return runs, leaked


def _median(runs: list[dict[str, Any]], key: str = "seconds") -> float:
    return statistics.median(float(r[key]) for r in runs)


def _phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median of each recovery phase over ``runs``, in the order ``trainguard report``
    lists them (a phase a run did not time counts 0)."""
    given = {p for r in runs for p in r["phases_s"]}
    names = [p for p in PHASES if p in given] + sorted(given - set(PHASES))
    return {p: statistics.median(float(r["phases_s"].get(p) or 0.0) for r in runs) for p in names}


def ratio(a: float, b: float) -> float | None:
    """``a / b``, or None when ``b`` is not a positive finite number (every ratio in the result
    is finite: a missing figure is null, never NaN or infinity)."""
    q = a / b if b > 0 and math.isfinite(b) else math.nan
    return q if math.isfinite(q) else None


def _is_main_launch(args: argparse.Namespace, world: int) -> bool:
    """A scaling world whose launches are the main comparison's own: in-process mode, the same
    world (2 ranks a node) and the tiny model (``--smoke``). Its first repeat is reused."""
    return (
        args.mode == "inprocess"
        and world == args.nodes * args.nproc
        and args.nproc == 2
        and all(getattr(args, k) == v for k, v in TINY.items())
    )


def bench(args: argparse.Namespace) -> dict[str, Any]:
    marker = uuid.uuid4().hex
    load_before = os.getloadavg()[0]
    inproc = args.mode == "inprocess"
    sides: dict[str, Launch] = {
        "trainguard": (run_trainguard, Side(args.nodes, args.nproc, inprocess=inproc)),
        "torchrun": (run_torchrun, Side(args.nodes, args.nproc, inprocess=False)),
    }
    if inproc:
        sides["restart_path"] = (run_trainguard, Side(args.nodes, args.nproc, inprocess=False))
    with tempfile.TemporaryDirectory(prefix="trainguard-bench-") as tmp:
        root = Path(tmp)
        (root / "tmp").mkdir()
        env = {**os.environ, MARKER_ENV: marker, "TMPDIR": str(root / "tmp")}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p
        )
        leaked = 0
        try:
            runs, leaked = _repeats(args, root, env, marker, sides, args.repeats)
            scaling = []
            for world in args.world_list:
                if _is_main_launch(args, world):  # the same launches: one run each, reused
                    scaling.append({"world": world, "reused": True,
                                    **{k: runs[k][0]["seconds"] for k in ("trainguard", "torchrun")}})  # fmt: skip
                    continue
                at = {
                    "trainguard": (run_trainguard, Side(world // 2, 2, inprocess=True, model=TINY)),
                    "torchrun": (run_torchrun, Side(world // 2, 2, inprocess=False, model=TINY)),
                }
                w_runs, w_leaked = _repeats(args, root / f"w{world}", env, marker, at, 1)
                leaked += w_leaked
                scaling.append(
                    {
                        "world": world,
                        "reused": False,
                        **{k: v[0]["seconds"] for k, v in w_runs.items()},
                    }
                )
        finally:
            leaked += _sweep(marker)
    tg, tr = runs["trainguard"], runs["torchrun"]
    tg_s, tr_s = _median(tg), _median(tr)
    vs = ratio(tg_s, tr_s)
    ratio_max, tg_max = TARGETS[args.mode]
    out: dict[str, Any] = {
        "mode": args.mode,
        "trainguard_s": tg_s,
        "torchrun_s": tr_s,
        "ratio": vs,
        "target_met": vs is not None and vs <= ratio_max and tg_s < tg_max,
        "target": {"ratio_max": ratio_max, "trainguard_s_max": tg_max},
        "trainguard_runs_s": [r["seconds"] for r in tg],
        "torchrun_runs_s": [r["seconds"] for r in tr],
        "trainguard_phases_s": _phases(tg),
        "trainguard_runs_phases_s": [r["phases_s"] for r in tg],
        "trainguard_report_total_s": _median(tg, "report_total_s"),
        "trainguard_exit_seen_s": _median(tg, "exit_seen_s"),
        "foreign_cpu_share": {k: [r["foreign_cpu_share"] for r in v] for k, v in runs.items()},
        "state_bytes": {
            "trainguard_dcp": tg[-1]["state_bytes"],
            "torchrun_torch_save": tr[-1]["state_bytes"],
        },  # fmt: skip
        "leaked_processes_killed": leaked,
        "trainguard_anomalies": [
            {"run": i + 1, **a} for i, r in enumerate(tg) for a in r["anomalies"]
        ],
    }
    if inproc:
        rp = runs["restart_path"]
        out |= {
            "survivors_kept": all(r["survivors_kept"] for r in tg),
            "restart_path_s": _median(rp),
            "restart_path_runs_s": [r["seconds"] for r in rp],
            "restart_path_phases_s": _phases(rp),
            "inprocess_vs_restart_path": ratio(tg_s, _median(rp)),
        }
    if scaling:
        by = {x["world"]: x["trainguard"] for x in scaling}
        lo, hi = min(by), max(by)
        out["scaling"] = [
            {"world": x["world"], "trainguard_s": x["trainguard"], "torchrun_s": x["torchrun"],
             "from_main_run": x["reused"]}
            for x in scaling
        ]  # fmt: skip
        grew = ratio(by[hi], by[lo])
        out["scaling_ratio"] = {"worlds": [lo, hi], "ratio": grew, "target_max": TARGET_SCALING}
        out["target_met"] = out["target_met"] and grew is not None and grew <= TARGET_SCALING
    out["config"] = {
        "nodes": args.nodes, "nproc_per_node": args.nproc, "world_size": args.nodes * args.nproc,
        **{k: getattr(args, k) for k in TINY}, "data_max_bytes": args.data_max_bytes,
        "steps": args.steps, "kill_rank": KILL_RANK,
        "kill_step": args.kill_step, "ckpt_every": 1, "repeats": args.repeats,
        "torchrun_monitor_interval_s": args.monitor_interval, "cpus": os.cpu_count(),
        "loadavg_1min_before": load_before, "worlds": args.world_list,
    }  # fmt: skip
    return out


def print_table(r: dict[str, Any]) -> None:
    c = r["config"]
    mb = {k: v / 1e6 for k, v in r["state_bytes"].items()}
    print(
        f"recovery ({r['mode']}): GPT n_layer={c['n_layer']} n_embd={c['n_embd']} batch="
        f"{c['batch_size']}x{c['block_size']}, {c['nodes']} nodes x {c['nproc_per_node']} ranks, "
        f"rank {c['kill_rank']} SIGKILLed at step {c['kill_step']}, checkpoint every step; "
        f"state {mb['trainguard_dcp']:.1f} MB (DCP) / {mb['torchrun_torch_save']:.1f} MB "
        f"(torch.save); {c['cpus']} CPUs, 1-min load before {c['loadavg_1min_before']:.2f}"
    )
    print("fault -> end of first resumed step on all ranks, seconds")
    rp = r.get("restart_path_runs_s")
    print(f"{'run':>6}  {'trainguard':>10}  {'torchrun':>8}  {'ratio':>6}"
          + (f"  {'restart path':>12}" if rp else ""))  # fmt: skip
    for i, (a, b) in enumerate(zip(r["trainguard_runs_s"], r["torchrun_runs_s"], strict=True)):
        extra = f"  {rp[i]:>12.2f}" if rp else ""
        print(f"{i + 1:>6}  {a:>10.2f}  {b:>8.2f}  {_fmt(ratio(a, b)):>6}{extra}")
    extra = f"  {r['restart_path_s']:>12.2f}" if rp else ""
    print(f"{'median':>6}  {r['trainguard_s']:>10.2f}  {r['torchrun_s']:>8.2f}  "
          f"{_fmt(r['ratio']):>6}{extra}")  # fmt: skip
    if rp:
        print(f"survivors kept their processes in every repeat: {r['survivors_kept']}")
    ph = r["trainguard_phases_s"]
    print(
        "trainguard phases (median s): kill->exit seen "
        f"{r['trainguard_exit_seen_s']:.3f}, " + ", ".join(f"{p} {v:.3f}" for p, v in ph.items())
    )
    for x in r.get("scaling", []):
        print(f"  world {x['world']:>3}: trainguard {x['trainguard_s']:.2f} s, "
              f"torchrun {x['torchrun_s']:.2f} s")  # fmt: skip
    t = r["target"]
    print(
        f"target ratio <= {t['ratio_max']} and trainguard < {t['trainguard_s_max']:g} s"
        + (f", world {r['scaling_ratio']['worlds'][1]} <= {TARGET_SCALING}x world "
           f"{r['scaling_ratio']['worlds'][0]}"
           if "scaling_ratio" in r and len(set(r["scaling_ratio"]["worlds"])) > 1 else "")
        + f": {'met' if r['target_met'] else 'NOT met'} "
        f"(torchrun --monitor-interval {c['torchrun_monitor_interval_s']} s)"
    )  # fmt: skip
    busy = [
        f"{side} {i + 1} ({share:.0%})"
        for side, shares in r["foreign_cpu_share"].items()
        for i, share in enumerate(shares)
        if share > FOREIGN_CPU_WARN
    ]
    if busy:
        print("warning: other processes used the CPUs during " + ", ".join(busy)
              + "; those runs are skewed")  # fmt: skip
    for a in r["trainguard_anomalies"]:
        if "fault" in a:
            print(
                f"warning: trainguard run {a['run']} had an extra recovery after the measured one: "
                f"{a['fault']} of rank {a['rank']} at step {a['step']} ({a['message']}); "
                "stacks in --json"
            )
    if r["leaked_processes_killed"]:
        print(f"warning: killed {r['leaked_processes_killed']} leftover process(es)")


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def table_rows(result: dict[str, Any]) -> list[common.Row]:
    """The README's "Measured" rows of a full run's JSON: fault → first resumed step of each
    side and the ratio against torchrun's target; with ``--worlds``, the scaling too."""
    c, t = result["config"], result["target"]
    model = (
        f"GPT example ({_plural(c['n_layer'], 'layer')}, {c['n_embd']} wide, "
        f"batch {c['batch_size']})"
    )
    crowd = f"{c['cpus']} CPUs for {c['world_size']} ranks and trainguard's processes"
    inproc = result["mode"] == "inprocess"
    sides = (
        [f"in process {result['trainguard_s']:.2f} s",
         f"restart path {result['restart_path_s']:.2f} s"]
        if inproc else [f"restart path {result['trainguard_s']:.2f} s"]
    )  # fmt: skip
    runs = f"median of {c['repeats']}" if c["repeats"] > 1 else "one run"
    verdicts = [
        "ratio " + _verdict(result["ratio"], t["ratio_max"], "×"),
        ("in process " if inproc else "trainguard ")
        + common.verdict(result["trainguard_s"], t["trainguard_s_max"], " s"),
    ]
    rows: list[common.Row] = [
        {
            "what": (
                f"recovery{' in process' if inproc else ', restart path'}, fault → first resumed "
                f"step, {model}, world {c['world_size']} ({c['nodes']} nodes × "
                f"{c['nproc_per_node']}), kill -9 of rank {c['kill_rank']} at step "
                f"{c['kill_step']}"
            ),
            "result": (
                ", ".join([*sides, f"torchrun {result['torchrun_s']:.2f} s"])
                + f" (ratio {_fmt(result['ratio'])}; {runs})"
            ),
            "target": _why("; ".join(verdicts), crowd),
        }
    ]
    if "scaling" in result:
        sc, grew = result["scaling"], result["scaling_ratio"]
        lo, hi = grew["worlds"]
        rows.append(
            {
                "what": (
                    f"recovery in process at world {lo}"
                    + (f" to {hi}" if hi != lo else "")
                    + " (GPT example, 1 layer, 32 wide; 2 ranks a simulated node; one run each)"
                ),
                "result": "; ".join(
                    [
                        *(
                            f"world {x['world']}: {x['trainguard_s']:.2f} s "
                            f"(torchrun {x['torchrun_s']:.2f} s)"
                            for x in sc
                        ),
                        *(
                            [f"world {hi} took {_fmt(grew['ratio'])}× world {lo}"]
                            if hi != lo
                            else []
                        ),
                    ]
                ),
                "target": (
                    _why(
                        f"world {hi} " + _verdict(grew["ratio"], grew["target_max"], "×"),
                        f"{c['cpus']} CPUs for up to {hi} ranks",
                    )
                    if hi != lo
                    else "—"
                ),
            }
        )
    return rows


def _verdict(value: float | None, limit: float, unit: str) -> str:
    """``common.verdict``, or the target with "no figure" when the figure is missing."""
    if value is None:
        return f"≤ {limit:g}{unit}: **no figure**"
    return common.verdict(value, limit, unit)


def _why(verdicts: str, why_not: str) -> str:
    """``verdicts``, with the reason once at the end when any of them was not met."""
    return verdicts + (f" ({why_not})" if "**" in verdicts else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = bench(args)
    except BenchError as e:
        print(f"recovery benchmark: error: {e}", file=sys.stderr)
        return 1
    common.finish("recovery", args, result, argv)
    if not args.json:
        print_table(result)
    return 1 if args.check and not result["target_met"] else 0


if __name__ == "__main__":
    sys.exit(main())
