"""A trainer written the torchtitan way, checkpointing through trainguard's DCP storage.

    trainguard run --nproc-per-node 2 titan_shaped.py [STEPS] [INTERVAL]
    torchrun --nproc-per-node 2 titan_shaped.py [STEPS] [INTERVAL]

The shape of torchtitan's trainer (``torchtitan/trainer.py``, ``components/checkpointer``):
a decoder sharded with FSDP2 (``fully_shard`` per block and at the root, a 1-D mesh), every
piece of state a ``Stateful`` (``ModelWrapper``, ``OptimizersContainer``, the LR scheduler,
``TrainState`` with the step and tokens seen, a dataloader whose state is pickled bytes
under ``dp_rank_<r>``), and a ``CheckpointManager`` that calls ``dcp.async_save`` on a gloo
process group of its own every INTERVAL steps and ``dcp.load`` at start. The only
trainguard lines are the storage writer, the reader and ``resume_step``. Rank 0 prints
``step N loss X`` (X: the global mean loss, ``repr`` of the float).
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainguard.dcp

VOCAB, DIM, SEQ, BATCH = 64, 32, 16, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1, self.w2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(h)


class ModelWrapper(Stateful):
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd)


class OptimizersContainer(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim)  # creates lazy state

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, sd)


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "ntokens_seen": torch.tensor(self.ntokens_seen)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = int(sd["step"]), int(sd["ntokens_seen"])


class DataLoader(Stateful):
    """Synthetic tokens, a pure function of (dp rank, sample index); the state is the index,
    pickled under this rank's key as torchtitan's ``ParallelAwareDataloader`` does."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank, self.sample = dp_rank, 0

    def next_batch(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.dp_rank + self.sample)
        self.sample += 1
        return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.dp_rank}": pickle.dumps({"sample": self.sample})}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sample = pickle.loads(sd[f"dp_rank_{self.dp_rank}"])["sample"]


class CheckpointManager:
    """torchtitan's: async saves on a gloo group of their own, one in flight at a time."""

    def __init__(self, states: dict[str, Stateful], interval: int) -> None:
        self.states, self.interval = states, interval
        self.pg = dist.new_group(backend="gloo")
        self.future: Any = None

    def load(self) -> int:
        step = trainguard.dcp.resume_step()
        if step is None:
            return 0
        dcp.load(self.states, storage_reader=trainguard.dcp.Reader())
        return step

    def save(self, step: int, last: bool = False) -> None:
        if step % self.interval and not last:
            return
        self.wait()
        self.future = dcp.async_save(
            self.states, storage_writer=trainguard.dcp.Writer(step), process_group=self.pg
        )

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def close(self) -> None:
        self.wait()
        trainguard.dcp.checkpointer().close()  # the last durable step committed


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    interval = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    model = Decoder()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 5))
    train_state, loader = TrainState(), DataLoader(rank)
    ckpt = CheckpointManager(
        {
            "model": ModelWrapper(model),
            "optimizer": OptimizersContainer(model, optim),
            "lr_scheduler": sched,
            "train_state": train_state,
            "dataloader": loader,
        },
        interval,
    )
    ckpt.load()
    while train_state.step < steps:
        train_state.step += 1
        batch = loader.next_batch()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        train_state.ntokens_seen += batch.numel() * world
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {train_state.step} loss {(mean / world).item()!r}", flush=True)
        ckpt.save(train_state.step, last=train_state.step == steps)
    ckpt.close()
    dist.destroy_process_group()
    if rank == 0 and os.environ.get("TITAN_SHAPED_DONE"):
        print("done", flush=True)


if __name__ == "__main__":
    main()
