"""Which run wrote a checkpoint part: an identity every rank of one run agrees on.

A step's durable copy is written as one part per rank, by different processes, into
``<root>/.tmp-step_<N>-gen<G>-<run id>/`` and committed by whoever persists rank 0. Without the
run id, a crashed run's leftover part and a later run's part of the same step and generation
(outside ``trainguard run`` generations start at 0 again) would share a directory and be merged
into one step that verifies, each part being intact. With it they never share one: each part's
``.done`` and the step's manifest name their run, the commit checks every part's, and a
leftover of another run is removed with an event (persister.py, storage.py).

Where the identity comes from, first match wins:

1. ``TRAINGUARD_RUN_ID`` (and ``TRAINGUARD_RUN_STARTED``, Unix seconds): set by the agent from
   the controller (a fresh id per run of a run dir; generations order the runs), or by the user
   for a launcher of their own;
2. an initialized process group of more than one rank (torchrun, ``mp.spawn``, any script that
   calls ``init_process_group``): rank 0 draws a random id and broadcasts it, once a process, at
   the first save (``broadcast_object_list``: a collective every rank reaches by saving);
3. a world of one rank: a random id;
4. several ranks without a process group: a digest of the launcher's variables
   (``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``, ``MASTER_ADDR``, ``MASTER_PORT``);
   if none is set, ranks cannot tell runs apart and a warning says to set ``TRAINGUARD_RUN_ID``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import secrets
import time

from trainguard.checkpoint.api import rank_world
from trainguard.runtime.api import ENV_GENERATION, ENV_RUN_ID, ENV_RUN_STARTED

log = logging.getLogger("trainguard.checkpoint")
_VALID = re.compile(r"^[0-9A-Za-z]{1,32}$")
_LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """``run_id``: 1-32 letters and digits, the same on every rank of one run; ``started``: Unix
    seconds when it was drawn (orders two runs outside ``trainguard run``, whose generations
    restart at 0; 0.0 when unknown); ``by_generation``: runs are ordered by generation number
    (``trainguard run``: one sequence across every run of a run dir)."""

    run_id: str
    started: float = 0.0
    by_generation: bool = False

    def to_json(self) -> dict[str, object]:
        return {"run_id": self.run_id, "run_started": self.started,
                "by_generation": self.by_generation}  # fmt: skip

    @staticmethod
    def from_json(d: dict[str, object]) -> RunIdentity | None:
        """The identity recorded in a ``.done`` or manifest; None when it records none (a copy
        written before run identities existed)."""
        rid = d.get("run_id")
        if not isinstance(rid, str) or not rid:
            return None
        started = d.get("run_started", 0.0)
        return RunIdentity(rid, float(started) if isinstance(started, int | float) else 0.0,
                           bool(d.get("by_generation", False)))  # fmt: skip


def newer(a: RunIdentity | None, a_gen: int, b: RunIdentity | None, b_gen: int) -> bool:
    """Whether a copy written by run ``a`` in generation ``a_gen`` is at least as new as one of
    run ``b`` in ``b_gen`` (the older copy of a step gives way to the newer one). One run, or
    runs numbered in one generation sequence: by generation; otherwise by when each run
    started; a copy that records no run is older than any that does."""
    if a is None and b is None:
        return a_gen >= b_gen
    if a is None or b is None:
        return a is not None
    if a.run_id == b.run_id or (a.by_generation and b.by_generation):
        return a_gen >= b_gen
    return a.started >= b.started


def from_env(env: dict[str, str] | os._Environ[str] | None = None) -> RunIdentity | None:
    """The identity named by ``TRAINGUARD_RUN_ID``, or None. Raises ValueError on a malformed
    one (the message names the variable and what it may hold)."""
    env = os.environ if env is None else env
    rid = env.get(ENV_RUN_ID, "")
    if not rid:
        return None
    if not _VALID.match(rid):
        raise ValueError(
            f"{ENV_RUN_ID}={rid!r}: a run id is 1-32 letters and digits; unset it to have one drawn"
        )
    try:
        started = float(env.get(ENV_RUN_STARTED, "0") or 0.0)
    except ValueError:
        started = 0.0
    return RunIdentity(rid, started, by_generation=bool(env.get(ENV_GENERATION)))


def identify() -> RunIdentity:
    """This process's run identity (module docstring for the order of sources). With a process
    group of several ranks this is a collective: every rank must call it (the Checkpointer does,
    at its first save); it waits as long as the group's timeout. Raises ValueError on a
    malformed ``TRAINGUARD_RUN_ID``."""
    env = from_env()
    if env is not None:
        return env
    import torch.distributed as dist

    rank, world = rank_world()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box: list[object] = [(secrets.token_hex(6), time.time())] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0)
        rid, started = box[0]  # type: ignore[misc]
        return RunIdentity(str(rid), float(started))
    if world <= 1:
        return RunIdentity(secrets.token_hex(6), time.time())
    seen = [f"{k}={os.environ[k]}" for k in _LAUNCHER_VARS if os.environ.get(k)]
    if not seen:
        log.warning(
            "ranks of this job cannot tell its run from an earlier one (no process group, no "
            "launcher variables): set %s to a fresh value for every run",
            ENV_RUN_ID,
        )
    return RunIdentity(hashlib.sha1("\n".join(seen).encode()).hexdigest()[:12])
