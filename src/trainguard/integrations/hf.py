"""Hugging Face ``transformers.Trainer`` under trainguard: a memory snapshot every step,
restored on restart through the Trainer's own resume path. One line changes::

    trainguard.integrations.hf.train(trainer)      # instead of trainer.train()

``train`` adds a :class:`TrainguardCallback` (usable on its own for snapshots only) and, when a
snapshot exists, restores it: the model's weights into the live model, and the optimizer,
scheduler, ``TrainerState`` and this rank's RNG states into a checkpoint directory in the
Trainer's format (``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``,
``rng_state[_R].pth``, the weights), which it passes as ``resume_from_checkpoint``; the
Trainer then fast-forwards its data loader past the trained batches as on any resume. The
user's ``TrainingArguments`` stay as they are.

Snapshot contents (taken in ``on_step_end``, after the optimizer step of ``global_step``):
``model`` (state dict), ``optim_state`` (the optimizer's per-parameter state, int keys),
``optim_groups``, ``scheduler`` and ``per_rank.rng`` (pickled by this process for itself:
lists and tuples of plain values, kept whole) and ``trainer_state`` (its JSON).
Errors: CheckpointError from the Checkpointer (a corrupt snapshot names its tier).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.utils import WEIGHTS_NAME

import trainguard
from trainguard.checkpoint.checkpointer import Checkpointer


def _rng() -> dict[str, Any]:
    """This rank's RNG states, as the Trainer saves them (``Trainer._save_rng_state``)."""
    out: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.random.get_rng_state_all()
    return out


class TrainguardCallback(TrainerCallback):
    """Snapshots the Trainer's whole training state every ``every`` optimizer steps (memory
    tier; disk every ``durable_every``-th) and reports steps to trainguard's runtime.

    Args:
        directory: durable root (default: the run's, under ``trainguard run``; else
            ``OUTPUT_DIR/trainguard``).
        every: snapshot every this many optimizer steps (>= 1).
        durable_every: persist every this many steps to disk (0 = only on a planned stop and
            at the end of training).
    """

    def __init__(self, directory: str | None = None, *, every: int = 1, durable_every: int = 50):
        if every < 1 or durable_every < 0:
            raise ValueError("every must be >= 1 and durable_every >= 0")
        self.directory, self.every, self.durable_every = directory, every, durable_every
        self.ckpt: Checkpointer | None = None
        self.rt: trainguard.Runtime | None = None

    def checkpointer(self, args: TrainingArguments) -> Checkpointer:
        if self.ckpt is None:
            under = os.environ.get("TRAINGUARD_CKPT_DIR") or os.environ.get("TRAINGUARD_RUN_DIR")
            where = self.directory or (None if under else str(Path(args.output_dir) / "trainguard"))
            self.ckpt = Checkpointer(where, durable_every=self.durable_every)
        return self.ckpt

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kw: Any) -> None:  # fmt: skip
        self.rt = trainguard.init(total_steps=state.max_steps)
        self.checkpointer(args)

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kw: Any) -> None:  # fmt: skip
        step = state.global_step
        if self.rt is not None:
            self.rt.step_end(step)
        if step % self.every and step != state.max_steps:
            return
        optim, sched = kw["optimizer"], kw.get("lr_scheduler")
        osd = optim.state_dict()
        snap = {
            "model": kw["model"].state_dict(),
            "optim_state": osd["state"],
            # lists of plain values, kept whole (pickled here, by this script, for itself)
            "optim_groups": pickle.dumps(osd["param_groups"]),
            "scheduler": pickle.dumps(sched.state_dict() if sched is not None else None),
            "trainer_state": json.dumps(dataclasses.asdict(state), default=str),
            "per_rank": {"rng": pickle.dumps(_rng())},
        }
        last = step == state.max_steps
        self.checkpointer(args).save(step, snap, durable=True if last else None)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kw: Any) -> None:  # fmt: skip
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None


def restore(trainer: Trainer, cb: TrainguardCallback) -> str | None:
    """Restore the newest snapshot (every rank the same step): weights into the live model,
    the rest into a Trainer-format checkpoint directory, whose path is returned (None: no
    snapshot, start afresh)."""
    args = trainer.args
    snap: dict[str, Any] = {
        "model": trainer.model,
        "optim_state": {},
        "optim_groups": None,
        "scheduler": None,
        "trainer_state": None,
        "per_rank": {"rng": None},
    }
    step = cb.checkpointer(args).load(snap)
    if step is None:
        return None
    out = Path(args.output_dir) / f"trainguard-resume-{step}-rank{args.process_index}"
    out.mkdir(parents=True, exist_ok=True)
    groups, sched = pickle.loads(snap["optim_groups"]), pickle.loads(snap["scheduler"])
    torch.save({"state": snap["optim_state"], "param_groups": groups}, out / "optimizer.pt")
    if sched is not None:
        torch.save(sched, out / "scheduler.pt")
    (out / "trainer_state.json").write_text(snap["trainer_state"])
    rng_name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
    torch.save(pickle.loads(snap["per_rank"]["rng"]), out / rng_name)
    # The weights are in the live model already; the Trainer insists on a weights file in
    # the directory (and reloads it). save_pretrained writes on rank 0 only: each rank
    # writes its own copy here.
    torch.save(trainer.model.state_dict(), out / WEIGHTS_NAME)
    return str(out)


def train(trainer: Trainer, callback: TrainguardCallback | None = None, **kwargs: Any) -> Any:
    """``trainer.train(**kwargs)`` with snapshots every step, resumed from the newest one when
    there is one (then ``resume_from_checkpoint`` is trainguard's). Returns what
    ``Trainer.train`` returns."""
    cb = callback or TrainguardCallback()
    trainer.add_callback(cb)
    resume = restore(trainer, cb)
    if resume is not None:
        kwargs["resume_from_checkpoint"] = resume
    return trainer.train(**kwargs)
