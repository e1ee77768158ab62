"""What the policy does about a detector's finding (``policy.react``) and the detectors' one
shape (``controller/detectors.py``), without a server."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_sdc import cfg, running
from trainguard import protocol
from trainguard.controller.api import Pool
from trainguard.controller.detectors import Finding, ProbeDetector, Seen
from trainguard.controller.ingest import Intake
from trainguard.controller.jobstate import Inputs
from trainguard.controller.monitor import Monitor
from trainguard.controller.policy import react
from trainguard.controller.store import Store

STRAGGLER = {"rank": 1, "score": 0.4, "generation": 0}


def at_risk(node: str) -> Finding:
    return Finding(kind="node_at_risk", data={"node": node, "reason": "edac_ce rose"}, node=node)


def test_a_straggler_is_evicted_under_replace_only_when_a_healthy_standby_waits() -> None:
    s, obs = running(1000.0)
    s.join_order = ["node0", "node1", "node2"]
    f = Finding(kind="straggler", data=STRAGGLER, node="node0")
    r = react(f, s, obs, 1000.0, cfg(straggler_action="replace"))
    assert r.evict == {"node0": "straggler: rank 1 computes 0.4x the median"} and not r.record
    assert react(f, s, obs, 1000.0, cfg()).evict == {}  # straggler_action "alert": kept
    # The standby's agent went silent: no healthy standby, the straggler is kept.
    r = react(f, s, obs, 1000.0 + 60, cfg(straggler_action="replace"))
    assert r.evict == {} and r.record == [
        ("straggler_kept", {"node": "node0", "reason": "no healthy standby"})
    ]


def test_a_node_at_risk_is_drained_kept_quarantined_or_watched() -> None:
    s, obs = running(1000.0)
    s.join_order = ["node0", "node1", "node2"]
    c = cfg()
    r = react(at_risk("node1"), s, obs, 1000.0, c)
    assert r.evict == {"node1": "at risk: edac_ce rose"}
    assert r.alert[0][1]["action"] == "drain to a standby at the next checkpoint boundary"
    r = react(at_risk("node2"), s, obs, 1000.0, c)
    assert r.quarantine == {"node2": "at risk: edac_ce rose"} and r.evict == {}
    r = react(at_risk("node1"), s, obs, 1000.0 + 60, c)  # no live standby
    assert r.evict == {} and r.alert[0][1]["action"].startswith("kept: no healthy standby")
    s.pools["node3"] = Pool.FAULTY
    r = react(at_risk("node3"), s, obs, 1000.0, c)
    assert (r.evict, r.quarantine) == ({}, {}) and r.alert[0][1][
        "action"
    ] == "not training: watched"


def test_a_wrong_gemm_probe_is_a_suspicion_once() -> None:
    s, _ = running(1000.0)
    probe = {"t": 5.0, "generation": 0, "step": 30, "ok": False, "last_ok": [0, 20],
             "results": [{"device": "cuda:0", "mismatches": 3, "first_bad": [0, 1]},
                         {"device": "cuda:1", "mismatches": 0}]}  # fmt: skip
    body = {"node_id": "node1", "addr": "a", "incarnation": "i", "health": {"probe": probe}}
    report = protocol.report_from_json(body)
    seen = Seen(node="node1", report=report, steps=report.steps, state=s, now=1000.0)
    det = ProbeDetector()
    (f,) = det.observe(seen)
    why = f.suspicion
    assert why is not None and (why.signal, why.node, why.step, why.after) == (
        "gemm_probe",
        "node1",
        30,
        20,
    )
    assert (
        "cuda:0: 3 wrong element(s), first at [0, 1]" in why.detail and "cuda:1" not in why.detail
    )
    assert det.observe(seen) == []  # the same probe again: nothing new


def test_step_records_without_a_report_are_stored_and_seen_by_the_step_detectors(
    tmp_path: Path,
) -> None:
    """A relay sends a training node's step records in its alive entry, not in a whole report
    (protocol/relay.py): ``Intake.take_steps`` stores them and the step detectors see them
    (rank 0's non-finite loss is found) as they would a report's; the detectors of a report's
    other fields see nothing (there is no report)."""
    s, _ = running(1000.0)
    store = Store(tmp_path)
    try:
        intake = Intake(cfg(), store, Monitor(), lambda: None, lambda _n, _t: None)
        items = [{"step": 30, "t_end": 999.0, "dur": 0.1, "loss": 2.0},
                 {"step": 31, "t_end": 999.1, "dur": 0.1, "loss": float("nan")}]  # fmt: skip
        batch = protocol.StepBatch.from_json(
            {"generation": s.generation, "rank": 0, "items": items}
        )
        found = intake.take_steps("node0", [batch], s, Inputs(), 1000.0)
        assert [f.kind for f in found] == ["loss_nonfinite"], found
        store.flush_steps()  # the controller's, at the end of the uplink that carried them
        rows = store.db.execute("SELECT step FROM steps WHERE rank = 0 ORDER BY step").fetchall()
        assert rows == [(30,), (31,)]
    finally:
        store.close()
