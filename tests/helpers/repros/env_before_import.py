"""Sets OMP_NUM_THREADS=2 before importing torch, as scripts do; prints what torch uses."""

import os

os.environ["OMP_NUM_THREADS"] = "2"
import torch  # noqa: E402

print(
    f"torch threads={torch.get_num_threads()} (script set OMP_NUM_THREADS=2 before import)",
    flush=True,
)
