"""The relay wire (issue 31) without a network: ``protocol/relay.py`` (shape keys, alive
entries and their checks), ``controller/relays.py`` (``apply_alive`` into an observation made
by ``ingest.observe``; the ``RelayBook``'s routes, change numbers and lost relays) and the
relay's own bookkeeping (``relay/server.py`` ``Relay.take``, ``uplink_body``, ``apply``)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from trainguard import protocol
from trainguard.controller.api import NodeObs
from trainguard.controller.ingest import observe
from trainguard.controller.relays import RelayBook, apply_alive, desired_batch, superseded
from trainguard.protocol.common import ProtocolError
from trainguard.protocol.relay import (
    APPENDED,
    NODE_VOLATILE,
    WORKER_VOLATILE,
    alive_entry,
    check_alive,
    check_uplink,
    shape_key,
)
from trainguard.protocol.report import _WORKER_FIELDS
from trainguard.relay.server import STEP_BATCHES_KEPT, Relay

T0 = 1_700_000_000.0  # the agent's clock at its first report


def _worker(rank: int, step: int, **kw: Any) -> dict[str, Any]:
    return {"rank": rank, "local_rank": rank, "pid": 100 + rank, "state": "running",
            "step": step, "progress_age_s": 0.1, "heartbeat_age_s": 0.05,
            "last_progress_at": T0 - 0.1, "coll": [10 * step, 10 * step], "runtime": True,
            "cpu_idle_s": 0.0, "in_trainguard": False, "proc_state": "running", **kw}  # fmt: skip


def agent_report(
    node: str = "node0", gen: int | None = 2, steps: tuple[int, ...] = (40, 41), **kw: Any
) -> dict[str, Any]:
    """A report as an agent writes it (every field, ``report_to_json`` of a checked one):
    generation ``gen``, one running worker per entry of ``steps`` (rank i at step steps[i])."""
    body = {"node_id": node, "addr": "127.0.0.2", "incarnation": "inc-1", "generation": gen,
            "desired_version": 3, "time": T0, "ckptd_at": T0 - 0.5,
            "workers": [_worker(r, s) for r, s in enumerate(steps)], **kw}  # fmt: skip
    return protocol.report_to_json(protocol.report_from_json(body))


def _other(kind: str, v: Any) -> Any:
    """A value of annotation ``kind`` other than ``v``."""
    base = kind.removesuffix(" | None")
    if base == "bool":
        return not v
    if base == "int":
        return (v or 0) + 1
    if base == "float":
        return (v or 0.0) + 1.5
    if base == "list[int]":
        return [*(v or []), 7]
    return f"{v}-changed"


def _snapshot(o: NodeObs) -> dict[str, Any]:
    return copy.deepcopy(dataclasses.asdict(o))


# --------------------------------------------------------------------------- shape keys
def test_the_volatile_fields_are_fields_of_the_report() -> None:
    """Every volatile name is a real field (a typo would make it shape, silently)."""
    assert set(WORKER_VOLATILE) <= set(_WORKER_FIELDS)
    assert set(NODE_VOLATILE) <= set(agent_report())
    assert len(set(WORKER_VOLATILE)) == len(WORKER_VOLATILE)


@pytest.mark.parametrize("field", sorted(_WORKER_FIELDS))
def test_shape_key_ignores_a_worker_field_iff_it_is_volatile(field: str) -> None:
    """Changing one field of one worker: the shape stays only for WORKER_VOLATILE fields."""
    base = agent_report()
    changed = copy.deepcopy(base)
    w = changed["workers"][1]
    w[field] = (
        "failed" if field == "state" else _other(_WORKER_FIELDS[field], w[field])
    )  # a value the report's check takes
    protocol.report_from_json(changed)
    assert (shape_key(changed) == shape_key(base)) is (field in WORKER_VOLATILE), field


@pytest.mark.parametrize("field", sorted(agent_report()))
def test_shape_key_ignores_a_report_field_iff_it_is_volatile(field: str) -> None:
    """Changing one top-level field of the report: the shape stays only for NODE_VOLATILE, the
    APPENDED records (gathered into alive entries) and events (a report with any goes whole,
    whatever its shape: ``Relay.take``)."""
    base = agent_report()
    changed = copy.deepcopy(base)
    changed[field] = ["something else", 1]
    kept = field in NODE_VOLATILE or field in APPENDED or field == "events"
    assert (shape_key(changed) == shape_key(base)) is kept, field


def test_shape_key_sees_added_fields_workers_and_events() -> None:
    """A field this version does not know, a worker more or less: shape; an event or a step
    record is not (the relay forwards a report with events whole, and gathers step records)."""
    base = agent_report()
    assert shape_key({**base, "future_field": 1}) != shape_key(base)
    assert shape_key(agent_report(steps=(40,))) != shape_key(base)
    assert shape_key(agent_report(events=[{"kind": "x", "ts": T0}])) == shape_key(base)
    batch = {"generation": 2, "rank": 0, "items": [{"step": 41, "t_end": T0, "dur": 0.1}]}
    assert shape_key({**base, "steps": [batch]}) == shape_key(base)
    # Only the volatile fields of every worker and the clock changed: the same shape.
    later = agent_report(steps=(90, 91), time=T0 + 60, ckptd_at=T0 + 59)
    for w in later["workers"]:
        w.update(progress_age_s=3.0, heartbeat_age_s=0.7, cpu_idle_s=2.0, in_trainguard=True,
                 proc_state="sleeping", coll=[1, 2], last_progress_at=T0 + 50)  # fmt: skip
    assert shape_key(later) == shape_key(base)


# --------------------------------------------------------------------------- alive entries
def _wire(entry: list[Any]) -> list[Any]:
    """``entry`` as the controller reads it off the wire, checked."""
    return check_alive(json.loads(json.dumps(entry)))


def test_an_alive_entry_round_trip_refreshes_the_observation() -> None:
    """report → observe at controller time 1000; a later report of the same shape as an alive
    entry aged 0.5 s, applied at 1010: last_seen 1009.5, the clock skew from that report,
    each worker's volatile fields, ckptd_at, the newest step of the generation."""
    first = agent_report()
    o = observe("node0", protocol.report_from_json(first), None, now=1000.0)
    assert o.steps_seen == {2: 41} and o.last_seen == 1000.0
    later = agent_report(steps=(55, 57), time=T0 + 9.8, ckptd_at=T0 + 9.0)
    later["workers"][0].update(progress_age_s=0.4, heartbeat_age_s=0.2, cpu_idle_s=None,
                               coll=[551, 550], in_trainguard=True, proc_state="sleeping",
                               last_progress_at=T0 + 9.4)  # fmt: skip
    assert shape_key(later) == shape_key(first)
    entry = _wire(alive_entry(later, age_s=0.5))
    assert entry[:3] == ["node0", "inc-1", 0.5]
    apply_alive(o, entry, now=1010.0)
    assert o.last_seen == 1009.5
    assert o.clock_skew_s == round(T0 + 9.8 - 1009.5, 3)
    assert o.ckptd_at == T0 + 9.0
    for w in later["workers"]:
        got = o.workers[w["rank"]]
        assert {k: getattr(got, k) for k in WORKER_VOLATILE} == {k: w[k] for k in WORKER_VOLATILE}
        assert (got.state, got.pid, got.runtime) == ("running", 100 + w["rank"], True)
    assert o.steps_seen == {2: 57}
    assert o.generation == 2 and o.incarnation == "inc-1"


