"""Checkpoint save/restore: trainguard vs DCP async_save vs torch.save, against memcpy, one run.

For one state of ``--size-gb`` (float32 tensors, 16 of them) this measures, in this
process and on the same disk (``--dir``):

- memcpy into pre-allocated memory (``dst.copy_(src)``): the physical limit of a snapshot;
- trainguard ``save`` blocking time, without overlap, and with overlap on a real step
  (a matmul loop as long as the copy): time in ``save`` plus time the optimizer pre-step
  hook waits for the background copy;
- DCP ``async_save`` blocking time, in its best configuration here: process executor with
  a reused shared-memory stager (``DefaultStager(use_shared_memory=True)``);
- ``torch.save`` + fsync (blocking = durable);
- time until durable for trainguard (ckptd process: checksums, DCP part, commit), DCP and torch.save;
- restore from memory (trainguard: verify + copy into the live tensors), from disk
  (trainguard durable tier, ``torch.load``, ``dcp.load``; page cache dropped for each file);
- sequential write (with fsync) and read bandwidth of the same disk;
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
            c.call({"op": "shutdown", "unlink": True})
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
        while not c.call({"op": "status"})["idle"] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        c.close()


def run(size_gb: float, repeats: int, base: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-", dir=base))
    shm = tmp / "shm"
    shm.mkdir()
    subprocess.run(
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={int(size_gb * 2.5 * 1024 + 256)}m",
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
    torch.set_num_threads(1)
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
    r: dict[str, Any] = {"size_bytes": nbytes}
    try:

        def memcpy() -> None:
            for k, v in state["model"].items():
                dst[k].copy_(v)

        memcpy()  # warm-up, as trainguard gets one (its first save allocates the slots)
        r["memcpy_s"] = median_time(memcpy, repeats)
        r["disk_seq_write_s"], r["disk_seq_read_s"] = disk_bandwidth(tmp, nbytes)
        with ckptd(tmp, shm, ckpt_dir):
            from trainguard.checkpoint.checkpointer import Checkpointer

            ck = Checkpointer(ckpt_dir, keep=1, durable_every=0)
            ck.save(0, state)  # allocates and pre-faults the slots once
            wait_idle()
            times = []
            for i in range(1, repeats + 1):
                t0 = time.perf_counter()
                ck.save(i, state)
                times.append(time.perf_counter() - t0)
                wait_idle()
            r["tg_save_blocking_s"] = statistics.median(times)
            # durable: blocking save, then until committed on disk
            t0 = time.perf_counter()
            ck.save(100, state, durable=True)
            ck.wait()
            r["tg_durable_s"] = time.perf_counter() - t0
            # RSS across 50 saves
            proc = psutil.Process()
            rss0 = proc.memory_info().rss
            for i in range(200, 250):
                ck.save(i, state)
            wait_idle()
            r["rss_growth_bytes_50_saves"] = proc.memory_info().rss - rss0
            # overlap on a real step: compute as long as the copy, copy in the background
            ov = Checkpointer(ckpt_dir, keep=1, durable_every=0, overlap=True)
            ov.save(300, state)
            ov.wait_staged()
            wait_idle()
            a = torch.randn(512, 512)
            per = median_time(lambda: a @ a, 5)
            iters = max(1, int(r["memcpy_s"] * 1.5 / per))
            blocked = []
            for i in range(301, 301 + repeats):
                t0 = time.perf_counter()
                ov.save(i, state)
                b = time.perf_counter() - t0
                for _ in range(iters):  # the next forward/backward
                    a @ a
                t1 = time.perf_counter()
                ov.wait_staged()  # what attach(optimizer)'s pre-step hook does
                blocked.append(b + time.perf_counter() - t1)
                wait_idle()
            r["tg_save_blocking_overlapped_s"] = statistics.median(blocked)
            r["overlap_step_compute_s"] = iters * per
            # restore from memory (newest snapshot) into the live tensors
            from trainguard.runtime.core import init

            rt = init()
            step = 300 + repeats
            rt.restore_step = step
            r["tg_restore_memory_s"] = median_time(lambda: ov.load(state), repeats)
            rt.restore_step = 100
            r["tg_restore_durable_s"] = median_time(
                lambda: (drop_cache(ckpt_dir), ck.load(state)), 1
            )
            ov.close()
            ck.close()
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
            "durable_over_seq_write": r["tg_durable_s"] / r["disk_seq_write_s"],
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
    p.add_argument(
        "--dir", type=Path, default=Path(tempfile.gettempdir()), help="disk to measure on"
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    r = run(a.size_gb, a.repeats, a.dir)
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
            "trainguard restore from memory",
            r["tg_restore_memory_s"],
            r["restore_memory_over_memcpy"],
        ),
    ]
    print(f"state: {gb:.2f} GiB in 16 float32 tensors")
    print(f"{'':52s} {'seconds':>9s} {'× memcpy':>9s}")
    for name, s, ratio in rows:
        print(f"{name:52s} {s:9.3f} {ratio:9.2f}")
    print(f"\n{'until durable':52s} {'seconds':>9s} {'× seq write':>11s}")
    for name, s in (
        ("disk sequential write + fsync", r["disk_seq_write_s"]),
        ("trainguard", r["tg_durable_s"]),
        ("DCP async_save", r["dcp_durable_s"]),
        ("torch.save + fsync", r["torch_save_s"]),
    ):
        print(f"{name:52s} {s:9.3f} {s / r['disk_seq_write_s']:11.2f}")
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
