"""Checkpointing sharded (FSDP2) state and very many small tensors, side by side in one run.

``--fsdp`` (what ``checkpoint.py --fsdp`` runs): torchrun starts 4 ranks (gloo, CPU); a model of
``--size-gb`` float32 parameters in 16 Linear layers is sharded with ``fully_shard``, so each
rank holds a quarter. Per rank, in the same process run:

- memcpy of the rank's shards into pre-allocated memory (``copy_`` per local tensor): the
  physical limit of a snapshot;
- trainguard ``save`` stall (memory tier, no overlap: the whole copy is in the step);
- restore from memory into the live local tensors: ``snapshot.restore`` with ckptd's
  verification done (as in a restart) and with the checksum in the worker;
- time until durable: trainguard ``save(durable=True)`` + ``wait()`` (the persister
  here runs in-process) vs DCP ``async_save`` of the same sharded state (blocking time and
  until its future completes; thread executor, pinned-memory-free default stager).

The slowest rank's time counts (a synchronous job waits for it); ratios to that rank's memcpy.

``--small N``: one process, a state of N tensors of 4 float32 each (N = 100000: a model of
very many small parameters): the stall of ``save`` against a loop of ``copy_`` into
pre-allocated tensors (the memcpy of the same tensors) and against one memcpy of all bytes.

Run: ``python benchmarks/checkpoint_sharded.py --fsdp [--size-gb 1]`` or ``--small 100000``;
``--json`` for one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from checkpoint import median_time  # beside this file

REPEATS = 9


def med(fn: Callable[[], Any]) -> float:
    return median_time(fn, REPEATS)


def settle(ck: Any) -> None:
    """Until the in-process persister has checksummed every staged snapshot (so no save is
    skipped for busy slots while it is timed)."""
    deadline = time.monotonic() + 60
    while not ck._backend.persister.idle() and time.monotonic() < deadline:
        time.sleep(0.002)


def timed_saves(ck: Any, state: dict[str, Any], first: int) -> float:
    out = []
    for i in range(REPEATS):
        settle(ck)
        t0 = time.perf_counter()
        ck.save(first + i, state)
        out.append(time.perf_counter() - t0)
    settle(ck)
    return statistics.median(out)


def fsdp_rank(size_gb: float, root: Path) -> dict[str, float]:
    """One rank of the --fsdp measurement (under torchrun)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainguard.checkpoint import snapshot
    from trainguard.checkpoint.checkpointer import Checkpointer

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.set_num_threads(1)
    width = int((size_gb * 2**30 / 4 / 16) ** 0.5)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(16)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    state = {"model": model.state_dict()}
    local = [t._local_tensor for t in state["model"].values()]
    dst = [torch.empty_like(t) for t in local]
    r: dict[str, float] = {"shard_bytes": float(sum(t.numel() * 4 for t in local))}
    r["memcpy_s"] = med(lambda: [d.copy_(s) for d, s in zip(dst, local, strict=True)])
    ck = Checkpointer(root / "tg", keep=1, durable_every=0)
    ck.save(0, state)  # allocates and pre-faults the slots
    r["tg_stall_s"] = timed_saves(ck, state, 1)
    assert ck._layout is not None
    slot = ck._slots[ck._newest]
    h = snapshot.peek_header(slot.path)
    assert h is not None
    sums = snapshot.Slot(slot.path, writable=False).checksums(h)
    targets = dict(zip([e.key for e in ck._layout.tensors], local, strict=True))
    r["tg_restore_verified_s"] = med(lambda: snapshot.restore(slot.path, h, None, targets, 1))
    r["tg_restore_checksum_s"] = med(lambda: snapshot.restore(slot.path, h, sums, targets, 1))
    dur = []
    for i in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        ck.save(2000 + i, state, durable=True)
        ck.wait()
        dur.append(time.perf_counter() - t0)
    r["tg_durable_s"] = statistics.median(dur)
    ck.close()
    blocking, until = [], []
    for i in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(root / f"dcp{i}"))
        t1 = time.perf_counter()
        fut.result()
        until.append(time.perf_counter() - t0)
        blocking.append(t1 - t0)
    r["dcp_async_blocking_s"] = statistics.median(blocking)
    r["dcp_durable_s"] = statistics.median(until)
    out = torch.tensor([r[k] for k in sorted(r)], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    dist.destroy_process_group()
    return dict(zip(sorted(r), out.tolist(), strict=True))


def fsdp(size_gb: float) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-fsdp-"))
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "4", __file__, "--_rank", "--size-gb", str(size_gb)]
        env = {**os.environ, "TG_BENCH_DIR": str(tmp), "TRAINGUARD_SHM_DIR": "/dev/shm"}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        if out.returncode != 0:
            raise SystemExit(f"benchmark ranks failed:\n{out.stderr[-3000:]}")
        r = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    m = r["memcpy_s"]
    r["ratios"] = {
        "stall_over_memcpy": r["tg_stall_s"] / m,
        "restore_verified_over_memcpy": r["tg_restore_verified_s"] / m,
        "restore_checksum_over_memcpy": r["tg_restore_checksum_s"] / m,
        "dcp_async_blocking_over_memcpy": r["dcp_async_blocking_s"] / m,
        "tg_durable_over_dcp_durable": r["tg_durable_s"] / r["dcp_durable_s"],
    }
    return r


def small(n: int) -> dict[str, Any]:
    from trainguard.checkpoint.checkpointer import Checkpointer

    torch.set_num_threads(1)
    tensors = {f"p{i}": torch.randn(4) for i in range(n)}
    dst = [torch.empty(4) for _ in range(n)]
    flat_src, flat_dst = torch.randn(4 * n), torch.empty(4 * n)
    r: dict[str, Any] = {"tensors": n}
    r["copy_loop_s"] = med(lambda: [d.copy_(s) for d, s in zip(dst, tensors.values(), strict=True)])
    r["one_memcpy_s"] = med(lambda: flat_dst.copy_(flat_src))
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-small-"))
    try:
        ck = Checkpointer(tmp, keep=1, durable_every=0)
        state = {"model": tensors}
        ck.save(0, state)
        r["tg_stall_s"] = timed_saves(ck, state, 1)
        ck.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r["stall_over_copy_loop"] = r["tg_stall_s"] / r["copy_loop_s"]
    r["stall_over_one_memcpy"] = r["tg_stall_s"] / r["one_memcpy_s"]
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--small", type=int, default=0, metavar="N")
    p.add_argument("--json", action="store_true")
    p.add_argument("--_rank", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._rank:
        r = fsdp_rank(a.size_gb, Path(os.environ["TG_BENCH_DIR"]))  # shared by the ranks
        if os.environ["RANK"] == "0":
            print(json.dumps(r), flush=True)
        return 0
    if not a.fsdp and not a.small:
        p.error("give --fsdp or --small N")
    out: dict[str, Any] = {}
    if a.fsdp:
        out["fsdp"] = fsdp(a.size_gb)
    if a.small:
        out["small"] = small(a.small)
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    for name, r in out.items():
        print(f"== {name}")
        for k, v in r.items():
            if isinstance(v, dict):
                for kk, vv in v.items():
                    print(f"  {kk:38s} {vv:8.3f}")
            else:
                print(f"  {k:38s} {v:10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
