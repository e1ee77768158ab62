"""Timing of DDP's gradient all-reduce: a communication hook that does what DDP's default
hook does (divide by the world size, all-reduce, in buckets) and records, per bucket, the
time from issuing the all-reduce to its completion, waiting for slower ranks included.

    ddp = DDP(model)
    trainguard.time_ddp(ddp)

The seconds go to the step's ``communication`` section; each bucket counts as a collective
for hang localization (``Runtime.coll_issued``/``coll_done``).
"""

from __future__ import annotations

from typing import Any

from trainguard.runtime.core import Runtime, init


def time_ddp(ddp: Any, rt: Runtime | None = None) -> None:
    """Register the timing hook on ``ddp`` (a DistributedDataParallel). Numerically the same
    as DDP's default ``allreduce_hook``. Raises RuntimeError if a hook is already registered."""
    import torch.distributed as dist

    runtime = rt or init()
    group = ddp.process_group
    world = dist.get_world_size(group)

    # No annotations: DDP checks them against the real classes, and this module's are strings.
    def hook(_state, bucket):  # type: ignore[no-untyped-def]
        tensor = bucket.buffer()
        tensor.div_(world)
        t0 = runtime.collective_issue()
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def done(f: Any) -> Any:
            runtime.collective_done(t0)
            return f.value()[0]

        return fut.then(done)

    ddp.register_comm_hook(None, hook)
