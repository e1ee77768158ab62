"""natural Stateful with AdamW.state_dict(), no optimizer pre-initialisation, 1 node;
run with --inject kill:rank=0:step=5 (memory tier) and with memory_tier = false."""

import torch
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

import trainguard


class App(Stateful):
    def __init__(self, m, o):
        self.m, self.o = m, o

    def state_dict(self):
        return {"model": self.m.state_dict(), "optim": self.o.state_dict()}

    def load_state_dict(self, sd):
        self.m.load_state_dict(sd["model"])
        self.o.load_state_dict(sd["optim"])


rt = trainguard.init()
torch.manual_seed(0)
m = nn.Linear(4, 4)
o = torch.optim.AdamW(m.parameters(), lr=0.1)
state = {"train": App(m, o)}
ckpt = trainguard.Checkpointer(durable_every=1)
start = ckpt.load(state) or 0
print(
    f"restored step {start}; optimizer state entries: {len(o.state)}; "
    f"steps: {[float(s['step']) for s in o.state.values()]}",
    flush=True,
)
for step in range(start + 1, 11):
    m(torch.ones(2, 4)).sum().backward()
    o.step()
    o.zero_grad()
    rt.step_end(step)
    ckpt.save(step, state)
ckpt.close()
