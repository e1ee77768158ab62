"""The checkpoint benchmarks' ``--smoke`` sizes run in CI's default run (issue 29): each prints the
keys its issue names, every figure is a finite number, and its README rows render. The figures
themselves come from the full sizes (``--record``), not from here."""

from __future__ import annotations

import os

import pytest

from tests.helpers.bench import smoke


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a private tmpfs for the slots (root)")
def test_the_checkpoint_benchmark_smoke_run_prints_its_keys() -> None:
    r = smoke("checkpoint", timeout=300)
    for key in (
        "save_blocking_over_memcpy", "save_blocking_overlapped_over_memcpy",
        "save_overlapped_with_optimizer_over_memcpy", "restore_memory_over_memcpy",
        "restore_memory_verified_in_worker_over_memcpy", "durable_over_seq_write",
        "durable_over_dcp_durable", "dcp_async_blocking_over_memcpy", "dcp_durable_over_seq_write",
        "torch_save_over_memcpy", "rss_growth_bytes_50_saves", "tg_restore_durable_s",
        "dcp_load_s", "torch_load_s",
    ):  # fmt: skip
        assert key in r, key
    ov = r["overlap_with_optimizer"]
    assert "AdamW" in ov["state"] and ov["stall_s"] > 0 and ov["memcpy_s"] > 0
    assert len(r["durable_over_seq_write_rounds"]) == 2


@pytest.mark.slow  # CI's slow run (the default run stays under 15 min)
def test_the_fsdp_checkpoint_benchmark_smoke_run_prints_its_keys() -> None:
    r = smoke("checkpoint_sharded", timeout=300)
    ratios = r["fsdp"]["ratios"]
    for key in ("stall_over_memcpy", "restore_verified_over_memcpy", "tg_durable_over_dcp_durable"):
        assert ratios[key] > 0, key
    assert "fully_shard" in r["fsdp"]["state"] and "AdamW" in r["fsdp"]["state"]
    assert r["small"]["tensors"] == 1000 and r["small"]["stall_over_copy_loop"] > 0


def test_the_storage_benchmark_smoke_run_prints_its_keys() -> None:
    r = smoke("storage", timeout=300)
    for key in (
        "prefetched_restore_vs_memcpy", "prefetched_restore_checked_while_read_vs_memcpy",
        "prefetch_check_at_restart_s", "upload_s", "restore_s", "incremental", "compression",
    ):  # fmt: skip
        assert key in r, key
    assert set(r["ratios"]) == {
        "upload_vs_s3fs_put",
        "restore_vs_s3fs_dcp_load",
        "restore_vs_memcpy",
    }


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a private tmpfs for the slots (root)")
def test_the_dcp_storage_benchmark_smoke_run_prints_its_keys() -> None:
    r = smoke("dcp_storage", timeout=300)
    for key in (
        "dcp_async_stall_over_checkpointer", "dcp_restore_over_checkpointer",
        "dcp_async_stall_over_memcpy", "dcp_sync_stall_over_memcpy",
        "dcp_default_async_stall_over_memcpy", "checkpointer_stall_over_memcpy",
    ):  # fmt: skip
        assert r[key] > 0, key
    assert r["reader_tiers"] == ["memory"]  # every timed dcp.load was served from memory
    # trainguard's own part of each DCP call is timed inside it: a part of the whole
    for part, whole in (("dcp_async_stage_s", "dcp_async_stall_s"),
                        ("dcp_restore_read_s", "dcp_restore_s")):  # fmt: skip
        assert all(0 < a < b for a, b in zip(r["rounds"][part], r["rounds"][whole], strict=True))
    assert r["dcp_async_outside_stage_ms"] > 0 and r["dcp_restore_outside_read_ms"] > 0
    assert "AdamW" in r["state"] and len(r["rounds"]["dcp_restore_s"]) == 2
