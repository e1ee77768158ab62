"""The Checkpointer's calls for a living process and for measurement (issue 29: the benchmarks use
only these): ``load_memory``, ``wait_persisted`` and ``node_daemon``. Real slot files, a real
in-process persister, and a real ckptd process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from trainguard.checkpoint import node_daemon, snapshot, storage
from trainguard.checkpoint.api import CheckpointCorruptError, CheckpointNotFoundError
from trainguard.checkpoint.checkpointer import Checkpointer


@pytest.fixture(autouse=True)
def private_shm(tmp_path: Path) -> Iterator[Path]:
    shm = tmp_path / "shm"
    shm.mkdir()
    old = os.environ.get("TRAINGUARD_SHM_DIR")
    os.environ["TRAINGUARD_SHM_DIR"] = str(shm)
    yield shm
    if old is None:
        os.environ.pop("TRAINGUARD_SHM_DIR", None)
    else:
        os.environ["TRAINGUARD_SHM_DIR"] = old


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().flatten().float() for t in model.state_dict().values()])


def test_load_memory_rolls_a_living_process_back_to_a_verified_snapshot(tmp_path: Path) -> None:
    model, opt = _model()
    ck = Checkpointer(tmp_path / "ck", durable_every=0, overlap=True)
    ck.attach(opt)
    state = {"model": model, "optim": opt}
    seen = {}
    for step in (1, 2, 3):
        _train(model, opt)
        ck.save(step, state)
        ck.wait_persisted()
        seen[step] = _flat(model).clone()
    _train(model, opt)  # past the newest snapshot
    assert ck.load_memory(state) == 3
    assert torch.equal(_flat(model), seen[3])
    with pytest.raises(CheckpointNotFoundError, match="no snapshot of step 99.*held: "):
        ck.load_memory(state, step=99)
    held = [h["step"] for p in _slots() if (h := snapshot.peek_header(p)) is not None]
    assert len(held) >= 2, held
    older = min(held)
    assert ck.load_memory(state, step=older) == older
    assert torch.equal(_flat(model), seen[older])
    # A bit flipped in the newest snapshot: refused; an older verified step still restores.
    _train(model, opt)
    newest = max(held)
    slot = next(p for p in _slots() if (h := snapshot.peek_header(p)) and h["step"] == newest)
    h = snapshot.peek_header(slot)
    assert h is not None
    first = h["layout"]["tensors"][0]
    with open(slot, "r+b") as f:
        f.seek(int(first["offset"]))
        b = f.read(1)
        f.seek(int(first["offset"]))
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CheckpointCorruptError, match=f"step {newest} in memory failed"):
        ck.load_memory(state, step=newest)
    assert ck.load_memory(state, step=older) == older
    assert torch.equal(_flat(model), seen[older])
    ck.close()


def _slots() -> list[Path]:
    return [Path(p) for p in sorted(Path(os.environ["TRAINGUARD_SHM_DIR"]).glob("*-s[0-9]"))]


def test_node_daemon_owns_the_slots_verifies_and_persists_then_goes(
    tmp_path: Path, private_shm: Path
) -> None:
    model, opt = _model()
    env_before = {k: os.environ.get(k) for k in ("TRAINGUARD_CKPTD", "TRAINGUARD_CKPT_DIR")}
    root = tmp_path / "ck"
    with node_daemon(root, shm_dir=private_shm) as name:
        assert os.environ["TRAINGUARD_CKPTD"] == name
        (daemon,) = [
            p for p in psutil.Process().children() if "trainguard.checkpoint.ckptd" in p.cmdline()
        ]
        ck = Checkpointer(durable_every=2)  # the daemon's directory is the default
        state = {"model": model, "optim": opt}
        for step in (1, 2):
            _train(model, opt)
            ck.save(step, state)
        ck.wait()
        want = _flat(model).clone()
        _train(model, opt)
        assert ck.load_memory(state) == 2  # ckptd verified it
        assert torch.equal(_flat(model), want)
        ck.close()
        assert storage.newest_verified(root)[0] == 2  # ckptd wrote and committed the step
        assert list(private_shm.iterdir())  # its slots, while it runs
    assert {k: os.environ.get(k) for k in env_before} == env_before
    assert not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE
    assert not [p for p in private_shm.iterdir() if p.name.startswith("trainguard")]


def test_a_step_saved_twice_is_read_from_its_newest_snapshot_and_its_durable_copy_is_whole(
    tmp_path: Path,
) -> None:
    """The persister writes a step's durable part once a generation: a second save of the
    step (its first commit still renaming the directory) left a torn step reported as saved.
    Memory serves the newest save; the durable step is the first, whole and verified."""
    ck = Checkpointer(tmp_path / "ck")
    ck.save(5, {"w": torch.full((1000,), 1.0)})
    ck.save(5, {"w": torch.full((1000,), 2.0)})
    ck.wait()
    got = {"w": torch.zeros(1000)}
    assert ck.load_memory(got) == 5 and torch.equal(got["w"], torch.full((1000,), 2.0))
    ck.close()
    assert storage.newest_verified(tmp_path / "ck")[0] == 5
    again = Checkpointer(tmp_path / "ck")
    got = {"w": torch.zeros(1000)}
    assert again.load(got) == 5 and torch.equal(got["w"], torch.full((1000,), 1.0))
    again.close()
