"""Cold tier (object storage): trainguard vs s3fs + DCP, side by side in one run.

For one committed durable step of ``--size-mb`` (float32 tensors, 8 of them, written by a
standalone ``Checkpointer``) and a real S3 server (moto's, its own process on loopback; or
any endpoint given with ``--endpoint``), this measures:

- full upload: ``Archive.upload`` (chunked, content-addressed, CRC-32C'd, manifest last;
  compression off) vs ``s3fs.put`` of the plain DCP step directory;
- incremental upload: the next step of a frozen-backbone fine-tune (``--changed`` of the
  bytes differ): bytes sent and time, against the full DCP upload of that step;
- restore into live tensors: ``Archive.fetch`` into an empty local directory (chunks read
  ``--concurrency`` at once, each checked) then ``dcp.load`` from it, vs ``dcp.load``
  straight from S3 through DCP's own ``FsspecReader`` (no checksums); memcpy as the floor;
- restore of a standby's prefetched copy (in /dev/shm) against memcpy: after its agent checked
  it whole for the restart (the check timed apart), and checked while read;
- compression on the GPT example's real state (model, AdamW moments after a few steps of
  training, fp32 and bf16): stored/raw ratio and single-core throughput of each codec mode.

Each time is the median of ``--repeats`` runs. Prints a table and the ratios (``--json``: one
JSON object). Everything it starts (moto) is killed, everything it writes removed.
"""

from __future__ import annotations

import argparse
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

from common import Row, add_common, finish, verdict  # noqa: E402  (beside this file)
from tests.helpers.s3server import CREDENTIALS, moto_server  # noqa: E402

from trainguard import Checkpointer  # noqa: E402
from trainguard.checkpoint import codec, prefetch, storage  # noqa: E402
from trainguard.checkpoint.archive import Archive  # noqa: E402


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


def incremental(
    live: dict[str, torch.Tensor], work: Path, ours: Archive, changed: float, repeats: int
) -> dict[str, Any]:
    """Step 2 of a frozen-backbone fine-tune: the last ``changed`` of the tensors' elements
    trained. Bytes sent and time of trainguard's incremental upload (step 1 already there)
    against s3fs putting step 2's plain DCP directory."""
    nxt = {k: v.clone() for k, v in live.items()}
    keys = sorted(nxt)
    for k in keys[int(len(keys) * (1 - changed)) :]:
        nxt[k].add_(0.01)  # the trained head's tensors
    hot = work / "hot"
    ck = Checkpointer(hot, durable_every=1, memory_tier=False, keep=3)
    ck.save(2, nxt)
    ck.close()
    step = storage.step_dir(hot, 2)
    fs = ours.fs
    sizes: list[dict[str, Any]] = []

    def drop_step2() -> None:
        ours.delete(2)
        ours.sweep()  # step 2's own chunks go; step 1's stay

    t_inc = median_s(lambda: sizes.append(ours.upload(step, 2)), repeats, drop_step2)
    t_full = median_s(
        lambda: fs.put(str(step) + "/", "bench/peer/step_2/", recursive=True),
        repeats,
        lambda: (
            fs.rm("bench/peer/step_2", recursive=True) if fs.exists("bench/peer/step_2") else None
        ),
    )
    full = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    sent = statistics.median(d["stored_bytes"] for d in sizes)
    return {
        "changed": changed,
        "bytes": {"trainguard": int(sent), "full_dcp": full},
        "seconds": {"trainguard": round(t_inc, 3), "full_dcp_put": round(t_full, 3)},
        "ratios": {"bytes": round(sent / full, 3), "time": round(t_inc / t_full, 3)},
    }


