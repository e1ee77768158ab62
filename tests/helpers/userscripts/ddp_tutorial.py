"""A script shaped like the PyTorch examples' DDP tutorial (``ddp-tutorial-series/
multigpu_torchrun.py``), written here, with only the device changed for CPU (gloo): it never
imports trainguard, keeps its own ``snapshot.pt`` in the working directory (saved by local
rank 0 every ``save_every`` epochs, loaded at start if present), and ends with
``destroy_process_group()``.

    torchrun --nproc-per-node 2 ddp_tutorial.py TOTAL_EPOCHS SAVE_EVERY [--batch_size N]

Seeded so that two runs can be compared; the snapshot holds the next epoch to run, so a
resumed run repeats no epoch and its final weights equal a run without a fault (SGD without
momentum has no state of its own).
"""

import os

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RandomPairs(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(1234)
        self.items = [
            (torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Trainer:
    def __init__(self, model, data, optimizer, save_every, snapshot_path):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.data = data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.first_epoch = 0
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            snap = torch.load(snapshot_path)
            self.model.load_state_dict(snap["MODEL_STATE"])
            self.first_epoch = snap["EPOCHS_RUN"]
            print(f"Resuming training from snapshot at Epoch {self.first_epoch}")
        self.model = DDP(self.model)

    def run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def run_epoch(self, epoch):
        print(f"[CPU{self.local_rank}] Epoch {epoch} | Steps: {len(self.data)}")
        self.data.sampler.set_epoch(epoch)
        for source, targets in self.data:
            self.run_batch(source, targets)

    def save_snapshot(self, epoch):
        snap = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snap, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.first_epoch, max_epochs):
            self.run_epoch(epoch)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self.save_snapshot(epoch)


def main(save_every, total_epochs, batch_size, snapshot_path="snapshot.pt"):
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    dataset = RandomPairs(2048)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = DataLoader(
        dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset)
    )
    Trainer(model, data, optimizer, save_every, snapshot_path).train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size per rank")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size)
