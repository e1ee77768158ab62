"""A PyTorch Lightning script as users write them, with trainguard's plugin and callback
passed to ``Trainer`` (nothing else changes: ``trainer.fit`` resumes by itself) and its
stateful ``ResumableDataLoader`` for a mid-epoch resume. A small LightningModule (dropout:
the RNG matters), AdamW with a step LR schedule, DDP over gloo on CPU. Rank 0 appends
``step loss`` lines to LOSSES_FILE. ``--plain``: no trainguard (the reference run).

    trainguard run --nproc-per-node 2 lightning_fit.py ROOT_DIR LOSSES_FILE [--plain]
"""

import sys

import lightning.pytorch as pl
import torch

root, losses_file = sys.argv[1], sys.argv[2]
plain = "--plain" in sys.argv


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.trainer.is_global_zero:
            with open(losses_file, "a") as f:
                f.write(f"{self.trainer.global_step + 1} {loss.item()!r}\n")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)]


def data(loader=torch.utils.data.DataLoader):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    return loader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True
    )


extra = {}
if not plain:
    from trainguard.integrations.lightning import (
        ResumableDataLoader,
        TrainguardCallback,
        TrainguardCheckpointIO,
    )

    io = TrainguardCheckpointIO()
    extra = {"plugins": [io], "callbacks": [TrainguardCallback(io)]}

pl.seed_everything(0)
model = Net()
trainer = pl.Trainer(
    max_steps=30,
    accelerator="cpu",
    devices=int(__import__("os").environ.get("WORLD_SIZE", 1)),
    strategy="ddp",
    default_root_dir=root,
    logger=False,
    # TrainguardCallback is a Checkpoint callback, which Lightning refuses beside
    # enable_checkpointing=False: on (its ModelCheckpoint writes a file at the end, through
    # trainguard's plugin to Lightning's own CheckpointIO).
    enable_checkpointing=not plain,
    enable_progress_bar=False,
    enable_model_summary=False,
    **extra,
)
trainer.fit(model, train_dataloaders=data() if plain else data(ResumableDataLoader))
