"""The ``sdc`` drill: one flipped bit in a real tensor of a rank's live training state, as a
defective ALU or memory cell would leave it (silent: nothing crashes, the job trains on)."""

from __future__ import annotations

from typing import Any

import torch

from trainguard.checkpoint import state as state_mod
from trainguard.checkpoint.api import own_key

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(state: dict[str, Any], rank: int, bit: int) -> dict[str, Any]:
    """Flip ``bit`` of element 0 of the first floating-point tensor of ``state`` that other
    ranks hold too (in DCP's flattening order: the model's first parameter for a state that
    starts with the model), in place. Returns what was flipped: ``key``, ``bit``, ``before``
    and ``after`` (the element's values). Raises ValueError when the state has no such
    tensor or ``bit`` is past the element's width."""
    flat = state_mod.flatten(state, rank, paths=False)
    for key, t in flat.tensors.items():
        if own_key(key, rank) or not t.is_floating_point() or t.numel() == 0:
            continue
        width = t.element_size() * 8
        if bit >= width:
            raise ValueError(f"sdc drill: bit {bit} is past {key}'s {width}-bit {t.dtype}")
        with torch.no_grad():
            elem = t.as_strided((1,), (1,), t.storage_offset())  # a view: the live tensor
            before = float(elem.item())
            ints = elem.view(_INT_OF_SIZE[t.element_size()])
            top = bit == width - 1 and ints.dtype != torch.uint8
            ints.bitwise_xor_(torch.iinfo(ints.dtype).min if top else 1 << bit)
            return {"key": key, "bit": bit, "before": before, "after": float(elem.item())}
    raise ValueError("sdc drill: the checkpointed state holds no replicated floating-point tensor")
