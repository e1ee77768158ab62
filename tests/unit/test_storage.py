import os
from pathlib import Path

from trainguard.checkpoint import storage


def _write_step(root: Path, step: int, payload: bytes) -> Path:
    tmp = storage.tmp_dir(root, step, 0)
    tmp.mkdir(parents=True)
    (tmp / ".metadata").write_bytes(b"meta")
    (tmp / "__0_0.distcp").write_bytes(payload)
    return storage.commit(tmp, root, step)


def test_commit_is_listed_only_when_complete(tmp_path: Path) -> None:
    _write_step(tmp_path, 5, b"x" * 1000)
    torn = storage.tmp_dir(tmp_path, 6, 0)
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")
    assert storage.list_committed(tmp_path) == [5]
    assert storage.verify(tmp_path, 5) == []


def test_flipped_byte_is_caught_and_older_step_used(tmp_path: Path) -> None:
    _write_step(tmp_path, 1, b"a" * 4096)
    final = _write_step(tmp_path, 2, b"b" * 4096)
    with open(final / "__0_0.distcp", "r+b") as f:
        f.seek(100)
        f.write(b"c")
    problems = storage.verify(tmp_path, 2)
    assert problems and "checksum" in problems[0]
    step, skipped = storage.newest_verified(tmp_path)
    assert step == 1 and 2 in skipped


def test_prune_keeps_newest_and_removes_stale_tmp(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4):
        _write_step(tmp_path, s, bytes([s]) * 10)
    stale = storage.tmp_dir(tmp_path, 2, 3)
    stale.mkdir()
    newer = storage.tmp_dir(tmp_path, 9, 3)  # in progress: kept
    newer.mkdir()
    assert storage.prune(tmp_path, 2, committed_step=4, generation=3) == [1, 2]
    assert newer.exists()
    newer.rmdir()
    assert storage.list_committed(tmp_path) == [3, 4]
    assert not stale.exists()
    assert storage.prune(tmp_path, 0) == [3]  # keep < 1 still keeps the newest
    assert os.listdir(tmp_path) == ["step_4"]


def test_a_manifest_of_the_wrong_shape_is_corrupt_not_a_crash(tmp_path: Path) -> None:
    final = _write_step(tmp_path, 3, b"z" * 64)
    for bad in (
        "[1, 2]",
        '{"files": {}}',
        '{"files": {"__0_0.distcp": {"size": 64, "crc32c": 0}}}',
    ):
        (final / "manifest.json").write_text(bad)
        assert storage.verify(tmp_path, 3), bad
