"""A script runs under ``trainguard run`` as under ``python``/``torchrun``: the scripts in
tests/helpers/repros/ (users' shapes, copied verbatim), each with its expected output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

REPROS = ROOT / "tests" / "helpers" / "repros"
CONFIG = 'preflight = "off"\nmax_restarts = 10\nheartbeat_s = 0.2\n'


def run_repro(tmp_path: Path, script: str, *args: str, run_args: tuple[str, ...] = ()) -> str:
    """``trainguard run`` a repro to completion (exit 0 asserted); rank 0's log, all gens."""
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG)
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "run", "--run-dir", str(run_dir)]
        + ["--config", str(cfg), *run_args, str(REPROS / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPROS,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank0.gen*.log")))


@pytest.mark.parametrize(
    "mode",
    ["spawn", *(pytest.param(m, marks=pytest.mark.slow) for m in ("forkserver", "pool", "exc"))],
)
def test_script_classes_cross_spawn_workers(tmp_path: Path, mode: str) -> None:
    logs = run_repro(tmp_path, "spawn_dataloader_script_class.py", mode)
    want = {
        "spawn": "OK spawn: 4 batches of __main__.Batch",
        "forkserver": "OK forkserver: 4 batches of __main__.Batch",
        "pool": "OK pool: [Batch(x=tensor([0]), y=tensor([0]))",
        "exc": "OK exc: caught MyError: bad item",
    }[mode]
    assert want in logs, logs[-2000:]


def test_thread_count_set_before_import_torch_is_honoured(tmp_path: Path) -> None:
    logs = run_repro(tmp_path, "env_before_import.py")
    assert "torch threads=2" in logs, logs[-2000:]
