"""Edges of the checkpoint engine found by trying to break it: standalone Checkpointers in
this process (persister threads, real slot files, real DCP directories)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import snapshot, storage
from trainguard.checkpoint.api import CheckpointError
from trainguard.checkpoint.checkpointer import Checkpointer


@pytest.fixture(autouse=True)
def private_shm(tmp_path: Path) -> Iterator[None]:
    shm = tmp_path / "shm"
    shm.mkdir()
    old = os.environ.get("TRAINGUARD_SHM_DIR")
    os.environ["TRAINGUARD_SHM_DIR"] = str(shm)
    yield
    if old is None:
        os.environ.pop("TRAINGUARD_SHM_DIR", None)
    else:
        os.environ["TRAINGUARD_SHM_DIR"] = old


def _save(root: Path, steps: range, make: object) -> None:
    ck = Checkpointer(root, durable_every=1)
    for step in steps:
        ck.save(step, make(step))  # type: ignore[operator]
    ck.close()


def test_int_keys_round_trip_as_int_keys(tmp_path: Path) -> None:
    def make(step: int) -> dict[str, object]:
        return {"history": {1: 0.9 * step, 5: "five"}, "w": {7: torch.full((3,), float(step))}}

    _save(tmp_path / "ck", range(1, 3), make)
    state: dict[str, object] = {"history": {}, "w": {7: torch.zeros(3)}}
    assert Checkpointer(tmp_path / "ck").load(state) == 2
    assert state["history"] == {1: 1.8, 5: "five"}  # int keys stay int keys
    assert torch.equal(state["w"][7], torch.full((3,), 2.0))  # type: ignore[index]


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        ({"m": {"a": {"b": torch.ones(2)}, "a.b": torch.zeros(2)}}, "same key m.a.b"),
        ({"h": {2.5: 1}}, "a key of type float"),
    ],
)
def test_states_no_checkpoint_can_restore_are_refused_at_save(
    tmp_path: Path, state: dict[str, object], needle: str
) -> None:
    ck = Checkpointer(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=needle):
        ck.save(1, state)
    with pytest.raises(ValueError, match="steps are >= 0"):
        ck.save(-1, {"w": torch.ones(1)})
    ck.close()


def test_a_step_saved_again_after_resuming_past_a_corrupt_copy_replaces_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ck"
    _save(root, range(1, 4), lambda s: {"w": torch.full((4,), float(s))})
    part = next((root / "step_3").rglob("*.distcp"))
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))  # step 3 on disk is now corrupt
    state = {"w": torch.zeros(4)}
    ck = Checkpointer(root, durable_every=1)
    assert ck.load(state) == 2  # the corrupt step is skipped
    state["w"].fill_(33.0)
    ck.save(3, state)  # the same step number again, from the resumed run
    ck.close()
    assert storage.verify(root, 3) == []
    again = {"w": torch.zeros(4)}
    assert Checkpointer(root).load(again) == 3 and torch.equal(again["w"], torch.full((4,), 33.0))
    assert not list(root.glob(".tmp-step_*")) and not list(root.glob(".replaced-*"))


def test_a_state_with_a_key_the_checkpoint_lacks_is_one_checkpoint_error(tmp_path: Path) -> None:
    _save(tmp_path / "ck", range(1, 2), lambda s: {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="does not fit this state"):
        Checkpointer(tmp_path / "ck").load({"w": torch.zeros(2), "extra": torch.zeros(1)})


def test_skipped_snapshots_are_bounded_said_and_waiting_for_a_slot_is_not_a_skip(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 13, property 8: while every slot is held (another process holds the shared
    lock the persister takes while it persists, as on a disk slower than the steps), at most
    ``max_skipped`` snapshots in a row are skipped, said once on stderr; the next save waits
    for a slot, so a memory restore never loses more than max_skipped + 1 steps."""
    import subprocess
    import sys
    import time

    ck = Checkpointer(tmp_path / "ck", durable_every=0, max_skipped=2)
    state = {"w": torch.zeros(1000)}
    for step in range(1, snapshot.SLOTS + 1):
        ck.save(step, state)  # every slot now holds a snapshot
    ck.wait_staged()
    assert ck._pool is not None
    slots = [s.path for s in ck._pool.slots]
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, sys, time\n"
         "fs = [open(p, 'rb') for p in sys.argv[1:]]\n"
         "[fcntl.flock(f, fcntl.LOCK_SH) for f in fs]\n"
         "print('held', flush=True); time.sleep(3)",
         *map(str, slots)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        s = snapshot.SLOTS
        ck.save(s + 1, state)  # skipped
        ck.save(s + 2, state)  # skipped
        assert time.monotonic() - t0 < 1.0
        ck.save(s + 3, state)  # the bound: waits until a slot is free
        waited = time.monotonic() - t0
        ck.wait_staged()
    finally:
        holder.wait(timeout=30)
    assert waited >= 2.0, waited
    held = [snapshot_step(p) for p in slots]
    assert s + 3 in held and s + 1 not in held and s + 2 not in held, held
    err = capfd.readouterr().err
    assert err.count(f"skipped the snapshot of step {s + 1}") == 1
    assert f"step {s + 2}" not in err
    ck.close()


def snapshot_step(path: Path) -> int | None:
    h = snapshot.peek_header(path)
    return None if h is None else int(h["step"])


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _flip_middle(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


def _data_file(step_dir: Path) -> Path:
    return next(step_dir.rglob("*.distcp"))


@pytest.mark.parametrize(
    ("what", "damage"),
    [
        ("a truncated part", lambda d: _truncate(_data_file(d))),
        ("a bit-flipped part", lambda d: _flip_middle(_data_file(d))),
        ("a truncated .metadata", lambda d: _truncate(d / ".metadata")),
        ("a bit-flipped .metadata", lambda d: _flip_middle(d / ".metadata")),
        ("a truncated manifest", lambda d: _truncate(d / "manifest.json")),
        ("a manifest of garbage", lambda d: (d / "manifest.json").write_bytes(os.urandom(64))),
        ("a deleted part", lambda d: _data_file(d).unlink()),
    ],
)
def test_a_damaged_newest_step_is_refused_and_the_one_before_restores(
    tmp_path: Path, what: str, damage: object
) -> None:
    """Issue 30, item 3: each kind of damage to the newest durable step's files. ``verify``
    names it, a standalone restore falls back to the step before with its exact bytes, and
    the step before is untouched (nothing committed is lost)."""
    root = tmp_path / "ck"
    _save(root, range(1, 3), lambda step: {"w": torch.full((1 << 16,), float(step)), "n": step})
    before = storage.verify(root, 1)
    damage(storage.step_dir(root, 2))  # type: ignore[operator]
    assert storage.verify(root, 2), what  # the damage is seen
    state: dict[str, object] = {"w": torch.zeros(1 << 16), "n": 0}
    ck = Checkpointer(root)
    assert ck.load(state) == 1, what
    assert torch.equal(state["w"], torch.full((1 << 16,), 1.0)) and state["n"] == 1  # type: ignore[arg-type]
    ck.close()
    assert before == [] and storage.verify(root, 1) == []
