"""The report protocol's validation and the timing rule that scales with the job."""

from __future__ import annotations

import json
import re

import pytest

from trainguard import protocol
from trainguard.controller.config import scaled_timing
from trainguard.protocol import PROTOCOL_VERSION, ProtocolError, report_from_json, report_to_json

GOOD = {
    "v": PROTOCOL_VERSION,
    "node_id": "node0",
    "addr": "127.0.0.2",
    "incarnation": "abc",
    "generation": 3,
    "workers": [{"rank": 0, "local_rank": 0, "pid": 1, "state": "running", "step": 9}],
    "memory": {"0": [[8, 3], [9, 3]]},
    "steps": [{"generation": 3, "rank": 0, "items": [{"step": 9, "t_end": 1000.0, "dur": 0.1}]}],
    "store": [3, 29500],
}


def test_a_well_formed_report_passes_and_unknown_fields_are_allowed() -> None:
    report_from_json(GOOD)
    report_from_json({**GOOD, "something_newer": {"x": 1}})


def test_a_report_survives_the_wire_typed() -> None:
    r = report_from_json(GOOD)
    assert (r.node_id, r.generation, r.store) == ("node0", 3, (3, 29500))
    assert r.workers[0].rank == 0 and r.workers[0].state == "running" and r.workers[0].step == 9
    assert r.ckptd.memory == {0: [(8, 3), (9, 3)]}
    assert r.steps[0].items == [protocol.StepRecord(step=9, t_end=1000.0, duration_s=0.1)]
    full = {**GOOD, "events": [{"kind": "ckpt_durable", "step": 9, "ts": 5.0}],
            "health": {"ok": False, "problems": ["disk"], "signals": {"edac_ce": 1}},
            "checks": [{"task": "1-node", "result": {"ok": True}}], "time": 7.0}  # fmt: skip
    wire = json.loads(json.dumps(report_to_json(report_from_json(full))))
    assert report_from_json(wire) == report_from_json(full)
    back = report_from_json(wire)
    assert back.events[0].step == 9 and back.events[0].to_json() == full["events"][0]
    assert back.health.problems == ("disk",) and back.checks[0].task == "1-node"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"node_id": 7}, "node_id"),
        ({"addr": "x" * 300}, "addr"),
        ({"generation": "3"}, "generation"),
        ({"workers": {"rank": 0}}, "workers: a list"),
        ({"workers": [{"rank": "0", "state": "running"}]}, "workers[].rank"),
        ({"memory": {"zero": [[1, 0]]}}, "rank 'zero'"),
        ({"memory": {"0": [[1, True]]}}, "memory[0]"),
        ({"steps": [{"generation": 1}]}, "steps[]"),
        ({"v": 0}, "v:"),
        ({"v": PROTOCOL_VERSION + 1}, "upgrade the controller"),
        ({"store": 5}, "store"),
        # Every field a worker report carries is checked, not only those read at once.
        ({"workers": [{**GOOD["workers"][0], "step": "abc"}]}, "workers[].step: int or null"),
        ({"workers": [{**GOOD["workers"][0], "exit_code": "boom"}]}, "workers[].exit_code"),
        ({"workers": [{**GOOD["workers"][0], "coll": "zz"}]}, "workers[].coll: list[int]"),
        ({"workers": [{**GOOD["workers"][0], "progress_age_s": [1]}]},
         "workers[].progress_age_s: float or null"),
        # Step records: every number a number (a null section time was an HTTP 500).
        ({"steps": [{"generation": 3, "rank": 0, "items": [{"step": 9, "t_end": 1.0, "dur": 1.0,
                                                            "sec": {"a": None}}]}]},
         "step record.sec: a mapping section → seconds"),
        ({"steps": [{"generation": 3, "rank": 0, "items": [{"step": 9, "t_end": 1.0, "dur": 1.0,
                                                            "loss": "x"}]}]},
         "step record.loss: a number or null"),
        ({"steps": [{"generation": 3, "rank": 0, "items": [{"step": 9, "t_end": 1.0, "dur": 1.0,
                                                            "tokens": "y"}]}]},
         "step record.tokens: an integer or null"),
        ({"events": [{"kind": "inject_fired", "inject": {"id": "x", "kind": 5}}]},
         "events[].inject.id: int expected"),
    ],
)  # fmt: skip
def test_a_malformed_field_is_named(change: dict[str, object], says: str) -> None:
    with pytest.raises(ProtocolError, match=None) as e:
        report_from_json({**GOOD, **change})
    assert says in str(e.value), str(e.value)


def test_the_heartbeat_scales_with_the_node_count() -> None:
    assert scaled_timing(4) == (0.5, 10.0)
    assert scaled_timing(4096) == (4.096, 20.48)
    hb, timeout = scaled_timing(16384)
    assert hb == 16.384 and timeout == 5 * hb  # five missed heartbeats


def test_through_relays_the_heartbeat_stays_at_most_2s_and_the_timeout_10s() -> None:
    """Issue 31's targets at every size: heartbeat <= 2 s, node timeout <= 10 s."""
    assert scaled_timing(1025, relays=3) == (2.0, 10.0)
    assert scaled_timing(4097, relays=9) == (2.0, 10.0)
    assert scaled_timing(16385, relays=33) == (2.0, 10.0)
    assert scaled_timing(1_000_000, relays=2000) == (2.0, 10.0)


