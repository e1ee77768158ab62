"""Cold tier (object storage) upload and restore: trainguard vs s3fs + DCP, one run.

For one committed durable step of ``--size-mb`` (float32 tensors, 8 of them, written by a
standalone ``Checkpointer``) and a real S3 server (moto's, its own process on loopback; the
same numbers hold against any endpoint given with ``--endpoint``), this measures:

- upload: ``Archive.upload`` (streamed, CRC-32C'd against the manifest on the way,
  ``--concurrency`` files at once, manifest last) vs ``s3fs.put`` of the step directory
  (recursive, no checksums);
- restore into live tensors from the cold tier: ``Archive.fetch`` into an empty local
  directory (ranged reads in flight, checksummed) then ``dcp.load`` from it, vs ``dcp.load``
  straight from S3 through DCP's own ``FsspecReader`` (no checksums);
- memcpy of the same bytes: the floor of any restore.

Each is the median of ``--repeats`` runs. Prints a table and the ratios (``--json``: one
JSON object). Everything it starts (moto) is killed, everything it writes removed.

Not measured here yet (issue 16): incremental steps, compression, standby prefetch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from tests.helpers.s3server import CREDENTIALS, moto_server  # noqa: E402

from trainguard.checkpoint import storage  # noqa: E402
from trainguard.checkpoint.archive import Archive  # noqa: E402
from trainguard.checkpoint.checkpointer import Checkpointer  # noqa: E402


def median_s(
    fn: Callable[[], Any], repeats: int, before: Callable[[], Any] = lambda: None
) -> float:
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def state(size_mb: int) -> dict[str, torch.Tensor]:
    n = size_mb * (1 << 20) // 4 // 8
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(n, generator=g) for i in range(8)}


def measure(endpoint: str, size_mb: int, repeats: int, concurrency: int) -> dict[str, Any]:
    os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
    work = Path(tempfile.mkdtemp(prefix="tg-bench-storage-"))
    try:
        hot = work / "hot"
        live = state(size_mb)
        ck = Checkpointer(hot, durable_every=1, memory_tier=False)
        ck.save(1, live)
        ck.close()
        step = storage.step_dir(hot, 1)
        nbytes = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
        ours = Archive("s3://bench/ours", concurrency=concurrency)
        ours.fs.mkdir("bench")
        fs = ours.fs

        def clear(prefix: str) -> Callable[[], None]:
            return lambda: fs.rm(prefix, recursive=True) if fs.exists(prefix) else None

        up_ours = median_s(lambda: ours.upload(step, 1), repeats, clear("bench/ours"))
        up_s3fs = median_s(
            lambda: fs.put(str(step) + "/", "bench/peer/step_1/", recursive=True),
            repeats,
            clear("bench/peer"),
        )
        if not fs.exists("bench/ours/step_1/manifest.json"):
            ours.upload(step, 1)
        if not fs.exists("bench/peer/step_1"):
            fs.put(str(step) + "/", "bench/peer/step_1/", recursive=True)
        target = {k: torch.empty_like(v) for k, v in live.items()}
        local = work / "restore"

        def ours_restore() -> None:
            shutil.rmtree(local, ignore_errors=True)
            local.mkdir()
            path = ours.fetch(1, local)
            dcp.load(target, checkpoint_id=str(path), no_dist=True)

        def peer_restore() -> None:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            dcp.load(target, storage_reader=FsspecReader("s3://bench/peer/step_1"), no_dist=True)

        restore_ours = median_s(ours_restore, repeats)
        assert all(torch.equal(target[k], live[k]) for k in live), "restore differs"
        restore_peer = median_s(peer_restore, repeats)
        memcpy = median_s(lambda: [target[k].copy_(v) for k, v in live.items()], repeats)
        return {
            "size_mb": round(nbytes / 1e6, 1),
            "concurrency": concurrency,
            "upload_s": {"trainguard": round(up_ours, 3), "s3fs_put": round(up_s3fs, 3)},
            "restore_s": {
                "trainguard": round(restore_ours, 3),
                "s3fs_dcp_load": round(restore_peer, 3),
                "memcpy": round(memcpy, 4),
            },
            "ratios": {
                "upload_vs_s3fs_put": round(up_ours / up_s3fs, 2),
                "restore_vs_s3fs_dcp_load": round(restore_ours / restore_peer, 2),
                "restore_vs_memcpy": round(restore_ours / memcpy, 1),
            },
            "restore_mb_per_s": round(nbytes / 1e6 / restore_ours, 1),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--endpoint", help="an S3 endpoint to use instead of a local moto server")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.endpoint:
        out = measure(args.endpoint, args.size_mb, args.repeats, args.concurrency)
    else:
        with moto_server() as endpoint:
            out = measure(endpoint, args.size_mb, args.repeats, args.concurrency)
    if args.json:
        print(json.dumps(out))
        return
    print(f"cold tier, {out['size_mb']} MB step, moto S3 on loopback, {args.repeats} repeats")
    for what, row in (("upload", out["upload_s"]), ("restore", out["restore_s"])):
        print(f"  {what:8s} " + "  ".join(f"{k} {v:.3f}s" for k, v in row.items()))
    print("  ratios  " + "  ".join(f"{k} {v}" for k, v in out["ratios"].items()))


if __name__ == "__main__":
    main()