def test_an_alive_entry_with_step_records_refreshes_the_observation_as_one_without() -> None:
    """An entry carrying step batches (its 6th item): applied as the 5-item one is (the
    records themselves go to the store through ``Controller.take_steps``)."""
    o = observe("node0", protocol.report_from_json(agent_report()), None, now=1000.0)
    later = agent_report(steps=(55, 57))
    batch = [{"generation": 2, "rank": 0, "items": [{"step": 55, "t_end": T0, "dur": 0.1}]}]
    entry = _wire(alive_entry(later, age_s=0.5, steps=batch))
    assert len(entry) == 6 and check_alive(entry) == entry
    apply_alive(o, entry, now=1010.0)
    assert o.last_seen == 1009.5 and o.steps_seen == {2: 57}


def test_an_older_alive_entry_never_moves_last_seen_or_the_skew_back() -> None:
    """An entry that was older than what the controller already has (a relay that was frozen
    sends what it held): last_seen, the clock skew and ckptd_at stay; steps_seen only grows."""
    o = observe("node0", protocol.report_from_json(agent_report()), None, now=1000.0)
    apply_alive(o, _wire(alive_entry(agent_report(steps=(60, 61), time=T0 + 20), 0.0)), 1020.0)
    assert (o.last_seen, o.steps_seen) == (1020.0, {2: 61})
    skew, ckptd_at = o.clock_skew_s, o.ckptd_at
    stale = agent_report(steps=(50, 51), time=T0 + 10, ckptd_at=T0 + 9)
    apply_alive(o, _wire(alive_entry(stale, age_s=9.0)), now=1021.0)  # seen at 1012 < 1020
    assert o.last_seen == 1020.0
    assert (o.clock_skew_s, o.ckptd_at) == (skew, ckptd_at)
    assert o.steps_seen == {2: 61}


