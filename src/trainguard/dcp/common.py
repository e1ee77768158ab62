"""What the DCP writer and reader share: the process's Checkpointer, the step a checkpoint id names."""

from __future__ import annotations

import atexit
import os
import re
import sys
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
    ``$TRAINGUARD_RUN_DIR/checkpoints``, else ``./checkpoints``). Made at the first call and
    closed at the interpreter's exit (``atexit``: the last durable step is committed first,
    ``Checkpointer.close``); ``close()`` sooner to see its errors."""
    global _default
    with _lock:
        if _default is None:
            _default = Checkpointer()
            atexit.register(_close_default)
        return _default


def _close_default() -> None:
    """At exit: wait for the last durable save of the process's checkpointer and release its
    slots (without it the persister's threads die mid-write with the interpreter)."""
    ck = _default
    if ck is None:
        return
    try:
        ck.close()
    except Exception as e:  # at exit: say it, the exit status is the script's
        print(f"trainguard: closing the DCP checkpointer at exit: {e}", file=sys.stderr)


def check_step(step: object, what: str) -> int | None:
    """``step`` as given to a Writer or Reader: None or an int >= 0. Raises TypeError or
    ValueError naming the argument."""
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"{what}(step={step!r}): a step is an int (the training step number)")
    if step < 0:
        raise ValueError(f"{what}(step={step}): steps are >= 0")
    return step


def check_checkpointer(ck: object, what: str) -> Checkpointer | None:
    """Raises TypeError unless ``ck`` is None or a Checkpointer."""
    if ck is not None and not isinstance(ck, Checkpointer):
        raise TypeError(
            f"{what}(checkpointer={ck!r}): give a trainguard Checkpointer (e.g. "
            "Checkpointer('/ckpt')), or leave it out for the process's"
        )
    return ck


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
