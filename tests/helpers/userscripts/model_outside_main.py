"""A user's script that builds its model and optimizer once, at module level, outside the
training function it hands to ``trainguard.run`` (docs/inprocess.md allows it: what the script
makes before ``run`` is kept); ``main`` forms the group, wraps DDP, restores in place and
trains. Rank 0 appends ``{"step", "loss"}`` to ``$TRAINGUARD_RUN_DIR/metrics.jsonl``.

    trainguard run --nproc-per-node 2 model_outside_main.py [STEPS]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import trainguard

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
torch.manual_seed(0)
NET = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
OPT = torch.optim.Adam(NET.parameters(), lr=1e-2)


def main() -> int:
    dist.init_process_group("gloo")
    rt = trainguard.init(total_steps=STEPS)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(NET)
    ckpt = trainguard.Checkpointer()
    state = {"model": NET, "optim": OPT}
    start = ckpt.load(state) or 0
    out = os.path.join(os.environ.get("TRAINGUARD_RUN_DIR", "."), "metrics.jsonl")
    for step in range(start + 1, STEPS + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        OPT.zero_grad()
        loss.backward()
        OPT.step()
        mean = torch.tensor([loss.item()])
        dist.all_reduce(mean)
        rt.step_end(step, loss=mean.item() / world)
        if rank == 0:
            with open(out, "a") as f:
                f.write(json.dumps({"step": step, "loss": mean.item() / world}) + "\n")
        ckpt.save(step, state)
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(trainguard.run(main))
