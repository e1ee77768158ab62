"""One torchft replica group (one rank) training the GPT of ``examples/gpt``: the torchft side
of ``benchmarks/local_recovery.py``, written as torchft's own ``train_ddp.py`` is.

    python benchmarks/torchft_replicas.py --group G --groups N --lighthouse ADDR --out DIR ...

``torchft.Manager`` (gloo, the lighthouse's quorum each step, ``PGTransport`` healing from a
live replica), ``Manager.allreduce`` of each gradient (torchft 0.2.0's ``DistributedDataParallel``
comm hook asserts on the empty future of a failed all-reduce, which kills the survivor at the
first fault) and ``torchft.Optimizer``'s quorum; the batches of
step s are ``BatchSampler(seed, rank=G).batch(s)`` (the same as trainguard's example). Each
committed step appends ``{"step", "time", "group", "width"}`` to ``DIR/metrics.<G>.jsonl``; at
the end ``{"group", "digest"}`` (xxh3-64 of model and optimizer state, the same bytes as
``ReplicaGroup.state_digest``) to ``DIR/digests.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import xxhash
from torch.distributed import TCPStore
from torch.distributed.checkpoint.state_dict import get_state_dict
from torchft import Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
from data import BatchSampler, load_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--data-max-bytes", type=int, default=4 << 20)
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, dropout=0.1)  # fmt: skip
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    get_state_dict(model, optim)  # the optimizer state made at the start, as trainguard's side
    torch.manual_seed(args.seed + 1 + args.group)
    sampler = BatchSampler(load_corpus(None, args.data_max_bytes), block_size=args.block_size,
                           batch_size=args.batch_size, seed=args.seed, rank=args.group)  # fmt: skip
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=5))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            optim.load_state_dict(sd["optim"]),
        ),  # fmt: skip
        state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
        replica_id=f"bench_{args.group}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        checkpoint_transport=PGTransport(
            pg, timeout=datetime.timedelta(seconds=10), device=torch.device("cpu")
        ),  # fmt: skip
        timeout=datetime.timedelta(seconds=10),
    )
    opt = Optimizer(manager, optim)
    # Start together, as trainguard's groups do (its rendezvous): each replica heartbeats
    # from here, and the lighthouse's first quorum holds them all. A restarted replica's own
    # file is there already: it goes on at once and heals in its first quorum.
    (args.out / f"ready.{args.group}").touch()
    deadline = time.monotonic() + 120.0
    while len(list(args.out.glob("ready.*"))) < args.groups:
        if time.monotonic() > deadline:
            raise SystemExit("torchft_replicas.py: the other replicas never started (120 s)")
        time.sleep(0.01)
    metrics = open(args.out / f"metrics.{args.group}.jsonl", "a")  # noqa: SIM115
    while manager.current_step() < args.steps:
        opt.zero_grad()  # starts the step's quorum (a returning replica heals here)
        x, y = sampler.batch(manager.current_step() + 1)
        model(x, y).backward()
        works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
        for w in works:  # a failed one is reported to the manager: should_commit() says no
            w.wait()
        width = manager.num_participants()
        # OptimizerWrapper.step() is this, returning None: the commit decision is needed here.
        if manager.should_commit():  # committed: every participant's all-reduce succeeded
            optim.step()
            rec = {"step": manager.current_step(), "time": time.time(), "group": args.group,
                   "width": width}  # fmt: skip
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
    h = xxhash.xxh3_64()
    tensors = list(model.state_dict().values())
    for st in optim.state_dict()["state"].values():
        tensors += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    with open(args.out / "digests.jsonl", "a") as f:
        f.write(json.dumps({"group": args.group, "digest": h.hexdigest()}) + "\n")
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
