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
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch

from trainguard.protocol import ckptd as cw

JOB, NODE = "bench", "node0"


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


@contextlib.contextmanager
def ckptd(tmp: Path, shm: Path, ckpt_dir: Path) -> Iterator[None]:
    from trainguard.checkpoint.ckptd import CkptdClient, socket_name, spawn

    proc = spawn(job=JOB, node=NODE, ckpt_dir=ckpt_dir, shm_dir=shm, keep=1, log=tmp / "ckptd.log")
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            c = CkptdClient(socket_name(JOB, NODE), timeout_s=5.0)
            c.call(cw.Shutdown(unlink=True))
            c.close()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_idle() -> None:
    from trainguard.checkpoint.ckptd import CkptdClient, socket_name

    c = CkptdClient(socket_name(JOB, NODE))
    try:
        deadline = time.monotonic() + 600
        while not c.call(cw.Status()).idle and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        c.close()


def run(size_gb: float, repeats: int, rounds: int, base: Path) -> dict[str, Any]:
    from trainguard.checkpoint.snapshot import SLOTS

    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-", dir=base))
    shm = tmp / "shm"
    shm.mkdir()
    subprocess.run(
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={int(size_gb * (SLOTS + 0.5) * 1024 + 256)}m",  # every slot of the rank
            "tmpfs",
            str(shm),
        ],
        check=True,
    )
    ckpt_dir = tmp / "ckpt"
    os.environ.update(
        {
            "TRAINGUARD_JOB_ID": JOB,
            "TRAINGUARD_NODE_ID": NODE,
            "TRAINGUARD_SHM_DIR": str(shm),
            "TRAINGUARD_CKPTD": f"@trainguard-ckptd-{JOB}-{NODE}",
            "TRAINGUARD_AGENT_ADDR": "127.0.0.1:9",
            "TRAINGUARD_TOKEN": "00" * 16,
            "TRAINGUARD_RESTORE_GEN": "0",
        }
    )
    r_threads = torch.get_num_threads()
    # DCP's process executor needs a process group, even for one rank.
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    )
    dist.init_process_group("gloo", rank=0, world_size=1)
    n = 16
    numel = int(size_gb * 2**30 / 4 / n)
    state = {"model": {f"w{i}": torch.randn(numel) for i in range(n)}}
    nbytes = n * numel * 4
    dst = {k: torch.zeros_like(v) for k, v in state["model"].items()}  # pre-faulted, like the slots
    r: dict[str, Any] = {"size_bytes": nbytes, "torch_threads": r_threads}
    try:

        def memcpy() -> None:
            for k, v in state["model"].items():
                dst[k].copy_(v)

        memcpy()  # warm-up, as trainguard gets one (its first save allocates the slots)
        # memcpy is sampled between the measurements below too (this VM's memory bandwidth
        # drifts); the limit is the median of all samples
        copies = [median_time(memcpy, repeats)]
        r["memcpy_s"] = copies[0]
        with ckptd(tmp, shm, ckpt_dir):
            from trainguard.checkpoint.checkpointer import Checkpointer

            ck = Checkpointer(ckpt_dir, keep=1, durable_every=0)
            ck.save(0, state)  # allocates and pre-faults the slots once
            wait_idle()
            times = []
            for i in range(1, repeats + 1):
                copies.append(median_time(memcpy, 1))
                t0 = time.perf_counter()
                ck.save(i, state)
                times.append(time.perf_counter() - t0)
                wait_idle()
            r["tg_save_blocking_s"] = statistics.median(times)
            # durable: blocking save, then until committed on disk; paired with the disk's
            # sequential write just before it, each from a clean page cache
            seq_w, seq_r, tg_d = [], [], []
            for i in range(rounds):
                os.sync()
                w, rd = disk_bandwidth(tmp, nbytes)
                seq_w.append(w)
                seq_r.append(rd)
                os.sync()
                t0 = time.perf_counter()
                ck.save(100 + i, state, durable=True)
                ck.wait()
                tg_d.append(time.perf_counter() - t0)
            r["disk_seq_write_s"] = statistics.median(seq_w)
            r["disk_seq_read_s"] = statistics.median(seq_r)
            r["tg_durable_s"] = statistics.median(tg_d)
            r["durable_over_seq_write_rounds"] = [d / w for d, w in zip(tg_d, seq_w, strict=True)]
            r["disk_seq_write_s_rounds"] = seq_w
            # RSS across 50 saves
            proc = psutil.Process()
            rss0 = proc.memory_info().rss
            for i in range(200, 250):
                ck.save(i, state)
            wait_idle()
            r["rss_growth_bytes_50_saves"] = proc.memory_info().rss - rss0
            # overlap on a real step: compute as long as the copy, copy in the background. On
            # this CPU-only box the step computes on one core and the copy runs on the other
            # (on a GPU node the step is on the GPU and the copy is a DMA).
            torch.set_num_threads(1)
            ov = Checkpointer(ckpt_dir, keep=1, durable_every=0, overlap=True)
            ov.save(300, state)
            ov.wait_staged()
            wait_idle()
            a = torch.randn(512, 512)
            per = median_time(lambda: a @ a, 5)
            iters = max(1, int(r["memcpy_s"] * 3 / per))  # a step 3x as long as the copy
            blocked = []
            for i in range(301, 301 + repeats):
                t0 = time.perf_counter()
                ov.save(i, state)
                b = time.perf_counter() - t0
                for _ in range(iters):  # the next forward/backward
                    a @ a
                t1 = time.perf_counter()
                ov.wait_copied()  # what attach(optimizer)'s pre-step hook does
                blocked.append(b + time.perf_counter() - t1)
                ov.wait_staged()
                wait_idle()
            torch.set_num_threads(r_threads)
            r["tg_save_blocking_overlapped_s"] = statistics.median(blocked)
            r["overlap_step_compute_s"] = iters * per
            # restore from memory (newest snapshot) into the live tensors
            from trainguard.checkpoint import snapshot
            from trainguard.checkpoint.ckptd import CkptdClient, socket_name
            from trainguard.runtime.core import init

            rt = init()
            step = 300 + repeats
            rt.restore_step = step
            # As in a restart: the agent has ckptd re-checksum the snapshot while the new
            # workers start (rendezvous, model build); the worker's restore then only copies.
            c = CkptdClient(socket_name(JOB, NODE))
            t0 = time.perf_counter()
            v = c.call(cw.Verify(rank=0, step=step, generation=0, for_generation=0), timeout_s=300)
            r["tg_ckptd_verify_s"] = time.perf_counter() - t0
            c.close()
            assert v.ok and v.slot is not None, v
            restores = []
            for _ in range(repeats):
                copies.append(median_time(memcpy, 1))
                restores.append(median_time(lambda: ov.load(state), 1))
            r["tg_restore_memory_s"] = statistics.median(restores)
            # Standalone (no ckptd): the worker checksums each chunk as it copies it.
            slot = Path(v.slot)
            h = snapshot.peek_header(slot)
            sums = snapshot.read_sums(slot, step, 0)
            flat_targets = {f"model.{k}": t for k, t in state["model"].items()}
            r["tg_restore_memory_verified_in_worker_s"] = median_time(
                lambda: snapshot.restore(slot, h, sums, flat_targets, snapshot.restore_threads()),
                repeats,
            )
            rt.restore_step = 100 + rounds - 1
            r["tg_restore_durable_s"] = median_time(
                lambda: (drop_cache(ckpt_dir), ck.load(state)), 1
            )
            ov.close()
            ck.close()
        r["memcpy_s"] = statistics.median(copies)
        r["memcpy_s_samples"] = copies
        # DCP async_save, process executor + reused shared-memory stager
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=True,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        blocking, durable = [], []
        for i in range(repeats + 1):
            d = tmp / f"dcp{i}"
            os.sync()
            t0 = time.perf_counter()
            fut = dcp.async_save(
                state,
                checkpoint_id=str(d),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=stager,
                no_dist=True,
            )
            t1 = time.perf_counter()
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
            t2 = time.perf_counter()
            if i:  # the first call starts the executor process and allocates the stager
                blocking.append(t1 - t0)
                durable.append(t2 - t0)
            if i < repeats:
                shutil.rmtree(d)
        stager.close()
        r["dcp_async_blocking_s"], r["dcp_durable_s"] = (
            statistics.median(blocking),
            statistics.median(durable),
        )
        last = tmp / f"dcp{repeats}"
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
        subprocess.run(["umount", "-l", str(shm)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        dist.destroy_process_group()
    m = r["memcpy_s"]
    r.update(
        {
            "save_blocking_over_memcpy": r["tg_save_blocking_s"] / m,
            "save_blocking_overlapped_over_memcpy": r["tg_save_blocking_overlapped_s"] / m,
            "restore_memory_over_memcpy": r["tg_restore_memory_s"] / m,
            "restore_memory_verified_in_worker_over_memcpy": r[
                "tg_restore_memory_verified_in_worker_s"
            ]
            / m,
            "ckptd_verify_over_memcpy": r["tg_ckptd_verify_s"] / m,
            "durable_over_seq_write": statistics.median(r["durable_over_seq_write_rounds"]),
            "dcp_async_blocking_over_memcpy": r["dcp_async_blocking_s"] / m,
            "torch_save_over_memcpy": r["torch_save_s"] / m,
            "dcp_durable_over_seq_write": r["dcp_durable_s"] / r["disk_seq_write_s"],
            "torch_save_over_seq_write": r["torch_save_s"] / r["disk_seq_write_s"],
        }
    )
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5, help="paired durable rounds")
    p.add_argument(
        "--dir", type=Path, default=Path(tempfile.gettempdir()), help="disk to measure on"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="the sharded case instead: 4 FSDP2 ranks, see checkpoint_sharded.py",
    )
    a = p.parse_args()
    if a.fsdp:
        import checkpoint_sharded  # beside this file

        return checkpoint_sharded.main(
            ["--fsdp", "--size-gb", str(a.size_gb)] + ["--json"] * a.json
        )
    r = run(a.size_gb, a.repeats, a.rounds, a.dir)
    if a.json:
        print(json.dumps(r, indent=2))
        return 0
    gb = r["size_bytes"] / 2**30
    rows = [
        ("memcpy into pre-allocated memory", r["memcpy_s"], 1.0),
        ("trainguard save, blocking", r["tg_save_blocking_s"], r["save_blocking_over_memcpy"]),
        (
            "trainguard save, overlapped with a step",
            r["tg_save_blocking_overlapped_s"],
            r["save_blocking_overlapped_over_memcpy"],
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
