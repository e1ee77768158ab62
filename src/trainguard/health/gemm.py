"""GEMM check: matrix-multiply throughput (GFLOP/s) and a known-answer correctness test.

Correctness: A and B hold small integers (-4..4) drawn from a seeded generator, so every
product and partial sum is an integer below 2**24 and float32 computes C = A @ B exactly,
whatever the summation order, thread count or BLAS. C must therefore equal the int64
reference bit for bit, and its checksum must be the same on every node: a node whose
arithmetic is wrong (silent data corruption) is caught, not only a slow one.

Throughput: float32 GEMMs of random matrices, repeated for a fixed wall-clock window that
starts at ``start_at`` on every node (so simulated nodes sharing cores contend equally) and
spans several CFS periods (100 ms), so a CPU-quota-throttled node cannot hide between
throttle periods. GFLOP/s = 2·n³·count / seconds.
"""

from __future__ import annotations

import os
import time
from typing import Any

import crc32c

KNOWN_ANSWER_SEED = 20261129


def known_answer(n: int, *, device: str = "cpu", corrupt: bool = False) -> dict[str, Any]:
    """Multiply the known-answer matrices (n×n, float32) and compare with the int64 result.

    Returns ``{"n", "checksum"`` (CRC-32C hex of C's int32 bytes), ``"mismatches"`` (elements
    that differ from the reference), ``"first_bad"`` ([i, j] or None)}. ``corrupt``: add 1 to
    one element of C (fault injection: a GEMM that returns a wrong result).
    """
    import torch

    g = torch.Generator().manual_seed(KNOWN_ANSWER_SEED)
    a = torch.randint(-4, 5, (n, n), generator=g, dtype=torch.int64)
    b = torch.randint(-4, 5, (n, n), generator=g, dtype=torch.int64)
    ref = a @ b
    if device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
    c = (a.float().to(device) @ b.float().to(device)).cpu()
    if corrupt:
        c[n // 3, n // 5] += 1.0
    got = c.to(torch.int64)
    bad = (got != ref).nonzero()
    return {
        "n": n,
        "checksum": f"{crc32c.crc32c(got.to(torch.int32).numpy().tobytes()):08x}",
        "mismatches": int(bad.shape[0]),
        "first_bad": bad[0].tolist() if bad.shape[0] else None,
    }


def throughput(
    n: int, window_s: float, *, start_at: float | None, device: str = "cpu"
) -> dict[str, Any]:
    """GFLOP/s of float32 n×n GEMMs over ``window_s`` seconds of wall clock, starting at the
    wall-clock time ``start_at`` (now if None or past). Returns ``{"n", "gflops", "count",
    "seconds", "threads"}``."""
    import torch

    threads = int(os.environ.get("TRAINGUARD_CHECK_THREADS", "0")) or torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(n, n, generator=g).to(device)
    b = torch.randn(n, n, generator=g).to(device)
    (a @ b).sum().item()  # warm-up: first-call allocation and kernel selection
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    count, t0 = 0, time.perf_counter()
    while True:
        c = a @ b
        if device != "cpu":
            torch.cuda.synchronize()
        count += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= window_s:
            break
    del c
    return {
        "n": n,
        "gflops": round(2.0 * n**3 * count / elapsed / 1e9, 3),
        "count": count,
        "seconds": round(elapsed, 3),
        "threads": threads,
    }
