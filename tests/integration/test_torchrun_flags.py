"""``trainguard run`` takes torchrun's launch flags: a user replaces ``torchrun`` with
``trainguard run`` and nothing else (``-m``, ``--no-python``, ``--nnodes``,
``--nproc_per_node``, ``--standalone``, ``--tee``/``--local-ranks-filter``, ``--log-dir``), and
the flags that mean nothing here are refused with what to use instead."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, events, trainguard_cmd


def _run(cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    (cwd / "job.toml").write_text(FAST_CONFIG)
    cmd = trainguard_cmd("run", "--run-dir", cwd / "run", "--config", cwd / "job.toml", *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_a_module_run_with_torchrun_spellings_shows_the_chosen_ranks(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import os, sys\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print(f'hello from {dist.get_rank()} of {dist.get_world_size()} as {__name__}', sys.argv[1:])\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )  # fmt: skip
    logs = tmp_path / "mylogs"
    res = _run(
        tmp_path, "--preflight", "off", "--standalone", "--nnodes", "1", "--nproc_per_node", "2", "--log_dir",
        str(logs), "--local-ranks-filter", "1", "-m", "mypkg.train", "--lr", "3",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "[rank1]:hello from 1 of 2 as __main__ ['--lr', '3']" in res.stdout, res.stdout[-2000:]
    assert "[rank0]:" not in res.stdout  # filtered out
    assert "hello from 0 of 2" in (logs / "rank0.gen0.log").read_text()
    assert not (tmp_path / "run" / "logs" / "rank0.gen0.log").exists()


def test_no_python_runs_a_program_and_a_timed_drill_reaches_it(tmp_path: Path) -> None:
    """``--no-python``: the worker *is* the program (the spare execs it, same pid); a kill
    drill by time restarts it; every rank's line is on the console with --tee 3."""
    prog = "echo start $RANK gen $TORCHELASTIC_RESTART_COUNT; sleep 4; echo end $RANK"
    res = _run(tmp_path, "--nproc-per-node", "2", "--tee", "3", "--inject", "kill:rank=1:after=2",
               "--no-python", "sh", "-c", prog)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    for line in ("[rank0]:start 0 gen 0", "[rank1]:start 1 gen 0", "[rank1]:start 1 gen 1",
                 "[rank1]:end 1"):  # fmt: skip
        assert line in res.stdout, res.stdout[-2000:]
    fired = [e for e in events(tmp_path / "run") if e["kind"] == "inject_fired"]
    assert len(fired) == 1 and fired[0]["rank"] == 1


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--rdzv-endpoint", "h:29400"], "shared secret of 16+ characters in $TRAINGUARD_SECRET"),
        (["--master_port", "29500"], "the controller picks rank 0's store"),
        (["--node-rank", "1"], "--node-rank is for a job across hosts: give --rdzv-endpoint"),
        (["--nproc-per-node", "two"], "--nproc-per-node two: give a number"),
        (["--tee", "7"], "--tee 7: use torchrun's 0-3"),
        (["--preflight", "sometimes"], "--preflight: invalid choice: 'sometimes'"),
        (["-m", "no.such.module"], "-m no.such.module: no such module"),
        (["--no-python", "no-such-program-xyz"], "--no-python no-such-program-xyz"),
    ],
)
def test_flags_that_mean_nothing_here_are_refused_in_one_line(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    script = [] if flags[0] in ("-m", "--no-python") else ["x.py"]
    (tmp_path / "x.py").write_text("")
    res = subprocess.run(trainguard_cmd("run", "--run-dir", tmp_path / "run", *flags, *script),
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 2 and says in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
