"""The node's two wires: runtime → agent datagrams (protocol/worker.py over runtime/wire.py's
HMAC framing) and ckptd's requests and replies (protocol/ckptd.py). Each type survives its
wire; a malformed message is refused with its reason."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from typing import Any

import pytest

from trainguard.protocol import PROTOCOL_VERSION, ProtocolError, StepRecord
from trainguard.protocol import ckptd as cw
from trainguard.protocol import worker as ww
from trainguard.runtime import wire

TOKEN = bytes.fromhex("00" * 31 + "2a")
SENDER = ww.Sender(rank=3, pid=4242, generation=2)
RECORD = StepRecord(
    step=9, t_end=1.7e9, duration_s=0.25, loss=2.5, tokens=4096, grad_norm=1.5,
    sections={"forward": 0.1, "communication": 0.05}, t_coll=1.7e9 - 0.1, gap=0.02,
)  # fmt: skip
FIRED = ww.WorkerEvent(
    kind="inject_fired", ts=1.7e9, data={"inject": {"id": 0, "kind": "kill"}, "step": 5}
)
MESSAGES: list[ww.WorkerMessage] = [
    ww.Heartbeat(ts=1.7e9),
    ww.Heartbeat(
        ts=1.7e9, step=8, coll=(12, 11), cpu_s=3.5, fingerprint=77, phase="eval", total_steps=100
    ),
    ww.StepEnd(RECORD),
    ww.StepEnd(StepRecord(step=1, t_end=1.7e9, duration_s=3.0)),
    ww.Alive(),
    ww.WorkerEvent(kind="ckpt_load_end", ts=1.7e9, data={"step": 4, "tier": "memory"}),
    FIRED,
    ww.Batch((ww.StepEnd(RECORD), ww.Alive(), FIRED, ww.Heartbeat(ts=1.0, coll=(1, 1)))),
    ww.Batch(()),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_each_worker_message_survives_the_signed_datagram(msg: ww.WorkerMessage) -> None:
    data = wire.encode_message(TOKEN, SENDER, msg)
    assert wire.decode_message(TOKEN, data) == (SENDER, msg)
    body = wire.decode(TOKEN, data)
    assert body["v"] == PROTOCOL_VERSION
    assert (body["rank"], body["pid"], body["gen"]) == (3, 4242, 2)


def test_a_step_datagram_keeps_the_short_keys_and_a_full_batch_fits() -> None:
    body = wire.decode(TOKEN, wire.encode_message(TOKEN, SENDER, ww.StepEnd(RECORD)))
    assert set(body) == {"t", "step", "t_end", "dur", "loss", "tokens", "gn", "sec", "tc",
                         "gap", "v", "rank", "pid", "gen"}  # fmt: skip
    assert body["t"] == "step" and body["dur"] == 0.25 and body["gn"] == 1.5
    batch = ww.Batch(tuple(ww.StepEnd(RECORD) for _ in range(64)))  # what the reporter sends
    assert len(wire.encode_message(TOKEN, SENDER, batch)) < wire.MAX_DATAGRAM_BYTES // 2


def test_an_event_keeps_its_data_and_its_sender_is_the_datagrams() -> None:
    ev = ww.WorkerEvent(kind="ckpt_per_rank_absent", ts=1.0, data={"step": 3, "rank": 7})
    sender, got = wire.decode_message(TOKEN, wire.encode_message(TOKEN, SENDER, ev))
    assert sender.rank == 3 and isinstance(got, ww.WorkerEvent)
    assert got.data == {"step": 3}  # the event's own "rank" is its sender's, as before
    assert (FIRED.fired_step, FIRED.fired_kind) == (5, "kill")
    assert (got.fired_step, got.fired_kind) == (None, None)


def test_a_datagram_signed_with_another_token_is_refused_before_parsing() -> None:
    data = wire.encode_message(b"other", SENDER, ww.Alive())
    with pytest.raises(wire.WireAuthError):
        wire.decode_message(TOKEN, data)
    with pytest.raises(wire.WireAuthError):
        wire.decode_message(TOKEN, b"no signature")


HB: dict[str, Any] = {"t": "hb", "ts": 1.0, "rank": 0, "pid": 1, "gen": 0}
STEP: dict[str, Any] = {"t": "step", "step": 1, "t_end": 1.0, "dur": 0.1, "rank": 0, "pid": 1,
                        "gen": 0}  # fmt: skip
EVENT: dict[str, Any] = {"t": "event", "kind": "x", "ts": 1.0, "rank": 0, "pid": 1, "gen": 0}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({**HB, "v": PROTOCOL_VERSION + 1}, "this agent speaks"),
        ({**HB, "v": "1"}, "v: the protocol version"),
        ({**HB, "rank": "0"}, "rank, pid, gen"),
        ({k: v for k, v in HB.items() if k != "pid"}, "rank, pid, gen"),
        ({**HB, "t": "beat"}, "t: one of hb, step, alive, event, batch, got 'beat'"),
        ({**HB, "t": ["hb"]}, "t: one of"),
        ({**HB, "ts": "now"}, "hb.ts"),
        ({**HB, "step": 1.5}, "hb.step"),
        ({**HB, "coll": [1]}, "hb.coll"),
        ({**HB, "cpu": "1"}, "hb.cpu"),
        ({**HB, "fp": 1.5}, "hb.fp"),
        ({**HB, "phase": 3}, "hb.phase"),
        ({**HB, "total": "100"}, "hb.total"),
        ({**STEP, "step": "1"}, "step record.step"),
        ({k: v for k, v in STEP.items() if k != "dur"}, "step record.dur"),
        ({**STEP, "sec": [1]}, "step record.sec"),
        ({**STEP, "sec": {"forward": "slow"}}, "step:"),
        ({**STEP, "loss": "2.5"}, "step.loss"),
        ({**EVENT, "kind": ""}, "event.kind"),
        ({**EVENT, "ts": None}, "event x.ts"),
        ({**EVENT, "kind": "inject_fired", "inject": {"kind": "kill"}}, "inject_fired.step"),
        ({**EVENT, "kind": "inject_fired", "step": 1, "inject": "kill"}, "inject_fired.inject"),
        ({**HB, "t": "batch", "items": {"t": "hb"}}, "batch.items: a list"),
        ({**HB, "t": "batch", "items": [{"t": "batch", "items": []}]}, "got 'batch'"),
        ({**HB, "t": "batch", "items": [{"t": "hb", "ts": 1.0}, 7]}, "a JSON object, got int"),
        ({**HB, "t": "batch", "items": [{"t": "alive"}] * (ww.MAX_BATCH + 1)}, "at most"),
    ],
)
def test_a_malformed_worker_message_is_refused_with_its_reason(body: Any, says: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(says)):
        wire.decode_message(TOKEN, wire.encode(TOKEN, body))


def _signed(body: Any) -> bytes:
    """A datagram whose (signed) body is not a JSON object: ``encode`` only takes objects."""
    raw = json.dumps(body).encode()
    return hmac.new(TOKEN, raw, hashlib.sha256).hexdigest().encode() + b"\n" + raw


def test_a_body_that_is_not_an_object_is_refused_as_the_framing_always_did() -> None:
    with pytest.raises(ValueError, match="not a JSON object"):
        wire.decode_message(TOKEN, _signed([1, 2]))
    with pytest.raises(ProtocolError, match="a datagram is a JSON object, got list"):
        ww.message_from_json([1, 2])


# ------------------------------------------------------------------------------ ckptd wire
REQUESTS: list[cw.CkptdRequest] = [
    cw.Alloc(rank=0, nbytes=1 << 20),
    cw.Staged(rank=1, slot="/dev/shm/s0", step=4, generation=1, durable=True),
    cw.Persist(step=4, generation=1),
    cw.WaitDurable(step=4, timeout_s=30.0),
    cw.WaitDurable(step=4, timeout_s=30),
    cw.Verify(rank=1, step=4, generation=1, for_generation=2),
    cw.Forget(slot="/dev/shm/s1"),
    cw.Status(),
    cw.Status(rescan=True),
    cw.SetPeers(),
    cw.SetPeers(addrs=("127.0.0.3:4000", "127.0.0.4:4000")),
    cw.Fetch(rank=1, step=4, generation=1, source="127.0.0.3:4000"),
    cw.Shutdown(),
    cw.Shutdown(unlink=True),
]


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: r.op)
def test_each_ckptd_request_survives_the_wire(req: cw.CkptdRequest) -> None:
    body = json.loads(json.dumps(cw.request_to_json(req)))
    assert body["op"] == req.op and body["v"] == PROTOCOL_VERSION
    assert cw.request_from_json(body) == req


REPLIES: list[tuple[cw.Request[Any], Any]] = [
    (cw.Alloc(rank=0, nbytes=8), cw.AllocReply(slots=("/dev/shm/a-s0", "/dev/shm/a-s1"))),
    (cw.Staged(rank=0, slot="s", step=1, generation=0, durable=False), cw.OkReply()),
    (cw.Persist(step=4, generation=1), cw.PersistReply(ranks=(0, 1))),
    (cw.WaitDurable(step=4, timeout_s=1.0), cw.WaitDurableReply(durable=True)),
    (cw.WaitDurable(step=4, timeout_s=1.0), cw.WaitDurableReply(durable=False, failed="ENOSPC")),
    (cw.Verify(rank=0, step=1, generation=0, for_generation=1),
     cw.VerifyReply(slot="/dev/shm/a-s0", ok=True, problem=None)),
    (cw.Verify(rank=0, step=1, generation=0, for_generation=1),
     cw.VerifyReply(slot=None, ok=False, problem="rank 0 holds no snapshot of step 1")),
    (cw.Status(), cw.StatusReply(memory={})),
    (cw.Status(rescan=True), cw.StatusReply(
        memory={"0": [[4, 1], [5, 1]]}, fingerprints={"0": [[5, 1, 9, 123]]},
        events=({"kind": "ckpt_rescanned", "rank": 0},), idle=False,
        replica_addr="127.0.0.2:4000", replicas={"1": [[5, 1]]})),
    (cw.Fetch(rank=1, step=4, generation=1, source="h:1"), cw.FetchReply(slot="/dev/shm/x")),
    (cw.Shutdown(unlink=True), cw.ErrorReply(error="no such slot")),
]  # fmt: skip


@pytest.mark.parametrize(("req", "reply"), REPLIES, ids=lambda x: type(x).__name__)
def test_each_ckptd_reply_survives_the_wire(req: cw.Request[Any], reply: Any) -> None:
    body = json.loads(json.dumps(cw.reply_to_json(reply)))
    assert cw.reply_from_json(req, body) == reply


ALLOC: dict[str, Any] = {"op": "alloc", "rank": 0, "nbytes": 8}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([ALLOC], "a ckptd request is a JSON object, got list"),
        (
            {"op": "reboot"},
            "op: one of alloc, staged, persist, wait_durable, verify, forget, "
            "status, set_peers, fetch, shutdown, got 'reboot'",
        ),
        ({"rank": 0}, "op: one of"),
        ({"op": ["alloc"]}, "op: one of"),
        ({**ALLOC, "v": PROTOCOL_VERSION + 1}, f"alloc: protocol version {PROTOCOL_VERSION + 1}"),
        ({**ALLOC, "v": True}, "alloc.v"),
        ({"op": "alloc", "rank": 0}, "alloc.nbytes: missing"),
        ({**ALLOC, "rank": "0"}, "alloc.rank: an integer, got '0'"),
        ({**ALLOC, "rank": True}, "alloc.rank: an integer"),
        ({**ALLOC, "bytes": 8}, "alloc: unknown field(s) bytes"),
        (
            {"op": "staged", "rank": 0, "slot": "s", "step": 1, "generation": 0, "durable": 1},
            "staged.durable: true or false",
        ),
        ({"op": "wait_durable", "step": 1, "timeout_s": "5"}, "wait_durable.timeout_s: a number"),
        ({"op": "verify", "rank": 0, "step": 1, "generation": 0}, "verify.for_generation"),
        ({"op": "forget", "slot": None}, "forget.slot: a string"),
        ({"op": "status", "rescan": "yes"}, "status.rescan"),
        ({"op": "set_peers", "addrs": "h:1"}, "set_peers.addrs: a list of strings"),
        ({"op": "set_peers", "addrs": [1]}, "set_peers.addrs: a list of strings"),
        ({"op": "fetch", "rank": 0, "step": 1, "generation": 0}, "fetch.source: missing"),
        ({"op": "shutdown", "unlink": None}, "shutdown.unlink"),
    ],
)
def test_a_malformed_ckptd_request_is_refused_with_its_reason(body: Any, says: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(says)):
        cw.request_from_json(body)
    with pytest.raises(ProtocolError) as e:
        cw.request_from_json(body)
    assert cw.refused(e.value) == cw.ErrorReply(error=f"refused: {e.value}")


@pytest.mark.parametrize(
    ("req", "body", "says"),
    [
        (cw.Status(), [], "status reply: a JSON object"),
        (cw.Status(), {"memory": {"zero": [[1, 0]]}}, "status reply.memory"),
        (cw.Status(), {"memory": {"0": [[1, True]]}}, "status reply.memory"),
        (cw.Status(), {"memory": {}, "events": [1]}, "status reply.events: a list of objects"),
        (cw.Status(), {"fingerprints": {}}, "status reply.memory: missing"),
        (cw.Alloc(rank=0, nbytes=1), {"slots": "/dev/shm/x"}, "alloc reply.slots"),
        (cw.Alloc(rank=0, nbytes=1), {"ok": True}, "alloc reply: unknown field(s) ok"),
        (
            cw.Verify(rank=0, step=1, generation=0, for_generation=1),
            {"ok": True},
            "verify reply.slot: missing",
        ),
        (cw.Persist(step=1, generation=0), {"ranks": [0], "v": 99}, "protocol version 99"),
        (cw.Forget(slot="s"), {"error": 3}, "forget reply.error: a string"),
    ],
)
def test_a_malformed_ckptd_reply_is_refused_with_its_reason(
    req: cw.Request[Any], body: Any, says: str
) -> None:
    with pytest.raises(ProtocolError, match=re.escape(says)):
        cw.reply_from_json(req, body)


def test_every_ckptd_op_has_one_request_type_and_its_reply_type() -> None:
    ops = [r.op for r in REQUESTS]
    assert set(ops) == set(cw._OPS) and len(cw._OPS) == 10
    for kind in cw._OPS.values():
        assert kind.reply in (cw.OkReply, cw.AllocReply, cw.PersistReply, cw.WaitDurableReply,
                              cw.VerifyReply, cw.StatusReply, cw.FetchReply)  # fmt: skip


# A real worker's sender, as the agent's datagram drain takes it.
SENDER_JSON = {"v": 1, "rank": 0, "pid": 4242, "gen": 0}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        # An inject_fired event is checked as the report wire checks it: a drill the agent
        # forwards can never be one its controller refuses (that killed the agent once).
        ({"t": "event", "kind": "inject_fired", "ts": 1.0, "step": 3, "inject": {"kind": "kill"}},
         "event inject_fired.inject: InjectSpec.__init__() missing 1 required"),
        ({"t": "event", "kind": "inject_fired", "ts": 1.0, "step": 3,
          "inject": {"id": 0, "kind": 5}}, "event inject_fired.inject.kind: str expected"),
    ],
)  # fmt: skip
def test_a_drill_the_report_wire_would_refuse_is_refused_on_receipt(body: Any, says: str) -> None:
    with pytest.raises(ProtocolError) as e:
        wire.decode_message(TOKEN, wire.encode(TOKEN, {**SENDER_JSON, **body}))
    assert str(e.value).startswith(says), e.value


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"t": "event", "kind": "x", "ts": NaN}', "event x.ts: seconds since the epoch"),
        (b'{"t": "event", "kind": "x", "ts": 1e400}', "event x.ts: seconds since the epoch"),
        (b'{"t": "event", "kind": "x", "ts": 1.0, "step": 1000000000000000000000000000000}',
         "does not fit 64 bits"),
        (b'{"t": "hb", "ts": Infinity}', "hb.ts: seconds since the epoch"),
    ],
)  # fmt: skip
def test_no_datagram_carries_a_value_the_store_or_a_deadline_cannot_hold(
    raw: bytes, says: str
) -> None:
    """A time that is NaN or infinite, and an integer past 64 bits (refused at decoding, on
    every wire), never reach the store: one such event once made every report of its node
    fail there (HTTP 500) until the job failed. A NaN loss is a value, not an error."""
    body = raw[:-1] + b', "v": 1, "rank": 0, "pid": 4242, "gen": 0}'
    with pytest.raises(ProtocolError, match=re.escape(says)):
        wire.decode_message(TOKEN, hmac.new(TOKEN, body, hashlib.sha256).hexdigest().encode()
                            + b"\n" + body)  # fmt: skip


def test_a_nan_loss_or_infinite_gradient_norm_travels_the_datagram() -> None:
    """What the anomaly and SDC checks look for must reach them."""
    body = (b'{"t": "step", "step": 5, "t_end": 1.0, "dur": 0.5, "loss": NaN, "gn": Infinity, '
            b'"v": 1, "rank": 0, "pid": 4242, "gen": 0}')  # fmt: skip
    _, msg = wire.decode_message(TOKEN, hmac.new(TOKEN, body, hashlib.sha256).hexdigest().encode()
                                 + b"\n" + body)  # fmt: skip
    assert isinstance(msg, ww.StepEnd) and msg.record.grad_norm == float("inf")
    assert msg.record.loss != msg.record.loss  # NaN
