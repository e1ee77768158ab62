"""Issue 15: silent data corruption during training. One bit flipped in a real parameter of
one rank (``--inject sdc``) crashes nothing; the replicas' snapshot fingerprints differ at
the next snapshot, the culprit is named (majority of 4) or the corruption is certain but not
localized (2 replicas), the job rolls back to the last agreeing step, and its losses equal a
fault-free run's, step for step. Corruption that reaches every replica alike through the
all-reduce (a flipped gradient bit, a node whose GEMMs went wrong) leaves the fingerprints in
agreement: the gradient norm and the in-job GEMM probe catch those."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import (
    FAST_CONFIG,
    TINY,
    events,
    fault_free_losses,
    finish_job,
    losses,
    reached_step,
    report,
    start_job,
    wait_for,
)

STEPS = 60
K = 5  # snapshot (and fingerprint) interval
ARGS = [*TINY, "--steps", str(STEPS), "--ckpt-every", str(K), "--durable-every", str(K)]
FOUR = ["--nodes", "2", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def reference4(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return fault_free_losses(tmp_path_factory, FOUR, ARGS)


@pytest.fixture(scope="module")
def reference2(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)


def _suspect_restores(evs: list[dict], detected: dict) -> list[tuple[int, int]]:
    """Restore points chosen after the detection that the corruption may have reached."""
    after, gen = detected["suspect_after"], detected["generation"]
    i = evs.index(detected)
    return [
        (e["restore_step"], e["restore_generation"])
        for e in evs[i:]
        if e["kind"] == "generation_started"
        and e["restore_step"] is not None
        and e["restore_step"] > after
        and e["restore_generation"] <= gen
    ]


@pytest.mark.slow  # CI's slow run (the default run stays under 15 min)
def test_a_flipped_bit_in_one_of_four_replicas_is_named_rolled_back_and_loses_nothing(
    tmp_path: Path, reference4: dict[int, float]
) -> None:
    run = tmp_path / "run"
    # Rank 0: its replicated state is what the durable tier persists (DCP writes replicated
    # tensors once, from rank 0), so the durable step written right after the flip is corrupt.
    proc = start_job(run, [*FOUR, "--standby", "1", "--inject", "sdc:rank=0:step=23"], ARGS)
    code, err = finish_job(proc, timeout=300)
    assert code == 0, err[-3000:]
    assert losses(run) == reference4  # every step, bit for bit
    evs = events(run)
    injected = [e for e in evs if e["kind"] == "sdc_injected"]
    assert len(injected) == 1 and injected[0]["rank"] == 0 and injected[0]["step"] == 25
    assert injected[0]["before"] != injected[0]["after"]
    (detected,) = [e for e in evs if e["kind"] == "sdc_detected"]
    # Within one snapshot interval of the flip: the snapshot it went into.
    assert detected["step"] == 25 and detected["culprits"] == [0], detected
    # The newest step every rank's fingerprint reached the controller for: 20, or older when a
    # rank's snapshot left its memory before a report carried it (a loaded machine).
    assert detected["nodes"] == ["node0"] and detected["last_agreed"][0] in (10, 15, 20), detected
    (fault,) = [e for e in evs if e["kind"] == "fault"]
    assert fault["cause"] == "sdc" and fault["node_id"] == "node0" and fault["rank"] == 0
    quarantined = [e for e in evs if e["kind"] == "pool_changed" and e["to"] == "faulty"]
    assert [e["node"] for e in quarantined] == ["node0"], quarantined
    starts = [e for e in evs if e["kind"] == "generation_started"]
    # A good point survived (retention keeps the newest agreeing durable step while newer
    # ones differ): not a restart from scratch, and nothing written after the flip.
    assert starts[1]["restore_step"] in (10, 15, 20), starts[1]
    assert "node0" not in starts[1]["assignment"], starts[1]
    assert starts[1]["assignment"]["node2"] == 0  # the standby took node rank 0
    assert not _suspect_restores(evs, detected)
    (sdc,) = report(run)["sdc"]
    assert sdc["culprits"] == [0] and sdc["rollback_to"] == starts[1]["restore_step"], sdc
    assert sdc["steps_recomputed"] == 25 - starts[1]["restore_step"]
    durable_25 = [e for e in evs if e["kind"] == "ckpt_durable" and e["step"] == 25]
    print(f"durable step 25 of the corrupt generation committed: {bool(durable_25)}")


def test_two_replicas_without_a_standby_roll_back_and_the_rerun_names_a_transient_culprit(
    tmp_path: Path, reference2: dict[int, float]
) -> None:
    """With 2 replicas no majority names the culprit: the job rolls back and recomputes on
    the same nodes (no standby); the flip was transient (a drill fires once), so the rerun
    agrees, with node0's old state: node1 is named, and kept (no standby to take its place).
    The flipped bit is in the optimizer's state (an Adam moment): the snapshot holds it."""
    run = tmp_path / "run"
    flip = "sdc:rank=1:step=30:target=optimizer:bit=20"
    proc = start_job(run, ["--nodes", "2", "--inject", flip], ARGS)
    code, err = finish_job(proc, timeout=300)
    assert code == 0, err[-3000:]
    assert losses(run) == reference2
    evs = events(run)
    (injected,) = [e for e in evs if e["kind"] == "sdc_injected"]
    assert injected["target"] == "optimizer" and "exp_avg" in injected["key"], injected
    (detected,) = [e for e in evs if e["kind"] == "sdc_detected"]
    assert detected["step"] == 30 and detected["culprits"] == [] and detected["undecided"] == [0, 1]
    assert detected["last_agreed"][0] in (15, 20, 25) and detected["held_out"] is None, detected
    (localized,) = [e for e in evs if e["kind"] == "sdc_localized"]
    assert localized["nodes"] == ["node1"] and "kept" in localized["action"], localized
    assert not [e for e in evs if e["kind"] == "pool_changed" and e["to"] == "faulty"]
    assert not _suspect_restores(evs, detected)


