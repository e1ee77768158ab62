"""Checkpoint save/restore: trainguard vs DCP async_save vs torch.save, against memcpy, one run.

For one state of ``--size-gb`` (float32 tensors, 16 of them) this measures, in this
process and on the same disk (``--dir``):

- memcpy into pre-allocated memory (``dst.copy_(src)``, torch's intra-op threads, as
  many as trainguard's copy uses): the physical limit of a snapshot;
- trainguard ``save`` blocking time, without overlap, and with overlap on a real step
  (a matmul loop three times as long as the copy, on one core): time in ``save`` plus time the optimizer pre-step
  hook waits for the background copy;
- DCP ``async_save`` blocking time, in its best configuration here: process executor with
  a reused shared-memory stager (``DefaultStager(use_shared_memory=True)``);
- ``torch.save`` + fsync (blocking = durable);
- time until durable for trainguard (ckptd process: checksums, DCP part, commit), DCP and torch.save;
- restore from memory (trainguard: verify + copy into the live tensors), from disk
  (trainguard durable tier, ``torch.load``, ``dcp.load``; page cache dropped for each file);
- sequential write (with fsync) and read bandwidth of the same disk. This disk's speed
  drifts by 3x from second to second (a shared virtual disk), so time until durable is
  measured in ``--rounds`` paired rounds (``sync``; sequential write; ``sync``; trainguard
  durable save) and the ratio is the median of the per-round ratios;
- RSS growth of this process across 50 saves.

Run: ``python benchmarks/checkpoint.py --size-gb 1`` (``--json`` for one JSON object).
The ckptd it uses is a real process on a private tmpfs; everything is removed at the end.
"""

from __future__ import annotations

import argparse
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

import psutil
import torch
from common import Row, add_common, finish, one_rank_group, verdict  # beside this file

