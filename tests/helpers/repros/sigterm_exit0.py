"""Rank 1 exits with status 0 when it gets SIGTERM (as some trainers do after a preemption save).
Run: trainguard run --nodes 2 --config job.toml sigterm_exit0.py --steps 60, then send SIGTERM to
rank 1's worker process (its pid is in the worker_started event of `trainguard events`) around step 20 (10 s in).
Expected: the fault names rank 1 (it left early while its peers ran), never rank 0; and a job whose
ranks stopped on an outside SIGTERM before the last step is not reported as succeeded."""

import argparse
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()

rt = trainguard.init()
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
torch.manual_seed(0)
model = DDP(nn.Linear(16, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
state = {"model": model.module, "optim": opt}
ckpt = trainguard.Checkpointer(durable_every=10)
start = ckpt.load(state) or 0
for step in range(start + 1, a.steps + 1):
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    rt.step_end(step)
    ckpt.save(step, state)
    time.sleep(0.5)  # about 30 s in all: time to send the signal
ckpt.close()
dist.destroy_process_group()