def test_an_alive_entry_keeps_steps_seen_per_generation_bounded() -> None:
    """steps_seen of a node with no generation is not touched; with one, only its entry."""
    o = observe("node0", protocol.report_from_json(agent_report(gen=None)), None, now=1.0)
    apply_alive(o, _wire(alive_entry(agent_report(gen=None, steps=(70, 71)), 0.0)), 2.0)
    assert o.steps_seen == {}
    o = observe("node0", protocol.report_from_json(agent_report(gen=5)), o, now=3.0)
    assert o.steps_seen == {5: 41}
    apply_alive(o, _wire(alive_entry(agent_report(gen=5, steps=(80, 79)), 0.0)), 4.0)
    assert o.steps_seen == {5: 80}


def test_a_field_missing_from_the_report_leaves_a_flag_and_clears_an_optional_value() -> None:
    """A report without ``in_trainguard`` (a bool) and ``cpu_idle_s`` (float | None) — an
    older agent's: the entry carries None for both; the flag keeps the value the observation
    has (its default), the optional value is None, as a whole report would make it."""
    first = agent_report()
    first["workers"][0]["in_trainguard"] = True
    o = observe("node0", protocol.report_from_json(first), None, now=1.0)
    assert o.workers[0].in_trainguard is True and o.workers[0].cpu_idle_s == 0.0
    later = agent_report(steps=(42, 43))
    for w in later["workers"]:
        del w["in_trainguard"], w["cpu_idle_s"]
    entry = _wire(alive_entry(later, 0.1))
    k_flag, k_idle = (1 + WORKER_VOLATILE.index(k) for k in ("in_trainguard", "cpu_idle_s"))
    assert entry[4][0][k_flag] is None and entry[4][0][k_idle] is None
    apply_alive(o, entry, now=2.0)
    assert o.workers[0].in_trainguard is True  # kept
    assert o.workers[1].in_trainguard is False  # the default observe gave it
    assert o.workers[0].cpu_idle_s is None and o.workers[1].cpu_idle_s is None
    assert o.workers[0].step == 42
    # A report missing the clock: the skew is not touched, last_seen still moves.
    skew = o.clock_skew_s
    apply_alive(o, _wire(alive_entry({**agent_report(), "time": None}, 0.0)), now=3.0)
    assert (o.last_seen, o.clock_skew_s) == (3.0, skew)


@pytest.mark.parametrize(
    ("rank", "field", "value", "says"),
    [
        (0, "step", "41", "rank 0.step: int | None"),
        (1, "step", 4.5, "rank 1.step: int | None"),
        (1, "in_trainguard", 1, "rank 1.in_trainguard: bool"),
        (0, "coll", [1, "2"], "rank 0.coll: list[int] | None"),
        (0, "progress_age_s", "0.1", "rank 0.progress_age_s: float | None"),
        (1, "proc_state", 3, "rank 1.proc_state: str | None"),
    ],
)
def test_a_worker_value_of_the_wrong_type_is_refused_by_name_and_nothing_changes(
    rank: int, field: str, value: Any, says: str
) -> None:
    """One bad value in one worker: ProtocolError naming node, rank and field; the
    observation is left exactly as it was (no half-applied entry)."""
    o = observe("node0", protocol.report_from_json(agent_report()), None, now=1.0)
    before = _snapshot(o)
    entry = _wire(alive_entry(agent_report(steps=(50, 51)), 0.0))
    entry[4][rank][1 + WORKER_VOLATILE.index(field)] = value
    with pytest.raises(ProtocolError, match=f"alive\\[node0\\] {_re(says)}"):
        apply_alive(o, entry, now=2.0)
    assert _snapshot(o) == before


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("time", "noon", "alive[].time: seconds since the epoch"),
        ("time", float("inf"), "alive[].time: seconds since the epoch"),
        ("ckptd_at", [1], "alive[].ckptd_at: seconds since the epoch"),
    ],
)
def test_a_node_value_of_the_wrong_type_is_refused_by_name(
    field: str, value: Any, says: str
) -> None:
    o = observe("node0", protocol.report_from_json(agent_report()), None, now=1.0)
    before = _snapshot(o)
    entry = _wire(alive_entry(agent_report(), 0.0))
    entry[3][NODE_VOLATILE.index(field)] = value
    with pytest.raises(ProtocolError, match=_re(says)):
        apply_alive(o, entry, now=2.0)
    assert _snapshot(o) == before


def test_a_rank_not_among_the_nodes_workers_is_refused() -> None:
    """An entry naming rank 7 for a node whose workers are ranks 0 and 1 (a stale entry of
    another generation's layout): refused, nothing applied, not even to ranks 0 and 1."""
    o = observe("node0", protocol.report_from_json(agent_report()), None, now=1.0)
    before = _snapshot(o)
    entry = _wire(alive_entry(agent_report(steps=(50, 51)), 0.0))
    entry[4][1][0] = 7
    with pytest.raises(ProtocolError, match="rank 7 is not among its workers"):
        apply_alive(o, entry, now=2.0)
    assert _snapshot(o) == before