@pytest.mark.slow  # CI's slow run (the default suite stays under 15 min)
def test_two_replicas_that_disagree_are_recomputed_with_one_held_out_and_the_culprit_drained(
    tmp_path: Path, reference2: dict[int, float]
) -> None:
    """Issue 15's 2-replica localization (controller/recompute.py): node0's Adam moment is
    flipped. The disagreement at step 30 holds node1 out (the standby takes its rank), the
    job rolls back and recomputes; the recomputed state at step 30 equals node1's old one,
    so node0 is the culprit: drained at the next checkpoint boundary to node1 (a standby
    again), quarantined, and the losses are a fault-free run's, step for step."""
    run = tmp_path / "run"
    flip = "sdc:rank=0:step=30:target=optimizer:bit=20"
    proc = start_job(run, ["--nodes", "2", "--standby", "1", "--inject", flip], ARGS)
    code, err = finish_job(proc, timeout=300)
    assert code == 0, err[-3000:]
    assert losses(run) == reference2
    evs = events(run)
    (detected,) = [e for e in evs if e["kind"] == "sdc_detected"]
    assert detected["step"] == 30 and detected["undecided"] == [0, 1], detected
    assert detected["held_out"] == "node1", detected
    starts = [e for e in evs if e["kind"] == "generation_started"]
    assert sorted(starts[1]["assignment"]) == ["node0", "node2"], starts[1]
    assert starts[1]["restore_step"] < 30 and not _suspect_restores(evs, detected)
    (localized,) = [e for e in evs if e["kind"] == "sdc_localized"]
    assert localized["nodes"] == ["node0"] and localized["recomputed_on"] == ["node2"]
    assert "node0 drained" in localized["action"] and "node1 back to standby" in localized["action"]
    quarantined = [e["node"] for e in evs if e["kind"] == "pool_changed" and e["to"] == "faulty"]
    assert quarantined == ["node0"], quarantined
    assert sorted(starts[-1]["assignment"]) == ["node1", "node2"], starts[-1]
    rep = report(run)
    assert [f["cause"] for f in rep["faults"]] == ["sdc"], rep["faults"]


