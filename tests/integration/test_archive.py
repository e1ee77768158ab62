"""The cold tier (issue 16) against a real S3 server: moto's standalone server on a loopback
port, started by the fixture as its own process; s3fs speaks real S3 to it. No client call
is mocked. Faults are real too: a killed uploader, a deleted object, a rewritten object, a
closed port."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import (
    FAST_CONFIG,
    ROOT,
    TINY,
    events,
    fault_free_losses,
    finish_job,
    losses,
    reached_step,
    report,
    run_job,
    start_job,
    wait_for,
)
from tests.helpers.s3server import CREDENTIALS, free_port, moto_server
from trainguard.checkpoint import storage
from trainguard.checkpoint.archive import CHUNK, Archive, ArchiveError
from trainguard.checkpoint.archiver import Archiver, restore_newest
from trainguard.checkpoint.checkpointer import Checkpointer


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (its own process, killed at the end); its endpoint."""
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def aws(s3: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Credentials and endpoint in the environment (this process and the jobs it starts)."""
    for k, v in {**CREDENTIALS, "AWS_ENDPOINT_URL": s3}.items():
        monkeypatch.setenv(k, v)
    return s3


def _bucket(name: str) -> Archive:
    a = Archive(f"s3://{name}/job")
    a.fs.mkdir(name)
    return a


def _steps(root: Path, *steps: int, numel: int = 1 << 20) -> dict[int, torch.Tensor]:
    """Committed durable steps in ``root``, written by a standalone Checkpointer."""
    ck = Checkpointer(root, durable_every=1, keep=len(steps))
    written = {}
    for step in steps:
        w = torch.randn(numel, generator=torch.Generator().manual_seed(step))
        ck.save(step, {"w": w, "step": step})
        written[step] = w
    ck.close()
    assert storage.list_committed(root)[-len(steps) :] == list(steps)
    return written


def _data_chunk(a: Archive, step: int) -> str:
    """The address of the first chunk of the step's tensor data (a ``.distcp`` file)."""
    files = a.manifest(step)["archive"]["files"]
    return next(f["chunks"][0] for n, f in sorted(files.items()) if n.endswith(".distcp"))


def _load(step_dir: Path, numel: int = 1 << 20) -> torch.Tensor:
    out = {"w": torch.zeros(numel)}
    dcp.load(out, checkpoint_id=str(step_dir), no_dist=True)
    return out["w"]


def test_archived_steps_restore_bit_for_bit_after_the_hot_tier_is_wiped(
    aws: str, tmp_path: Path
) -> None:
    hot = tmp_path / "ck"
    written = _steps(hot, 1, 2, 3)
    a = _bucket("roundtrip")
    for step in (1, 2, 3):
        done = a.upload(storage.step_dir(hot, step), step)
        assert done["bytes"] > 4 << 20 and done["files"] >= 2 and done["new_bytes"] > 4 << 20
    assert a.list_steps() == [1, 2, 3] and a.verify(3) == []
    assert a.prune(2) == [1] and a.list_steps() == [2, 3]
    shutil.rmtree(hot)
    seen: list[tuple[str, dict[str, object]]] = []
    assert restore_newest([a], hot, lambda k, **d: seen.append((k, d))) == 3
    assert [k for k, _ in seen] == ["archive_restore_started", "archive_restored"]
    assert storage.list_committed(hot) == [3] and storage.verify(hot, 3) == []
    assert torch.equal(_load(storage.step_dir(hot, 3)), written[3])  # plain dcp.load reads it
    # The hot tier already holds the newest: nothing is copied again.
    assert restore_newest([a], hot, lambda k, **d: seen.append((k, d))) is None


def test_a_killed_upload_is_never_listed_and_the_previous_step_restores(
    aws: str, tmp_path: Path
) -> None:
    hot = tmp_path / "ck"
    written = _steps(hot, 1, 2, numel=4 << 20)  # 16 MiB a step
    a = _bucket("halfway")
    a.upload(storage.step_dir(hot, 1), 1)
    # Step 2 uploaded at 2 MB/s by another process, SIGKILLed once part of it is there.
    code = (
        "import sys; from pathlib import Path\n"
        "from trainguard.checkpoint.archive import Archive\n"
        "a = Archive('s3://halfway/job', mbps=2.0, concurrency=1)\n"
        "print('go', flush=True); a.upload(Path(sys.argv[1]), 2)\n"
    )
    up = subprocess.Popen(
        [sys.executable, "-c", code, str(storage.step_dir(hot, 2))],
        stdout=subprocess.PIPE, text=True, env=os.environ.copy(),
    )  # fmt: skip
    try:
        assert up.stdout is not None and up.stdout.readline().strip() == "go"
        before = len(a.fs.find("halfway/job/chunks"))
        wait_for(
            lambda: len(a.fs.find("halfway/job/chunks")) > before, 60, "part of step 2 uploaded"
        )
        up.send_signal(signal.SIGKILL)
    finally:
        up.kill()
        up.wait(timeout=30)
    assert not a.fs.exists("halfway/job/step_2/manifest.json")
    assert a.list_steps() == [1]
    assert a.sweep() >= 1  # the killed upload's orphan chunks; step 1's stay
    assert a.verify(1) == []
    shutil.rmtree(hot)
    assert restore_newest([a], hot, lambda k, **d: None) == 1
    assert torch.equal(_load(storage.step_dir(hot, 1), 4 << 20), written[1])


def test_a_deleted_or_rewritten_archived_file_is_refused_and_an_older_step_restores(
    aws: str, tmp_path: Path
) -> None:
    hot = tmp_path / "ck"
    written = _steps(hot, 1, 2, 3)
    a = _bucket("damaged")
    for step in (1, 2, 3):
        a.upload(storage.step_dir(hot, step), step)
    a.fs.rm_file(a.chunk_path(_data_chunk(a, 3)))  # a deleted object
    flip = a.chunk_path(_data_chunk(a, 2))
    blob = bytearray(a.fs.cat_file(flip))
    blob[len(blob) // 2] ^= 0x10  # one flipped bit, same size
    a.fs.pipe_file(flip, bytes(blob))
    assert any("missing" in p for p in a.verify(3))
    assert any("checksum" in p for p in a.verify(2))
    with pytest.raises(ArchiveError, match="is missing"):
        a.fetch(3, tmp_path / "elsewhere")
    shutil.rmtree(hot)
    seen: list[tuple[str, dict[str, object]]] = []
    assert restore_newest([a], hot, lambda k, **d: seen.append((k, d))) == 1
    corrupt = [d["step"] for k, d in seen if k == "checkpoint_corrupt"]
    assert corrupt == [3, 2] and all(
        d["tier"] == "archive" for k, d in seen if k == "checkpoint_corrupt"
    )
    assert storage.list_committed(hot) == [1] and not list(hot.glob(".tmp-*"))
    assert torch.equal(_load(storage.step_dir(hot, 1)), written[1])


def test_a_damaged_copy_is_replaced_by_another_targets_copy_of_the_same_step(
    aws: str, tmp_path: Path
) -> None:
    """Two targets (buckets in separate failure domains) hold step 2; the first's copy lost a
    chunk: the restore takes the same step from the second, not an older step."""
    hot = tmp_path / "ck"
    written = _steps(hot, 1, 2)
    zones = [_bucket("zone-a"), _bucket("zone-b")]
    for a in zones:
        for step in (1, 2):
            a.upload(storage.step_dir(hot, step), step)
    zones[0].fs.rm_file(zones[0].chunk_path(_data_chunk(zones[0], 2)))
    shutil.rmtree(hot)
    seen: list[tuple[str, dict[str, object]]] = []
    assert restore_newest(zones, hot, lambda k, **d: seen.append((k, d))) == 2
    bad = [d for k, d in seen if k == "checkpoint_corrupt"]
    assert [(d["step"], d["url"]) for d in bad] == [(2, "s3://zone-a/job")], bad
    assert next(d["url"] for k, d in seen if k == "archive_restored") == "s3://zone-b/job"
    assert torch.equal(_load(storage.step_dir(hot, 2)), written[2])


def test_an_unreachable_tier_is_an_event_with_the_fix_and_training_state_is_untouched(
    aws: str, tmp_path: Path
) -> None:
    hot = tmp_path / "ck"
    _steps(hot, 1)
    closed = f"http://127.0.0.1:{free_port()}"
    seen: list[tuple[str, dict[str, object]]] = []
    dead = Archive("s3://nowhere/job", endpoint_url=closed, retries=1)
    arch = Archiver(dead, hot, every=0, keep=2, emit=lambda k, **d: seen.append((k, d)), poll_s=0.1)
    arch.start()
    try:
        wait_for(
            lambda: any(k == "archive_failed" for k, _ in seen), 120, "an archive_failed event"
        )
    finally:
        arch.close(timeout_s=5)
    reason = next(str(d["reason"]) for k, d in seen if k == "archive_failed")
    assert closed in reason or "nowhere" in reason, reason
    assert "check archive_url" in reason and "\n" not in reason, reason
    assert storage.list_committed(hot) == [1] and storage.verify(hot, 1) == []
    assert restore_newest([dead], tmp_path / "other", lambda k, **d: seen.append((k, d))) is None
    missing = Archive("s3://no-such-bucket/job", retries=1)  # reachable server, wrong bucket
    with pytest.raises(ArchiveError, match="no-such-bucket"):
        missing.upload(storage.step_dir(hot, 1), 1)


def test_two_targets_archive_the_same_steps_at_once(tmp_path: Path) -> None:
    """One archiver per target (two ``file://`` tiers), both picking up each new durable step
    at the same moment: each stages its own hard-linked copy. CI's slow run lost the final
    step of both targets when they shared one staging directory (one re-staged it while the
    other read it, the first to finish removed it); this loop failed 19 of 56 uploads so."""
    hot = tmp_path / "ck"
    ck = Checkpointer(hot, durable_every=1, keep=2)
    ck.save(1, {"w": torch.randn(1000)})
    ck.wait()
    seen: list[tuple[str, dict[str, object]]] = []
    targets = [Archive(f"file://{tmp_path}/tier{i}") for i in range(2)]
    archs = [
        Archiver(a, hot, every=0, keep=2, emit=lambda k, **d: seen.append((k, d)), poll_s=0.01)
        for a in targets
    ]
    (hot / ".archiving-00000000-step_1").mkdir()  # another target's leftover: not ours
    for arch in archs:
        arch.start()
    try:
        for step in range(2, 14):
            ck.save(step, {"w": torch.full((100_000,), float(step))})
            ck.wait()
            time.sleep(0.2)
        ck.close()
    finally:
        for arch in archs:
            arch.close(timeout_s=60)
    assert not [d for k, d in seen if k == "archive_failed"], seen
    for a in targets:
        assert a.list_steps()[-1] == 13 and a.verify(13) == []
    assert [p.name for p in hot.glob(".archiving-*")] == [".archiving-00000000-step_1"]


def test_a_bad_archive_url_is_refused_before_the_job_starts(tmp_path: Path) -> None:
    cfg = tmp_path / "job.toml"
    cfg.write_text(FAST_CONFIG + 'archive_url = "nosuch://bucket/x"\n')
    res = subprocess.run(
        [sys.executable, "-m", "trainguard", "run", "--run-dir", str(tmp_path / "run"),
         "--config", str(cfg), str(ROOT / "examples" / "gpt" / "train.py")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "unknown storage scheme 'nosuch'" in line and "s3://bucket/prefix" in line, line


def test_an_incremental_step_uploads_what_changed_and_restores_after_its_base_is_deleted(
    aws: str, tmp_path: Path
) -> None:
    """A frozen backbone and a trained head (3% of the bytes): the second step uploads the
    head and at most a chunk on each side of it; deleting the first step (and sweeping its
    chunks) leaves the second restorable bit for bit."""
    hot = tmp_path / "ck"
    ck = Checkpointer(hot, durable_every=1, keep=3)
    g = torch.Generator().manual_seed(0)
    state = {
        "backbone": torch.randn(32 << 20, generator=g),
        "head": torch.randn(1 << 20, generator=g),
    }
    ck.save(1, state)
    state["head"] = state["head"] + 0.01  # only the head trained
    ck.save(2, state)
    ck.close()
    a = Archive("s3://incremental/job", compress="off")
    a.fs.mkdir("incremental")
    first = a.upload(storage.step_dir(hot, 1), 1)
    second = a.upload(storage.step_dir(hot, 2), 2)
    assert first["new_bytes"] >= first["bytes"] - (16 << 20)  # everything, less repeats
    head = state["head"].numel() * 4
    assert second["new_bytes"] <= head + 2 * CHUNK + (1 << 20), second
    assert second["new_bytes"] <= 0.16 * second["bytes"], second
    assert a.prune(1) == [1] and a.list_steps() == [2]
    shutil.rmtree(hot)
    path = a.fetch(2, hot)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    assert all(torch.equal(out[k], state[k]) for k in state)


@pytest.mark.parametrize("mode", ["zstd+shuf2", "auto"])
def test_compressed_chunks_restore_bit_for_bit(aws: str, tmp_path: Path, mode: str) -> None:
    """bf16 state: forced shuffle+zstd stores less than the raw bytes; auto stores the first
    step raw (nothing measured yet) and decides the next from its measurements. Either way
    the restore is bit for bit."""
    hot = tmp_path / "ck"
    ck = Checkpointer(hot, durable_every=1, keep=3)
    states = {}
    for step in (1, 2):
        g = torch.Generator().manual_seed(step)
        states[step] = {"w": torch.randn(8 << 20, generator=g).to(torch.bfloat16)}
        ck.save(step, states[step])
    ck.close()
    a = Archive(f"s3://compress-{mode.replace('+', '-')}/job", compress=mode)
    a.fs.mkdir(a.base.split("/")[0])
    done = [a.upload(storage.step_dir(hot, step), step) for step in (1, 2)]
    if mode == "auto":
        assert done[0]["mode"] == "raw" and a.chooser.link_bps and a.chooser.sample
    else:
        assert all(d["stored_bytes"] < 0.8 * d["new_bytes"] for d in done), done
    for step in (1, 2):
        path = a.fetch(step, tmp_path / f"restore{step}")
        out = {"w": torch.zeros(8 << 20, dtype=torch.bfloat16)}
        dcp.load(out, checkpoint_id=str(path), no_dist=True)
        assert torch.equal(out["w"], states[step]["w"])


ARGS = [*TINY, "--steps", "60", "--durable-every", "10"]


@pytest.mark.slow  # three runs of the example (CI's slow run)
def test_a_stopped_job_resumes_from_the_cold_tier_on_an_empty_disk_with_the_same_losses(
    aws: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A job archives to S3 while it trains; it is stopped (SIGTERM, as a preemption), its
    final step reaches the cold tier on the way out; the local disk is then wiped (a new
    machine) and the same job run again: it restores from S3 and ends with the losses of a
    run that was never interrupted, step for step."""
    reference = fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)
    _bucket("job")
    _bucket("job-zone-b")
    config = FAST_CONFIG + (
        'archive_url = ["s3://job/run", "s3://job-zone-b/run"]\narchive_copies = 2\n'
        "archive_every = 20\narchive_keep = 2\n"
    )
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2"], ARGS, config=config)
    try:
        wait_for(lambda: reached_step(run, 35), 180, "step 35")
        proc.send_signal(signal.SIGTERM)
        code, err = finish_job(proc, timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 128 + signal.SIGTERM, err[-3000:]
    evs = events(run)
    saved = next(e["saved_step"] for e in evs if e["kind"] == "planned_stop")
    for url in ("s3://job/run", "s3://job-zone-b/run"):
        uploaded = [e["step"] for e in evs if e["kind"] == "archive_uploaded" and e["url"] == url]
        assert uploaded and uploaded[-1] == saved >= 35, (url, uploaded, saved)
    durable = [e["step"] for e in evs if e["kind"] == "archive_durable"]
    assert durable[-1] == saved and len(durable) == len(set(durable)), durable
    assert Archive("s3://job/run").list_steps()[-1] == saved
    shutil.rmtree(run / "checkpoints")
    res = run_job(run, ["--nodes", "2"], ARGS, config=config, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    evs = events(run)
    assert [e["step"] for e in evs if e["kind"] == "archive_restored"] == [saved]
    assert losses(run) == reference
    arc = report(run)["archive"]
    assert arc["restored"] == [saved] and arc["newest_durable"] == 60 and arc["failures"] == 0, arc
    assert 0 < arc["sent_bytes"] <= arc["step_bytes"] + 1024, arc


@pytest.mark.slow  # CI's slow run (the default run stays under 15 min)
def test_ckpt_ls_verify_and_export_cover_the_archive_tier(aws: str, tmp_path: Path) -> None:
    """``trainguard ckpt`` on a run with a cold tier: ``ls`` lists the archive's steps,
    ``export`` writes a step only the archive holds, ``verify`` reads the archive back and
    fails on a damaged object."""
    import json

    from trainguard.controller.store import Store

    run, hot = tmp_path / "run", tmp_path / "run" / "checkpoints"
    written = _steps(hot, 1, 2)
    a = _bucket("cli")
    for step in (1, 2):
        a.upload(storage.step_dir(hot, step), step)
    shutil.rmtree(storage.step_dir(hot, 1))  # hot retention dropped it; the archive keeps it
    store = Store(run)
    store.put("config", {"archive_url": "s3://cli/job", "checkpoint_dir": str(hot)})
    store.close()

    def ckpt(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "trainguard", "ckpt", *args, "--run-dir", str(run)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    rows = json.loads(ckpt("ls", "--json").stdout)
    assert sorted((r["step"], r["tier"]) for r in rows) == [
        (1, "archive"), (2, "archive"), (2, "durable"),
    ]  # fmt: skip
    out = tmp_path / "step1.pt"
    res = ckpt("export", "--step", "1", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert torch.equal(torch.load(out, weights_only=False)["w"], written[1])
    assert ckpt("verify").returncode == 0
    name = a.chunk_path(_data_chunk(a, 1))
    blob = bytearray(a.fs.cat_file(name))
    blob[-1] ^= 1
    a.fs.pipe_file(name, bytes(blob))
    res = ckpt("verify", "--json")
    assert res.returncode == 1
    bad = [r for r in json.loads(res.stdout) if r["state"] == "corrupt"]
    assert [(r["step"], r["tier"]) for r in bad] == [(1, "archive")], bad


def test_a_file_archive_makes_its_directories_and_refuses_a_damaged_or_escaping_manifest(
    tmp_path: Path,
) -> None:
    """A ``file://`` target that does not exist yet is made as chunks arrive. A manifest that
    is not one (``[]``) or whose file names leave the step (``../``) is refused with an
    event, and the restore takes the newest good step; nothing is written outside the hot
    tier."""
    import json

    hot = tmp_path / "ck"
    written = _steps(hot, 1, 2, 3)
    a = Archive(f"file://{tmp_path}/no/such/dir/yet")
    for step in (1, 2, 3):
        a.upload(storage.step_dir(hot, step), step)
    assert a.list_steps() == [1, 2, 3] and a.verify(3) == []
    base = tmp_path / "no" / "such" / "dir" / "yet"
    (base / "step_3" / "manifest.json").write_text("[]")
    m = json.loads((base / "step_2" / "manifest.json").read_text())
    m["archive"]["files"]["../../escape.txt"] = next(iter(m["archive"]["files"].values()))
    (base / "step_2" / "manifest.json").write_text(json.dumps(m))
    assert any("no valid manifest" in p for p in a.verify(3))
    shutil.rmtree(hot)
    seen: list[tuple[str, dict[str, object]]] = []
    assert restore_newest([a], hot, lambda k, **d: seen.append((k, d))) == 1
    bad = {d["step"]: d["problems"][0] for k, d in seen if k == "checkpoint_corrupt"}
    assert set(bad) == {3, 2} and "leaves the step" in str(bad[2]), bad
    assert not (tmp_path / "escape.txt").exists() and not (hot.parent / "escape.txt").exists()
    assert torch.equal(_load(storage.step_dir(hot, 1)), written[1])