CKPT = protocol.CkptConf(dir="/c", shm_dir="/dev/shm", keep=3, memory_tier=True)


@pytest.mark.parametrize(
    "desired",
    [
        protocol.Idle(),
        protocol.Idle(nproc_per_node=8, ckpt=CKPT),
        protocol.Shutdown(phase="SUCCEEDED", reason="all 16 ranks finished"),
        protocol.Check(task=protocol.CheckTask(id="1-node", run=1, stage="node", node_id="node0",
                                               level="quick", deadline_s=60.0,
                                               params={"gemm_n": 512, "inject": []})),
        protocol.Stop(generation=2, grace_s=15.0),
        protocol.Stop(generation=2, grace_s=15.0, dump_stacks=True, persist=(40, 2)),
        protocol.Run(
            generation=1, node_rank=0, nnodes=2, nproc_per_node=2, world_size=4,
            master_addr="127.0.0.2", master_port=29500, host_store=True, restore_step=30,
            restore_gen=0, restore_memory=True, ckpt=CKPT, restarts=1, max_restarts=3,
            injects=[protocol.InjectSpec(id=0, kind="kill", rank=1, step=5)], script="train.py",
            launch="script", log_dir=None, script_args=["--steps", "60"], hang_timeout_s=None,
            hang_timeout_min_s=30.0, hang_timeout_max_s=600.0, first_step_timeout_s=600.0,
            heartbeat_s=0.5, node_timeout_s=10.0, replica_peers=["127.0.0.3:4000"],
            replica_sources={"3": "127.0.0.3:4000"},
        ),
    ],
)  # fmt: skip
def test_each_desired_state_type_survives_the_wire(desired: protocol.Desired) -> None:
    wire = json.loads(json.dumps(protocol.desired_to_json(desired)))
    assert wire["action"] in ("idle", "shutdown", "check", "stop", "run")
    assert protocol.desired_from_json(wire) == desired


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([], "a desired state is a JSON object"),
        ({"action": "reboot"}, "desired.action: one of run, stop, idle, check, shutdown"),
        ({"action": "stop", "grace_s": 1.0}, "desired stop"),
        ({"action": "shutdown", "phase": "FAILED", "reason": "x", "extra": 1}, "desired shutdown"),
        ({"action": "idle", "ckpt": {"dir": "/c"}}, "desired.ckpt"),
        (
            {"action": "stop", "generation": 1, "grace_s": 1.0, "persist": {"s": 1}},
            "desired.persist",
        ),
    ],
)
def test_a_malformed_desired_state_is_refused_by_name(body: object, says: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(says)):
        protocol.desired_from_json(body)


def test_fault_causes_are_an_enum_that_reads_as_its_wire_string() -> None:
    assert protocol.FaultCause.NODE_LOST == "node_lost"
    assert json.dumps({"cause": protocol.FaultCause.HANG}) == '{"cause": "hang"}'
    assert protocol.FaultCause("worker_crash") is protocol.FaultCause.WORKER_CRASH


def test_the_report_body_refuses_values_no_store_holds() -> None:
    """``protocol.loads`` is how the controller decodes a report body: integers past 64 bits
    are refused there, a non-finite time by the report's check (either reached SQLite once:
    HTTP 500 until the job failed); a NaN loss is read as the value it is."""
    with pytest.raises(ProtocolError, match="does not fit 64 bits"):
        protocol.loads(b'{"generation": 99999999999999999999}')
    for raw in (b'{"time": NaN}', b'{"time": -Infinity}'):
        with pytest.raises(ProtocolError, match="time: seconds since the epoch"):
            report_from_json({**GOOD, **protocol.loads(raw)})
    item = protocol.loads(b'{"step": 9, "t_end": 1.0, "dur": 0.1, "loss": NaN}')
    steps = [{"generation": 3, "rank": 0, "items": [item]}]
    assert report_from_json({**GOOD, "steps": steps}).steps[0].items[0].loss != 0.0


def test_a_long_poll_takes_its_mark_and_a_bounded_wait_or_refuses_them() -> None:
    """``/v1/desired`` (controller, relay) and ``/v1/relay/desired`` share one reading: a
    malformed or non-finite value is a 400 naming the fields, never a 500 or a wait of NaN."""
    from trainguard.protocol.desired import MAX_WAIT_S, long_poll_args

    assert long_poll_args({}, "version") == (0, 10.0)
    assert long_poll_args({"since": "7", "wait_s": "2.5"}, "since") == (7, 2.5)
    assert long_poll_args({"version": "3", "wait_s": "900"}, "version") == (3, MAX_WAIT_S)
    assert long_poll_args({"version": "3", "wait_s": "-4"}, "version") == (3, 0.0)
    for bad in ({"version": "x"}, {"wait_s": "soon"}, {"wait_s": "nan"}, {"wait_s": "inf"}):
        with pytest.raises(protocol.ProtocolError) as e:
            long_poll_args(bad, "version")
        assert "wait_s" in str(e.value)
