"""Local recovery with replica groups (``--replica-groups``, ``examples/gpt/replicas.py``):
real processes, a real kill -9; the surviving group keeps its process and trains on, the
killed group restarts and heals from it over the network, and at the end every group's model
and optimizer state is the same (xxh3 digests). Faults during the heal (the healing group dies
again; the source dies while sending) end consistent: healed from another live group, or, with
no live peer, a global recovery whose losses equal a fault-free run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    ROOT,
    TINY,
    WARM_CONFIG,
    events,
    fault_free_losses,
    finish_job,
    losses,
    reached_step,
    report,
    run_job,
    trainguard_cmd,
    wait_for,
    worker_pid,
)
from trainguard.observe.view import build_view

EXAMPLE = ROOT / "examples" / "gpt" / "replicas.py"
STEPS = 300
ARGS = [*TINY, "--steps", str(STEPS), "--durable-every", "50"]
CONFIG = WARM_CONFIG + "hang_timeout_min_s = 3.0\n"  # a heal waits for no import


def _start(run: Path, flags: list[str], env: dict[str, str] | None = None,
           steps: int = STEPS) -> subprocess.Popen[str]:  # fmt: skip
    cfg = run.parent / f"{run.name}.toml"
    cfg.write_text(CONFIG)
    args = [*TINY, "--steps", str(steps), "--durable-every", "50"]
    cmd = trainguard_cmd("run", "--run-dir", run, "--config", cfg, *flags, EXAMPLE, *args)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, **(env or {})})  # fmt: skip


def _digests(run: Path) -> dict[tuple[int, int], str]:
    lines = (run / "digests.jsonl").read_text().splitlines()
    return {(d["group"], d["slot"]): d["digest"] for d in map(json.loads, lines)}


def _metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _started(run: Path, rank: int) -> list[int]:
    return [e["pid"] for e in events(run) if e["kind"] == "worker_started" and e["rank"] == rank]


def _kill_rank(run: Path, rank: int, after_step: int) -> int:
    pid = worker_pid(run, rank)
    wait_for(lambda: reached_step(run, after_step), 120, f"step {after_step}")
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """train.py (plain DDP, no replica groups) over 2 ranks: the same global batch."""
    return fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_without_a_fault_the_losses_equal_a_run_without_replica_groups(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    run = tmp_path / "run"
    code, err = finish_job(_start(run, ["--nodes", "2", "--replica-groups", "2"]), 240)
    assert code == 0, err[-3000:]
    assert losses(run) == reference  # bit for bit: a/2 + b/2 in both
    assert len(set(_digests(run).values())) == 1
    rep = report(run)
    assert rep["recoveries"] == [] and rep["local"]["reduced_width"] == []
    assert {m["width"] for m in _metrics(run)} == {2}


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_groups_of_two_ranks_train_as_one_ddp_world_of_four(tmp_path: Path) -> None:
    """2 groups × 2 ranks (DDP inside each) against plain DDP over 4 ranks: the same global
    batch, the sums taken in another order (close, not bitwise)."""
    steps = ["--steps", "30"]
    ref = tmp_path / "ref"
    res = run_job(ref, ["--nodes", "2", "--nproc-per-node", "2"], [*TINY, *steps], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "run"
    proc = _start(run, ["--nodes", "2", "--nproc-per-node", "2", "--replica-groups", "2"],
                  steps=30)  # fmt: skip
    code, err = finish_job(proc, 240)
    assert code == 0, err[-3000:]
    got, want = losses(run), losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, 31))
    assert all(abs(got[s] - want[s]) <= 1e-4 * abs(want[s]) for s in want), (got, want)
    assert len(_digests(run)) == 4 and len(set(_digests(run).values())) == 1


def test_a_killed_group_heals_from_the_live_one_which_never_stops(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    run = tmp_path / "run"
    proc = _start(run, ["--nodes", "2", "--replica-groups", "2"])
    survivor = worker_pid(run, 0)
    killed = _kill_rank(run, 1, 30)
    code, err = finish_job(proc, 240)
    assert code == 0, err[-3000:]
    rep = report(run)
    assert rep["recoveries"] == [], rep["recoveries"]  # no global recovery
    assert _started(run, 0) == [survivor]  # the survivor kept its process throughout
    assert killed in _started(run, 1) and len(_started(run, 1)) == 2
    (rec,) = rep["local"]["recoveries"]
    assert rec["group"] == 1 and rec["reason"] == "rank 1 killed by signal 9"
    assert rec["heal"]["source_group"] == 0 and rec["heal"]["bytes"] > 0
    # Group 0 trained every step; the steps without group 1 are named with their batches.
    g0 = [m for m in _metrics(run) if m["group"] == 0]
    assert [m["step"] for m in g0] == list(range(1, STEPS + 1))
    narrow = {m["step"] for m in g0 if m["width"] == 1}
    assert narrow and {s["step"] for s in rep["local"]["reduced_width"]} == narrow
    assert all(s["missing_batches"] == [[s["step"], 1]] for s in rep["local"]["reduced_width"])
    assert min(narrow) > 30 and max(narrow) == rec["heal"]["step"]
    assert {r[0] for r in build_view(run)["reduced_width"]} == narrow  # marked on the curve
    # Before the fault: the fault-free run's losses; after the heal both groups log the same.
    got = losses(run)
    assert all(got[s] == reference[s] for s in range(1, min(narrow)))
    g1 = {m["step"]: m["loss"] for m in _metrics(run) if m["group"] == 1}
    assert all(g1[s] == m["loss"] for m in g0 if (s := m["step"]) > max(narrow))
    assert len(set(_digests(run).values())) == 1  # state equal after the heal


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_groups_of_two_ranks_heal_after_a_kill_with_every_rank_equal(tmp_path: Path) -> None:
    """2 groups x 2 ranks, one rank of group 1 killed: each slot has its own cross-group
    all-reduce, so the group's ranks must decide together (apply the step or retry it, move
    to the next epoch); at the end all four ranks hold the same state."""
    run = tmp_path / "run"
    proc = _start(run, ["--nodes", "2", "--nproc-per-node", "2", "--replica-groups", "2"],
                  steps=400)  # fmt: skip
    _kill_rank(run, 2, 100)  # slot 0 of group 1
    code, err = finish_job(proc, 300)
    assert code == 0, err[-3000:]
    rep = report(run)
    assert rep["recoveries"] == [], rep["local"]
    (rec,) = rep["local"]["recoveries"]
    assert rec["group"] == 1 and rec["heal"] is not None, rec
    digests = _digests(run)
    assert len(digests) == 4 and len(set(digests.values())) == 1, digests
    g0 = [m["step"] for m in _metrics(run) if m["group"] == 0]
    assert g0 == list(range(1, 401))


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_a_healing_group_that_dies_again_heals_on_its_next_restart(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # Group 0 paced 3x (a sleep; the losses do not change): it must still be training when
    # group 1's third incarnation joins. Unpaced, on a loaded machine, group 0 had finished
    # its 300 steps by then and group 1 fell back to a global restart (no live peer).
    proc = _start(run, ["--nodes", "2", "--replica-groups", "2",
                        "--inject", "slow:rank=0:factor=3"],
                  env={"TRAINGUARD_REPLICA_DRILL": "die-receiving:5"})  # fmt: skip
    _kill_rank(run, 1, 30)
    code, err = finish_job(proc, 240)
    assert code == 0, err[-3000:]
    rep = report(run)
    assert rep["recoveries"] == []
    first, second = rep["local"]["recoveries"]  # the kill; the drill's kill mid-heal
    assert first["heal"] is None and second["heal"] is not None, rep["local"]
    assert first["reason"] == second["reason"] == "rank 1 killed by signal 9"
    assert (run / ".replica-drill-fired").exists()
    assert len(set(_digests(run).values())) == 1


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_a_source_that_dies_while_sending_leaves_a_consistent_state(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """Two groups: the only live peer dies mid-heal, no group holds a trained state: global
    recovery from the checkpoint, and the losses (last word per step) equal a fault-free
    run's: the steps at reduced width are trained again at full width."""
    run = tmp_path / "run"
    proc = _start(run, ["--nodes", "2", "--replica-groups", "2"],
                  env={"TRAINGUARD_REPLICA_DRILL": "die-sending:5"})  # fmt: skip
    _kill_rank(run, 1, 30)
    code, err = finish_job(proc, 240)
    assert code == 0, err[-3000:]
    rep = report(run)
    assert len(rep["recoveries"]) == 1 and rep["local"]["fallbacks"], rep["local"]
    assert losses(run) == reference
    assert len(set(_digests(run).values())) == 1


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_with_three_groups_a_dead_source_is_replaced_by_the_other_live_group(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    # Killed at step 150 of 600: its node's warm spare is ready by then (a cold start under
    # CI's load took 12 s, and the heal came at the end, in finish(), where a second death
    # has no live state left to heal from but the ones that finished).
    proc = _start(run, ["--nodes", "3", "--replica-groups", "3"],
                  env={"TRAINGUARD_REPLICA_DRILL": "die-sending:5"}, steps=600)  # fmt: skip
    _kill_rank(run, 2, 150)
    code, err = finish_job(proc, 240)
    assert code == 0, err[-3000:]
    rep = report(run)
    assert rep["recoveries"] == [], rep["local"]
    groups = sorted(r["group"] for r in rep["local"]["recoveries"])
    assert groups == [0, 2], rep["local"]  # the killed one, and the source the drill killed
    assert all(r["heal"] is not None for r in rep["local"]["recoveries"])
    assert len(_digests(run)) == 3 and len(set(_digests(run).values())) == 1


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_a_stopped_rank_is_killed_and_its_group_heals(tmp_path: Path) -> None:
    """SIGSTOP (a hang from outside): its agent sees the process stopped past
    hang_timeout_min_s, kills it (its sockets close, the other group's all-reduce fails), and
    the group restarts and heals; no global recovery."""
    run = tmp_path / "run"
    proc = _start(run, ["--nodes", "2", "--replica-groups", "2"], steps=600)
    pid = worker_pid(run, 1)
    wait_for(lambda: reached_step(run, 30), 120, "step 30")
    os.kill(pid, signal.SIGSTOP)
    code, err = finish_job(proc, 240)
    assert code == 0, err[-3000:]
    rep = report(run)
    assert rep["recoveries"] == [], rep["recoveries"]
    assert [e["rank"] for e in events(run) if e["kind"] == "group_rank_killed"] == [1]
    (rec,) = rep["local"]["recoveries"]
    assert rec["group"] == 1 and rec["heal"] is not None
    assert len(set(_digests(run).values())) == 1
