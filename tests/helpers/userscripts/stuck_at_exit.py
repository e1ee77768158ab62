"""A DDP script whose rank 0 never exits after its last step: it blocks with no CPU, as a
process-group destructor waiting on a gloo thread that waits for the GIL does.

    trainguard run --nproc-per-node 2 stuck_at_exit.py STEPS [--runtime]

``--runtime`` reports steps (``trainguard.init(total_steps=STEPS)``); without it the script
never imports trainguard. Rank 0 prints ``rank 0 done`` and then blocks forever.
"""

import argparse
import os
import threading

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("steps", type=int)
p.add_argument("--runtime", action="store_true")
a = p.parse_args()
rt = None
if a.runtime:
    import trainguard

    rt = trainguard.init(total_steps=a.steps)
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, a.steps + 1):
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    if rt is not None:
        rt.step_end(step)
dist.destroy_process_group()
if int(os.environ["RANK"]) == 0:
    print("rank 0 done", flush=True)
    threading.Event().wait()  # never returns
