"""Reports → observations and recovery milestones (controller/ingest.py), without a server."""

from __future__ import annotations

from typing import Any

from trainguard import protocol
from trainguard.controller.api import STEPS_SEEN_GENERATIONS
from trainguard.controller.ingest import Milestones, addresses_changed, observe
from trainguard.protocol import StepRecord


def report(gen: int | None, at: list[int], **kw: Any) -> protocol.AgentReport:
    """A node's report: generation ``gen``, one running worker per entry of ``at`` (its step)."""
    workers = [
        {"rank": r, "local_rank": r, "pid": 100 + r, "state": "running", "step": s}
        for r, s in enumerate(at)
    ]
    body = {"node_id": "n", "addr": "10.0.0.1", "incarnation": "a", "generation": gen,
            "workers": workers, **kw}  # fmt: skip
    return protocol.report_from_json(body)


def recs(items: list[dict[str, Any]]) -> list[StepRecord]:
    return [StepRecord.from_json(it) for it in items]


def test_a_report_after_a_stop_keeps_the_steps_the_one_before_showed() -> None:
    """The planned-stop fault of the coalesced tick: the last report before the stop showed
    step 41; the one after lists no workers. The newest step of generation 3 stays 41."""
    o1 = observe("n", report(3, [40, 41]), None, now=1.0)
    o2 = observe("n", report(None, []), o1, now=1.5)
    assert o2.workers == {} and o2.steps_seen == {3: 41}
    batch = {"generation": 3, "rank": 0, "items": [{"step": 44, "t_end": 2.0, "dur": 0.1}]}
    assert observe("n", report(None, [], steps=[batch]), o2, now=2.0).steps_seen == {3: 44}


def test_steps_seen_keeps_only_the_newest_generations() -> None:
    o = None
    for gen in range(10):
        o = observe("n", report(gen, [gen * 10]), o, now=float(gen))
    assert o is not None and sorted(o.steps_seen) == list(range(10 - STEPS_SEEN_GENERATIONS, 10))


def test_addresses_are_compared() -> None:
    o1 = observe("n", report(None, []), None, now=1.0)
    o2 = observe("n", report(None, []), o1, now=2.0)
    assert not addresses_changed(o1, o2)
    assert addresses_changed(o2, observe("n", report(None, [], incarnation="b"), o2, now=3.0))
    assert addresses_changed(None, o2)


def test_milestones_come_once_every_rank_reached_them_at_the_last_rank_s_time() -> None:
    m = Milestones()
    assert m.load("ckpt_load_start", 2, 0, 10.0, world=2) == []
    assert m.load("ckpt_load_start", 2, 1, 10.5, world=2) == [(2, "t_rendezvous", 10.5)]
    assert m.load("ckpt_load_end", 2, 1, 11.0, world=2) == []
    assert m.load("ckpt_load_end", 2, 0, 11.2, world=2) == [(2, "t_loaded", 11.2)]
    one = [{"step": 31, "t_end": 12.0, "dur": 0.5}, {"step": 32, "t_end": 12.4, "dur": 0.4}]
    assert m.steps(2, 0, recs(one), world=2) == (None, [])
    event, got = m.steps(2, 1, recs([{"step": 31, "t_end": 12.3, "dur": 0.6}]), world=2)
    assert event == {"generation": 2, "step": 31, "t": 12.3}
    assert [(g, n) for g, n, _ in got] == [(2, "t_first_step_start"), (2, "t_first_step")]
    assert abs(got[0][2] - 11.7) < 1e-9 and got[1][2] == 12.3  # start: t_end - dur
    assert m.steps(2, 1, recs([{"step": 33, "t_end": 13.0, "dur": 0.4}]), world=2) == (None, [])


def test_an_agents_last_report_says_it_is_leaving_on_the_wire_and_in_the_observation() -> None:
    r = protocol.AgentReport(node_id="n", addr="127.0.0.1", incarnation="i", leaving=True)
    body = protocol.report_to_json(r)
    assert body["leaving"] is True
    back = protocol.report_from_json(body)
    assert back.leaving and observe("n", back, None, 1.0).leaving
    plain = protocol.report_to_json(protocol.AgentReport(node_id="n", addr="a", incarnation="i"))
    assert "leaving" not in plain and not protocol.report_from_json(plain).leaving
    assert not protocol.report_from_json({**plain, "leaving": "yes"}).leaving  # only true
