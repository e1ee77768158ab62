"""A user's script that opts in to in-process recovery, shaped the way users write one: the
dataset is built once, outside the training function (kept across recoveries); inside it the
process group, a DDP model, an optimizer whose state is created lazily at the first step, a
DataLoader with ``spawn`` workers, and a Checkpointer. Rank 0 appends ``{"step", "loss"}`` to
``$TRAINGUARD_RUN_DIR/metrics.jsonl``.

    trainguard run --nodes 1 --nproc-per-node 2 inprocess_user.py --steps 60
        [--workers N]        DataLoader workers (spawn), 0 = none
        [--probe FILE]       each entry of main() appends this process's threads, fds,
                             /dev/shm mappings, child processes and RSS (rank 0)
        [--stuck-at STEP]    rank 0 of generation 0 enters a C call no abort reaches
                             (libc sleep(60), every signal blocked) after STEP: the
                             escalation test
        [--sleep-at STEP]    rank 0 of generation 0 sleeps in time.sleep(60) after STEP:
                             a blocking call the abort must interrupt
        [--stall-init GEN]   rank 1 of generation GEN writes $TRAINGUARD_RUN_DIR/stalled
                             and sleeps before init_process_group: its peer waits inside
                             init_process_group when the fault comes
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import trainguard


class Pairs(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def resources() -> dict[str, int]:
    me = psutil.Process()
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {
        "threads": threading.active_count(),
        "os_threads": me.num_threads(),
        "fds": len(os.listdir("/proc/self/fd")),
        "shm_maps": sum(1 for m in maps if "/dev/shm/" in m),
        "children": len(me.children(recursive=True)),
        "rss": me.memory_info().rss,
    }


def main(args: argparse.Namespace, data: Pairs) -> int:
    gen = int(os.environ.get("TRAINGUARD_GENERATION", "0"))
    if args.stall_init is not None and gen == args.stall_init and os.environ["RANK"] == "1":
        Path(os.environ["TRAINGUARD_RUN_DIR"], "stalled").write_text(str(os.getpid()))
        time.sleep(600)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    rt = trainguard.init(total_steps=args.steps)
    run_dir = Path(os.environ.get("TRAINGUARD_RUN_DIR", "."))
    if args.probe and rank == 0:
        with open(args.probe, "a") as f:
            f.write(json.dumps({"generation": rt.generation, **resources()}) + "\n")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1)))  # fmt: skip
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)  # state appears at the first step
    ckpt = trainguard.Checkpointer(durable_every=10, overlap=True)
    ckpt.attach(optim)
    state = {"model": model.module, "optim": optim}
    start = ckpt.load(state) or 0
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(
        data, batch_size=8, sampler=sampler, num_workers=args.workers,
        multiprocessing_context="spawn" if args.workers else None,
        persistent_workers=bool(args.workers),
    )  # fmt: skip
    batches = len(loader)
    metrics = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    step = start
    while step < args.steps:
        skip = step % batches  # the data position follows the step (restores land mid-epoch)
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue
            step += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            t = torch.tensor([loss.item()])
            dist.all_reduce(t)
            mean = t.item() / world
            rt.step_end(step, loss=mean)
            if metrics is not None:
                metrics.write(json.dumps({"step": step, "loss": mean}) + "\n")
                metrics.flush()
            ckpt.save(step, state, durable=step == args.steps or None)
            if args.stuck_at == step and rank == 0 and rt.generation == 0:
                # a C call that no exception, socket or signal reaches (a hung device wait)
                signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
                ctypes.CDLL(None).sleep(60)
            if args.sleep_at == step and rank == 0 and rt.generation == 0:
                time.sleep(60)  # as a DataLoader's queue.get or a lock wait blocks
            if step >= args.steps:
                break
    ckpt.close()
    if metrics is not None:
        metrics.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--probe", default="")
    p.add_argument("--stuck-at", type=int, default=0)
    p.add_argument("--sleep-at", type=int, default=0)
    p.add_argument("--stall-init", type=int, default=None)
    a = p.parse_args()
    raise SystemExit(trainguard.run(main, a, Pairs(256)))
