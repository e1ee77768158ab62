"""The runtime Checkpointer: ``save(step, state)``, ``load(state)``, ``wait()``, ``close()``.

This version saves synchronously with ``torch.distributed.checkpoint`` (DCP) into
the durable tier (storage.py) and commits by atomic rename; the shared-memory
engine replaces what is under this API without changing it.

``state`` is a nested dict of tensors, ``Stateful`` objects and picklable values.
DCP treats plain tensors and values as replicated across ranks (rank 0's copy is
kept); everything under ``state["per_rank"]`` (RNG states, data position) is saved
separately for every rank under the key ``per_rank.<rank>``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainguard.checkpoint import storage
from trainguard.checkpoint.api import (
    PER_RANK_KEY,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)
from trainguard.runtime import api as rt_api
from trainguard.runtime.core import init as runtime_init


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Checkpointer:
    """Saves and restores training state; one per process.

    Args:
        directory: durable root; default ``$TRAINGUARD_CKPT_DIR``, else
            ``$TRAINGUARD_RUN_DIR/checkpoints``, else ``./checkpoints``.
        keep: committed steps retained (>= 1; the newest is never deleted).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint")
        env = os.environ
        if directory is None:
            run_dir = env.get(rt_api.ENV_RUN_DIR)
            directory = env.get(rt_api.ENV_CKPT_DIR) or (
                Path(run_dir) / "checkpoints" if run_dir else "checkpoints"
            )
        self.root = Path(directory)
        self.keep = keep
        self._rt = runtime_init()

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as ``step`` on every rank (collective when a process group exists).

        Returns when the step is committed durably. Raises CheckpointError if the write
        fails (e.g. disk full); the previously committed step is untouched.
        """
        t0 = time.time()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = storage.tmp_dir(self.root, step, self._rt.generation)
        try:
            dcp.save(self._to_dcp(state), checkpoint_id=str(tmp))
            if _rank() == 0:
                storage.commit(tmp, self.root, step)
                storage.prune(self.root, self.keep)
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"saving step {step} to {self.root} failed: {e}") from e
        self._rt.event("ckpt_saved", step=step, tier="durable", duration_s=time.time() - t0)

    # ------------------------------------------------------------------ load
    def load(self, state: dict[str, Any]) -> int | None:
        """Restore ``state`` in place from the agreed step; returns that step or None.

        Under ``trainguard run`` the step is the one the controller chose for every rank
        (``$TRAINGUARD_RESTORE_STEP``); standalone it is the newest verified step.
        Raises CheckpointCorruptError if the chosen step fails verification and
        CheckpointNotFoundError if it is not committed.
        """
        if self._rt.supervised:
            step = self._rt.restore_step
            if step is None:
                return None
            problems = storage.verify(self.root, step)
            if problems:
                if not storage.step_dir(self.root, step).exists():
                    raise CheckpointNotFoundError(f"step {step} is not committed under {self.root}")
                raise CheckpointCorruptError(f"step {step}: {'; '.join(problems)}")
        else:
            step, _skipped = storage.newest_verified(self.root)
            if step is None:
                return None
        t0 = time.time()
        self._rt.event("ckpt_load_start", step=step)
        flat = self._to_dcp(state)
        dcp.load(flat, checkpoint_id=str(storage.step_dir(self.root, step)))
        for key in state:
            if key != PER_RANK_KEY:
                state[key] = flat[key]
        self._rt.event("ckpt_load_end", step=step, tier="durable", duration_s=time.time() - t0)
        return step

    def _to_dcp(self, state: dict[str, Any]) -> dict[str, Any]:
        flat = {k: v for k, v in state.items() if k != PER_RANK_KEY}
        if PER_RANK_KEY in state:
            flat[f"{PER_RANK_KEY}.{_rank()}"] = state[PER_RANK_KEY]
        return flat

    def wait(self) -> None:
        """Block until the last save is durable (immediate: saves here are synchronous)."""

    def close(self) -> None:
        """Release resources (none held by the synchronous engine)."""
