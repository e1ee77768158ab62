"""A worker whose state has every shape a real script's state has, for checkpoint tests.

    shapes_worker.py save --root DIR --steps N [--fingerprints FILE]
    shapes_worker.py load --root DIR

The state: a conv net with ``channels_last`` weights and BatchNorm (its running statistics
change in every forward), tied embeddings, an AdamW whose state is created lazily (no
pre-initialisation: it exists only after the first ``step()``), an EMA of the weights, a
script-defined object, and tensors of every kind (bf16, fp16, fp8, int64, bool, 0-d, empty,
transposed, expanded). ``save`` trains N steps with ``overlap=True`` (the snapshot copy runs
during the next forward, which changes the BatchNorm buffers) and writes, at each save, a
fingerprint (SHA-256 of every tensor's bytes and of the objects) of the state as of that
step to FILE. ``load`` builds the same objects from another seed (every value differs),
restores, and prints one JSON line: the step, the fingerprint, and the structural checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

from trainguard.checkpoint.checkpointer import Checkpointer


class Progress:  # a script-defined class in the state (pickled by value of its module)
    def __init__(self, epoch: int, seen: list[int]) -> None:
        self.epoch, self.seen = epoch, seen


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.tok = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.fc = nn.Linear(8 * 8 * 8, 512)  # a larger tensor: the overlapped copy takes a while

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).relu().flatten(1)
        return self.fc(h).sum() + self.head(self.tok(idx)).sum()


class App(Stateful):
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.net = Net().to(memory_format=torch.channels_last)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-3)  # state created lazily
        self.ema = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
        g = torch.Generator().manual_seed(seed)
        self.extra: dict[str, Any] = {
            "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
            "fp16": torch.randn(3, 5, generator=g).half(),
            "i64": torch.randint(0, 1 << 40, (6,), generator=g),
            "mask": torch.rand(9, generator=g) > 0.5,
            "scalar": torch.tensor(float(seed)),
            "empty": torch.empty(0, 4),
            "transposed": torch.randn(4, 6, generator=g).t(),
            "expanded": torch.randn(1, 5, generator=g).expand(3, 5),
            "progress": Progress(seed, [seed, seed + 1]),
            "counter": seed,
        }
        if hasattr(torch, "float8_e4m3fn"):
            self.extra["fp8"] = torch.randn(8, generator=g).to(torch.float8_e4m3fn)

    def state_dict(self) -> dict[str, Any]:
        return {
            "net": self.net.state_dict(),
            "opt": self.opt.state_dict(),
            "ema": self.ema,
            "extra": self.extra,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.net.load_state_dict(sd["net"])
        self.opt.load_state_dict(sd["opt"])
        self.ema = sd["ema"]
        self.extra = sd["extra"]


def fingerprint(app: App) -> str:
    h = hashlib.sha256()

    def add(prefix: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().contiguous().view(-1)
            h.update(f"{prefix}:{v.dtype}:{tuple(v.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                add(f"{prefix}.{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                add(f"{prefix}.{i}", x)
        elif isinstance(v, Progress):
            h.update(f"{prefix}:Progress:{v.epoch}:{v.seen}".encode())
        else:
            h.update(f"{prefix}:{v!r}".encode())

    add("", app.state_dict())
    return h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--fingerprints", default=None)
    a = p.parse_args()
    app = App(seed=1 if a.mode == "save" else 2)
    state = {"app": app}
    ckpt = Checkpointer(a.root, durable_every=1, overlap=True)
    ckpt.attach(app.opt)
    if a.mode == "load":
        step = ckpt.load(state)
        n = app.net
        out = {
            "step": step,
            "fingerprint": fingerprint(app),
            "tied": n.head.weight is n.tok.weight,
            "channels_last": n.conv.weight.is_contiguous(memory_format=torch.channels_last),
            "optimizer_entries": len(app.opt.state),
            "optimizer_steps": sorted({float(s["step"]) for s in app.opt.state.values()}),
            "progress": [app.extra["progress"].epoch, app.extra["progress"].seen],
        }
        print(json.dumps(out), flush=True)
        ckpt.close()
        return 0
    prints: dict[int, str] = {}
    x, idx = torch.randn(4, 3, 8, 8), torch.randint(0, 50, (4, 3))
    for step in range(1, a.steps + 1):
        app.net(x.to(memory_format=torch.channels_last), idx).backward()  # BN buffers change
        app.opt.step()
        app.opt.zero_grad()
        with torch.no_grad():
            for k, v in app.net.state_dict().items():
                if v.is_floating_point():
                    app.ema[k].mul_(0.9).add_(v, alpha=0.1)
        app.extra["counter"] = step
        app.extra["progress"].seen.append(step)
        prints[step] = fingerprint(app)  # the state as of this step, before the next forward
        ckpt.save(step, state)
    ckpt.close()
    if a.fingerprints:
        with open(a.fingerprints, "w") as f:
            json.dump(prints, f)
    print("saved", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