def _re(s: str) -> str:
    import re

    return re.escape(s)


@pytest.mark.parametrize(
    "entry",
    [
        {"node": "n"},
        ["node0", "inc-1", 0.0, [None, None]],  # 4 items
        ["node0", "inc-1", -1.0, [None, None], []],  # negative age
        ["node0", "inc-1", float("nan"), [None, None], []],
        ["node0", "inc-1", "0.1", [None, None], []],
        [1, "inc-1", 0.0, [None, None], []],  # node id not a string
        ["node0", None, 0.0, [None, None], []],
        ["node0", "inc-1", 0.0, [None], []],  # node fields short
        ["node0", "inc-1", 0.0, [None, None], [[0, *([None] * (len(WORKER_VOLATILE) - 1))]]],
        ["node0", "inc-1", 0.0, [None, None], [["0", *([None] * len(WORKER_VOLATILE))]]],
        ["node0", "inc-1", 0.0, [None, None], [[True, *([None] * len(WORKER_VOLATILE))]]],
        ["node0", "inc-1", 0.0, [None, None], [{"rank": 0}]],
        ["node0", "inc-1", 0.0, [None, None], [], {"generation": 0}],  # steps not a list
        ["node0", "inc-1", 0.0, [None, None], [], [[0, 1]]],  # a step batch not an object
        ["node0", "inc-1", 0.0, [None, None], [], [], "x"],  # 7 items
    ],
)
def test_check_alive_refuses_a_malformed_entry(entry: Any) -> None:
    with pytest.raises(ProtocolError, match="alive"):
        check_alive(entry)


def test_check_uplink_names_the_bad_field() -> None:
    good = {"v": 1, "relay": "r", "addr": "h:1", "since": 0, "reports": [], "alive": []}
    assert check_uplink(good) is good
    for bad, says in [
        ({**good, "v": 2}, "v: relay protocol 2"),
        ({**good, "relay": ""}, "relay: the relay's id"),
        ({**good, "addr": 5}, "addr"),
        ({**good, "since": "0"}, "since: an integer"),
        ({**good, "alive": {}}, "alive: a list"),
        ({**good, "reports": None}, "reports: a list"),
    ]:
        with pytest.raises(ProtocolError, match=_re(says)):
            check_uplink(bad)


# --------------------------------------------------------------------------- RelayBook
def test_relay_book_routes_a_node_from_relay_a_to_b_to_direct() -> None:
    """A node's desired-state changes go to the relay its last report came through, only
    that one, and none once it reports directly; ``since`` filters what a relay has had; a
    node that joins a relay is news to it (its current desired state must reach it)."""
    book = RelayBook()
    assert book.seen("A", "10.0.0.1:1", now=100.0) is True  # new
    assert book.seen("A", "10.0.0.1:1", now=100.2) is False
    assert book.seen("B", "10.0.0.2:1", now=100.2) is True
    book.through("n", "A")
    book.through("m", "A")
    assert sorted(book.newer("A", 0)) == ["m", "n"]  # joined: news to A
    had = book.seq
    assert book.newer("A", had) == [] and book.newer("B", 0) == []
    book.changed("n")
    assert book.seq == had + 1
    assert book.newer("A", had) == ["n"] and book.newer("B", 0) == []
    assert book.newer("A", had + 1) == []  # had it
    book.changed("m")
    assert book.newer("A", had + 1) == ["m"]
    assert book.through("n", "A") is False  # the same route: no news
    assert book.through("n", "B") is True  # n's reports now come through B
    assert book.route == {"n": "B", "m": "A"}
    assert book.newer("A", 0) == ["m"] and book.newer("B", 0) == ["n"]
    book.through("n", None)  # directly
    assert "n" not in book.route
    assert book.newer("B", 0) == [] and book.newer("A", 0) == ["m"]
    book.changed("n")
    since = book.seq
    assert book.newer("B", since) == [] and book.newer("A", since) == []
    book.through("n", "B")  # back behind B: its current desired state is B's news
    assert book.newer("B", since) == ["n"]
    ids = json.dumps(desired_batch(book, "B", since, {"n": (4, "idle")}, lambda d: {"a": d}))
    assert json.loads(ids) == {
        "seq": book.seq,
        "desired": {"n": {"version": 4, "desired": {"a": "idle"}}},
    }
    # A node with no desired state yet (not in ``desired``) is left out of the batch.
    assert desired_batch(book, "A", 0, {}, str) == {"seq": book.seq, "desired": {}}


