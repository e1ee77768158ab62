"""The ``gemm-wrong`` drill's defect: ``WrongGemm``, a torch-function mode under which every
matrix product comes out wrong in one element, as a node whose GEMM unit went bad computes.
Needs torch only (the in-job probe process imports it, and nothing heavier)."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# WrongGemm's error: element 0 of each product moves by 2**-10 of its magnitude (at least of
# 1.0, so a zero moves too): far above float32 rounding (2**-24), one bf16 step or more.
GEMM_ERROR = 2.0**-10

_GEMMS = {
    torch.mm,
    torch.matmul,
    torch.addmm,
    torch.bmm,
    torch.baddbmm,
    torch.nn.functional.linear,
    torch.Tensor.__matmul__,
    torch.Tensor.mm,
    torch.Tensor.matmul,
}


class WrongGemm(TorchFunctionMode):
    """While active, every matrix product this thread computes comes out with element 0
    moved by ``GEMM_ERROR`` × max(|x|, 1): a GEMM unit that went bad (``gemm-wrong`` drill).
    Enter it with ``mode.__enter__()`` for the rest of the process (a defect does not heal)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _GEMMS and isinstance(out, torch.Tensor) and out.is_floating_point():
            with torch.no_grad():
                if out.numel():
                    first = out.view(-1)[:1]
                    first.add_(first.abs().clamp_min(1.0) * GEMM_ERROR)
        return out