@pytest.mark.slow  # in CI's slow run (keeps the default suite under 15 min)
def test_a_node_whose_corrected_errors_climb_is_drained_with_no_lost_step(
    tmp_path: Path, reference2: dict[int, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failure prediction: node1's memory controller starts reporting corrected errors (the
    EDAC counter files its agent reads, written here). It is flagged at risk and drained to
    the standby at the next checkpoint boundary: a planned stop, no fault, no restart charged,
    no step lost, the same losses."""
    root = tmp_path / "signals"
    for node in ("node0", "node1", "node2"):
        mc = root / node / "sys/devices/system/edac/mc/mc0"
        mc.mkdir(parents=True)
        (mc / "ce_count").write_text("0\n")
        (mc / "ue_count").write_text("0\n")
    monkeypatch.setenv("TRAINGUARD_SIGNALS_ROOT", str(root / "{node}"))
    run = tmp_path / "run"
    # rank 0 sleeps (losses unchanged): the job outlasts the agent's 2 s counter reads
    slow = ["--inject", "slow:rank=0:factor=6"]
    proc = start_job(run, ["--nodes", "2", "--standby", "1", *slow], ARGS)
    try:
        wait_for(lambda: reached_step(run, 15), 180, "step 15")
        (root / "node1/sys/devices/system/edac/mc/mc0/ce_count").write_text("57\n")
        code, err = finish_job(proc, timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 0, err[-3000:]
    assert losses(run) == reference2
    evs = events(run)
    (risk,) = [e for e in evs if e["kind"] == "node_at_risk"]
    assert risk["node"] == "node1" and risk["reason"].startswith("edac_ce: 57 corrected errors")
    assert risk["action"].startswith("drain"), risk
    assert not [e for e in evs if e["kind"] == "fault"]
    starts = [e for e in evs if e["kind"] == "generation_started"]
    assert len(starts) == 2 and starts[1]["assignment"] == {"node0": 0, "node2": 1}, starts
    # No step lost: the drained generation's last snapshot is where the next one starts.
    (planned,) = [e for e in evs if e["kind"] == "planned_stop"]
    assert planned["steps_lost"] <= 0 and starts[1]["restore_step"] == planned["saved_step"]
    rep = report(run)
    assert rep["faults"] == [] and rep["recoveries"] == [], rep
    assert rep["at_risk"] == [{k: risk[k] for k in ("node", "reason", "action")}]


# Steps ~5x longer (a sleep on rank 0; the losses do not change): the controller hears of a
# sign within a step or two, before retention has dropped the checkpoints before it.
PACE = ["--inject", "slow:rank=0:factor=5"]
# Retention knows of fingerprint disagreements only (README): for a gradient or probe sign the
# rollback target must outlive the steps run until the stop, so three durable steps are kept
# (a loaded machine ran 8 steps past the sign before its workers stopped).
KEEP3 = FAST_CONFIG + "keep_checkpoints = 3\n"


@pytest.mark.slow  # CI's slow run (the default run stays under 15 min)
def test_a_flipped_gradient_bit_before_the_all_reduce_is_caught_by_the_gradient_norm(
    tmp_path: Path, reference2: dict[int, float]
) -> None:
    """Every replica applies the same corrupt average, so their fingerprints agree; the
    gradient norm (the example reports it) does not. The job rolls back to a checkpoint
    before the step, recomputes it (clean now: the drill fires once) and loses nothing."""
    run = tmp_path / "run"
    flip = ["--inject", "sdc:rank=1:step=33:target=grad:bit=30"]
    proc = start_job(run, ["--nodes", "2", *flip, *PACE], ARGS, config=KEEP3)
    code, err = finish_job(proc, timeout=300)
    assert code == 0, err[-3000:]
    assert losses(run) == reference2
    evs = events(run)
    (injected,) = [e for e in evs if e["kind"] == "sdc_injected"]
    assert injected["target"] == "grad" and injected["step"] == 33 and injected["rank"] == 1
    (spike,) = [e for e in evs if e["kind"] == "grad_norm_spike"]
    assert spike["step"] == 33, spike
    (detected,) = [e for e in evs if e["kind"] == "sdc_detected"]
    assert detected["signal"] == "grad_norm" and detected["step"] == 33, detected
    assert detected["suspect_after"] == 31 and detected["nodes"] == []  # step 32 may hold it
    assert not [e for e in evs if e["kind"] == "pool_changed" and e["to"] == "faulty"]
    starts = [e for e in evs if e["kind"] == "generation_started"]
    assert len(starts) == 2 and starts[1]["restore_step"] in (25, 30), starts[1]
    assert not _suspect_restores(evs, detected)
    (sdc,) = report(run)["sdc"]
    assert sdc["signal"] == "grad_norm" and sdc["rollback_to"] == starts[1]["restore_step"]


@pytest.mark.slow  # in CI's slow run (keeps the default suite under 15 min)
def test_a_node_whose_gemms_go_wrong_in_training_is_named_by_its_probe_and_replaced(
    tmp_path: Path, reference2: dict[int, float]
) -> None:
    """node1 passes its pre-flight, then from step 40 every matrix product it computes is off
    in one element (its workers' and its probe's). The corrupt local gradients are averaged
    into both replicas alike (the fingerprints agree); node1's in-job known-answer probe
    fails, node1 is quarantined, the standby takes its rank, and the job restarts from a
    point before node1's last passing probe: the same losses as a run without the fault."""
    run = tmp_path / "run"
    probing = KEEP3.replace("probe_every_s = 0", "probe_every_s = 0.5")
    wrong = ["--inject", "gemm-wrong:node=1:step=40"]
    slow = ["--inject", "slow:rank=0:factor=8"]  # the probe process is up well before step 40
    proc = start_job(run, ["--nodes", "2", "--standby", "1", *wrong, *slow], ARGS, config=probing)
    code, err = finish_job(proc, timeout=300)
    assert code == 0, err[-3000:]
    assert losses(run) == reference2
    evs = events(run)
    fired = [e for e in evs if e["kind"] == "inject_fired" and e["inject"]["kind"] == "gemm-wrong"]
    # At the end of step 39 (the step completed, as every drill's event says): 40 on is wrong.
    assert fired and fired[0]["node"] == "node1" and fired[0]["step"] == 39, fired
    (detected,) = [e for e in evs if e["kind"] == "sdc_detected"]
    assert detected["signal"] == "gemm_probe" and detected["nodes"] == ["node1"], detected
    assert detected["step"] >= 39 and detected["suspect_after"] < 40, detected  # after 39: wrong
    (fault,) = [e for e in evs if e["kind"] == "fault"]
    assert fault["cause"] == "sdc" and fault["node_id"] == "node1"
    quarantined = [e for e in evs if e["kind"] == "pool_changed" and e["to"] == "faulty"]
    assert [e["node"] for e in quarantined] == ["node1"], quarantined
    starts = [e for e in evs if e["kind"] == "generation_started"]
    assert starts[1]["assignment"] == {"node0": 0, "node2": 1}, starts[1]
    back = starts[1]["restore_step"]
    assert back is None or back <= detected["suspect_after"], (back, detected)
    assert not _suspect_restores(evs, detected)
    (sdc,) = report(run)["sdc"]
    assert sdc["signal"] == "gemm_probe" and sdc["nodes"] == ["node1"]
    print(
        f"probe: last pass after step {detected['suspect_after']}, failed at step "
        f"{detected['step']}; restarted from {back}"
    )