def prefetched_restore(live: dict[str, torch.Tensor], hot: Path, repeats: int) -> dict[str, float]:
    """A standby's restore of the step it prefetched (``prefetch.copy_step`` into /dev/shm),
    the rank's path in ``Checkpointer.load`` (``prefetch.restore``): ``restore_s`` after its
    agent checked the copy whole for this restart (``prefetch.verify_for_restart``,
    ``check_s``, which runs while the workers start), read without checksums;
    ``checked_while_read_s`` when the rank got there first and checks each file's CRC-32C as
    it reads. Medians, seconds."""
    dest = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tg-bench-prefetch-"))
    try:
        prefetch.copy_step(hot, dest, 1)
        target = {k: torch.zeros_like(v) for k, v in live.items()}  # live tensors (model init)
        gen = storage.committed_generation(dest, 1)

        def load(how: str) -> None:
            assert prefetch.restore(target, dest, 1, gen) == how, "not read as planned"

        (dest / "verified.json").unlink(missing_ok=True)
        while_read = median_s(lambda: load("while read"), repeats)
        check = median_s(lambda: prefetch.verify_for_restart(dest, 0), repeats)
        restore = median_s(lambda: load("at the restart"), repeats)
        assert all(torch.equal(target[k], live[k]) for k in live), "prefetched restore differs"
        return {"restore_s": restore, "check_s": check, "checked_while_read_s": while_read}
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def gpt_state(dtype: torch.dtype) -> bytes:
    """The GPT example's model and AdamW state after 5 steps on its corpus, as bytes."""
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from data import load_corpus  # type: ignore[import-not-found]
    from model import GPT, GPTConfig  # type: ignore[import-not-found]

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = load_corpus(None, 1 << 20).long()
    for i in range(5):
        idx = torch.stack([data[j : j + 64] for j in range(i * 8, i * 8 + 8)])
        tgt = torch.stack([data[j + 1 : j + 65] for j in range(i * 8, i * 8 + 8)])
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    tensors = list(model.state_dict().values())
    tensors += [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    return b"".join(
        t.detach().to(dtype).contiguous().view(torch.uint8).numpy().tobytes() for t in tensors
    )


def compression() -> dict[str, Any]:
    """Stored/raw ratio and single-core MB/s of each mode on the GPT example's state."""
    out: dict[str, Any] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        raw = gpt_state(dtype)
        chunks = [raw[i : i + codec.CHUNK_SAMPLE] for i in range(0, len(raw), codec.CHUNK_SAMPLE)]
        c = codec.Chooser()
        c.measure(chunks)
        out[name] = {
            "mb": round(len(raw) / 1e6, 1),
            **{
                m.name.lower(): {"ratio": round(r, 3), "mb_per_s": round(v / 1e6)}
                for m, (r, v) in c.sample.items()
            },
        }
    return out


def measure(
    endpoint: str, size_mb: int, repeats: int, concurrency: int, changed: float
) -> dict[str, Any]:
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
        archive = {"ours": Archive("s3://bench/ours", concurrency=concurrency, compress="off")}
        archive["ours"].fs.mkdir("bench")
        fs = archive["ours"].fs

        def clear(prefix: str) -> Callable[[], None]:
            def run() -> None:
                if fs.exists(prefix):
                    fs.rm(prefix, recursive=True)
                # deleted behind its back: a new Archive lists the tier again (a new job's)
                archive["ours"] = Archive(
                    "s3://bench/ours", concurrency=concurrency, compress="off"
                )

            return run

        up_ours = median_s(lambda: archive["ours"].upload(step, 1), repeats, clear("bench/ours"))
        ours = archive["ours"]
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
        inc = incremental(live, work, ours, changed, repeats)
        pre = prefetched_restore(live, hot, repeats)
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
            "prefetched_restore_s": round(pre["restore_s"], 4),
            "prefetched_restore_vs_memcpy": round(pre["restore_s"] / memcpy, 2),
            "prefetch_check_at_restart_s": round(pre["check_s"], 4),
            "prefetched_restore_checked_while_read_s": round(pre["checked_while_read_s"], 4),
            "prefetched_restore_checked_while_read_vs_memcpy": round(
                pre["checked_while_read_s"] / memcpy, 2
            ),
            "incremental": inc,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table_rows(out: dict[str, Any]) -> list[Row]:
    """The README's rows (``benchmarks/table.py``)."""
    q, inc = out["ratios"], out["incremental"]
    mb = f"{out['size_mb']} MB step of 8 float32 tensors"
    return [
        Row(
            what=f"restore of a standby's prefetched copy ({mb}, in /dev/shm, checked at the "
            "restart)",
            result=f"{out['prefetched_restore_vs_memcpy']:.2f}× memcpy; checked while read "
            f"{out['prefetched_restore_checked_while_read_vs_memcpy']:.2f}×",
            target=verdict(
                out["prefetched_restore_vs_memcpy"],
                1.2,
                "× memcpy",
                "files of the DCP layout read through the filesystem against one memcpy"
                + (f"; load {out['load_1min']:.1f}" if out["load_1min"] > 2 else ""),
            ),
        ),  # fmt: skip
        Row(
            what=f"cold tier (moto S3 on loopback), {mb}",
            result=f"upload {q['upload_vs_s3fs_put']:.2f}× s3fs put, restore "
            f"{q['restore_vs_s3fs_dcp_load']:.2f}× s3fs + dcp.load; incremental step "
            f"({inc['changed']:.0%} changed) sends {inc['ratios']['bytes']:.2f}× the bytes",
            target="—",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--changed", type=float, default=0.1, help="incremental: share trained")
    ap.add_argument("--endpoint", help="an S3 endpoint to use instead of a local moto server")
    add_common(ap, smoke="a 4 MB step, one repeat (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size_mb, args.repeats = 4, 1
    torch.set_num_threads(1)
    run = (args.size_mb, args.repeats, args.concurrency, args.changed)
    if args.endpoint:
        out = measure(args.endpoint, *run)
    else:
        with moto_server() as endpoint:
            out = measure(endpoint, *run)
    out["load_1min"] = os.getloadavg()[0]
    out["compression"] = compression()
    finish("storage", args, out, argv)
    if args.json:
        return 0
    print(f"cold tier, {out['size_mb']} MB step, moto S3 on loopback, {args.repeats} repeats")
    for what, row in (("upload", out["upload_s"]), ("restore", out["restore_s"])):
        print(f"  {what:8s} " + "  ".join(f"{k} {v:.3f}s" for k, v in row.items()))
    print("  ratios  " + "  ".join(f"{k} {v}" for k, v in out["ratios"].items()))
    print(f"  restore of a standby's prefetched copy {out['prefetched_restore_s']:.3f}s, "
          f"{out['prefetched_restore_vs_memcpy']}x memcpy (its agent checked it at the restart "
          f"in {out['prefetch_check_at_restart_s']:.3f}s); checked while read "
          f"{out['prefetched_restore_checked_while_read_s']:.3f}s, "
          f"{out['prefetched_restore_checked_while_read_vs_memcpy']}x")  # fmt: skip
    inc = out["incremental"]
    print(f"  incremental ({inc['changed']:.0%} changed): bytes {inc['bytes']}, "
          f"seconds {inc['seconds']}, ratios {inc['ratios']}")  # fmt: skip
    for dt, row in out["compression"].items():
        print(f"  compression {dt} ({row['mb']} MB): {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
