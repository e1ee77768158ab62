"""What the policy does about a detector's finding (``policy.react``) and the detectors' one
shape (``controller/detectors.py``), without a server."""

from __future__ import annotations

from tests.unit.test_sdc import cfg, running
from trainguard import protocol
from trainguard.controller.api import Pool
from trainguard.controller.detectors import Finding, ProbeDetector, Seen
from trainguard.controller.policy import react

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
    seen = Seen(node="node1", report=protocol.report_from_json(body), state=s, now=1000.0)
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
