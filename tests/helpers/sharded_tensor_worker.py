"""A ShardedTensor (legacy sharding) through trainguard's durable tier: 3 ranks save, 3 restore.

    torchrun --nproc-per-node 3 sharded_tensor_worker.py ROOT save|load

``load`` prints "<rank> <step> <equal>" per rank.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec

from trainguard.checkpoint.checkpointer import Checkpointer

dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
spec = ChunkShardingSpec(dim=0, placements=[f"rank:{i}/cpu" for i in range(w)])
st = sharded_tensor.empty(spec, 10, 3)
for s in st.local_shards():
    s.tensor.copy_(
        torch.arange(s.tensor.numel(), dtype=torch.float32).reshape(s.tensor.shape) + 100 * r
    )
root = sys.argv[1]
ck = Checkpointer(root, durable_every=1)
if sys.argv[2] == "save":
    ck.save(1, {"m": {"st": st}})
    ck.close()
else:
    st2 = sharded_tensor.empty(spec, 10, 3)
    for s in st2.local_shards():
        s.tensor.zero_()
    step = ck.load({"m": {"st": st2}})
    equal = all(
        torch.equal(a.tensor, b.tensor)
        for a, b in zip(st.local_shards(), st2.local_shards(), strict=True)
    )
    # One write per rank: unbuffered print() writes each field apart, and three ranks share
    # the pipe (seen: "11" and "TrueTrue").
    sys.stdout.write(f"{r} {step} {equal}\n")
    sys.stdout.flush()
    ck.close()
dist.destroy_process_group()
