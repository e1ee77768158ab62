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
from checkpoint import median_time, tensors_of  # beside this file
from common import Row, add_common, finish, verdict

REPEATS = 9


def together(fn: Callable[[], Any], repeats: int, sync: Callable[[], Any]) -> float:
    """Median seconds of ``fn``, each run started by every rank at once (``sync``: a barrier),
    so that a rank's save and its memcpy meet the same contention from the others."""
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def timed_saves(
    ck: Any, state: dict[str, Any], first: int, repeats: int, sync: Callable[[], Any] = lambda: None
) -> float:
    """Median stall of ``save``, in steady state: the slots written once each first (a
    training job saves every few steps), and the persister done with the previous snapshot
    before each timed one (none is skipped for busy slots)."""
    steps = iter(range(first, first + repeats + 4))
    for _ in range(4):
        ck.save(next(steps), state)
    ck.wait_persisted()

    def one() -> None:
        ck.save(next(steps), state)

    def settle() -> None:
        ck.wait_persisted()
        sync()

    t = together(one, repeats, settle)
    ck.wait_persisted()
    return t


class AppState:
    """DCP's recipe for FSDP2 state (the ``torch.distributed.checkpoint`` tutorial): model and
    optimizer through ``get_state_dict``/``set_state_dict``, a ``Stateful``."""

    def __init__(self, model: Any, optim: Any) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )


def local_tensors(app: AppState) -> list[torch.Tensor]:
    """This rank's shards of every tensor of the state (``DTensor.to_local``)."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors_of(app.state_dict())]


def fsdp_rank(size_gb: float, root: Path, repeats: int) -> dict[str, float]:
    """One rank of the --fsdp measurement (under torchrun, beside the node's ckptd)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainguard import Checkpointer

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.set_num_threads(1)
    width = max(8, int((size_gb * 2**30 / 12 / 16) ** 0.5))  # AdamW: 3x the parameters
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(16)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).square().mean().backward()
    optim.step()  # AdamW creates its state at the first step
    optim.zero_grad()
    state = {"app": AppState(model, optim)}
    local = local_tensors(state["app"])
    dst = [torch.empty_like(t) for t in local]
    r: dict[str, float] = {"shard_bytes": float(sum(t.numel() * t.element_size() for t in local))}
    r["memcpy_s"] = median_time(
        lambda: [d.copy_(s) for d, s in zip(dst, local, strict=True)], repeats
    )
    # the user's state_dict() (DCP's get_state_dict), which every save and DCP call pays
    r["state_dict_s"] = median_time(state["app"].state_dict, repeats)
    ck = Checkpointer(root / "tg", keep=1, durable_every=0)
    ck.save(0, state)  # allocates and pre-faults the slots
    r["tg_stall_s"] = timed_saves(ck, state, 1, repeats, dist.barrier)
    dist.barrier()
    t0 = time.perf_counter()
    ck.load_memory(state)  # ckptd verifies the snapshot first (a restart: while workers start)
    first = time.perf_counter() - t0
    r["tg_restore_verified_s"] = together(lambda: ck.load_memory(state), repeats, dist.barrier)
    r["tg_restore_first_s"] = first
    dur = []
    for i in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        ck.save(2000 + i, state, durable=True)
        ck.wait()
        dist.barrier()  # durable when every rank's part is
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
        dist.barrier()
        until.append(time.perf_counter() - t0)
        blocking.append(t1 - t0)
    r["dcp_async_blocking_s"] = statistics.median(blocking)
    r["dcp_durable_s"] = statistics.median(until)
    out = torch.tensor([r[k] for k in sorted(r)], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    dist.destroy_process_group()
    return dict(zip(sorted(r), out.tolist(), strict=True))


def fsdp(size_gb: float, repeats: int) -> dict[str, Any]:
    """4 ranks under torchrun, sharing this node's ckptd (``node_daemon``, as ``trainguard
    run`` gives a node one)."""
    from trainguard.checkpoint import node_daemon

    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-fsdp-"))
    shm = tmp / "shm"
    shm.mkdir()
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "4", __file__, "--worker", "--size-gb", str(size_gb)]
        cmd += ["--repeats", str(repeats)]
        with node_daemon(tmp / "tg", shm_dir=shm, keep=1):
            env = {**os.environ, "TG_BENCH_DIR": str(tmp)}
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        if out.returncode != 0:
            raise SystemExit(f"benchmark ranks failed:\n{out.stderr[-3000:]}")
        r = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    m = r["memcpy_s"]
    r["state"] = "16 Linear layers, fully_shard per layer and root, AdamW (get_state_dict)"
    r["ratios"] = {
        "stall_over_memcpy": r["tg_stall_s"] / m,
        "state_dict_over_memcpy": r["state_dict_s"] / m,
        "restore_verified_over_memcpy": r["tg_restore_verified_s"] / m,
        "restore_first_over_memcpy": r["tg_restore_first_s"] / m,
        "dcp_async_blocking_over_memcpy": r["dcp_async_blocking_s"] / m,
        "tg_durable_over_dcp_durable": r["tg_durable_s"] / r["dcp_durable_s"],
    }
    return r


