"""Train a small byte-level GPT with DDP (or FSDP2, ``--fsdp``) over gloo; trainguard's main job.

Runs unchanged under ``trainguard run`` or ``torchrun`` (or alone, one process).
Deterministic for a given seed and world size: the checkpoint holds model,
optimizer, step, per-rank RNG states and data position, so a resumed run produces
the same per-step losses as one without a fault. Rank 0 appends
``{"step": N, "loss": X, "time": T}`` per step to ``<run dir>/metrics.jsonl``.
SIGTERM: every rank finishes its step, the job saves a checkpoint and exits 0.
``trainguard.run(main)``: the survivors of a fault recover in process (main() again, same
process); the failed rank alone is a new process.

With ``--fsdp`` every block and the root are sharded with FSDP2 (``fully_shard`` on a 1-D
``DeviceMesh`` over all ranks): model and optimizer state are DTensors, each rank holding
only its shards, and trainguard snapshots, replicates and persists just those shards.

Each step is timed in sections (data, forward, backward, optimizer) and its collectives
(DDP's gradient all-reduce, the loss all-reduce) as communication, for trainguard's
straggler detection. A step whose loss is not finite is skipped on every rank (as AMP's
GradScaler skips one), and reported.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import BatchSampler, load_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

import trainguard  # noqa: E402


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags of the run's length, data, model and optimizer (``replicas.py`` shares them)."""
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in total")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--data", default=None, help="text file or directory (default: Python's stdlib sources)"
    )
    p.add_argument("--data-max-bytes", type=int, default=4 << 20)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--durable-every", type=int, default=10, help="persist every K-th step to disk")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--ckpt-every", type=int, default=1, help="snapshot every K steps (0 = never)")
    p.add_argument(
        "--timing-ab",
        type=int,
        default=0,
        metavar="BLOCK",
        help="benchmark: section timing on and off in alternating blocks of BLOCK steps",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard parameters, gradients and optimizer state with FSDP2 instead of DDP",
    )
    p.add_argument(
        "--no-time-ddp",
        action="store_true",
        help="benchmark: DDP's built-in all-reduce, untimed (no trainguard comm hook)",
    )
    p.add_argument(
        "--dp-ranks",
        type=int,
        default=0,
        help="data-parallel shards of the global batch (default: the world size). For an "
        "elastic job (--nodes MIN:MAX) give MAX x nproc: each rank then runs the shards "
        "r, r+W, ... as gradient-accumulation micro-batches, so the global batch and the loss "
        "curve do not change when the world shrinks or grows",
    )
    p.add_argument(
        "--ckpt-ab",
        type=int,
        default=0,
        metavar="BLOCK",
        help="overhead measurement (benchmarks/step_overhead.py): blocks of BLOCK steps, offset "
        "by half a block, alternately with and without snapshots (0 = off)",
    )
    p.add_argument(
        "--out", default=None, help="run dir for metrics.jsonl (default: $TRAINGUARD_RUN_DIR or .)"
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.ckpt_every < 0 or args.durable_every < 0 or args.dp_ranks < 0:
        p.error("--steps must be >= 1; --ckpt-every, --durable-every and --dp-ranks >= 0")
    return args


class TrainState(Stateful):
    """Model, optimizer and step as one DCP ``Stateful`` (FQN keys, replicated across DP ranks)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim, self.step = model, optim, 0
        self.module = model.module if isinstance(model, DDP) else model  # FSDP2: in place
        get_state_dict(model, optim)  # once: creates the optimizer state a restore fills in
        self._names = [n for n, _ in self.module.named_parameters()]

    def state_dict(self) -> dict[str, Any]:
        """The dict DCP's ``get_state_dict`` builds (FQN-keyed model and optimizer state, the
        live tensors), built directly: ``get_state_dict`` re-validates its options on every
        call, ~5 ms a step for this model, most of the cost of a snapshot every step."""
        osd = self.optim.state_dict()
        ids = [i for g in osd["param_groups"] for i in g["params"]]
        fqn = dict(zip(ids, self._names, strict=True))
        optim = {
            "state": {fqn[i]: st for i, st in osd["state"].items()},
            "param_groups": [
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [fqn[i] for i in g["params"]],
                }
                for g in osd["param_groups"]
            ],
        }
        return {"model": self.module.state_dict(), "optim": optim, "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        self.step = int(sd["step"])


def _total_norm(model: torch.nn.Module) -> float:
    """The 2-norm of all gradients (a DTensor's: of the whole tensor, all shards)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads)
    full = getattr(norm, "full_tensor", None)
    return float((full() if full is not None else norm).item())


@functools.cache
def corpus_of(data: str | None, max_bytes: int) -> torch.Tensor:
    """The training text, read once per process (an in-process recovery keeps it)."""
    return load_corpus(data, max_bytes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    distributed = "MASTER_ADDR" in os.environ
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    rt = trainguard.init(total_steps=args.steps)  # exit 0 before it: stopped, not finished

    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("requested", True))

    corpus = corpus_of(args.data, args.data_max_bytes)  # read once: kept across recoveries
    cfg = GPTConfig.from_args(args)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GPT(cfg)
    if args.fsdp and distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root: embeddings (tied to the head), final norm
        ddp: torch.nn.Module = model
    else:
        ddp = DDP(model) if distributed else model
        if distributed and not args.no_time_ddp:
            trainguard.time_ddp(ddp)  # DDP's own all-reduce, timed as communication
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, foreach=False)
    torch.manual_seed(args.seed + 1 + rank)  # per-rank stream (dropout)
    shards = args.dp_ranks or world
    if shards < world:
        raise SystemExit(f"--dp-ranks {shards} is smaller than the world size {world}")
    samplers = [
        BatchSampler(
            corpus, block_size=args.block_size, batch_size=args.batch_size, seed=args.seed, rank=v
        )
        for v in range(rank, shards, world)
    ]
    scale = world / shards  # DDP averages over the world; the loss is the mean over all shards

    train = TrainState(ddp, optim)
    # The dropout RNG stream is this rank's; each data shard's position follows the shard to
    # whichever rank runs it after an elastic change (trainguard merges per_shard by shard).
    per_rank = {"rng": torch.get_rng_state()}
    per_shard = {
        v: s.state_dict() for v, s in zip(range(rank, shards, world), samplers, strict=True)
    }
    state: dict[str, Any] = {"train": train, "per_rank": per_rank, "per_shard": per_shard}
    # Snapshots to memory overlap the next forward/backward; the optimizer waits for them.
    ckpt = trainguard.Checkpointer(durable_every=args.durable_every, overlap=True)
    ckpt.attach(optim)
    restored = ckpt.load(state)
    if restored is not None:
        torch.set_rng_state(per_rank["rng"])
        for v, s in zip(range(rank, shards, world), samplers, strict=True):
            s.load_state_dict(per_shard[v])
    start = train.step
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"[rank {rank}/{world}] params={n_params} corpus={len(corpus)}B start_step={start} restored={restored}",
        flush=True,
    )

    out = Path(args.out or os.environ.get("TRAINGUARD_RUN_DIR") or ".")
    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    ddp.train()
    step = start
    for step in range(start + 1, args.steps + 1):
        rt.timing = args.timing_ab == 0 or (step - 1) // args.timing_ab % 2 == 0
        drill = rt.drill(step)  # an injected data fault (tests, drills); None normally
        optim.zero_grad(set_to_none=True)
        loss_sum, tokens = 0.0, 0
        for i, shard in enumerate(samplers):  # one shard per rank unless the world shrank
            with rt.section("data"):
                x, y = shard.batch(step)
                if drill == "loss-spike":  # random bytes instead of text: a real loss spike
                    g = torch.Generator().manual_seed(step)
                    x = torch.randint(0, cfg.vocab_size, x.shape, generator=g)
                    y = torch.randint(0, cfg.vocab_size, y.shape, generator=g)
            last_shard = i == len(samplers) - 1
            if args.fsdp and distributed:  # FSDP2: reduce-scatter only after the last micro-batch
                ddp.set_requires_gradient_sync(last_shard)  # type: ignore[operator]
            no_sync = not (last_shard or not distributed or args.fsdp)
            with ddp.no_sync() if no_sync else contextlib.nullcontext():  # type: ignore[operator]
                with rt.section("forward"):
                    loss = ddp(x, y)
                    if drill == "nan":
                        loss = loss * float("nan")
                with rt.section("backward"):
                    (loss * scale if scale != 1.0 else loss).backward()
            loss_sum += loss.item()
            tokens += x.numel()
        # One small all-reduce: mean loss for the log, and whether any rank got SIGTERM.
        flags = torch.tensor([loss_sum, float(stop["requested"])], dtype=torch.float64)
        if distributed:
            with rt.collective():
                dist.all_reduce(flags)
        mean_loss = flags[0].item() / shards
        with rt.section("optimizer"):
            # The total gradient norm, as clip_grad_norm_ would return it (clipping left to
            # taste): trainguard watches it for corrupt gradients that every replica shares.
            grad_norm = _total_norm(model)
            if math.isfinite(mean_loss):  # every rank sees the same mean: all skip together
                optim.step()
        train.step = step
        rt.step_end(step, loss=mean_loss, tokens=tokens, grad_norm=grad_norm)
        if metrics is not None:
            metrics.write(json.dumps({"step": step, "loss": mean_loss, "time": time.time()}) + "\n")
            metrics.flush()
        stopping = flags[1].item() > 0
        last = stopping or step == args.steps
        ab_off = args.ckpt_ab > 0 and (step - 1 + args.ckpt_ab // 2) // args.ckpt_ab % 2 == 1
        if last or (args.ckpt_every and step % args.ckpt_every == 0 and not ab_off):
            per_rank["rng"] = torch.get_rng_state()
            for v, s in zip(range(rank, shards, world), samplers, strict=True):
                per_shard[v] = s.state_dict()
            ckpt.save(step, state, durable=True if last else None)
        if stopping:
            print(f"[rank {rank}] SIGTERM: saved step {step}, exiting", flush=True)
            break
    ckpt.close()  # returns once the last durable step is committed
    if metrics is not None:
        metrics.close()
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # In-process recovery: after a fault the surviving ranks call main() again in the same
    # process (a new process group, a restore from memory); only the failed rank is new.
    sys.exit(trainguard.run(main))