def test_a_node_back_behind_its_relay_brings_its_current_desired_state_to_it() -> None:
    """node n reports directly (its relay failed it); its desired state changes (seq 1),
    e.g. a Stop; relay B's uplinks are answered meanwhile (``since`` 1). n's agent takes its
    next report to B before its direct long poll had the change: B must get n's desired
    state (``newer``), or the agent, long-polling B, never sees it until the next change."""
    book = RelayBook()
    book.seen("B", "b:1", now=1.0)
    book.through("n", "B")
    book.through("n", None)  # directly
    book.changed("n")
    since = desired_batch(book, "B", 0, {"n": (5, "stop")}, str)["seq"]  # B's answer
    assert since == book.seq
    book.through("n", "B")  # back behind B
    assert book.newer("B", since) == ["n"]


def test_relay_book_says_a_silent_relay_lost_once_and_a_returning_one_fresh() -> None:
    book = RelayBook()
    book.seen("A", "a:1", now=100.0)
    book.seen("B", "b:1", now=101.5)
    assert book.lost(now=102.0, timeout_s=2.0) == []  # A silent exactly 2 s: not yet
    assert book.lost(now=102.1, timeout_s=2.0) == ["A"]
    assert book.lost(now=110.0, timeout_s=2.0) == ["B"]  # A once only
    assert book.lost(now=120.0, timeout_s=2.0) == []
    assert book.seen("A", "a:2", now=121.0) is True  # back: joined again
    assert book.relays["A"].addr == "a:2" and not book.relays["A"].lost
    assert book.seen("A", "a:2", now=121.2) is False
    assert book.lost(now=122.0, timeout_s=2.0) == []


# --------------------------------------------------------------------------- the relay
def _bare() -> Relay:
    return Relay(controller="127.0.0.1:1", token="00" * 16, relay_id="r", addr="x:1")


async def _relay() -> Relay:
    """A relay whose controller just answered an uplink (nothing in the answer)."""
    relay = _bare()
    await relay.apply({"seq": 0})
    return relay


def test_a_relay_without_controller_contact_keeps_forwarding_and_says_how_old_it_is() -> None:
    """A relay whose controller is slow or unreachable answers its agents as ever (they stay:
    sending a whole rack to a slow controller directly would bury it), says how old its
    contact is (their fencing clock) and forwards what they sent once the controller answers
    again. A late copy of a report the agent sent again directly is dropped by the controller
    (``superseded``)."""

    async def go() -> None:
        relay = _bare()
        relay.upstream_ok = time.monotonic() - 8.0  # started, never answered
        first = agent_report("node0", events=[{"kind": "x", "ts": T0}])
        reply = relay.take(first)
        assert reply["version"] == 0 and reply["upstream_age_s"] >= 8.0
        assert _bare().take(agent_report("node1"))["upstream_age_s"] < 1.0  # just started
        await relay.apply({"seq": 1, "desired": {"node0": {"version": 2, "desired": {}}}})
        assert relay.uplink_body()["reports"] == [first]  # forwarded, nothing lost
        relay.take(agent_report("node0"))
        assert relay.take(agent_report("node0"))["version"] == 2

    asyncio.run(go())


def test_a_late_relayed_copy_of_a_report_is_superseded_by_the_newer_one() -> None:
    o = observe("node0", protocol.report_from_json(agent_report("node0")), None, T0)
    t = o.reported_at
    assert t is not None
    assert superseded(o, o.incarnation, t - 1.0)  # made before what the controller holds
    assert not superseded(o, o.incarnation, t)
    assert not superseded(o, o.incarnation, t + 1.0)
    assert not superseded(o, "another-agent", t - 1.0)  # a new incarnation is never late
    assert not superseded(None, o.incarnation, t - 1.0)
    assert not superseded(o, o.incarnation, None)


