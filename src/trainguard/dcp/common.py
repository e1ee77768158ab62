"""What the DCP writer and reader share: the process's Checkpointer, the step a checkpoint id names."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from torch.futures import Future

from trainguard.checkpoint.checkpointer import Checkpointer

_STEP_AT_END = re.compile(r"(\d+)$")
_lock = threading.Lock()
_default: Checkpointer | None = None


def checkpointer() -> Checkpointer:
    """The process's ``Checkpointer`` behind every ``Writer`` and ``Reader`` that is not given
    one: its slots, its connection to ckptd, its durable root (``$TRAINGUARD_CKPT_DIR``, else
    ``$TRAINGUARD_RUN_DIR/checkpoints``, else ``./checkpoints``). Made at the first call."""
    global _default
    with _lock:
        if _default is None:
            _default = Checkpointer()
        return _default


def resume_step() -> int | None:
    """The step a ``Reader`` would restore: under ``trainguard run`` the controller's choice for
    every rank, else the newest verified durable step; None for a fresh start. Reads no data."""
    return checkpointer().resume_step()


def step_of(checkpoint_id: str | os.PathLike[str] | None) -> int | None:
    """The step a checkpoint id names at its end (``step-100``, ``.../step_100``, ``100``)."""
    if checkpoint_id is None:
        return None
    m = _STEP_AT_END.search(Path(checkpoint_id).name)
    return int(m.group(1)) if m else None


def done_future() -> Future[None]:
    """A completed future, as DCP's ``write_data``/``read_data`` return."""
    fut: Future[None] = Future()
    fut.set_result(None)
    return fut


class UsesCheckpointer:
    """The ``Checkpointer`` a writer or reader works through: the one given, else the
    process's (``checkpointer()``), taken at first use."""

    _ck: Checkpointer | None = None

    @property
    def ck(self) -> Checkpointer:
        if self._ck is None:
            self._ck = checkpointer()
        return self._ck
