"""``trainguard chaos``: the GPT example under random faults of workers and of trainguard's own
parts for ``--minutes``, then the same job without faults; prints the faults injected, the
recoveries, steps lost and redone, and whether every step's loss equals the fault-free run's.

Exit status 0 when the job succeeded with no step lost, no recovery beyond the redo bound and
the fault-free losses; 1 otherwise, with the reasons; 2 for bad input (before anything starts);
130 on Ctrl-C or SIGTERM (both runs are torn down first).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import trainguard
from trainguard.chaos.faults import ChaosError
from trainguard.chaos.run import ChaosRun, ChaosSpec, default_steps

SEED_ENV = "TRAINGUARD_CHAOS_SEED"


def chaos_parser(c: argparse.ArgumentParser) -> None:
    c.add_argument("--minutes", type=float, default=10.0,
                   help="how long to inject faults (default 10)")  # fmt: skip
    c.add_argument("--seed", type=int, default=None,
                   help=f"seed of the faults' choices (default ${SEED_ENV}, else random)")  # fmt: skip
    c.add_argument("--run-dir", type=Path, default=None,
                   help="new or empty directory for both runs (default ./chaos-SEED)")  # fmt: skip
    c.add_argument("--steps", type=int, default=None,
                   help="the job's steps (default: sized to outlast the faults)")  # fmt: skip
    c.add_argument("--script", type=Path, default=None,
                   help="the GPT example (default examples/gpt/train.py of this checkout)")  # fmt: skip
    c.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _seed(flag: int | None) -> int:
    if flag is not None:
        return flag
    env = os.environ.get(SEED_ENV)
    if env is None:
        return random.randrange(1 << 30)
    try:
        return int(env)
    except ValueError:
        raise ValueError(f"{SEED_ENV}={env!r}: not an integer; unset it or pass --seed N") from None


def _spec(args: argparse.Namespace) -> ChaosSpec:
    """The spec from the flags. Raises ValueError or FileNotFoundError (bad input)."""
    seed = _seed(args.seed)
    if not args.minutes > 0:  # before the steps default is sized from it
        raise ValueError(f"--minutes {args.minutes}: must be > 0; e.g. --minutes 10")
    script = args.script or Path(trainguard.__file__).parents[2] / "examples" / "gpt" / "train.py"
    return ChaosSpec(
        script=script.resolve(),
        out_dir=(args.run_dir or Path(f"chaos-{seed}")).resolve(),
        minutes=args.minutes,
        seed=seed,
        steps=default_steps(args.minutes) if args.steps is None else args.steps,
    )


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _print_text(s: dict[str, Any]) -> None:
    f, r = s["faults"], s["steps_redone"]
    kinds = ", ".join(f"{k} {n}" for k, n in f["kinds"].items())
    lines = [
        f"seed {s['seed']} (replay: --seed {s['seed']}), run dir {s['run_dir']}",
        f"faults injected: {f['total']} of {len(f['kinds'])} kinds ({kinds}) over "
        f"{f['seconds']:.0f}s of the {s['minutes'] * 60:.0f}s asked"
        + (" (the job ended first)" if f["seconds"] < s["minutes"] * 60 - 10 else ""),
        *(f"  {x['t_s']:7.1f}s {x['kind']:<17} {x['what']}" for x in f["list"]),
        f"recoveries: {s['recoveries']} (+ {s['reruns']} re-run of the run dir)",
        f"steps lost: {s['steps_lost']} of {s['steps']}",
        f"steps redone: {r['total']} in {len(r['restarts'])} restarts, at most {r['max']} "
        f"(bound {r['bound']}; {r['beyond_bound']} beyond)",
        f"losses equal to the fault-free run's: {'yes' if s['losses_equal'] else 'no'}",
        f"job {s['job']['seconds']:.0f}s, reference {s['reference']['seconds']:.0f}s, "
        f"total {s['seconds']:.0f}s",
        "verdict: PASS" if s["ok"] else "verdict: FAIL: " + "; ".join(s["reasons"]),
    ]
    print("\n".join(lines))


def chaos_command(args: argparse.Namespace) -> int:
    """Run the chaos command. Raises ValueError or FileNotFoundError for bad input (exit 2 in
    ``cli/main.py``) before any process starts."""
    spec = _spec(args)
    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        summary = ChaosRun(spec).run()
    except KeyboardInterrupt:
        print("trainguard: chaos interrupted; both runs stopped", file=sys.stderr)
        return 130
    except ChaosError as e:
        print(f"trainguard: chaos failed: {e} (seed {spec.seed})", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
    if args.json:
        print(json.dumps(summary))
    else:
        _print_text(summary)
    if not summary["ok"]:
        print(f"trainguard: chaos failed: {'; '.join(summary['reasons'])}", file=sys.stderr)
    return 0 if summary["ok"] else 1
