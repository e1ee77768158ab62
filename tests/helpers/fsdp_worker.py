"""FSDP2 state through trainguard's durable tier at one world size, back at another (torchrun).

    torchrun --nproc-per-node W fsdp_worker.py save --root DIR --out FULL.pt
    torchrun --nproc-per-node W fsdp_worker.py load --root DIR --out FULL.pt [--plain]

An MLP sharded with ``fully_shard`` on a 1-D mesh, AdamW state through DCP's
``get_state_dict`` (DTensors). ``save`` trains 3 steps with a standalone Checkpointer
(persister in-process, durable every step), writes the full (unsharded) model and optimizer
state to FULL.pt from rank 0, and prints, per rank, the tensor bytes its snapshot holds and
the bytes of the whole state. ``load`` builds the model from another seed, restores (with
``--plain``: plain ``dcp.load``, no trainguard) and prints whether every full tensor equals
FULL.pt's, the rank's ``per_rank`` value and the positions of the ``per_shard`` shards it
runs now.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from trainguard.checkpoint import storage
from trainguard.checkpoint.checkpointer import Checkpointer


class App(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )


def full(sd: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of a nested state dict, unsharded (a collective for DTensors)."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = full(v)
        elif isinstance(v, DTensor):
            out[k] = v.full_tensor()
        else:
            out[k] = v
    return out


SHARDS = 8  # data-parallel shards: the largest world this helper runs at


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0 if a.mode == "save" else 1)
    model = nn.Sequential(
        nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 13), nn.ReLU(), nn.Linear(13, 5)
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    app = App(model, optim)
    # Per-rank state (follows the rank number) and the state of 8 data-parallel shards, rank r
    # running shards r, r+W, ... (follows the shard to whichever rank runs it).
    per_rank = {"who": torch.tensor([rank if a.mode == "save" else -1])}
    per_shard = {v: {"pos": -1} for v in range(rank, SHARDS, world)}
    state: dict[str, Any] = {"app": app, "per_rank": per_rank, "per_shard": per_shard}
    ckpt = Checkpointer(a.root, durable_every=1)
    if a.mode == "save":
        g = torch.Generator().manual_seed(rank)
        for step in range(1, 4):
            model(torch.randn(8, 24, generator=g)).square().sum().backward()
            optim.step()
            optim.zero_grad()
            for v in per_shard:
                per_shard[v]["pos"] = 1000 + 10 * v + step
            ckpt.save(step, state)
        pool = ckpt._pool  # the snapshot's layout: what this rank's slot holds
        assert pool is not None and pool.layout is not None
        mine = sum(e.nbytes for e in pool.layout.tensors)
        ckpt.close()
        whole = full(app.state_dict())
        total = sum(t.numel() * t.element_size() for t in _tensors(whole))
        print(json.dumps({"rank": rank, "snapshot_bytes": mine, "state_bytes": total}), flush=True)
        if rank == 0:
            torch.save(whole, a.out)
    else:
        if a.plain:
            step = storage.list_committed(Path(a.root))[-1]
            dcp.load({"app": app}, checkpoint_id=str(storage.step_dir(Path(a.root), step)))
        else:
            step = ckpt.load(state)
        got = full(app.state_dict())
        want = torch.load(a.out, weights_only=False)
        same = _equal(got, want)
        shards = ",".join(f"{v}:{s['pos']}" for v, s in per_shard.items())  # a flat line
        out = {"rank": rank, "step": step, "equal": same, "who": int(per_rank["who"])}
        print(json.dumps(out | ({} if a.plain else {"shards": shards})), flush=True)
        ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _tensors(d: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for v in d.values():
        if isinstance(v, dict):
            out += _tensors(v)
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    # Skip interpreter finalization: a gloo worker thread that still drops its last tensor
    # reference then needs the GIL and aborts the process ("terminate called without an active
    # exception", pytorch/pytorch#190489), once in many runs. Everything this helper shows is
    # printed and written by now.
    os._exit(rc)
