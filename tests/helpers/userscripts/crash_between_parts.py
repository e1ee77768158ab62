"""A user's two-rank script with a Checkpointer, for a crash between the parts of one step.

    crash_between_parts.py --value V --steps N [--crash-at S --crash self|hold]
                           [--slow-rank R] [--root DIR] [--pg] [--load]

Every step fills ``model.w`` (1 MiB float32) with ``V*1000 + step`` and this rank's
``per_rank.v`` with ``V*1000 + step + rank/2``, then saves it (durable every step). With
``--crash-at S``, rank 0 reaches step S, waits (60 s at most) until rank 1's part of step S is
on disk, writes ``between-parts`` in the working directory and then SIGKILLs itself (``self``)
or sleeps to be killed by the test (``hold``): a run that died between its parts. With
``--slow-rank R`` rank R sleeps 3 s before each save (a slow rank of a re-run: its peer's part
is written long before its own). ``--pg`` joins a gloo process group (``env://``). Resumes
from ``Checkpointer.load``. ``--load`` prints one JSON line per rank instead: the restored
step, ``w``'s value and ``per_rank.v``. ``CBP_VALUE``, ``CBP_CRASH_AT``, ``CBP_CRASH`` and
``CBP_SLOW_RANK`` in the environment are the defaults of the flags (a re-run of a run dir must
repeat its command: what differs between the runs comes from the environment).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.checkpoint.checkpointer import Checkpointer


def main() -> int:
    p = argparse.ArgumentParser()
    env = os.environ.get
    p.add_argument("--value", type=int, default=int(env("CBP_VALUE", "1")))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--crash-at", type=int, default=int(env("CBP_CRASH_AT", "0")) or None)
    p.add_argument("--crash", choices=["self", "hold"], default=env("CBP_CRASH", "self"))
    p.add_argument("--slow-rank", type=int, default=int(env("CBP_SLOW_RANK", "-1")))
    p.add_argument("--root")
    p.add_argument("--pg", action="store_true")
    p.add_argument("--load", action="store_true")
    a = p.parse_args()
    if a.pg:
        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    ckpt = Checkpointer(a.root)
    root = ckpt.root
    state = {"model": {"w": torch.zeros(1 << 18)}, "per_rank": {"v": torch.zeros(1)}}
    start = ckpt.load(state) or 0
    if a.load:
        w, v = state["model"]["w"], state["per_rank"]["v"]
        print(json.dumps({"rank": rank, "step": start, "w": float(w[0]),
                          "w_uniform": bool((w == w[0]).all()), "v": float(v[0])}), flush=True)  # fmt: skip
        return 0
    for step in range(start + 1, a.steps + 1):
        state["model"]["w"].fill_(a.value * 1000 + step)
        state["per_rank"]["v"].fill_(a.value * 1000 + step + rank / 2)
        if step == a.crash_at and rank == 0:
            deadline = time.monotonic() + 60
            while not list(root.glob(f".tmp-step_{step}-*/rank_1/.done")):
                if time.monotonic() > deadline:
                    raise SystemExit(f"rank 1's part of step {step} never reached {root}")
                time.sleep(0.05)
            Path("between-parts").write_text(str(step))
            if a.crash == "self":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)
        if a.slow_rank == rank:
            time.sleep(3)
        ckpt.save(step, state, durable=True)
        print(f"rank {rank} saved {step}", flush=True)
    ckpt.close()
    if a.pg:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
