"""trainguard under a real Slurm (issue 18): munged, slurmctld and slurmd started by the
fixture on this host (tests/helpers/slurm.py), the batch script ``deploy/slurm/trainguard.sbatch``
submitted with ``sbatch`` as a user would. One Slurm node runs three agents (two nodes of the
job and a standby), each with its own node id and loopback address."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import (
    ROOT,
    TINY,
    events,
    fault_free_losses,
    losses,
    reached_step,
    report,
    wait_for,
)
from tests.helpers.s3server import free_port
from tests.helpers.slurm import Slurm, available, slurm_cluster

pytestmark = [
    pytest.mark.slow,  # Slurm daemons and whole jobs (CI's slow run)
    pytest.mark.xdist_group("slurm"),  # one cluster (module fixture), one worker
    pytest.mark.skipif(available() is not None, reason=str(available())),
]
SBATCH = ROOT / "deploy" / "slurm" / "trainguard.sbatch"
ARGS = [*TINY, "--steps", "150", "--durable-every", "10"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)


def _submit(slurm: Slurm, run: Path) -> int:
    cfg = run.parent / "job.toml"
    cfg.write_text(
        'preflight = "off"\nprobe_every_s = 0\nheartbeat_s = 0.2\nnode_timeout_s = 3.0\n'
    )
    env = {
        "TG_SCRIPT": str(ROOT / "examples" / "gpt" / "train.py"),
        "TG_ARGS": " ".join(ARGS),
        "TG_RUN_DIR": str(run),
        "TG_AGENTS_PER_NODE": "3",
        "TG_STANDBY": "1",
        "TG_CONFIG": str(cfg),
        "TG_PORT": str(free_port()),
        "PATH": os.environ["PATH"],
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
    }
    out = run.parent / "slurm-%j.out"
    return slurm.sbatch(SBATCH, "--nodes=1", "--ntasks-per-node=3", f"--output={out}", env=env)


def _output(run: Path) -> str:
    return "".join(p.read_text() for p in run.parent.glob("slurm-*.out"))


def _wait_step(slurm: Slurm, run: Path, job: int, step: int) -> None:
    """Wait up to 240 s for the job to reach ``step``; on a timeout say where it is: the
    job's Slurm state, its output and the daemons' logs (CI once timed out here silently)."""
    try:
        wait_for(lambda: reached_step(run, step), 240, f"step {step} under Slurm")
    except AssertionError as e:
        logs = {p.name: p.read_text()[-1500:] for p in slurm.dir.glob("slurm*.log")}
        raise AssertionError(f"{e}\njob: {slurm.job(job)}\n{_output(run)[-3000:]}\n{logs}") from e


@pytest.mark.timeout(900)
def test_a_preempted_job_is_requeued_and_resumes_with_the_losses_of_an_uninterrupted_run(
    slurm: Slurm, tmp_path: Path, reference: dict[int, float]
) -> None:
    run = tmp_path / "run"
    job = _submit(slurm, run)
    _wait_step(slurm, run, job, 40)
    res = slurm.run("scancel", "--batch", "--signal=TERM", str(job))  # as --signal=B:TERM@T
    assert res.returncode == 0, res.stderr
    # A requeued job waits out its credential's lifetime (120 s by default; the test
    # cluster's slurm.conf sets cred_expire=10).
    info = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 600)
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", (info, _output(run))
    evs = events(run)
    stop = [e for e in evs if e["kind"] == "planned_stop"]
    assert len(stop) == 1 and stop[0]["saved_step"] >= 40, stop
    # The requeued job's first generation restored the saved step: nothing before it was
    # computed again. (A later recovery of the requeued job, as a node loss on a loaded CI
    # machine, is allowed: the losses below still have to match.)
    after = [e for e in evs if e["kind"] == "generation_started" and e["ts"] > stop[0]["ts"]]
    faults = [e for e in evs if e["kind"] in ("fault", "fault_refined")]
    assert after and after[0].get("restore_step") == stop[0]["saved_step"], (after, faults)
    assert losses(run) == reference
    assert "requeueing job" in _output(run)


@pytest.mark.timeout(900)
def test_a_killed_agents_node_is_replaced_by_the_allocations_standby(
    slurm: Slurm, tmp_path: Path, reference: dict[int, float]
) -> None:
    run = tmp_path / "run"
    job = _submit(slurm, run)
    _wait_step(slurm, run, job, 30)

    def agent_of(node_rank: int) -> psutil.Process:
        running = [e for e in events(run) if e["kind"] == "generation_started"][-1]
        node = next(n for n, r in running["assignment"].items() if r == node_rank)
        return next(
            p for p in psutil.process_iter(["cmdline"])
            if "agent" in (p.info["cmdline"] or []) and node in (p.info["cmdline"] or [])
            and str(run) in " ".join(p.info["cmdline"] or [])
        )  # fmt: skip

    agent_of(1).send_signal(signal.SIGKILL)  # its node is gone as far as the job can tell
    info = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 600)
    assert info["JobState"] == "COMPLETED", (info, _output(run)[-3000:])
    rep = report(run)
    gens0 = next(e for e in events(run) if e["kind"] == "generation_started")
    node = next(n for n, r in gens0["assignment"].items() if r == 1)
    assert [(f["cause"], f["node_id"]) for f in rep["faults"]] == [("node_lost", node)], gens0
    standby = rep["recoveries"][0]["replaced"][node]
    assert standby not in gens0["assignment"], rep["recoveries"]
    assert losses(run) == reference


SAME_LINE = """#!/bin/bash
#SBATCH --job-name=tg-same-line
# The torchrun way: one task per host, the same line in each (here three tasks on this one
# Slurm node, each with a loopback address of its own, as simulated hosts).
srun --kill-on-bad-exit=0 bash -c 'exec {py} -m trainguard run --nnodes 2 --standby 1 \\
  --nproc-per-node 1 --rdzv-endpoint 127.0.0.10:{port} --local-addr 127.0.0.$((10 + SLURM_PROCID)) \\
  --run-dir {run} --config {cfg} {script} {args}'
"""


@pytest.mark.timeout(900)
def test_srun_runs_the_same_trainguard_run_line_in_every_task(
    slurm: Slurm, tmp_path: Path, reference: dict[int, float]
) -> None:
    """``srun trainguard run --rdzv-endpoint ...``: one task binds the endpoint and runs the
    controller, the others join; the token comes from ``$TRAINGUARD_SECRET`` in the job's
    environment; the job's output file holds the ranks' lines."""
    run = tmp_path / "run"
    cfg = tmp_path / "job.toml"
    cfg.write_text('preflight = "off"\nprobe_every_s = 0\nwarm_spares = 0\n')
    script = tmp_path / "same-line.sbatch"
    script.write_text(SAME_LINE.format(
        py=sys.executable, port=free_port(), run=run, cfg=cfg,
        script=ROOT / "examples" / "gpt" / "train.py", args=" ".join(ARGS),
    ))  # fmt: skip
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "TRAINGUARD_SECRET": "a-secret-for-this-allocation-0123",
    }
    out = tmp_path / "slurm-%j.out"
    job = slurm.sbatch(script, "--nodes=1", "--ntasks=3", f"--output={out}", env=env)
    info = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 600)
    text = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert info["JobState"] == "COMPLETED", (info, text[-3000:])
    assert losses(run) == reference
    assert "[rank0]:" in text and "[rank1]:" in text, text[-3000:]
    assert text.count("runs the controller at 127.0.0.10") == 1, text[-3000:]
    assert not (run / "token").exists()
