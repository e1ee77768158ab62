"""Every state a real script has, through every tier: memory (the node's ckptd), a peer's
replica (pulled over a real socket), and the durable tier (DCP on disk).

The worker (tests/helpers/shapes_worker.py) records a fingerprint of its state at every
save; a restore into objects built from another seed must reproduce that fingerprint bit for
bit. The scripts under tests/helpers/repros/ are the small inputs that failed before, run as
their docstrings say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.test_hyckpt import JOB, NODE, _env, ckptd  # noqa: F401 - a fixture
from trainguard.checkpoint import replica, snapshot

WORKER = ROOT / "tests" / "helpers" / "shapes_worker.py"
REPROS = ROOT / "tests" / "helpers" / "repros"
TOKEN = "ab" * 16
CONFIG = 'preflight = "off"\nmax_restarts = 10\nheartbeat_s = 0.2\nprobe_every_s = 0\n'


def _shapes(mode: str, root: Path, env: dict[str, str], *args: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, str(WORKER), mode, "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]) if mode == "load" else {}


def test_every_state_shape_restores_bit_exact_from_memory_replica_and_disk(
    tmp_path: Path,
    shm: Path,  # noqa: F811
    ckptd: subprocess.Popen[bytes],  # noqa: F811
) -> None:
    root, prints = tmp_path / "checkpoints", tmp_path / "prints.json"
    _shapes("save", root, _env(tmp_path, shm), "--steps", "4", "--fingerprints", str(prints))
    want = json.loads(prints.read_text())["4"]
    expect = {
        "step": 4,
        "fingerprint": want,
        "tied": True,  # restored in place: the head still is the embedding
        "channels_last": True,
        "optimizer_entries": 7,  # AdamW state created lazily, all of it restored
        "optimizer_steps": [4.0],
        "progress": [1, [1, 2, 1, 2, 3, 4]],  # the script-defined object
    }
    empty = tmp_path / "no-durable-tier"  # nothing on disk: memory must serve alone
    got = _shapes("load", empty, _env(tmp_path, shm, restore=(4, 0)))
    assert got == expect

    # A peer's replica: pushed over a real socket to another node's replica server, then
    # restored there by a worker of that node (its ckptd gone: the slot is checked here).
    (slot,) = [p for p in shm.glob(f"trainguard-{JOB}-{NODE}-r0-s*") if _step(p) == 4]
    sums = snapshot.read_sums(slot, 4, 0)
    peer_shm = tmp_path / "peer"
    peer_shm.mkdir()
    srv = replica.ReplicaServer(
        token=TOKEN,
        bind="127.0.0.1",
        shm_dir=peer_shm,
        job=JOB,
        node="nodeB",
        emit=lambda *a, **k: None,
    )
    try:
        replica.push(srv.addr, TOKEN, slot, 0, 4, 0, sums)
        dest = snapshot.slot_paths(peer_shm, JOB, "nodeB", 0)[0]
        replica.pull(srv.addr, TOKEN, dest, 0, 4, 0)
    finally:
        srv.close()
    env = {**_env(tmp_path, peer_shm, restore=(4, 0), ckptd=False), "TRAINGUARD_NODE_ID": "nodeB"}
    try:
        assert _shapes("load", empty, env) == expect
    finally:
        for p in peer_shm.iterdir():
            p.unlink()

    # The durable tier, standalone (plain python: the newest verified step on disk).
    standalone = {k: v for k, v in _env(tmp_path, shm, ckptd=False).items()}
    assert _shapes("load", root, standalone) == expect


def _step(path: Path) -> int | None:
    h = snapshot.peek_header(path)
    return None if h is None else int(h["step"])


def _run(tmp_path: Path, name: str, script: str, *args: str, config: str = CONFIG) -> str:
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(config)
    cmd = [sys.executable, "-m", "trainguard", "run", "--run-dir", str(tmp_path / name)]
    out = subprocess.run(
        [*cmd, "--config", str(cfg), *args, str(REPROS / script)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPROS,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return "".join(p.read_text() for p in sorted((tmp_path / name / "logs").glob("rank0.gen*.log")))


def test_noncontiguous_parameter_restores_from_memory(tmp_path: Path) -> None:
    # The kill fires in step_end(5), before save(5): the newest snapshot is step 4.
    logs = _run(tmp_path, "nc", "noncontiguous_param.py", "--inject", "kill:rank=0:step=5")
    assert "restored step 4; w == original: True" in logs


@pytest.mark.parametrize("memory_tier", ["true", "false"])
def test_lazily_created_optimizer_state_is_restored(tmp_path: Path, memory_tier: str) -> None:
    config = CONFIG + f"memory_tier = {memory_tier}\n"
    logs = _run(
        tmp_path, "lazy", "lazy_optimizer_state.py", "--inject", "kill:rank=0:step=5", config=config
    )
    assert "restored step 4; optimizer state entries: 2; steps: [4.0, 4.0]" in logs


def test_object_of_an_unimportable_class_is_stored_as_opaque_bytes(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPROS / "unimportable_object_in_state.py"), str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=120,
        # the script ends with os._exit while its persister may still write a .sum: keep its
        # slots in the test's own directory
        env={**os.environ, "TRAINGUARD_SHM_DIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "wait: returned (durable)" in out.stdout
    assert "third durable save returned within 20 s: True" in out.stdout
    assert "ckpt_persist_failed" not in out.stdout
