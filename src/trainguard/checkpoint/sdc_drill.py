"""The ``sdc`` and ``gemm-wrong`` drills: silent data corruption in a rank's live training, as
a defective ALU or memory cell would leave it (silent: nothing crashes, the job trains on).

- ``flip_bit``: one bit of a parameter or optimizer-state tensor (``target=param|optimizer``).
- ``GradFlip``: one bit of a parameter's gradient in one step's backward, before the
  all-reduce (``target=grad``): every replica then applies the same corrupt average, so the
  replicas' fingerprints agree and only the gradient norm shows it.
- ``WrongGemm`` (``faults/gemm.py``, importable without the checkpoint modules: the probe
  process uses it): every matrix product of the process is off in one element from a step
  on (``gemm-wrong:node=N:step=S``), as a node whose GEMM unit went bad computes.

The Checkpointer arms these (it holds the live state and its optimizers); they sit in
``checkpoint/`` because ``flip_bit`` walks the state as ``checkpoint/state.py`` flattens it:
``faults/`` imports nothing of trainguard (the runtime and the probe import it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from trainguard.checkpoint import state as state_mod
from trainguard.checkpoint.api import own_key
from trainguard.faults.gemm import GEMM_ERROR, WrongGemm

__all__ = ["GEMM_ERROR", "GradFlip", "WrongGemm", "flip_bit", "state_pointers"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _flip_element(t: torch.Tensor, bit: int, what: str) -> tuple[float, float]:
    """Flip ``bit`` of element 0 of ``t`` in place; (value before, value after). Raises
    ValueError when ``bit`` is past the element's width."""
    width = t.element_size() * 8
    if bit >= width:
        raise ValueError(f"sdc drill: bit {bit} is past {what}'s {width}-bit {t.dtype}")
    with torch.no_grad():
        elem = t.as_strided((1,), (1,), t.storage_offset())  # a view: the live tensor
        before = float(elem.item())
        ints = elem.view(_INT_OF_SIZE[t.element_size()])
        top = bit == width - 1 and ints.dtype != torch.uint8
        ints.bitwise_xor_(torch.iinfo(ints.dtype).min if top else 1 << bit)
        return before, float(elem.item())


def _local(t: Any) -> torch.Tensor:
    """A DTensor's local shard, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_pointers(optimizers: Iterable[torch.optim.Optimizer], target: str) -> set[int]:
    """Data pointers of the attached optimizers' parameters (``target="param"``) or of their
    state tensors (``"optimizer"``: Adam's moments, …): where ``flip_bit`` may flip."""
    out: set[int] = set()
    for opt in optimizers:
        if target == "param":
            out |= {_local(p).data_ptr() for g in opt.param_groups for p in g["params"]}
        else:
            out |= {
                _local(v).data_ptr()
                for st in opt.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor) and v.numel() > 1
            }
    return out


def flip_bit(
    state: dict[str, Any], rank: int, bit: int, *, among: set[int] | None = None
) -> dict[str, Any]:
    """Flip ``bit`` of element 0 of the first floating-point tensor of ``state`` that other
    ranks hold too (in DCP's flattening order: the model's first parameter for a state that
    starts with the model), in place. ``among``: only a tensor whose data pointer is in it
    (``state_pointers``: a parameter, or optimizer state). Returns what was flipped: ``key``,
    ``bit``, ``before`` and ``after`` (the element's values). Raises ValueError when the state
    has no such tensor or ``bit`` is past the element's width."""
    flat = state_mod.flatten(state, rank, paths=False)
    for key, t in flat.tensors.items():
        if own_key(key, rank) or not t.is_floating_point() or t.numel() == 0:
            continue
        if among is not None and t.data_ptr() not in among:
            continue
        before, after = _flip_element(t, bit, key)
        return {"key": key, "bit": bit, "before": before, "after": after}
    what = "replicated floating-point tensor"
    if among is not None:
        what += " of the attached optimizers (Checkpointer.attach) in that target"
    raise ValueError(f"sdc drill: the checkpointed state holds no {what}")


class GradFlip:
    """Flip ``bit`` of element 0 of ``param``'s gradient in the backward of step ``step``,
    before it is accumulated into ``.grad`` (so before DDP's all-reduce, which hooks the
    accumulation). ``current_step()`` names the step the backward belongs to; ``fired(what)``
    is called once, after the flip and before the gradient is used (send the drill's events
    there: key, bit, target, before, after). One-shot: the
    hook removes itself."""

    def __init__(
        self,
        param: torch.Tensor,
        step: int,
        bit: int,
        current_step: Callable[[], int],
        fired: Callable[[dict[str, Any]], None],
        name: str = "param",
    ) -> None:
        self.step, self.bit, self.name = step, bit, name
        self._current, self._fired = current_step, fired
        self._handle = param.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self._current() != self.step:
            return None
        self._handle.remove()
        g = grad.clone()
        key = f"grad of {self.name}"
        before, after = _flip_element(_local(g), self.bit, key)
        # Told before the corrupt gradient leaves this hook (nothing has used it yet).
        self._fired(
            {"key": key, "bit": self.bit, "target": "grad", "before": before, "after": after}
        )
        return g
