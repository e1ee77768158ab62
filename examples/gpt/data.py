"""Byte-level text data with an exactly resumable position.

With no path, the corpus is the running interpreter's standard-library source tree
(real text on every machine): its ``.py`` files in sorted order, test suites
excluded, concatenated up to ``max_bytes``.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch


def _walk_sorted(root: Path, *, skip_top: set[str], suffix: str) -> Iterator[Path]:
    """Files under ``root`` in a deterministic (sorted) order, lazily: reading stops early."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        if Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d not in skip_top]
        for name in sorted(filenames):
            if name.endswith(suffix):
                yield Path(dirpath) / name


def load_corpus(path: str | None, max_bytes: int) -> torch.Tensor:
    """Return the corpus as a uint8 tensor of at most ``max_bytes`` bytes.

    Raises FileNotFoundError / ValueError with the fix when the path has no text.
    """
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _walk_sorted(root, skip_top={"test", "idlelib", "site-packages"}, suffix=".py")
    else:
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(
                f"--data {path}: no such file or directory; pass a text file or a directory of them"
            )
        files = iter([root]) if root.is_file() else _walk_sorted(root, skip_top=set(), suffix="")
    chunks: list[bytes] = []
    total = 0
    for f in files:
        data = f.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1024:
        raise ValueError(f"--data {path}: only {total} bytes of text; give at least 1 KiB")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class BatchSampler:
    """Random windows of the corpus for one data-parallel rank.

    The batch of step ``s`` depends only on (seed, rank, s), so the data position is
    the next step number and resuming at that step yields the same batches.
    """

    def __init__(
        self, corpus: torch.Tensor, *, block_size: int, batch_size: int, seed: int, rank: int
    ) -> None:
        self.corpus, self.block_size, self.batch_size = corpus, block_size, batch_size
        self.seed, self.rank = seed, rank
        self.position = 0  # next step whose batch will be drawn

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 inputs and targets, each [batch_size, block_size]."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + step)
        starts = torch.randint(
            0, len(self.corpus) - self.block_size - 1, (self.batch_size,), generator=g
        )
        rows = torch.stack(
            [self.corpus[i : i + self.block_size + 1] for i in starts.tolist()]
        ).long()
        self.position = step + 1
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed, "rank": self.rank}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
