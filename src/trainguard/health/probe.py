"""The in-job known-answer GEMM probe: a small process beside the training workers that
multiplies the pre-flight's known-answer matrices (``health/gemm.py``: small integers, so
float32 computes the product exactly in any summation order) on each of the node's devices
when asked, and says whether every element came out exact.

Protocol (``python -m trainguard.health.probe AGENT_PID N``): once set up, one line out,
``{"ready": [devices]}``; then one JSON line in on stdin per
probe, ``{"wrong": bool}`` (``wrong``: the ``gemm-wrong`` drill has fired on this node: the
product is computed under ``faults.gemm.WrongGemm``, the same defect its workers have), one
JSON line out: ``{"ok": bool, "results": [{"device", "mismatches", "first_bad", "seconds"}]}``.
It exits at EOF, and dies with the agent (``PR_SET_PDEATHSIG``).

Cost: an N×N GEMM (N=256: 34 MFLOP, about 1 ms of one core here; microseconds on a GPU) and a
compare, on the devices the node's workers use; CUDA with TF32 off, as the pre-flight.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

import torch

from trainguard.health.gemm import KNOWN_ANSWER_SEED


class KnownAnswer:
    """The known-answer operands (n×n float32, on ``device``) and their exact product."""

    def __init__(self, n: int, device: str) -> None:
        g = torch.Generator().manual_seed(KNOWN_ANSWER_SEED)
        a = torch.randint(-4, 5, (n, n), generator=g, dtype=torch.int64)
        b = torch.randint(-4, 5, (n, n), generator=g, dtype=torch.int64)
        self.ref = (a @ b).to(torch.float32)  # exact: |entries| <= 16 n < 2**24
        self.device = device
        self.a, self.b = a.float().to(device), b.float().to(device)

    def run(self, *, wrong: bool) -> dict[str, Any]:
        """One probe: ``{"device", "mismatches", "first_bad" ([i, j] or None), "seconds"}``."""
        from trainguard.faults.gemm import WrongGemm

        t0 = time.perf_counter()
        with WrongGemm() if wrong else contextlib.nullcontext():
            c = self.a @ self.b
        if self.device != "cpu":
            torch.cuda.synchronize(self.device)
        bad = (c.cpu() != self.ref).nonzero()
        return {
            "device": self.device,
            "mismatches": int(bad.shape[0]),
            "first_bad": bad[0].tolist() if bad.shape[0] else None,
            "seconds": round(time.perf_counter() - t0, 6),
        }


def devices() -> list[str]:
    """The node's GPUs as this process sees them, else the CPU."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def main(argv: list[str]) -> int:
    from trainguard.runtime.process import die_with_parent

    die_with_parent(int(argv[0]))
    torch.set_num_threads(1)  # one core: the workers own the rest
    probes = [KnownAnswer(int(argv[1]), d) for d in devices()]
    for p in probes:
        p.run(wrong=False)  # warm-up: the first product's allocation and kernel choice
    sys.stdout.write(json.dumps({"ready": [p.device for p in probes]}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        results = [p.run(wrong=bool(req.get("wrong"))) for p in probes]
        ok = all(r["mismatches"] == 0 for r in results)
        sys.stdout.write(json.dumps({"ok": ok, "results": results}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
