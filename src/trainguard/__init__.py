"""trainguard: keeps synchronous PyTorch training jobs running through faults.

What a training script uses::

    import trainguard
    rt = trainguard.init(total_steps=steps)  # the step it ends at (optional)
    ckpt = trainguard.Checkpointer()
    start = ckpt.load(state) or 0
    ...
    trainguard.step_end(step, loss=loss, tokens=n)
    ckpt.save(step, state)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainguard.runtime.core import Runtime, init, step_end

if TYPE_CHECKING:
    from trainguard.checkpoint.checkpointer import Checkpointer
    from trainguard.runtime.ddp import time_ddp

__all__ = ["Checkpointer", "Runtime", "init", "step_end", "time_ddp"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Checkpointer imports torch; keep `import trainguard` cheap for the CLI and agents.
    if name == "Checkpointer":
        from trainguard.checkpoint.checkpointer import Checkpointer

        return Checkpointer
    if name == "time_ddp":
        from trainguard.runtime.ddp import time_ddp

        return time_ddp
    raise AttributeError(name)
