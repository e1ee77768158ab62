"""In-process recovery with checkpoints through DCP, written the torchtitan way: the training
function that ``trainguard.run`` re-enters after a fault builds its process group, a 1-D
device mesh, a model sharded with FSDP2 (``fully_shard``), Adam (state created lazily at the
first step), an ``AppState`` Stateful over ``get_model_state_dict`` /
``get_optimizer_state_dict``, and a gloo group of its own for ``dcp.async_save`` (one save in
flight, waited before the next). It loads with ``dcp.load`` when
``trainguard.dcp.resume_step()`` names a step. Rank 0 appends ``{"step", "loss"}`` to
``$TRAINGUARD_RUN_DIR/metrics.jsonl``.

    trainguard run --nproc-per-node 2 inprocess_dcp.py --steps 30
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainguard
import trainguard.dcp

BATCH = 8


class AppState(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optim),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd["model"])
        set_optimizer_state_dict(self.model, self.optim, sd["optim"])


def main(args: argparse.Namespace, data: torch.Tensor) -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    rt = trainguard.init(total_steps=args.steps)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    app = {"app": AppState(model, optim)}
    step = 0
    resume = trainguard.dcp.resume_step()
    if resume is not None:
        dcp.load(app, storage_reader=trainguard.dcp.Reader())
        step = resume
    ckpt_group = dist.new_group(backend="gloo")
    out = Path(os.environ["TRAINGUARD_RUN_DIR"]) / "metrics.jsonl"
    metrics = open(out, "a") if rank == 0 else None  # noqa: SIM115
    pending: Future[Any] | None = None
    while step < args.steps:
        lo = ((step * world + rank) * BATCH) % (len(data) - BATCH)
        x = data[lo : lo + BATCH]
        y = x.sum(dim=1, keepdim=True)
        step += 1
        loss = nn.functional.mse_loss(model(x), y)
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
        if pending is not None:
            pending.result()
        durable = step % 10 == 0 or step == args.steps
        pending = dcp.async_save(
            app, storage_writer=trainguard.dcp.Writer(step, durable=durable),
            process_group=ckpt_group,
        )  # fmt: skip
    if pending is not None:
        pending.result()
    if metrics is not None:
        metrics.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    raise SystemExit(
        trainguard.run(main, a, torch.randn(512, 16, generator=torch.Generator().manual_seed(7)))
    )
