"""No trainguard import. A DataLoader with spawn/forkserver workers whose collate_fn returns a
script-defined NamedTuple; or a multiprocessing Pool returning it; or a worker raising a
script-defined exception. Usage: spawn_dataloader_script_class.py spawn|forkserver|pool|exc"""

import multiprocessing
import sys
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset


class Batch(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class MyError(Exception):
    pass


class DS(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((4,), float(i)), i


def collate(items):
    return Batch(torch.stack([a for a, _ in items]), torch.tensor([b for _, b in items]))


def f(i):
    return Batch(torch.tensor([i]), torch.tensor([i * 2]))


def g(i):
    raise MyError(f"bad item {i}")


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "spawn"
    if mode in ("spawn", "forkserver"):
        dl = DataLoader(
            DS(), batch_size=8, num_workers=2, collate_fn=collate, multiprocessing_context=mode
        )
        n = 0
        for b in dl:
            assert isinstance(b, Batch), type(b)
            n += 1
        print(f"OK {mode}: {n} batches of {type(b).__module__}.{type(b).__name__}", flush=True)
    elif mode == "pool":
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            out = pool.map(f, range(4))
        print(f"OK pool: {out}", flush=True)
    elif mode == "exc":
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            try:
                pool.map(g, range(2))
            except MyError as e:
                print(f"OK exc: caught MyError: {e}", flush=True)


if __name__ == "__main__":
    main()
