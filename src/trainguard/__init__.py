"""trainguard: keeps synchronous PyTorch training jobs running through faults.

What a training script uses::

    import trainguard
    rt = trainguard.init(total_steps=steps)  # the step it ends at (optional)
    ckpt = trainguard.Checkpointer()
    start = ckpt.load(state) or 0
    ...
    trainguard.step_end(step, loss=loss, tokens=n)
    ckpt.save(step, state)

In-process recovery (survivors of a fault keep their processes): hand the training function
to ``trainguard.run(main)``; it is called again after each recovery (runtime/inprocess.py).
Local recovery (replica groups keep training while a failed one heals from a live peer):
``trainguard.replica`` (runtime/replica.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainguard.runtime.core import Runtime, init, step_end
from trainguard.runtime.inprocess import InProcessAbort, run

if TYPE_CHECKING:
    from trainguard.checkpoint.checkpointer import Checkpointer
    from trainguard.runtime.ddp import time_ddp

__all__ = [
    "Checkpointer", "InProcessAbort", "Runtime", "init", "replica", "run", "step_end", "time_ddp",
]  # fmt: skip
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Checkpointer imports torch; keep `import trainguard` cheap for the CLI and agents.
    if name == "Checkpointer":
        from trainguard.checkpoint.checkpointer import Checkpointer

        return Checkpointer
    if name == "replica":  # replica groups, local recovery (imports torch)
        from trainguard.runtime import replica

        return replica
    if name == "time_ddp":
        from trainguard.runtime.ddp import time_ddp

        return time_ddp
    raise AttributeError(name)
