"""The torchrun baseline of ``benchmarks/recovery.py``: the GPT example with torch.save checkpoints.

Same model, data, optimizer and training loop as ``examples/gpt/train.py`` (same
flags and defaults), run under ``torchrun --max-restarts 1``; only checkpointing
differs, done the plain PyTorch way:

- every ``--ckpt-every`` steps, rank 0 writes model + optimizer + step with
  ``torch.save`` and every rank writes its RNG state and data position to its own
  file (each to a temp file, then ``os.replace``); after a barrier, rank 0 commits
  the step by atomically rewriting ``<ckpt dir>/latest``;
- at start every rank reads ``latest`` and restores with ``torch.load``.

Fault and timing (what the benchmark measures): on the first launch
(``TORCHELASTIC_RESTART_COUNT == 0``) rank ``--kill-rank`` writes ``time.time()`` to
``<timing dir>/fault`` and SIGKILLs itself at the end of step ``--kill-step``, at the
point where ``trainguard.step_end`` fires an injected ``kill`` in the example (after
the step's all-reduce, before its checkpoint). After the restart every rank writes
the wall time at the end of its first step to ``<timing dir>/first_step.<rank>``.

Not meant to be run by hand; ``benchmarks/recovery.py`` launches it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "gpt"))
from data import BatchSampler, load_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data", default=None)
    p.add_argument("--data-max-bytes", type=int, default=4 << 20)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--timing-dir", type=Path, required=True)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-step", type=int, default=-1, help="-1: no fault")
    args = p.parse_args(argv)
    if args.steps < 1 or args.ckpt_every < 0:
        p.error("--steps must be >= 1 and --ckpt-every >= 0")
    return args


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(
    root: Path,
    step: int,
    rank: int,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    per_rank: dict[str, Any],
    distributed: bool,
) -> None:
    if rank == 0:
        _atomic_save(
            {"model": model.state_dict(), "optim": optim.state_dict(), "step": step},
            root / f"model.{step}.pt",
        )
    _atomic_save(per_rank, root / f"rank{rank}.{step}.pt")
    if distributed:
        dist.barrier()  # every rank's files are on disk: the step is complete
    if rank == 0:
        old = _latest(root)
        _write_text(root / "latest", str(step))
        if old is not None and old != step:
            for f in root.glob(f"*.{old}.pt"):
                f.unlink(missing_ok=True)


def _latest(root: Path) -> int | None:
    try:
        return int((root / "latest").read_text())
    except (FileNotFoundError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    distributed = "MASTER_ADDR" in os.environ
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)

    corpus = load_corpus(args.data, args.data_max_bytes)
    cfg = GPTConfig.from_args(args)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, foreach=False)
    torch.manual_seed(args.seed + 1 + rank)
    sampler = BatchSampler(
        corpus, block_size=args.block_size, batch_size=args.batch_size, seed=args.seed, rank=rank
    )

    start = 0
    restored = _latest(args.ckpt_dir)
    if restored is not None:
        sd = torch.load(args.ckpt_dir / f"model.{restored}.pt", weights_only=True)
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])
        start = int(sd["step"])
        mine = torch.load(args.ckpt_dir / f"rank{rank}.{restored}.pt", weights_only=True)
        torch.set_rng_state(mine["rng"])
        sampler.load_state_dict(mine["data"])
    ddp = DDP(model) if distributed else model
    print(
        f"[rank {rank}/{world}] restart={restart} start_step={start} restored={restored}",
        flush=True,
    )

    ddp.train()
    first = True
    for step in range(start + 1, args.steps + 1):
        x, y = sampler.batch(step)
        loss = ddp(x, y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        flags = torch.tensor([loss.item(), 0.0], dtype=torch.float64)
        if distributed:
            dist.all_reduce(flags)
        now = time.time()  # where trainguard.step_end(step) is called in the example
        if first and restart > 0:
            _write_text(
                args.timing_dir / f"first_step.{rank}",
                json.dumps({"step": step, "t": now, "restored": restored, "restart": restart}),
            )
        first = False
        if restart == 0 and rank == args.kill_rank and step == args.kill_step:
            _write_text(args.timing_dir / "fault", json.dumps({"step": step, "t": time.time()}))
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.steps or (args.ckpt_every and step % args.ckpt_every == 0):
            per_rank = {"rng": torch.get_rng_state(), "data": sampler.state_dict()}
            save(args.ckpt_dir, step, rank, model, optim, per_rank, distributed)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
