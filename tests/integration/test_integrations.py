"""Framework hook-ins with the real libraries on tiny models (CPU, 2 ranks, DDP over gloo):
a Hugging Face ``Trainer`` and a PyTorch Lightning ``Trainer``, each changed by one line,
killed mid-run under ``trainguard run``: they resume from the memory tier and every step's
loss equals the fault-free run's under plain torchrun, bit for bit (data position, RNG,
optimizer and scheduler state all restored)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, ROOT, trainguard_cmd

USER = ROOT / "tests" / "helpers" / "userscripts"


def _losses(path: Path) -> dict[int, str]:
    """step → loss as printed; after a restart the later line for a step counts."""
    out = {}
    for line in path.read_text().splitlines():
        step, loss = line.split()
        out[int(step)] = loss
    return out


def _compare(tmp_path: Path, script: str, kill_step: int) -> None:
    ref = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(USER / script), "ref-out", "ref.txt", "--plain"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    (tmp_path / "job.toml").write_text(FAST_CONFIG)
    res = subprocess.run(
        trainguard_cmd("run", "--run-dir", tmp_path / "run", "--config", tmp_path / "job.toml",
                       "--nproc-per-node", "2", "--inject", f"kill:rank=1:step={kill_step}",
                       USER / script, "out", "tg.txt"),
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "job succeeded after 1 recovery" in res.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("rank*.gen1.log"))
    restored = f"restored step {kill_step - 1} from the memory tier"
    assert logs.count(restored) == 2, logs[-3000:]
    want, got = _losses(tmp_path / "ref.txt"), _losses(tmp_path / "tg.txt")
    assert sorted(got) == sorted(want) and got == want, [s for s in want if got.get(s) != want[s]]


@pytest.mark.slow  # CI's slow run (the default run stays under 15 min)
def test_a_hugging_face_trainer_resumes_exactly_after_a_kill(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _compare(tmp_path, "hf_trainer.py", kill_step=10)


@pytest.mark.slow  # in CI's slow run (keeps the default suite under 15 min)
def test_a_lightning_trainer_resumes_exactly_after_a_kill(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    _compare(tmp_path, "lightning_fit.py", kill_step=12)
