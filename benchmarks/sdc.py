"""Silent data corruption on the GPT example: how fast a flipped bit is found, and what the
fingerprints cost.

Detection: ``trainguard run --nodes 2 --nproc-per-node 2 --standby 1`` (4 data-parallel
ranks) with ``--inject sdc:rank=0:step=S:bit=B`` for a float32 exponent bit (30), the top
mantissa bit (22) and the lowest mantissa bit (0) of a parameter; the top mantissa bit of an
Adam moment (``target=optimizer``); an exponent and a mantissa bit of a gradient before the
all-reduce (``target=grad``: every replica applies the same corrupt average); and node1
computing wrong GEMMs from step S on (``gemm-wrong:node=1:step=S``, the in-job probe every
second). Per case: the signal that saw it, the steps and seconds from the fault to the
``sdc_detected`` event, the culprit named, the rollback point, the steps recomputed, and
whether the final losses equal a fault-free run's step for step.

Costs of the other signals, measured in-process: one known-answer probe (``health/probe.py``,
256x256) as a duty cycle at the default ``probe_every_s``, and the gradient norm the example
computes each step against that model's step.

Overhead: the same job without a fault in one run whose ckptd fingerprints snapshots only
in every other block of ``--block`` steps (``TRAINGUARD_FINGERPRINT_AB``), with snapshots
every step and every ``--every`` steps; the ratio is the median over blocks with
fingerprints of the block's median step time over its neighbours' (ckptd competes with
training for this machine's 2 cores, so this is where a cost would show). Whole runs
compared one after the other differed by ±20% on this VM, more than any effect.

Keys: ``every``, ``at``, ``steps``, ``detection`` (``reference_step_s``, ``cases``: one entry
a case, ``case``, ``tag``, ``inject``, ``flipped_at_step``, ``before``, ``after``,
``detected``, ``signal``, ``detected_at_step``, ``steps_to_detect``, ``seconds_to_detect``,
``culprits``, ``rollback_to``, ``steps_recomputed``, ``losses_equal_fault_free``; null where
nothing was detected), ``overhead`` (one entry a snapshot interval: ``snapshot_every``,
``median_step_ms_with``, ``median_step_ms_without``, ``ratio_median``, ``blocks``),
``signal_costs``. No target is named for these figures (docs/sdc.md).

``--smoke``: 24 steps, snapshots every 4, one case (a parameter's bit 22), the fault-free
reference run doubling as the one overhead run, in blocks of 4 (CI). ``--record`` writes
``benchmarks/results/sdc.json`` (``table_rows``). Run: ``python benchmarks/sdc.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import common
from step_overhead import GPT, SMALL, ab_blocks, block_ratios, min_steps, run_to_end, step_times

CONFIG = 'preflight = "off"\nheartbeat_s = 0.2\nnode_timeout_s = 3.0\nfault_stop_grace_s = 0.1\n'
FOUR = ["--nodes", "2", "--nproc-per-node", "2"]
AB_ENV = "TRAINGUARD_FINGERPRINT_AB"  # ckptd fingerprints only every other block of N steps
# name -> (tag, inject, job config added, slower pace): parameter flips, then what
# fingerprints cannot see (a gradient before the all-reduce, a node's GEMMs), then what
# nothing sees.
CASES: dict[str, tuple[str, str, str, bool]] = {
    "parameter, exponent (bit 30)": ("P30", "sdc:rank=0:step={at}:bit=30", "", False),
    "parameter, high mantissa (bit 22)": ("P22", "sdc:rank=0:step={at}:bit=22", "", False),
    "parameter, low mantissa (bit 0)": ("P0", "sdc:rank=0:step={at}:bit=0", "", False),
    "Adam moment, high mantissa (bit 22)": (
        "A22", "sdc:rank=0:step={at}:target=optimizer:bit=22", "", False),
    "gradient, exponent (bit 30)": ("G30", "sdc:rank=0:step={at}:target=grad:bit=30", "", True),
    "node1's GEMMs wrong from step S": (
        "GEMM", "gemm-wrong:node=1:step={at}", "probe_every_s = 1.0\n", True),
    "gradient, high mantissa (bit 22)": (
        "G22", "sdc:rank=0:step={at}:target=grad:bit=22", "", True),
}  # fmt: skip
SMOKE_CASES = ["parameter, high mantissa (bit 22)"]
PACE = ["--inject", "slow:rank=0:factor=4"]  # steps 4x longer: a probe every second sees them


def _run(tmp: Path, name: str, run_args: list[str], script_args: list[str],
         env: dict[str, str] | None = None, config: str = "") -> Path:  # fmt: skip
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG + config)
    run = tmp / name
    cmd = [sys.executable, "-m", "trainguard", "run", "--run-dir", str(run), "--config",
           str(cfg), *run_args, str(GPT), *script_args]  # fmt: skip
    rc, err = run_to_end(cmd, 600, {**os.environ, **(env or {})})
    if rc != 0:
        raise SystemExit(f"sdc.py: {name}: trainguard run failed:\n{err[-2000:]}")
    return run


def _events(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]


def _losses(run: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


def _value(v: float | None) -> float | str | None:
    """A flipped element's value for the JSON: a number, or ``"inf"``/``"nan"`` as text (an
    exponent flip of a value in [1, 2) makes one; JSON has no such numbers)."""
    return v if v is None or math.isfinite(v) else str(v)


def _g(v: float | str) -> str:
    return v if isinstance(v, str) else f"{v:.6g}"


def _case(tmp: Path, i: int, name: str, at: int, script: list[str],
          ref: dict[int, float]) -> dict[str, Any]:  # fmt: skip
    tag, inject, config, slow = CASES[name]
    drill = ["--inject", inject.format(at=at), *(PACE if slow else [])]
    run = _run(tmp, f"case{i}", [*FOUR, "--standby", "1", *drill], script, config=config)
    evs = _events(run)
    flip = next(
        (e for e in evs if e["kind"] == "sdc_injected"
         or (e["kind"] == "inject_fired" and e["inject"]["kind"] == "gemm-wrong")),
        None,
    )  # fmt: skip
    if flip is None:
        raise SystemExit(f"sdc.py: {name}: the fault never fired (no sdc_injected event)")
    found = [e for e in evs if e["kind"] == "sdc_detected"]
    row: dict[str, Any] = {
        "case": name, "tag": tag, "inject": inject.format(at=at),
        "flipped_at_step": flip["step"], "before": _value(flip.get("before")),
        "after": _value(flip.get("after")), "detected": bool(found), "signal": None,
        "detected_at_step": None, "steps_to_detect": None, "seconds_to_detect": None,
        "culprits": None, "rollback_to": None, "steps_recomputed": None,
    }  # fmt: skip
    if found:
        d = found[0]
        start = next((e for e in evs[evs.index(d) :] if e["kind"] == "generation_started"), {})
        restore = start.get("restore_step")
        row.update(
            signal=d.get("signal", "fingerprints"),
            detected_at_step=d["step"],
            steps_to_detect=d["step"] - flip["step"],
            seconds_to_detect=round(d["ts"] - flip["ts"], 3),
            culprits=d["culprits"] or d["nodes"],
            rollback_to=restore,
            steps_recomputed=d["step"] - (restore or 0),
        )
    row["losses_equal_fault_free"] = _losses(run) == ref
    return row


def _ab(run: Path, every: int, block: int) -> dict[str, Any]:
    """The fingerprints' cost in a run under ``TRAINGUARD_FINGERPRINT_AB=block``: each block
    with fingerprints against the mean of its two neighbours' median step times (drift
    cancels, as in step_overhead.py); the first step of a block and the first two blocks are
    dropped."""
    blocks = ab_blocks(step_times(run), block, block // 2)
    ratios = block_ratios(blocks)
    on = [d for b, ds in blocks.items() if b % 2 == 0 for d in ds]
    off = [d for b, ds in blocks.items() if b % 2 == 1 for d in ds]
    if not ratios or not on or not off:
        raise SystemExit("sdc.py: the overhead run logged too few steps for a block ratio")
    return {
        "snapshot_every": every,
        "median_step_ms_with": round(statistics.median(on) * 1e3, 2),
        "median_step_ms_without": round(statistics.median(off) * 1e3, 2),
        "ratio_median": round(statistics.median(ratios), 4),
        "blocks": len(ratios),
    }


def detection(
    tmp: Path, steps: int, every: int, at: int, cases: list[str], ab_block: int = 0
) -> tuple[dict[str, Any], Path]:
    """The fault-free reference run, then each case; (the detection result, the reference's
    run dir). ``ab_block``: the reference runs under ``TRAINGUARD_FINGERPRINT_AB`` (the smoke
    run's overhead figure comes from it: fingerprints do not change the losses)."""
    script = [*SMALL, "--steps", str(steps), "--ckpt-every", str(every),
              "--durable-every", str(every)]  # fmt: skip
    env = {AB_ENV: str(ab_block)} if ab_block else None
    ref_run = _run(tmp, "reference", FOUR, script, env)
    ref = _losses(ref_run)
    out: dict[str, Any] = {
        "reference_step_s": statistics.median(d for _, d in step_times(ref_run)),
        "cases": [_case(tmp, i, name, at, script, ref) for i, name in enumerate(cases)],
    }
    return out, ref_run


def signal_costs(step_s: float, repeats: int = 50) -> dict[str, Any]:
    """Seconds of one known-answer probe (as the probe process runs it) and of the example's
    gradient norm of the small model (in-process, one thread), the norm against ``step_s``
    (the 4-rank reference run's median step: what it adds to each step there)."""
    import time

    import torch

    from trainguard.controller.config import JobConfig
    from trainguard.health.probe import KnownAnswer

    torch.set_num_threads(1)
    probe = KnownAnswer(256, "cpu")
    probe.run(wrong=False)
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        probe.run(wrong=False)
        t.append(time.perf_counter() - t0)
    per_probe = statistics.median(t)
    every = JobConfig(script="x", run_dir="/tmp/x").sdc.probe_every_s
    sys.path.insert(0, str(GPT.parent))
    from model import GPT as Model  # noqa: E402  (the example's model)
    from model import GPTConfig  # noqa: E402

    torch.manual_seed(0)
    model = Model(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32, dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (4, 32))
    norms = []
    for _ in range(repeats + 10):
        opt.zero_grad(set_to_none=True)
        model(x, x).backward()
        t1 = time.perf_counter()
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        norms.append(time.perf_counter() - t1)
        opt.step()
    norm = statistics.median(norms[10:])
    return {
        "probe_ms": round(per_probe * 1e3, 3),
        "probe_every_s": every,
        "probe_duty_cycle": per_probe / every if every > 0 else 0.0,
        "grad_norm_ms": round(norm * 1e3, 4),
        "step_ms": round(step_s * 1e3, 3),
        "grad_norm_share": round(norm / step_s, 4) if step_s > 0 else 0.0,
    }


def overhead(tmp: Path, steps: int, every: int, block: int) -> dict[str, Any]:
    """One run, snapshots every ``every`` steps, ckptd fingerprinting only in every other
    block of ``block`` steps (``TRAINGUARD_FINGERPRINT_AB``): see ``_ab``."""
    script = [*SMALL, "--steps", str(steps), "--ckpt-every", str(every),
              "--durable-every", str(10 * block)]  # fmt: skip
    return _ab(_run(tmp, f"ab{every}", FOUR, script, {AB_ENV: str(block)}), every, block)


def _found_text(r: dict[str, Any]) -> str:
    if not r["detected"]:
        return f"{r['tag']} not detected"
    return (
        f"{r['tag']} by {r['signal']} after {r['steps_to_detect']} steps, "
        f"{r['seconds_to_detect']:.2f} s"
    )


def table_rows(result: dict[str, Any]) -> list[common.Row]:
    """The README's rows: detection per case, the fingerprints' cost, the other signals'."""
    cases = result["detection"]["cases"]
    found = [c for c in cases if c["detected"]]
    equal = sum(1 for c in found if c["losses_equal_fault_free"])
    over = "; ".join(
        f"snapshot every {o['snapshot_every']}: {o['ratio_median']:.3f}× "
        f"({o['median_step_ms_with']:.1f} vs {o['median_step_ms_without']:.1f} ms, "
        f"{o['blocks']} block ratio{'s' if o['blocks'] != 1 else ''})"
        for o in result["overhead"]
    )
    c = result["signal_costs"]
    return [
        {
            "what": (
                f"silent data corruption, {len(cases)} injected case(s), 4 data-parallel ranks "
                f"(tiny GPT, snapshots every {result['every']} steps, fault due at step "
                f"{result['at']}); [cases](docs/sdc.md#measured)"
            ),
            "result": (
                "; ".join(_found_text(r) for r in cases)
                + f". {len(found)} of {len(cases)} detected, {equal} of them rolled back to "
                "losses equal to a fault-free run's"
            ),
            "target": "—",
        },
        {
            "what": "fingerprints' cost: step time with vs without (the same run, alternating "
            "blocks, 4 ranks)",
            "result": over,
            "target": "—",
        },
        {
            "what": "the other signals' cost: known-answer GEMM probe (256×256), gradient norm",
            "result": (
                f"probe {c['probe_ms']:.2f} ms every {c['probe_every_s']:g} s "
                f"({c['probe_duty_cycle']:.1e} of a core); gradient norm {c['grad_norm_ms']:.3f} "
                f"ms of a {c['step_ms']:.1f} ms step ({c['grad_norm_share']:.2%})"
            ),
            "target": "—",
        },
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5, help="snapshot (fingerprint) interval")
    p.add_argument("--at", type=int, default=23, help="the step the flip is due")
    p.add_argument("--overhead-steps", type=int, default=400)
    p.add_argument("--block", type=int, default=10)
    common.add_common(p, smoke="24 steps, one case, the reference run as the overhead run (CI)")
    args = p.parse_args(argv)
    cases = list(CASES)
    if args.smoke:
        args.steps, args.every, args.at, args.block = 24, 4, 7, 4
        cases = SMOKE_CASES
    if args.every < 1 or not 1 <= args.at < args.steps - args.every or args.block < 2:
        p.error("--every >= 1, --at within the run (before its last snapshot), --block >= 2")
    need = min_steps(args.block, args.block // 2)
    if (args.overhead_steps if not args.smoke else args.steps) < need:
        p.error(f"--overhead-steps must be >= {need} for --block {args.block}")
    tmp = Path(tempfile.mkdtemp(prefix="tg-sdc-"))
    try:
        found, ref_run = detection(
            tmp, args.steps, args.every, args.at, cases, args.block if args.smoke else 0
        )
        if args.smoke:  # the reference ran under the A/B: its figure, not a run of its own
            over = [_ab(ref_run, args.every, args.block)]
        else:
            over = [overhead(tmp, args.overhead_steps, e, args.block) for e in (1, args.every)]
        result = {
            "steps": args.steps,
            "every": args.every,
            "at": args.at,
            "detection": found,
            "overhead": over,
            "signal_costs": signal_costs(found["reference_step_s"], 10 if args.smoke else 50),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    common.finish("sdc", args, result, argv)
    if args.json:
        return 0
    print(f"detection, 4 data-parallel ranks, snapshots every {args.every} steps:")
    for r in result["detection"]["cases"]:
        what = "" if r["before"] is None else f"{_g(r['before'])} -> {_g(r['after'])} "
        if not r["detected"]:
            print(f"  {r['case']}: {what}at step {r['flipped_at_step']}, NOT detected; losses "
                  f"equal a fault-free run: {r['losses_equal_fault_free']}")  # fmt: skip
            continue
        print(
            f"  {r['case']}: {what}at step {r['flipped_at_step']}; found by {r['signal']} "
            f"{r['steps_to_detect']} steps / {r['seconds_to_detect']} s later, culprit "
            f"{r['culprits'] or 'not named'}; rolled back to step {r['rollback_to']} "
            f"({r['steps_recomputed']} recomputed); losses equal a fault-free run: "
            f"{r['losses_equal_fault_free']}"
        )
    c = result["signal_costs"]
    print(f"GEMM probe: {c['probe_ms']} ms each, every {c['probe_every_s']:g} s by default: "
          f"{c['probe_duty_cycle']:.2e} of one core; gradient norm: {c['grad_norm_ms']} ms of a "
          f"{c['step_ms']} ms step ({c['grad_norm_share']:.2%})")  # fmt: skip
    for o in result["overhead"]:
        print(
            f"overhead, snapshots every {o['snapshot_every']} step(s): step time with / without "
            f"fingerprints {o['ratio_median']} (median of {o['blocks']} block ratios; "
            f"{o['median_step_ms_with']} vs {o['median_step_ms_without']} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
