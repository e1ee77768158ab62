"""Local recovery of trainguard's replica groups vs torchft, same model, same fault, one run.

For each group count (``--groups 2,4``; one rank a group): train the GPT of ``examples/gpt``
as replica groups and SIGKILL the rank of group 1 once step ``--kill-step`` is logged; the
other groups go on, the killed one restarts and heals from a live one.

- trainguard: ``trainguard run --nodes 2 --nproc-per-node G/2 --replica-groups G
  examples/gpt/replicas.py`` (the README's local-recovery job; its agent restarts the group
  from a warm spare at once).
- torchft (skipped, with the reason, when it is not installed): a Lighthouse in this process
  (``join_timeout_ms`` 100, ``quorum_tick_ms`` 50, ``heartbeat_timeout_ms`` 1000) and G
  processes of ``benchmarks/torchft_replicas.py``; the killed one is started again the moment
  its exit is seen (this benchmark plays torchelastic's part), and pays its cold start.

Keys, per group count and side: ``steady_step_s`` (median interval between a surviving group's
steps before the fault), ``survivor_max_gap_s`` (its longest interval from the fault until the
healed group's first step, plus 5 steps), ``heal_s`` (kill → the healed group's first logged
step in the quorum), ``steps_at_reduced_width`` (the survivor's steps logged with fewer than G
groups), ``state_equal_after_heal`` (every group's xxh3 digest of model and optimizer state at
the end, equal); for trainguard also ``heal_ratio`` (its ``heal_s`` / torchft's) and
``gap_over_step`` (``survivor_max_gap_s`` / ``steady_step_s``). Targets: ``gap_over_step`` <= 2,
``heal_ratio`` <= 0.5, ``state_equal_after_heal`` true.

``--smoke``: the smallest model and corpus, 2 groups, an early fault, shorter timeouts (the CI
test of this file). ``--record`` writes ``benchmarks/results/local_recovery.json`` for the
README's table (``table_rows``). Run from the repository root:
``python benchmarks/local_recovery.py --json``.
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
import time
from pathlib import Path
from typing import Any

import common
import psutil

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt" / "replicas.py"
FT_WORKER = REPO / "benchmarks" / "torchft_replicas.py"
CONFIG = 'heartbeat_s = 0.2\nnode_timeout_s = 3.0\npreflight = "off"\nprobe_every_s = 0\n'
SMOKE_STEPS, SMOKE_KILL = 800, 150  # --smoke: the tiny model's steps take ~0.02 s
TARGET_GAP_OVER_STEP = 2.0  # the survivor's longest step gap over its steady step
TARGET_HEAL_RATIO = 0.5  # trainguard's heal_s over torchft's


class BenchError(RuntimeError):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", default="2,4", help="group counts, comma-separated (even)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--kill-step", type=int, default=60)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--data-max-bytes", type=int, default=4 << 20, help="corpus bytes each rank reads"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    common.add_common(p, smoke="smallest sizes, 2 groups, early fault (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.groups, args.steps, args.kill_step, args.timeout = "2", SMOKE_STEPS, SMOKE_KILL, 120.0
        args.n_layer, args.n_head, args.n_embd, args.block_size, args.batch_size = 1, 2, 32, 32, 4
        args.data_max_bytes = 64 << 10
    try:
        args.group_counts = [int(g) for g in args.groups.split(",")]
    except ValueError:
        p.error(f"--groups {args.groups!r}: comma-separated even counts, e.g. 2,4")
    if any(g < 2 or g % 2 for g in args.group_counts):
        p.error(f"--groups {args.groups}: even counts >= 2 (two simulated nodes)")
    if not 1 <= args.kill_step < args.steps or args.timeout <= 0 or args.data_max_bytes < 1024:
        p.error("need 1 <= --kill-step < --steps, --timeout > 0 and --data-max-bytes >= 1024")
    return args


def _model(args: argparse.Namespace) -> list[str]:
    return ["--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd",
            str(args.n_embd), "--block-size", str(args.block_size), "--batch-size",
            str(args.batch_size), "--steps", str(args.steps), "--data-max-bytes",
            str(args.data_max_bytes)]  # fmt: skip


def _lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                p.kill()
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _wait(pred: Any, deadline: float, what: str) -> Any:
    while time.monotonic() < deadline:
        if v := pred():
            return v
        time.sleep(0.02)
    raise BenchError(f"timed out waiting for {what}")


def measure(recs: list[dict[str, Any]], digests: list[str], groups: int, t_kill: float,
            survivor: int = 0, healed: int = 1) -> dict[str, Any]:  # fmt: skip
    """The keys of one side from its step records ``{"step", "time", "group", "width"}``."""
    mine = sorted((r for r in recs if r["group"] == survivor), key=lambda r: r["time"])
    before = [b["time"] - a["time"] for a, b in zip(mine, mine[1:], strict=False)
              if b["time"] <= t_kill]  # fmt: skip
    back = min(
        (r["time"] for r in recs if r["group"] == healed and r["time"] > t_kill), default=None
    )
    end = (back or mine[-1]["time"]) + 5 * (statistics.median(before) if before else 0.0)
    window = [r["time"] for r in mine if r["time"] <= end]
    gaps = [b - a for a, b in zip(window, window[1:], strict=False) if b > t_kill]
    return {
        "steady_step_s": round(statistics.median(before), 4) if before else None,
        "survivor_max_gap_s": round(max(gaps), 4) if gaps else None,
        "heal_s": round(back - t_kill, 3) if back is not None else None,
        "steps_at_reduced_width": sum(1 for r in mine if r["width"] < groups),
        "state_equal_after_heal": len(digests) == groups and len(set(digests)) == 1,
    }


def run_trainguard(args: argparse.Namespace, work: Path, groups: int) -> dict[str, Any]:
    run = work / f"tg{groups}"
    cfg = work / "tg.toml"
    cfg.write_text(CONFIG)
    cmd = [sys.executable, "-m", "trainguard", "run", "--run-dir", str(run), "--config",
           str(cfg), "--nodes", "2", "--nproc-per-node", str(groups // 2), "--replica-groups",
           str(groups), str(EXAMPLE), *_model(args)]  # fmt: skip
    log = open(work / f"tg{groups}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + args.timeout
    try:
        _wait(lambda: any(r["step"] >= args.kill_step for r in _lines(run / "metrics.jsonl")),
              deadline, f"trainguard step {args.kill_step}")  # fmt: skip
        pid = next(e["pid"] for e in reversed(_lines(run / "events.jsonl"))
                   if e["kind"] == "worker_started" and e["rank"] == 1)  # fmt: skip
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        _kill_tree(proc)
        raise
    finally:
        log.close()
    if code != 0:
        raise BenchError(
            f"trainguard exited {code}: {(work / f'tg{groups}.log').read_text()[-2000:]}"
        )
    digests = [d["digest"] for d in _lines(run / "digests.jsonl")]
    return measure(_lines(run / "metrics.jsonl"), digests, groups, t_kill)


def run_torchft(args: argparse.Namespace, work: Path, groups: int) -> dict[str, Any]:
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as e:
        return {"skipped": f"torchft is not installed ({e}): pip install --no-deps torchft==0.2.0"}
    out = work / f"ft{groups}"
    out.mkdir()
    lh = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100,
                          quorum_tick_ms=50, heartbeat_timeout_ms=1000)  # fmt: skip
    addr = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]

    def start(g: int) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, str(FT_WORKER), "--group", str(g), "--groups", str(groups),
               "--lighthouse", addr, "--out", str(out), *_model(args)]  # fmt: skip
        with open(out / f"w{g}.log", "ab") as f:
            return subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip

    procs = {g: start(g) for g in range(groups)}
    deadline = time.monotonic() + args.timeout
    recs = lambda: [r for g in range(groups) for r in _lines(out / f"metrics.{g}.jsonl")]  # noqa: E731
    try:
        _wait(lambda: any(r["step"] >= args.kill_step for r in recs()), deadline,
              f"torchft step {args.kill_step}")  # fmt: skip
        t_kill = time.time()
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=10)
        procs[1] = start(1)  # torchelastic's part: a new process at once
        for g, p in procs.items():
            if p.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                log = (out / f"w{g}.log").read_text(errors="replace").splitlines()
                tail = "\n".join(line for line in log if "[INFO]" not in line)[-2000:]
                raise BenchError(f"torchft worker {g} exited {p.returncode}:\n{tail}")
    finally:
        for p in procs.values():
            _kill_tree(p)
        lh.shutdown()
    digests = [d["digest"] for d in _lines(out / "digests.jsonl")]
    return measure(recs(), digests, groups, t_kill)


def _ratio(a: float | None, b: float | None, digits: int) -> float | None:
    """``a / b`` rounded, or None when either is missing or ``b`` is not positive."""
    if a is None or not b or b <= 0:
        return None
    q = round(a / b, digits)
    return q if math.isfinite(q) else None


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides at each group count (see the module docstring for the keys)."""
    result: dict[str, Any] = {"model": _model(args), "kill_step": args.kill_step, "groups": {}}
    with tempfile.TemporaryDirectory(prefix="tg-local-") as tmp:
        for g in args.group_counts:
            tg = run_trainguard(args, Path(tmp), g)
            ft = run_torchft(args, Path(tmp), g)
            row: dict[str, Any] = {**tg, "torchft": ft}
            row["gap_over_step"] = _ratio(tg["survivor_max_gap_s"], tg["steady_step_s"], 2)
            row["heal_ratio"] = _ratio(tg["heal_s"], ft.get("heal_s"), 3)
            result["groups"][str(g)] = row
            if not args.json:
                print(f"{g} groups: {json.dumps(row)}", file=sys.stderr)
    return result


