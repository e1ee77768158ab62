"""one non-contiguous (transposed) parameter, 1 node; run with --inject kill:rank=0:step=5."""

import torch

import trainguard

rt = trainguard.init()
w = torch.nn.Parameter(torch.arange(256.0).reshape(8, 32).t())  # (32, 8), not contiguous
state = {"model": {"w": w}}
ckpt = trainguard.Checkpointer(durable_every=0)
start = ckpt.load(state) or 0
print(
    f"restored step {start}; w == original: {torch.equal(w.detach(), torch.arange(256.0).reshape(8, 32).t())}",
    flush=True,
)
for step in range(start + 1, 11):
    rt.step_end(step)
    ckpt.save(step, state)
ckpt.close()
