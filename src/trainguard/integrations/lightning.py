"""PyTorch Lightning under trainguard: a memory snapshot every training step, restored on
restart through Lightning's own resume path (``fit(ckpt_path=…)`` read by a CheckpointIO
plugin). One line changes::

    trainguard.integrations.lightning.fit(trainer, model, datamodule=dm)   # trainer.fit(...)

``fit`` installs :class:`TrainguardCheckpointIO` as the strategy's ``checkpoint_io`` (saves
and loads of ``trainguard://`` paths go to trainguard's tiers; any other path to the plugin it
replaces, so ``ModelCheckpoint`` files still work), adds :class:`TrainguardCallback` and, when
a snapshot exists, passes ``ckpt_path`` so that Lightning restores model, optimizers,
schedulers, loops and callbacks from it. A plain ``DataLoader`` passed as
``train_dataloaders`` is made resumable (its position in the epoch is saved), so a resume
mid-epoch continues with the next batch, as Lightning does for stateful loaders; a
datamodule's loaders need ``state_dict``/``load_state_dict`` themselves for that.

Every rank snapshots its own copy of Lightning's checkpoint dict (``dump_checkpoint``, the dict
``trainer.save_checkpoint`` would write on rank 0): ``state_dict`` and each optimizer's
per-parameter ``state`` as tensors (copied, not pickled), everything else (loops, param
groups, schedulers, callbacks, hyper-parameters) pickled by this process for itself.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from torch.utils.data import DataLoader

import trainguard
from trainguard.checkpoint.checkpointer import Checkpointer

SCHEME = "trainguard://"


def _split(ckpt: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict → a snapshot: tensors as tensors, the rest pickled."""
    optims = ckpt.get("optimizer_states", [])
    rest = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    rest["optimizer_groups"] = [o.get("param_groups") for o in optims]
    return {
        "model": ckpt["state_dict"],
        "optim_state": {str(i): o.get("state", {}) for i, o in enumerate(optims)},
        "meta": pickle.dumps(rest),
        # Lightning's checkpoints leave RNG out; an exact resume needs this rank's (dropout,
        # random augmentations): python, numpy, torch CPU (and CUDA) generators.
        "per_rank": {"rng": pickle.dumps(_rng_state())},
    }


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np
    import torch

    out = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(s: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["cpu"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _join(snap: dict[str, Any]) -> dict[str, Any]:
    rest = pickle.loads(snap["meta"])
    groups = rest.pop("optimizer_groups")
    optims = [
        {"state": snap["optim_state"].get(str(i), {}), "param_groups": g}
        for i, g in enumerate(groups)
    ]
    return {**rest, "state_dict": snap["model"], "optimizer_states": optims}


class _ResumableDataLoader(DataLoader):  # type: ignore[type-arg]
    """A plain DataLoader that Lightning sees as stateful (``state_dict``/``load_state_dict``):
    its state is the position in the epoch (batches trained, set by the callback, so a
    prefetched batch does not count); a resumed iterator skips that many batches of the same
    epoch's order, as the Trainer of Hugging Face does (``skip_first_batches``). Lightning
    re-creates it with its DistributedSampler as it does any DataLoader (same ``__init__``)."""

    _tg_position = 0
    _tg_skip = 0

    def state_dict(self) -> dict[str, Any]:
        return {"trainguard_batches": self._tg_position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._tg_skip = int(state.get("trainguard_batches", 0))

    def __iter__(self) -> Any:
        it = super().__iter__()
        skip, self._tg_skip = self._tg_skip, 0
        if skip >= len(self):
            skip = 0  # saved at an epoch's last batch: Lightning starts the next epoch
        for _ in range(skip):
            next(it)
        return it


class TrainguardCheckpointIO(CheckpointIO):
    """Routes ``trainguard://`` paths to a Checkpointer; others to ``fallback`` (Lightning's
    ``TorchCheckpointIO`` by default). ``load_checkpoint`` returns the newest snapshot every
    rank agrees on; raises CheckpointError when there is none."""

    def __init__(self, ckpt: Checkpointer, fallback: CheckpointIO | None = None) -> None:
        self.ckpt, self.fallback = ckpt, fallback or TorchCheckpointIO()
        self.restored_step: int | None = None
        self.pending_rng: dict[str, Any] | None = None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        if str(path).startswith(SCHEME):
            step = int(str(path)[len(SCHEME) :])
            self.ckpt.save(step, _split(checkpoint))
        else:
            self.fallback.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not str(path).startswith(SCHEME):
            return self.fallback.load_checkpoint(path, map_location, weights_only)
        snap: dict[str, Any] = {
            "model": {},
            "optim_state": {},
            "meta": None,
            "per_rank": {"rng": None},
        }
        step = self.ckpt.load(snap)
        if step is None:
            from trainguard.checkpoint.api import CheckpointError

            raise CheckpointError(
                "no trainguard snapshot to resume from; run fit without ckpt_path"
            )
        self.restored_step = step
        # Set at the first batch (TrainguardCallback): creating the data iterator draws its
        # base seed from the global generator, which the saved state already had done.
        self.pending_rng = pickle.loads(snap["per_rank"]["rng"])
        return _join(snap)

    def remove_checkpoint(self, path: Any) -> None:
        if not str(path).startswith(SCHEME):
            self.fallback.remove_checkpoint(path)


class TrainguardCallback(pl.Callback):
    """Snapshots every ``every`` training steps (all ranks, after the optimizer step) and
    reports steps to trainguard's runtime; the last step is also written to disk."""

    def __init__(self, io: TrainguardCheckpointIO, every: int = 1) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self.io, self.every = io, every
        self.rt: trainguard.Runtime | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self.rt = trainguard.init(total_steps=total)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:  # fmt: skip
        if self.io.pending_rng is not None:
            _set_rng_state(self.io.pending_rng)
            self.io.pending_rng = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:  # fmt: skip
        step = trainer.global_step
        if self.rt is not None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            self.rt.step_end(step, loss=float(loss) if loss is not None else None)
        if step % self.every == 0:
            for loader in getattr(trainer.fit_loop._combined_loader, "flattened", []):
                if isinstance(loader, _ResumableDataLoader):
                    loader._tg_position = batch_idx + 1
            # Lightning's own checkpoint dict, on every rank (trainer.save_checkpoint would
            # write it on rank 0 only).
            ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            self.io.save_checkpoint(ckpt, f"{SCHEME}{step}")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        self.io.ckpt.save(step, _split(ckpt), durable=True)
        self.io.ckpt.close()


def fit(trainer: pl.Trainer, model: pl.LightningModule, *, directory: str | None = None,
        every: int = 1, durable_every: int = 50, **kwargs: Any) -> None:  # fmt: skip
    """``trainer.fit(model, **kwargs)`` with snapshots every ``every`` steps, resumed from the
    newest one when there is one. ``directory``: durable root (default the run's under
    ``trainguard run``, else ``default_root_dir/trainguard``)."""
    under = os.environ.get("TRAINGUARD_CKPT_DIR") or os.environ.get("TRAINGUARD_RUN_DIR")
    where = directory or (None if under else str(Path(trainer.default_root_dir) / "trainguard"))
    ckpt = Checkpointer(where, durable_every=durable_every)
    io = TrainguardCheckpointIO(ckpt, trainer.strategy.checkpoint_io)
    trainer.strategy.checkpoint_io = io
    trainer.callbacks.append(TrainguardCallback(io, every))
    loaders = kwargs.get("train_dataloaders")
    for dl in loaders if isinstance(loaders, list | tuple) else [loaders]:
        if type(dl) is DataLoader:  # its position in the epoch is saved and restored
            dl.__class__ = _ResumableDataLoader
    if ckpt.resume_step() is not None and "ckpt_path" not in kwargs:
        kwargs["ckpt_path"] = f"{SCHEME}latest"
    trainer.fit(model, **kwargs)
