"""PyTorch Lightning under trainguard: a memory snapshot every training step, restored on
restart through Lightning's own resume path. A plugin and a callback passed to ``Trainer``,
as any Lightning plugin is; Lightning's public API only::

    from trainguard.integrations.lightning import TrainguardCallback, TrainguardCheckpointIO

    io = TrainguardCheckpointIO()
    trainer = pl.Trainer(..., plugins=[io], callbacks=[TrainguardCallback(io)])
    trainer.fit(model, train_dataloaders=loader)     # unchanged: it resumes by itself

:class:`TrainguardCheckpointIO` is the strategy's ``CheckpointIO``: saves and loads of
``trainguard://`` paths (and of the callback's resume path) go to trainguard's tiers, any other
path to Lightning's ``TorchCheckpointIO`` (or the ``fallback`` given), so ``ModelCheckpoint``
files still work. :class:`TrainguardCallback` snapshots through ``trainer.save_checkpoint``
every ``every`` steps on every rank (the dict is taken in its ``on_save_checkpoint`` hook,
which Lightning calls on every rank; the file write itself is rank 0's), and it is an
``OnExceptionCheckpoint``: Lightning's ``fit`` without ``ckpt_path`` resumes from such a
callback's ``ckpt_path`` when that file exists (``ckpt_path="last"``), and this one's exists
exactly when trainguard has a step to restore. Lightning then restores model, optimizers,
schedulers, loops and callbacks from it; RNG states are restored at the first batch. A resume
mid-epoch continues with the next batch when the train loader is stateful, as Lightning
requires of any loader: :class:`ResumableDataLoader` is a ``DataLoader`` that is.

Every rank snapshots its own copy of Lightning's checkpoint dict: ``state_dict`` and each
optimizer's per-parameter ``state`` as tensors (copied, not pickled), everything else (loops,
param groups, schedulers, callbacks, hyper-parameters) pickled by this process for itself.
``fit(trainer, model, ...)`` is the same wiring for a ``Trainer`` built already.
"""

from __future__ import annotations

import atexit
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from torch.utils.data import DataLoader

import trainguard
from trainguard.checkpoint.checkpointer import Checkpointer

SCHEME = "trainguard://"
RESUME_NAME = "trainguard-resume"  # the callback's ckpt_path: <tmp>/trainguard-resume-<pid>.ckpt


def _ours(path: Any) -> bool:
    """A path trainguard's tiers serve: ``trainguard://…`` or the callback's resume path."""
    p = str(path)
    return p.startswith(SCHEME) or Path(p).name.startswith(RESUME_NAME + "-")


def _directory(directory: str | None) -> str | None:
    """The durable root: ``directory``, else the run's under ``trainguard run`` (None: the
    Checkpointer's own), else ./trainguard_checkpoints."""
    if directory is not None:
        return directory
    if os.environ.get("TRAINGUARD_CKPT_DIR") or os.environ.get("TRAINGUARD_RUN_DIR"):
        return None
    return str(Path.cwd() / "trainguard_checkpoints")


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


class ResumableDataLoader(DataLoader):  # type: ignore[type-arg]
    """A ``DataLoader`` (same arguments) that Lightning sees as stateful
    (``state_dict``/``load_state_dict``): its state is the position in the epoch (batches
    trained, set by :class:`TrainguardCallback`, so a prefetched batch does not count); a
    resumed iterator skips that many batches of the same epoch's order, as the Trainer of
    Hugging Face does (``skip_first_batches``). Lightning re-creates it with its
    DistributedSampler as it does any DataLoader (same ``__init__``)."""

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
    """Routes trainguard's paths (``trainguard://…``, the callback's resume path) to a
    Checkpointer, others to ``fallback`` (Lightning's ``TorchCheckpointIO`` by default).
    ``ckpt``: the Checkpointer (default: one on ``directory``, the run's durable tier under
    ``trainguard run``, writing every ``durable_every``-th snapshot to it). ``load_checkpoint``
    returns the newest snapshot every rank agrees on; raises CheckpointError when there is
    none."""

    def __init__(
        self,
        ckpt: Checkpointer | None = None,
        fallback: CheckpointIO | None = None,
        *,
        directory: str | None = None,
        durable_every: int = 50,
    ) -> None:
        self.ckpt = ckpt or Checkpointer(_directory(directory), durable_every=durable_every)
        self.fallback = fallback or TorchCheckpointIO()
        self.restored_step: int | None = None
        self.pending_rng: dict[str, Any] | None = None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        if not _ours(path):
            self.fallback.save_checkpoint(checkpoint, path, storage_options)
        # trainguard's: TrainguardCallback saved it on every rank (this is rank 0's write)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not _ours(path):
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
        if not _ours(path):
            self.fallback.remove_checkpoint(path)


