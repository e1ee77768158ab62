"""Issue 15: silent data corruption during training. One bit flipped in a real parameter of
one rank (``--inject sdc``) crashes nothing; the replicas' snapshot fingerprints differ at
the next snapshot, the culprit is named (majority of 4) or the corruption is certain but not
localized (2 replicas), the job rolls back to the last agreeing step, and its losses equal a
fault-free run's, step for step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import (
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


def test_two_replicas_that_disagree_roll_back_without_naming_a_culprit(
    tmp_path: Path, reference2: dict[int, float]
) -> None:
    """With 2 replicas no majority names the culprit: the job rolls back (nobody is
    quarantined) and still ends with the fault-free losses."""
    run = tmp_path / "run"
    proc = start_job(run, ["--nodes", "2", "--inject", "sdc:rank=1:step=30:bit=20"], ARGS)
    code, err = finish_job(proc, timeout=300)
    assert code == 0, err[-3000:]
    assert losses(run) == reference2
    evs = events(run)
    (detected,) = [e for e in evs if e["kind"] == "sdc_detected"]
    assert detected["step"] == 30 and detected["culprits"] == [] and detected["undecided"] == [0, 1]
    assert detected["last_agreed"][0] in (15, 20, 25), detected
    assert not [e for e in evs if e["kind"] == "pool_changed" and e["to"] == "faulty"]
    assert not _suspect_restores(evs, detected)


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