def test_the_relay_queues_a_changed_shape_whole_and_the_rest_as_alive_entries() -> None:
    """First report of a node: whole. Same shape again: an alive entry of its latest only,
    aged by the relay's clock. A worker exit, an event: whole, each; step records of a report
    of an unchanged shape go in the node's next alive entry, gathered in their order; after
    each uplink nothing is sent twice."""

    async def go() -> None:
        relay = await _relay()
        r1 = agent_report("node0")
        r2 = agent_report("node1")
        reply = relay.take(r1)
        assert reply["version"] == 0 and "desired" not in reply
        assert 0 <= reply["upstream_age_s"] <= 1.0
        relay.take(r2)
        body = relay.uplink_body()
        assert body["reports"] == [r1, r2] and body["alive"] == []
        assert (body["v"], body["relay"], body["addr"], body["since"]) == (1, "r", "x:1", 0)
        assert relay.uplink_body()["reports"] == [] and relay.uplink_body()["alive"] == []

        relay.take(agent_report("node0", steps=(42, 43), time=T0 + 0.2))
        latest = agent_report("node0", steps=(44, 45), time=T0 + 0.4)
        relay.take(latest)
        time.sleep(0.05)
        body = relay.uplink_body()
        assert body["reports"] == []
        (entry,) = body["alive"]  # node1 sent nothing new: no entry for it
        assert entry[:2] == ["node0", "inc-1"] and 0.05 <= entry[2] < 1.0
        assert entry[3] == [T0 + 0.4, T0 - 0.5]
        assert [w[:2] for w in entry[4]] == [[0, 44], [1, 45]]
        assert check_alive(json.loads(json.dumps(entry))) == entry
        assert relay.uplink_body()["alive"] == []

        exited = agent_report("node0", steps=(46, 47))
        exited["workers"][1].update(state="failed", exit_code=-9, exited_at=T0 + 1)
        relay.take(exited)
        again = agent_report("node0", steps=(46, 47))
        again["workers"][1].update(state="failed", exit_code=-9, exited_at=T0 + 1)
        again["workers"][0]["heartbeat_age_s"] = 0.9
        relay.take(again)  # same shape as ``exited``: an alive entry
        event = {**again, "events": [{"kind": "worker_exited", "ts": T0 + 1, "rank": 1,
                                      "generation": 2, "exit_code": -9}]}  # fmt: skip
        relay.take(event)
        batch = {"generation": 2, "rank": 0, "items": [{"step": 46, "t_end": T0, "dur": 0.1}]}
        steps = {**again, "steps": [batch]}
        relay.take(steps)
        batch2 = {"generation": 2, "rank": 1, "items": [{"step": 46, "t_end": T0, "dur": 0.2}]}
        relay.take({**again, "steps": [batch2]})  # the shape of ``again``: alive, gathered
        relay.take(agent_report("node1", steps=(46, 47), events=[{"kind": "x", "ts": T0}]))
        body = relay.uplink_body()
        # One whole report per node with news (the exit, then the event: one, the newest,
        # carrying the events of the one it replaced); node0's step records after it in its
        # alive entry, in their order.
        node0, node1 = body["reports"]
        assert node0 == event
        assert node1["node_id"] == "node1" and node1["events"] == [{"kind": "x", "ts": T0}]
        (entry,) = body["alive"]
        assert entry[0] == "node0" and entry[5] == [batch, batch2]
        assert check_alive(json.loads(json.dumps(entry))) == entry
        assert relay.uplink_body() == {**relay.uplink_body(), "reports": [], "alive": []}
        # A report whose shape changed takes the step records gathered before it along.
        relay.take({**again, "steps": [batch]})
        moved = agent_report("node0", steps=(48, 49))
        relay.take({**moved, "steps": [batch2]})
        body = relay.uplink_body()
        (whole,) = body["reports"]
        assert whole["steps"] == [batch, batch2] and body["alive"] == []

    asyncio.run(go())


def test_the_relay_refuses_a_malformed_report_as_the_controller_would() -> None:
    async def go() -> None:
        relay = await _relay()
        for bad in (
            [],
            {"addr": "a"},
            {**agent_report(), "generation": "two"},
            {**agent_report(), "workers": [{"rank": 0}]},
        ):
            with pytest.raises(ProtocolError):
                relay.take(bad)
        assert relay.uplink_body()["reports"] == [] and relay.uplink_body()["alive"] == []

    asyncio.run(go())


def test_the_relay_applies_desired_states_and_resends_what_the_controller_asks() -> None:
    """An answer with desired states: kept per node (an older version ignored), handed to
    the agent with its next reply unless it holds that version, long polls woken, ``since``
    advanced; ``resend``: the node's latest report is queued whole again, and its next
    report of the same shape goes whole too. ``flush_s`` from the controller is taken."""

    async def go() -> None:
        relay = await _relay()
        relay.take(agent_report("node0"))
        relay.take(agent_report("node0", steps=(50, 51)))  # alive
        relay.uplink_body()

        async def poll() -> None:
            async with relay.changed:
                await relay.changed.wait_for(lambda: relay.desired.get("node0", (0, {}))[0] > 3)

        waiter = asyncio.create_task(poll())
        await asyncio.sleep(0.01)
        run = {"action": "idle"}
        await relay.apply({"seq": 9, "desired": {"node0": {"version": 4, "desired": run}},
                           "resend": [], "flush_s": 0.5})  # fmt: skip
        await asyncio.wait_for(waiter, timeout=2.0)
        assert relay.desired == {"node0": (4, run)} and relay.since == 9
        assert relay.flush_s == 0.5
        age = relay.upstream_age()
        assert age is not None and 0 <= age < 1.0
        reply = relay.take(agent_report("node0", steps=(52, 53)))  # holds version 3
        assert reply["version"] == 4 and reply["desired"] == run
        assert reply["upstream_age_s"] is not None
        reply = relay.take(agent_report("node0", steps=(52, 53), desired_version=4))
        assert reply == {"version": 4, "upstream_age_s": reply["upstream_age_s"]}
        await relay.apply({"seq": 5, "desired": {"node0": {"version": 2, "desired": {}}}})
        assert relay.desired == {"node0": (4, run)} and relay.since == 9  # nothing older
        relay.uplink_body()

        latest = agent_report("node0", steps=(54, 55), desired_version=4)
        relay.take(latest)
        await relay.apply({"seq": 9, "resend": ["node0", "unknown"]})
        body = relay.uplink_body()
        assert body["reports"] == [latest] and body["alive"] == []
        following = agent_report("node0", steps=(56, 57), desired_version=4)
        relay.take(following)
        assert relay.uplink_body()["reports"] == [following]
        relay.take(agent_report("node0", steps=(58, 59), desired_version=4))
        body = relay.uplink_body()
        assert body["reports"] == [] and len(body["alive"]) == 1

    asyncio.run(go())


