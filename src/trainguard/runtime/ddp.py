"""Timing of DDP's gradient all-reduce: a communication hook that does what DDP's default
hook does (divide by the world size, all-reduce, in buckets) and records, per bucket, the
time from issuing the all-reduce to its completion, waiting for slower ranks included.

    ddp = DDP(model)
    trainguard.time_ddp(ddp)

The seconds go to the step's ``communication`` section; each bucket counts as a collective
for hang localization (``Runtime.coll_issued``/``coll_done``).

With more than two ranks the sum is taken in float64 (``exact``): gloo's ring all-reduce
adds an element's per-rank values in an order that depends on where the element falls in
the bucket, and DDP rebuilds its buckets after the first iteration of every process — so
a restarted job's first step would otherwise differ from a fault-free run's in the last
bits, and the runs drift apart. Four float32 values add exactly in float64, in any order.
The price is twice the bytes on the wire; with two ranks a + b needs no help.
"""

from __future__ import annotations

from typing import Any

from trainguard.runtime.core import Runtime, init


def time_ddp(ddp: Any, rt: Runtime | None = None, *, exact: bool = True) -> None:
    """Register the timing hook on ``ddp`` (a DistributedDataParallel): an average of the
    ranks' gradients as DDP's default ``allreduce_hook`` computes it (``exact=False``, or
    two ranks), or summed in float64 (see above). Raises RuntimeError if a hook is already
    registered."""
    import torch
    import torch.distributed as dist

    runtime = rt or init()
    group = ddp.process_group
    world = dist.get_world_size(group)

    # No annotations: DDP checks them against the real classes, and this module's are strings.
    def hook(_state, bucket):  # type: ignore[no-untyped-def]
        tensor = bucket.buffer()
        wide = exact and world > 2 and tensor.dtype != torch.float64
        buf = tensor.to(torch.float64) if wide else tensor.div_(world)
        t0 = runtime.collective_issue()
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

        def done(f):  # type: ignore[no-untyped-def]
            runtime.collective_done(t0)
            if wide:
                return tensor.copy_(buf.div_(world))
            return f.value()[0]

        return fut.then(done)

    ddp.register_comm_hook(None, hook)