JOB, NODE = f"bench{os.getpid()}", f"bench{os.getpid()}"  # never an agent's node id


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def drop_cache(path: Path) -> None:
    """Evict a file (or every file below a directory) from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bandwidth(d: Path, nbytes: int) -> tuple[float, float]:
    """Seconds to write ``nbytes`` sequentially (with fsync) and to read them back cold."""
    path = d / "seq.bin"
    block = os.urandom(8 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return write_s, read_s


class Ratios:
    """Per-round ratios of until-durable times, each round from a clean page cache: a sequential
    write of the same bytes, trainguard's durable save, DCP ``async_save`` (this disk's speed
    drifts 3x between seconds, so each is compared with the write made just before it)."""

    def __init__(self) -> None:
        self.seq_w: list[float] = []
        self.seq_r: list[float] = []
        self.tg: list[float] = []
        self.dcp: list[float] = []
        self.dcp_blocking: list[float] = []


def make_flat(size_gb: float) -> dict[str, Any]:
    """The flat state: 16 float32 tensors of ``size_gb`` in all, no optimizer."""
    n = 16
    numel = int(size_gb * 2**30 / 4 / n)
    return {"model": {f"w{i}": torch.randn(numel) for i in range(n)}}


def make_model(size_gb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The README's state: 16 blocks of Linear + BatchNorm1d (parameters and buffers) and
    AdamW, whose two moments make the state three times the parameters: ``size_gb`` in all."""
    width = max(8, int((size_gb * 2**30 / 12 / 16) ** 0.5))
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width))
        for _ in range(16)
    ]
    model = torch.nn.Sequential(*blocks)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of a state (modules and optimizers through their state_dict)."""
    out: list[torch.Tensor] = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif hasattr(v, "state_dict"):
            walk(v.state_dict())
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)

    walk(state)
    return out


class Memcpy:
    """memcpy of a state's tensors into pre-allocated, pre-faulted memory, sampled between the
    measurements (this VM's memory bandwidth drifts): the limit is the median of all samples."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.src = tensors_of(state)
        self.dst = [torch.zeros_like(t) for t in self.src]
        self.samples: list[float] = []
        self()  # warm-up, as trainguard gets one (its first save allocates the slots)

    def __call__(self) -> None:
        for d, s in zip(self.dst, self.src, strict=True):
            d.copy_(s)

    def sample(self, repeats: int = 1) -> float:
        t = median_time(self, repeats)
        self.samples.append(t)
        return t

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def measure_blocking(ck: Any, state: dict[str, Any], mc: Memcpy, repeats: int) -> float:
    times = []
    for i in range(1, repeats + 1):
        mc.sample()
        t0 = time.perf_counter()
        ck.save(i, state)
        times.append(time.perf_counter() - t0)
        ck.wait_persisted()
    return statistics.median(times)


def measure_durable(ck: Any, state: dict[str, Any], tmp: Path, rounds: int) -> Ratios:
    """``rounds`` paired rounds: sequential write, trainguard durable save, DCP async_save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    # DCP's best configuration here: process executor, a reused shared-memory stager
    opts = StagingOptions(
        use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
        use_non_blocking_copy=False,
    )  # fmt: skip
    stager = DefaultStager(opts)
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    out = Ratios()

    def dcp_save(i: int) -> tuple[float, float]:
        d = tmp / f"dcp{i}"
        os.sync()
        t0 = time.perf_counter()
        fut = dcp.async_save(
            state, checkpoint_id=str(d), async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager, no_dist=True,
        )  # fmt: skip
        t1 = time.perf_counter()
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        return t1 - t0, time.perf_counter() - t0

    dcp_save(-1)  # the first call starts the executor process and allocates the stager
    shutil.rmtree(tmp / "dcp-1")
    for i in range(rounds):
        os.sync()
        w, rd = disk_bandwidth(tmp, nbytes)
        out.seq_w.append(w)
        out.seq_r.append(rd)
        os.sync()
        t0 = time.perf_counter()
        ck.save(100 + i, state, durable=True)
        ck.wait()
        out.tg.append(time.perf_counter() - t0)
        blocking, durable = dcp_save(i)
        out.dcp_blocking.append(blocking)
        out.dcp.append(durable)
        if i < rounds - 1:
            shutil.rmtree(tmp / f"dcp{i}")
    stager.close()
    return out


def measure_overlap(size_gb: float, ckpt_dir: Path, repeats: int, r: dict[str, Any]) -> None:
    """The README's pattern: ``Checkpointer(overlap=True)`` with the optimizer attached; a
    real training step (forward, backward, ``optimizer.step()``) on one core while the copy
    runs on the other (on a GPU node the step is on the GPU and the copy a DMA). The stall is
    the time in ``save`` plus the time ``optimizer.step()``'s pre-hook waits for the copy."""
    from trainguard import Checkpointer

    torch.set_num_threads(1)
    model, opt = make_model(size_gb)
    state = {"model": model, "optim": opt}
    marks: list[float] = []
    opt.register_step_pre_hook(lambda *_: marks.append(time.perf_counter()))
    ck = Checkpointer(ckpt_dir, keep=1, durable_every=0, overlap=True)
    ck.attach(opt)  # its hook runs between the two marks
    opt.register_step_pre_hook(lambda *_: marks.append(time.perf_counter()))
    width = model[0][0].in_features
    batch = 16

    def step() -> float:
        t0 = time.perf_counter()
        model(torch.randn(batch, width)).square().mean().backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return t1 - t0

    step()  # AdamW creates its state at the first step
    mc = Memcpy(state)
    mc.sample(3)
    while step() < 3 * statistics.median(mc.samples) and batch < 4096:
        batch *= 2  # forward + backward at least three times the copy, as in training
    ck.save(1, state)
    ck.wait_persisted()
    stalls, computes = [], []
    for i in range(2, 2 + repeats):
        mc.sample()
        t0 = time.perf_counter()
        ck.save(i, state)
        in_save = time.perf_counter() - t0
        marks.clear()
        computes.append(step())
        stalls.append(in_save + (marks[1] - marks[0]))
        ck.wait_persisted()
    ck.close()
    torch.set_num_threads(r["torch_threads"])
    r["overlap_with_optimizer"] = {
        "state": "16 x (Linear + BatchNorm1d) + AdamW",
        "size_bytes": sum(t.numel() * t.element_size() for t in tensors_of(state)),
        "batch": batch, "memcpy_s": mc.median, "stall_s": statistics.median(stalls),
        "forward_backward_s": statistics.median(computes),
    }  # fmt: skip


def measure_restores(ov: Any, state: dict[str, Any], mc: Memcpy, repeats: int) -> dict[str, float]:
    """Restore from memory: the first ``load_memory`` has ckptd verify the snapshot (a restart
    has that done while its workers start), the later ones only copy."""
    t0 = time.perf_counter()
    # its own newest save (steps 1..repeats): the slots are the rank's, shared with the
    # Checkpointer before it, whose older steps one of them may still hold
    ov.load_memory(state, repeats)
    first = time.perf_counter() - t0
    restores = []
    for _ in range(repeats):
        mc.sample()
        restores.append(median_time(lambda: ov.load_memory(state, repeats), 1))
    copy = statistics.median(restores)
    return {"tg_restore_memory_s": copy, "tg_ckptd_verify_s": max(0.0, first - copy)}


def run(size_gb: float, repeats: int, rounds: int, base: Path) -> dict[str, Any]:
    from trainguard import Checkpointer
    from trainguard.checkpoint import node_daemon

    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-", dir=base))
    shm = tmp / "shm"
    shm.mkdir()
    # a private tmpfs for the slots (a limit, not a reservation: every slot of every save)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={int(size_gb * 8 * 1024) + 512}m"]
    subprocess.run([*mount, "tmpfs", str(shm)], check=True)
    os.environ["TRAINGUARD_SHM_DIR"] = str(shm)
    ckpt_dir = tmp / "ckpt"
    r_threads = torch.get_num_threads()
    # DCP's process executor needs a process group, even for one rank.

    import torch.distributed as dist

    one_rank_group()
    state = make_flat(size_gb)
    nbytes = sum(t.numel() * 4 for t in state["model"].values())
    r: dict[str, Any] = {"size_bytes": nbytes, "torch_threads": r_threads,
                         "state": "16 float32 tensors, no optimizer"}  # fmt: skip
    mc = Memcpy(state)
    try:
        mc.sample(repeats)
        with node_daemon(ckpt_dir, shm_dir=shm, job=JOB, node=NODE):
            ck = Checkpointer(ckpt_dir, keep=1, durable_every=0)
            ck.save(0, state)  # allocates and pre-faults the slots once
            ck.wait_persisted()
            r["tg_save_blocking_s"] = measure_blocking(ck, state, mc, repeats)
            d = measure_durable(ck, state, tmp, rounds)
            # RSS across 50 saves
            proc = psutil.Process()
            rss0 = proc.memory_info().rss
            for i in range(200, 250):
                ck.save(i, state)
            ck.wait_persisted()
            r["rss_growth_bytes_50_saves"] = proc.memory_info().rss - rss0
            # overlap=True without an attached optimizer: every tensor is copied in the step
            ov = Checkpointer(ckpt_dir, keep=1, durable_every=0, overlap=True)
            r["tg_save_blocking_overlapped_s"] = measure_blocking(ov, state, mc, repeats)
            r.update(measure_restores(ov, state, mc, repeats))
            r["tg_restore_durable_s"] = median_time(
                lambda: (drop_cache(ckpt_dir), ck.load(state)), 1
            )  # standalone load(): the newest verified durable step
            ov.close()
            ck.close()
            measure_overlap(size_gb, tmp / "ckpt-ov", repeats, r)
        # Standalone (no ckptd): the worker checksums each chunk as it copies it.
        local = Checkpointer(tmp / "ckpt-local", keep=1, durable_every=0)
        local.save(1, state)
        local.load_memory(state)
        r["tg_restore_memory_verified_in_worker_s"] = median_time(
            lambda: local.load_memory(state), repeats
        )
        local.close()
        r["disk_seq_write_s"] = statistics.median(d.seq_w)
        r["disk_seq_read_s"] = statistics.median(d.seq_r)
        r["tg_durable_s"] = statistics.median(d.tg)
        r["durable_over_seq_write_rounds"] = [t / w for t, w in zip(d.tg, d.seq_w, strict=True)]
        r["dcp_durable_over_seq_write_rounds"] = [
            t / w for t, w in zip(d.dcp, d.seq_w, strict=True)
        ]
        r["tg_durable_over_dcp_durable_rounds"] = [t / w for t, w in zip(d.tg, d.dcp, strict=True)]
        r["disk_seq_write_s_rounds"] = d.seq_w
        r["dcp_async_blocking_s"] = statistics.median(d.dcp_blocking)
        r["dcp_durable_s"] = statistics.median(d.dcp)
        import torch.distributed.checkpoint as dcp

        last = tmp / f"dcp{rounds - 1}"
        drop_cache(last)
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=str(last), no_dist=True)
        r["dcp_load_s"] = time.perf_counter() - t0
        # torch.save + fsync
        path = tmp / "state.pt"

        def torch_save() -> None:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        r["torch_save_s"] = median_time(torch_save, max(1, repeats // 2))
        drop_cache(path)
        t0 = time.perf_counter()
        torch.load(path, weights_only=True)
        r["torch_load_s"] = time.perf_counter() - t0
    finally:
        os.environ.pop("TRAINGUARD_SHM_DIR", None)
        subprocess.run(["umount", "-l", str(shm)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        dist.destroy_process_group()
    r["memcpy_s"] = mc.median
    r["memcpy_s_samples"] = mc.samples
    return ratios(r)


def ratios(r: dict[str, Any]) -> dict[str, Any]:
    m = r["memcpy_s"]
    ov = r["overlap_with_optimizer"]
    r.update(
        {
            "save_blocking_over_memcpy": r["tg_save_blocking_s"] / m,
            "save_blocking_overlapped_over_memcpy": r["tg_save_blocking_overlapped_s"] / m,
            "save_overlapped_with_optimizer_over_memcpy": ov["stall_s"] / ov["memcpy_s"],
            "restore_memory_over_memcpy": r["tg_restore_memory_s"] / m,
            "restore_memory_verified_in_worker_over_memcpy": r[
                "tg_restore_memory_verified_in_worker_s"
            ]
            / m,
            "ckptd_verify_over_memcpy": r["tg_ckptd_verify_s"] / m,
            "durable_over_seq_write": statistics.median(r["durable_over_seq_write_rounds"]),
            "durable_over_dcp_durable": statistics.median(r["tg_durable_over_dcp_durable_rounds"]),
            "dcp_async_blocking_over_memcpy": r["dcp_async_blocking_s"] / m,
            "torch_save_over_memcpy": r["torch_save_s"] / m,
            "dcp_durable_over_seq_write": statistics.median(r["dcp_durable_over_seq_write_rounds"]),
            "torch_save_over_seq_write": r["torch_save_s"] / r["disk_seq_write_s"],
        }
    )
    return r


DISK = (
    "the write is the same bytes plus checksums, the DCP metadata and an fsync per file on a "
    "shared virtual disk whose speed drifts 3x: the floor itself"
)


def table_rows(r: dict[str, Any]) -> list[Row]:
    """The README's rows (``benchmarks/table.py``)."""
    gib = r["size_bytes"] / 2**30
    ov = r["overlap_with_optimizer"]
    ov_gib = ov["size_bytes"] / 2**30
    mem = f"memcpy {r['memcpy_s']:.3f} s"
    return [
        Row(
            what=f"save overlapped with a step, README pattern ({ov_gib:.2f} GiB: "
            f"{ov['state']}, optimizer attached)",
            result=f"stall {ov['stall_s'] * 1e3:.1f} ms = "
            f"{r['save_overlapped_with_optimizer_over_memcpy']:.3f}× memcpy "
            f"({ov['memcpy_s']:.3f} s; forward+backward {ov['forward_backward_s']:.2f} s)",
            target=verdict(
                r["save_overlapped_with_optimizer_over_memcpy"],
                0.05,
                "× memcpy",
                "what is left is save's own bookkeeping in the step (milliseconds), not the copy",
            ),
        ),
        Row(
            what=f"save, blocking ({gib:.2f} GiB, {r['state']})",
            result=f"{r['save_blocking_over_memcpy']:.2f}× memcpy ({mem}); DCP async_save "
            f"blocks {r['dcp_async_blocking_over_memcpy']:.2f}×",
            target="—",
        ),
        Row(
            what=f"restore from memory ({gib:.2f} GiB, ckptd verified during the restart)",
            result=f"{r['restore_memory_over_memcpy']:.2f}× memcpy; checksum in the worker "
            f"{r['restore_memory_verified_in_worker_over_memcpy']:.2f}×",
            target=verdict(
                r["restore_memory_over_memcpy"],
                1.1,
                "× memcpy",
                "pread from /dev/shm through the kernel against memcpy in user space, 2 cores",
            ),
        ),
        Row(
            what=f"until durable ({gib:.2f} GiB, median of per-round ratios)",
            result=f"{r['durable_over_seq_write']:.2f}× a sequential write, "
            f"{r['durable_over_dcp_durable']:.2f}× DCP async_save (DCP "
            f"{r['dcp_durable_over_seq_write']:.2f}× the write)",
            target=f"{verdict(r['durable_over_seq_write'], 1.0, '× write', DISK)}; "
            f"{verdict(r['durable_over_dcp_durable'], 1.0, '× DCP')}",
        ),
        Row(
            what=f"restore from disk, cold page cache ({gib:.2f} GiB)",
            result=f"trainguard {r['tg_restore_durable_s']:.2f} s, dcp.load "
            f"{r['dcp_load_s']:.2f} s, torch.load {r['torch_load_s']:.2f} s",
            target="—",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5, help="paired durable rounds")
    p.add_argument(
        "--dir", type=Path, default=Path(tempfile.gettempdir()), help="disk to measure on"
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="the sharded case instead: 4 FSDP2 ranks, see checkpoint_sharded.py",
    )
    add_common(p, smoke="8 MiB, 2 repeats, 2 rounds (CI)")
    a = p.parse_args(argv)
    if a.fsdp:
        import checkpoint_sharded  # beside this file

        flags = ["--json"] * a.json + ["--smoke"] * a.smoke + ["--record"] * a.record
        return checkpoint_sharded.main(["--fsdp", "--size-gb", str(a.size_gb), *flags])
    if a.smoke:
        a.size_gb, a.repeats, a.rounds = 2**-7, 2, 2
    r = run(a.size_gb, a.repeats, a.rounds, a.dir)
    finish("checkpoint", a, r)
    if a.json:
        return 0
    gb = r["size_bytes"] / 2**30
    rows = [
        ("memcpy into pre-allocated memory", r["memcpy_s"], 1.0),
        ("trainguard save, blocking", r["tg_save_blocking_s"], r["save_blocking_over_memcpy"]),
        (
            "trainguard save, overlap=True, no optimizer attached",
            r["tg_save_blocking_overlapped_s"],
            r["save_blocking_overlapped_over_memcpy"],
        ),
        (
            "  the README's pattern, AdamW attached (own memcpy)",
            r["overlap_with_optimizer"]["stall_s"],
            r["save_overlapped_with_optimizer_over_memcpy"],
        ),
        (
            "DCP async_save (process, shm stager), blocking",
            r["dcp_async_blocking_s"],
            r["dcp_async_blocking_over_memcpy"],
        ),
        ("torch.save + fsync, blocking", r["torch_save_s"], r["torch_save_over_memcpy"]),
        (
            "trainguard restore from memory (copy; ckptd verified)",
            r["tg_restore_memory_s"],
            r["restore_memory_over_memcpy"],
        ),
        (
            "  ckptd re-checksum, during the restart",
            r["tg_ckptd_verify_s"],
            r["ckptd_verify_over_memcpy"],
        ),
        (
            "trainguard restore from memory, verified in worker",
            r["tg_restore_memory_verified_in_worker_s"],
            r["restore_memory_verified_in_worker_over_memcpy"],
        ),
    ]
    print(f"state: {gb:.2f} GiB in 16 float32 tensors; torch threads: {r['torch_threads']}")
    print(f"{'':52s} {'seconds':>9s} {'× memcpy':>9s}")
    for name, s, ratio in rows:
        print(f"{name:52s} {s:9.3f} {ratio:9.2f}")
    print(f"\n{'until durable':52s} {'seconds':>9s} {'× seq write':>11s}")
    for name, s, ratio in (
        ("disk sequential write + fsync (median)", r["disk_seq_write_s"], 1.0),
        (
            "trainguard (median of per-round ratios)",
            r["tg_durable_s"],
            r["durable_over_seq_write"],
        ),
        ("DCP async_save", r["dcp_durable_s"], r["dcp_durable_over_seq_write"]),
        ("torch.save + fsync", r["torch_save_s"], r["torch_save_over_seq_write"]),
    ):
        print(f"{name:52s} {s:9.3f} {ratio:11.2f}")
    rounds = ", ".join(
        f"{w:.2f}s→{q:.2f}"
        for w, q in zip(
            r["disk_seq_write_s_rounds"], r["durable_over_seq_write_rounds"], strict=True
        )
    )
    print(f"  paired rounds (seq write → trainguard ratio): {rounds}")
    print(f"\n{'restore from disk (cold page cache)':52s} {'seconds':>9s}")
    for name, s in (
        ("disk sequential read", r["disk_seq_read_s"]),
        ("trainguard durable tier", r["tg_restore_durable_s"]),
        ("torch.load", r["torch_load_s"]),
        ("dcp.load", r["dcp_load_s"]),
    ):
        print(f"{name:52s} {s:9.3f}")
    print(f"\nRSS growth over 50 saves: {r['rss_growth_bytes_50_saves'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