def _post_failing_once(
    sent: list[dict[str, Any]], fail: asyncio.Event
) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """A relay's ``_post`` that records each uplink body in ``sent``: the first fails (OSError)
    once ``fail`` is set, the next ones stay in flight for the test to read."""

    async def post(body: dict[str, Any]) -> None:
        sent.append(copy.deepcopy(body))
        if len(sent) == 1:
            await fail.wait()
            raise OSError("controller down")
        await asyncio.Event().wait()

    return post


async def _until(pred: Callable[[], bool], timeout_s: float) -> None:
    """Polls ``pred`` every 10 ms for up to ``timeout_s``; the caller asserts what it needs."""
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_a_failed_uplink_loses_no_event_and_keeps_their_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The controller does not take an uplink (its POST fails) carrying node0's report with
    event A; meanwhile node0's next report with event B and a step record came. The retried
    uplink carries one report of node0, the newest, with A then B and the step record."""

    async def go() -> None:
        relay = await _relay()
        sent: list[dict[str, Any]] = []
        fail = asyncio.Event()
        post = _post_failing_once(sent, fail)
        monkeypatch.setattr(relay, "_post", post)
        ev_a = {"kind": "worker_exited", "ts": T0, "rank": 1, "generation": 2, "exit_code": 1}
        ev_b = {"kind": "inject_fired", "ts": T0 + 1, "rank": 0}
        relay.take(agent_report("node0", events=[ev_a]))
        loop = asyncio.create_task(relay.uplink_loop())
        try:
            await _until(lambda: bool(sent), 2.0)
            assert [r["events"] for r in sent[0]["reports"]] == [[ev_a]]
            batch = {"generation": 2, "rank": 0, "items": [{"step": 42, "t_end": T0, "dur": 0.1}]}
            newer = agent_report("node0", steps=(42, 43), events=[ev_b], time=T0 + 1)
            newer["steps"] = [batch]
            relay.take(newer)
            fail.set()
            await _until(lambda: len(sent) > 1, 5.0)
            (retried,) = sent[1]["reports"]
            assert retried["events"] == [ev_a, ev_b] and retried["steps"] == [batch]
            assert retried["workers"] == newer["workers"] and retried["time"] == T0 + 1
            assert relay.uplinks == 0
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop

    asyncio.run(go())


def test_a_failed_uplink_keeps_the_step_records_of_its_alive_entries_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Step records gathered for node0's alive entry go in an uplink the controller does not
    take; a newer record comes meanwhile. The retried uplink's alive entry carries both, the
    older first; a relay that cannot reach the controller keeps at most STEP_BATCHES_KEPT."""

    def batch(step: int) -> dict[str, Any]:
        return {"generation": 2, "rank": 0, "items": [{"step": step, "t_end": T0, "dur": 0.1}]}

    async def go() -> None:
        relay = await _relay()
        sent: list[dict[str, Any]] = []
        fail = asyncio.Event()
        post = _post_failing_once(sent, fail)
        relay.take(agent_report("node0"))
        relay.uplink_body()  # its shape went whole
        monkeypatch.setattr(relay, "_post", post)
        relay.take({**agent_report("node0", time=T0 + 1), "steps": [batch(42)]})
        loop = asyncio.create_task(relay.uplink_loop())
        try:
            await _until(lambda: bool(sent), 3.0)
            (entry,) = sent[0]["alive"]
            assert entry[5] == [batch(42)]
            relay.take({**agent_report("node0", time=T0 + 2), "steps": [batch(43)]})
            fail.set()
            await _until(lambda: len(sent) > 1, 5.0)
            (entry,) = sent[1]["alive"]
            assert entry[5] == [batch(42), batch(43)] and entry[3][0] == T0 + 2
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        node = relay.nodes["node0"]
        node.gather([batch(i) for i in range(STEP_BATCHES_KEPT + 5)])
        assert len(node.steps) == STEP_BATCHES_KEPT and node.steps[0] == batch(5)

    asyncio.run(go())


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda r: r["workers"][0].update(step="41"), "workers[].step: int or null"),
        (lambda r: r["workers"][1].update(in_trainguard=None), "workers[].in_trainguard: bool"),
        (lambda r: r["workers"][0].update(coll=[1, 2.5]), "workers[].coll: list[int] or null"),
        (lambda r: r.update(time="now"), "time: seconds since the epoch"),
        (lambda r: r.update(ckptd_at=float("nan")), "ckptd_at: seconds since the epoch"),
        (lambda r: r["workers"].append(7), "workers: a list of objects"),
    ],
)
def test_a_report_of_a_known_shape_is_refused_as_the_controller_would_refuse_it(
    change: Callable[[dict[str, Any]], None], says: str
) -> None:
    """A report whose shape the relay saw already is not checked whole; its other fields
    (volatile values, workers that are not objects: what the shape key leaves out) must be
    checked still: the controller refuses such a report (400) when it comes directly, and as
    an alive entry it would be refused there (the node then silent though its agent got
    200s) or break the relay's uplink (``alive_entry`` raising in ``uplink_body``)."""

    async def go() -> None:
        relay = await _relay()
        relay.take(agent_report("node0"))
        relay.uplink_body()
        bad = agent_report("node0", steps=(42, 43))
        change(bad)
        with pytest.raises(ProtocolError) as direct:
            protocol.report_from_json(bad)  # what the controller says to it directly
        with pytest.raises(ProtocolError, match=_re(says)):
            relay.take(bad)
        assert says.split(":")[0] in str(direct.value)
        body = relay.uplink_body()  # still works; nothing of the refused report in it
        assert body["reports"] == [] and body["alive"] == []

    asyncio.run(go())