def _s(x: float | None, spec: str = ".2f", unit: str = " s") -> str:
    return "—" if x is None else f"{x:{spec}}{unit}"


def _flag(model: list[str], name: str) -> str:
    return model[model.index(name) + 1] if name in model else "?"


def _yes(x: Any) -> str:
    return "—" if x is None else "yes" if x else "**no**"


def table_rows(result: dict[str, Any]) -> list[common.Row]:
    """The README's "Measured" rows of a full run's JSON, one per group count: the heal time
    against torchft's and the survivor's longest gap against its steady step, with targets."""
    m = result["model"]
    layers = _flag(m, "--n-layer")
    model = (
        f"GPT example ({layers} layer{'' if layers == '1' else 's'}, {_flag(m, '--n-embd')} "
        f"wide, batch {_flag(m, '--batch-size')}, {_flag(m, '--steps')} steps)"
    )
    rows: list[common.Row] = []
    for g, r in result["groups"].items():
        ft = r["torchft"]
        skipped = "skipped" in ft
        heal = f"heal {_s(r['heal_s'])}" + (
            " (torchft skipped: not installed)"
            if skipped
            else f" vs torchft {_s(ft.get('heal_s'))} (ratio {_s(r['heal_ratio'], '.2f', '')})"
        )
        gap = (
            f"survivor's longest gap {_s(r['survivor_max_gap_s'])} = "
            f"{_s(r['gap_over_step'], '.2f', '×')} its step ({_s(r['steady_step_s'], '.3f')})"
        )
        equal = f"states equal after the heal: {_yes(r['state_equal_after_heal'])}" + (
            "" if skipped else f", torchft {_yes(ft.get('state_equal_after_heal'))}"
        )
        heal_target = (
            "—"
            if r["heal_ratio"] is None
            else common.verdict(r["heal_ratio"], TARGET_HEAL_RATIO, "×", "")
        )
        gap_target = (
            "—"
            if r["gap_over_step"] is None
            else common.verdict(r["gap_over_step"], TARGET_GAP_OVER_STEP, "×", "")
        )
        rows.append(
            {
                "what": (
                    f"local recovery vs torchft, kill -9 → the healed group's first step, {g} "
                    f"replica groups of one rank, {model}, group 1 killed at step "
                    f"{result['kill_step']}"
                ),
                "result": f"{heal}; {gap}; {equal}",
                "target": f"heal vs torchft {heal_target}; gap {gap_target}; states equal: "
                + ("met" if r["state_equal_after_heal"] else "**not met**"),
            }
        )
    return rows


def print_table(result: dict[str, Any]) -> None:
    """The human-readable summary (the default output; ``--json`` prints the object)."""
    for row, (g, r) in zip(table_rows(result), result["groups"].items(), strict=True):
        print(f"{g} groups: {row['result']}")
        print(f"  targets: {row['target']}")
        print(
            f"  steps at reduced width: trainguard {r['steps_at_reduced_width']}"
            + ("" if "skipped" in r["torchft"]
               else f", torchft {r['torchft'].get('steps_at_reduced_width')}")
        )  # fmt: skip
        if "skipped" in r["torchft"]:
            print(f"  torchft: {r['torchft']['skipped']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = bench(args)
    common.finish("local_recovery", args, result, argv)
    if not args.json:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