class TrainguardCallback(OnExceptionCheckpoint):
    """Snapshots every ``every`` training steps (all ranks, after the optimizer step) and
    reports steps to trainguard's runtime; the last step is also written to the durable tier.
    Pass the same ``io`` as the Trainer's plugin. As an ``OnExceptionCheckpoint`` it makes
    ``fit`` resume from trainguard's newest agreed step (``ckpt_path``: a file that exists
    exactly when there is one); on an exception it saves nothing more (trainguard's newest
    snapshot and its recovery cover it)."""

    def __init__(self, io: TrainguardCheckpointIO, every: int = 1) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        super().__init__(tempfile.gettempdir(), f"{RESUME_NAME}-{os.getpid()}")
        self.io, self.every = io, every
        self.rt: trainguard.Runtime | None = None
        self._capture = False
        self._dumped: dict[str, Any] | None = None
        atexit.register(self._forget)

    @property
    def ckpt_path(self) -> str:
        """What ``fit`` resumes from: this file exists iff trainguard has a step to restore
        (read when ``fit`` starts, before any hook)."""
        path = Path(super().ckpt_path)
        if self.io.ckpt.resume_step() is not None:
            path.touch()
        else:
            path.unlink(missing_ok=True)
        return str(path)

    def _forget(self) -> None:
        Path(OnExceptionCheckpoint.ckpt_path.fget(self)).unlink(missing_ok=True)  # type: ignore[attr-defined]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.strategy.checkpoint_io is not self.io:
            raise ValueError(
                "TrainguardCallback needs its TrainguardCheckpointIO as the Trainer's plugin: "
                "pl.Trainer(plugins=[io], callbacks=[TrainguardCallback(io)])"
            )

    def on_exception(self, trainer: pl.Trainer, *_: Any, **__: Any) -> None:
        pass  # no extra save: the newest snapshot is in trainguard's tiers already

    def teardown(self, trainer: pl.Trainer, *_: Any, **__: Any) -> None:
        self._forget()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self.rt = trainguard.init(total_steps=total)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:  # fmt: skip
        if self.io.pending_rng is not None:
            _set_rng_state(self.io.pending_rng)
            self.io.pending_rng = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:  # fmt: skip
        if self._capture:  # the dict trainer.save_checkpoint is writing, on every rank
            self._dumped = checkpoint

    def _snapshot(self, trainer: pl.Trainer, step: int) -> dict[str, Any]:
        """Lightning's checkpoint dict of now, on every rank (``trainer.save_checkpoint``
        dumps it on every rank and writes it on rank 0, to this plugin: a no-op)."""
        self._capture, self._dumped = True, None
        try:
            trainer.save_checkpoint(f"{SCHEME}{step}")
        finally:
            self._capture = False
        ckpt, self._dumped = self._dumped, None
        if ckpt is None:
            raise RuntimeError("Lightning did not call on_save_checkpoint while saving")
        return ckpt

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:  # fmt: skip
        step = trainer.global_step
        if self.rt is not None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            self.rt.step_end(step, loss=float(loss) if loss is not None else None)
        if step % self.every == 0:
            for loader in _loaders(trainer.train_dataloader):
                if isinstance(loader, ResumableDataLoader):
                    loader._tg_position = batch_idx + 1
            self.io.ckpt.save(step, _split(self._snapshot(trainer, step)))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        self.io.ckpt.save(step, _split(self._snapshot(trainer, step)), durable=True)
        self.io.ckpt.close()


def _loaders(x: Any) -> list[Any]:
    """The loaders in ``trainer.train_dataloader`` (one, or a list/tuple/dict of them)."""
    if isinstance(x, dict):
        return [v for item in x.values() for v in _loaders(item)]
    if isinstance(x, list | tuple):
        return [v for item in x for v in _loaders(item)]
    return [] if x is None else [x]


def fit(trainer: pl.Trainer, model: pl.LightningModule, *, directory: str | None = None,
        every: int = 1, durable_every: int = 50, **kwargs: Any) -> None:  # fmt: skip
    """``trainer.fit(model, **kwargs)`` with the plugin and callback added to a ``Trainer``
    built already (public setters), a plain ``DataLoader`` made a ``ResumableDataLoader``.
    ``directory``: durable root (default the run's under ``trainguard run``, else
    ``default_root_dir/trainguard``)."""
    under = os.environ.get("TRAINGUARD_CKPT_DIR") or os.environ.get("TRAINGUARD_RUN_DIR")
    where = directory or (None if under else str(Path(trainer.default_root_dir) / "trainguard"))
    io = TrainguardCheckpointIO(Checkpointer(where, durable_every=durable_every),
                                trainer.strategy.checkpoint_io)  # fmt: skip
    trainer.strategy.checkpoint_io = io
    trainer.callbacks.append(TrainguardCallback(io, every))
    loaders = kwargs.get("train_dataloaders")
    for dl in loaders if isinstance(loaders, list | tuple) else [loaders]:
        if type(dl) is DataLoader:  # its position in the epoch is saved and restored
            dl.__class__ = ResumableDataLoader
    trainer.fit(model, **kwargs)