def test_a_workers_field_that_is_not_a_list_is_refused_not_forwarded() -> None:
    """``workers`` an object where the node's last report had none: the same shape key (the
    key keeps only the workers that are objects); refused, and the uplink still works."""

    async def go() -> None:
        relay = await _relay()
        relay.take(agent_report("node0", steps=()))
        relay.uplink_body()
        with pytest.raises(ProtocolError, match="workers"):
            relay.take({**agent_report("node0", steps=()), "workers": {"rank": 0}})
        with pytest.raises(ProtocolError):
            protocol.report_from_json({**agent_report("node0", steps=()), "workers": {"r": 0}})
        assert relay.uplink_body()["alive"] == []

    asyncio.run(go())


def test_a_node_whose_whole_report_waits_for_a_later_uplink_sends_no_alive_entry_before_it() -> (
    None
):
    """A whole rack acks a stop at once: more whole reports than one uplink carries
    (UPLINK_REPORTS). A node whose changed report waits for the next uplink and that sends
    its next heartbeat (same shape) meanwhile must not be sent as an alive entry first: the
    controller would take the entry's newer time, then drop the whole report as a late copy
    (``superseded``) and never see the stop acked (4,096 simulated nodes stayed in STOPPING
    for minutes). Its heartbeat's step records follow its report, in the uplink after."""
    from trainguard.relay.server import UPLINK_REPORTS

    async def go() -> None:
        relay = await _relay()
        nodes = [f"node{i}" for i in range(UPLINK_REPORTS + 1)]
        for n in nodes:  # each node's shape is known to the relay and the controller
            relay.take(agent_report(n))
        relay.uplink_body()
        last = nodes[-1]
        acks = {n: agent_report(n, stopped_generation=2, time=T0 + 1) for n in nodes}
        for n in nodes:  # the stop acked by every node: a changed shape, whole
            relay.take(acks[n])
        batch = {"generation": 2, "rank": 0, "items": [{"step": 42, "t_end": T0, "dur": 0.1}]}
        beat = {**agent_report(last, stopped_generation=2, time=T0 + 2), "steps": [batch]}
        relay.take(beat)  # its next heartbeat: same shape, an alive entry's worth
        first = relay.uplink_body()
        assert len(first["reports"]) == UPLINK_REPORTS
        assert last not in [r["node_id"] for r in first["reports"]]
        assert last not in [e[0] for e in first["alive"]]  # not before its whole report
        second = relay.uplink_body()
        assert [r["node_id"] for r in second["reports"]] == [last]
        # What the controller does with them in that order: the ack is taken, not dropped.
        o = observe(last, protocol.report_from_json(agent_report(last)), None, T0)
        (report,) = second["reports"]
        assert not superseded(o, o.incarnation, report["time"])
        assert report["stopped_generation"] == 2
        (entry,) = second["alive"]  # after it, in the same uplink: the heartbeat's records
        assert entry[0] == last and entry[5] == [batch]

    asyncio.run(go())