def small(n: int, repeats: int) -> dict[str, Any]:
    from trainguard import Checkpointer

    torch.set_num_threads(1)
    tensors = {f"p{i}": torch.randn(4) for i in range(n)}
    dst = [torch.empty(4) for _ in range(n)]
    flat_src, flat_dst = torch.randn(4 * n), torch.empty(4 * n)
    r: dict[str, Any] = {"tensors": n, "state": f"{n} tensors of 4 float32"}
    pairs = list(zip(dst, tensors.values(), strict=True))
    r["copy_loop_s"] = median_time(lambda: [d.copy_(s) for d, s in pairs], repeats)
    r["one_memcpy_s"] = median_time(lambda: flat_dst.copy_(flat_src), repeats)
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-small-"))
    try:
        ck = Checkpointer(tmp, keep=1, durable_every=0)
        state = {"model": tensors}
        ck.save(0, state)
        r["tg_stall_s"] = timed_saves(ck, state, 1, repeats)
        ck.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r["stall_over_copy_loop"] = r["tg_stall_s"] / r["copy_loop_s"]
    r["stall_over_one_memcpy"] = r["tg_stall_s"] / r["one_memcpy_s"]
    return r


def table_rows(out: dict[str, Any]) -> list[Row]:
    """The README's rows (``benchmarks/table.py``)."""
    rows: list[Row] = []
    if "fsdp" in out:
        r = out["fsdp"]
        q = r["ratios"]
        where = f"4 ranks, {r['shard_bytes'] / 2**20:.0f} MiB a rank: {r['state']}"
        rows.append(Row(
            what=f"FSDP2 save stall ({where})",
            result=f"{q['stall_over_memcpy']:.2f}× the rank's memcpy ({r['memcpy_s']:.3f} s), "
            f"of which get_state_dict {q['state_dict_over_memcpy']:.2f}×; DCP async_save "
            f"blocks {q['dcp_async_blocking_over_memcpy']:.2f}×",
            target=verdict(
                q["stall_over_memcpy"], 1.1, "× memcpy",
                "4 ranks and ckptd's checksums of their snapshots share 2 cores",
            ),
        ))  # fmt: skip
        rows.append(Row(
            what="FSDP2 restore from memory (the same state)",
            result=f"{q['restore_verified_over_memcpy']:.2f}× memcpy (ckptd verified); "
            f"{q['restore_first_over_memcpy']:.2f}× with ckptd's verification in it",
            target=verdict(
                q["restore_verified_over_memcpy"], 1.2, "× memcpy",
                "4 ranks reading at once on 2 cores",
            ),
        ))  # fmt: skip
        rows.append(Row(
            what="FSDP2 until durable (the same state)",
            result=f"{q['tg_durable_over_dcp_durable']:.2f}× DCP async_save "
            f"({r['tg_durable_s']:.2f} s vs {r['dcp_durable_s']:.2f} s)",
            target=verdict(
                q["tg_durable_over_dcp_durable"], 1.0, "× DCP",
                "one ckptd writes the node's 4 parts after checksumming them, on 2 cores; the "
                "disk is shared and noisy",
            ),
        ))  # fmt: skip
    if "small" in out:
        r = out["small"]
        rows.append(Row(
            what=f"save stall, {r['state']}",
            result=f"{r['stall_over_copy_loop']:.2f}× a loop of copy_ "
            f"({r['tg_stall_s']:.3f} s vs {r['copy_loop_s']:.3f} s)",
            target="—",
        ))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--small", type=int, default=0, metavar="N")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_common(p, smoke="--fsdp at 8 MiB and --small 1000, 2 repeats (CI)")
    a = p.parse_args(argv)
    if a.worker:
        r = fsdp_rank(a.size_gb, Path(os.environ["TG_BENCH_DIR"]), a.repeats)
        if os.environ["RANK"] == "0":
            print(json.dumps(r), flush=True)
        sys.stderr.flush()
        # Half the runs of 4 FSDP2 ranks on torch 2.13 abort in the interpreter's teardown,
        # after the process group is destroyed ("terminate called without an active
        # exception", no Python frame): a C++ thread of torch's outlives main(). The result is
        # out; end the process without the static destructors.
        os._exit(0)
    if a.smoke:
        a.size_gb, a.small, a.repeats, a.fsdp = 2**-7, 1000, 2, True
    if not a.fsdp and not a.small:
        p.error("give --fsdp or --small N")
    out: dict[str, Any] = {}
    if a.fsdp:
        out["fsdp"] = fsdp(a.size_gb, a.repeats)
    if a.small:
        out["small"] = small(a.small, a.repeats)
    finish("checkpoint_sharded", a, out, argv)
    if a.json:
        return 0
    for name, r in out.items():
        print(f"== {name}")
        for k, v in r.items():
            if isinstance(v, dict):
                for kk, vv in v.items():
                    print(f"  {kk:38s} {vv:8.3f}")
            elif isinstance(v, int | float):
                print(f"  {k:38s} {v:10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
