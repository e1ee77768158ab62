"""A worker for checkpoint fault tests: saves or loads a state whose bytes encode the step.

    ckpt_worker.py save --first A --last B --size-mb M [--durable-every K] [--hold]
    ckptworker.py load

State: {"model": {"w": float32 tensor of M MiB, every element == step}, "step": step,
"per_rank": {"pos": step * 10}}. ``save`` prints "saving N" before each save and "saved N"
after (with ``--stepwise``, only once a line arrives on stdin); with ``--hold`` it then sleeps (to be killed) instead of waiting for durability.
``load`` prints one JSON line: the restored step and whether every byte matches it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from trainguard.checkpoint.checkpointer import Checkpointer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--root", required=True)
    p.add_argument("--first", type=int, default=1)
    p.add_argument("--last", type=int, default=1)
    p.add_argument("--size-mb", type=float, default=1.0)
    p.add_argument("--durable-every", type=int, default=1)
    p.add_argument("--hold", action="store_true")
    p.add_argument(
        "--stepwise", action="store_true", help="read a line from stdin before each save"
    )
    a = p.parse_args()
    w = torch.zeros(int(a.size_mb * 2**20 / 4), dtype=torch.float32)
    state = {"model": {"w": w}, "step": 0, "per_rank": {"pos": 0}}
    ckpt = Checkpointer(a.root, durable_every=a.durable_every)
    if a.mode == "load":
        step = ckpt.load(state)
        ok = step is not None and bool((w == float(step)).all()) and state["step"] == step
        print(
            json.dumps({"step": step, "bytes_ok": ok, "pos": state["per_rank"]["pos"]}), flush=True
        )
        return 0
    for step in range(a.first, a.last + 1):
        w.fill_(float(step))
        state["step"], state["per_rank"]["pos"] = step, step * 10
        if a.stepwise:
            sys.stdin.readline()
        print(f"saving {step}", flush=True)
        ckpt.save(step, state)
        print(f"saved {step}", flush=True)
    if a.hold:
        time.sleep(3600)
    ckpt.close()
    print("closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
