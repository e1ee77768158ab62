"""The GPT example as replica groups: local recovery (docs/local_recovery.md).

    trainguard run --nodes 2 --replica-groups 2 examples/gpt/replicas.py --steps 200

Each replica group is a whole model (DDP over the group's ranks when it has several); across
the groups the gradients are averaged by ``trainguard.replica.ReplicaGroup``, over the groups
that are live at that step. When a rank dies, the other groups go on training at reduced
width while its group restarts and heals from a live one; nothing waits for a checkpoint.

The data of step s for job rank r is the same as ``train.py``'s for rank r in a world of the
same size (``BatchSampler``: a function of seed, rank and step), so without a fault the losses
equal ``train.py``'s. Each group's slot 0 appends ``{"step", "loss", "group", "width",
"time"}`` to ``<run dir>/metrics.jsonl`` (the loss is the mean over the groups that took part;
``width`` how many did), and at the end ``{"group", "slot", "digest"}`` of its model and
optimizer state to ``<run dir>/digests.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import BatchSampler, load_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from train import add_model_args  # noqa: E402

import trainguard  # noqa: E402
from trainguard import replica  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)  # train.py's: the same model, data and optimizer flags
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    replica.init_process_group("gloo")  # this replica group's ranks (all ranks when G = 1)
    rank = int(os.environ.get("RANK", "0"))  # the job's rank: names the data shard
    rt = trainguard.init(total_steps=args.steps)
    cfg = GPTConfig.from_args(args)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GPT(cfg)
    inner = DDP(model) if dist.get_world_size() > 1 else model  # within the group
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, foreach=False)
    get_state_dict(inner, optim)  # creates the optimizer state (as train.py does) at the start
    torch.manual_seed(args.seed + 1 + rank)  # per-rank stream (dropout), as train.py's
    corpus = load_corpus(args.data, args.data_max_bytes)
    sampler = BatchSampler(
        corpus, block_size=args.block_size, batch_size=args.batch_size, seed=args.seed, rank=rank
    )
    # The RNG stream is each rank's own (per_rank): replicated state is restored from rank 0's
    # copy, and rank 1 given rank 0's dropout stream would train other losses after a restore.
    state = {"model": model, "optim": optim, "per_rank": {"rng": torch.get_rng_state()}}
    ckpt = trainguard.Checkpointer(durable_every=args.durable_every)
    start = 0
    if (restored := ckpt.load(state)) is not None:  # a global recovery's restore point
        torch.set_rng_state(state["per_rank"]["rng"])
        start = restored
    rg = replica.ReplicaGroup(model, optim, step=start)  # joins; a returning group heals here
    out = Path(os.environ.get("TRAINGUARD_RUN_DIR") or ".")
    metrics = open(out / "metrics.jsonl", "a") if rg.slot == 0 else None  # noqa: SIM115
    inner.train()
    saved = start  # the last step this rank checkpointed (or restored)
    while rg.step < args.steps:
        step = rg.step + 1
        x, y = sampler.batch(step)
        loss = inner(x, y)
        loss.backward()
        local = torch.tensor([loss.item()], dtype=torch.float64)
        if dist.get_world_size() > 1:  # the group's mean loss (its ranks' shards)
            dist.all_reduce(local)
            local /= dist.get_world_size()
        mean = rg.step_optimizer(loss=local.item())  # averaged across the live groups
        if rg.step != step:  # healed past it: this step's work was the others'
            continue
        saved = step
        rt.step_end(step, loss=mean, tokens=x.numel())
        if metrics is not None:
            rec = {"step": step, "loss": mean, "group": rg.group, "width": rg.width,
                   "time": time.time()}  # fmt: skip
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
        state["per_rank"]["rng"] = torch.get_rng_state()
        ckpt.save(step, state, durable=True if step == args.steps else None)
    rg.finish()  # a group still restarting is waited for and healed to the last step
    if saved < rg.step:  # healed at the end: this rank's last step, and its checkpoint part
        rt.step_end(rg.step)
        ckpt.save(rg.step, state, durable=True)
    ckpt.close()
    if metrics is not None:
        metrics.close()
    with open(out / "digests.jsonl", "a") as f:
        f.write(
            json.dumps({"group": rg.group, "slot": rg.slot, "digest": rg.state_digest()}) + "\n"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
