"""The relay → controller wire (issue 31): a relay takes its nodes' reports and sends the
controller only what changed, with a compact liveness summary of the rest.

An agent's report (``report.py``) holds two kinds of fields:

- its **shape**: worker states, exits and errors, generation, events, the ckptd's memory
  index, health, pre-flight results, the desired version it holds… Any change of these is a
  fact the controller acts on: the relay forwards that report whole, at once;
- its **volatile** fields (``WORKER_VOLATILE``, ``NODE_VOLATILE``): step counters, ages, the
  collective counters, CPU idleness, the report's clock. They change every heartbeat and only
  refresh what the controller knows. The relay sends them as one ``alive`` entry per node
  (``AliveEntry``), a few numbers per worker, batched over all its nodes;
- its **step records** (``steps``, ``APPENDED``): a training node's reports carry new ones
  every heartbeat. They are not shape: the relay gathers them per node and sends them in the
  node's next alive entry (its sixth element), so a training job's reports are not forwarded
  whole each heartbeat; the controller stores them and runs its step detectors on them as it
  does for a whole report's.

One uplink (``POST /v1/relay``, JSON) carries ``{"v", "relay", "addr", "reports": [report…],
"alive": [AliveEntry…], "since": S}``; the controller answers ``{"seq": S', "desired":
{node: {"version": V, "desired": …}}, "resend": [node…]}``: the desired states of the relay's
nodes that changed after ``since`` (its desired-state sequence number), and the nodes whose
next report it wants whole (it has no observation of them: it restarted, or the node's
incarnation changed). ``GET /v1/relay/desired?relay=R&since=S&wait_s=W`` is the same answer
as a long poll: it returns once a desired state of the relay's nodes is newer than ``S``.
"""

from __future__ import annotations

import json
from typing import Any

from trainguard.protocol.common import MAX_ITEMS, ProtocolError, _need, finite

RELAY_PROTOCOL_VERSION = 1

# A worker's fields that change on every heartbeat (report.WorkerReport): their order is the
# order of the numbers in an alive entry.
WORKER_VOLATILE = (
    "step",
    "progress_age_s",
    "heartbeat_age_s",
    "last_progress_at",
    "coll",
    "cpu_idle_s",
    "in_trainguard",
    "proc_state",
)
# A report's own fields that change on every heartbeat (its clock; when ckptd was asked).
NODE_VOLATILE = ("time", "ckptd_at")
# A report's lists of new records, gathered by the relay and sent in alive entries.
APPENDED = ("steps",)

# [node_id, incarnation, age_s, [node volatile…], [[rank, worker volatile…], …]] and, when
# the relay gathered step records since the node's last entry, [step batch…] (report.py)
AliveEntry = list[Any]


def shape_key(report: dict[str, Any]) -> str:
    """The report's shape: its JSON without the volatile fields, keys sorted. Two reports of
    one node with the same key differ only in what an alive entry carries (an agent writes
    its keys in one order, so they are not sorted)."""
    # events: a report that has any is forwarded whole whatever its shape (not part of it)
    body = {k: v for k, v in report.items()
            if k not in NODE_VOLATILE and k not in APPENDED and k != "events"}  # fmt: skip
    body["workers"] = [
        {k: v for k, v in w.items() if k not in WORKER_VOLATILE}
        for w in report.get("workers") or []
        if isinstance(w, dict)
    ]
    return json.dumps(body, separators=(",", ":"))  # an agent writes its keys in one order


def alive_entry(
    report: dict[str, Any], age_s: float, steps: list[dict[str, Any]] | None = None
) -> AliveEntry:
    """The alive entry of a report received ``age_s`` seconds ago (relay's clock), with the
    step batches ``steps`` gathered since the node's last entry, if any."""
    entry = [
        report["node_id"],
        report["incarnation"],
        round(age_s, 3),
        [report.get(k) for k in NODE_VOLATILE],
        [[w["rank"], *(w.get(k) for k in WORKER_VOLATILE)] for w in report.get("workers") or []],
    ]
    return [*entry, steps] if steps else entry


def check_alive(entry: Any) -> AliveEntry:
    """``entry`` if it is an alive entry of the shape ``alive_entry`` makes; ProtocolError
    naming the problem otherwise (the values' types are checked where they are applied)."""
    _need(
        isinstance(entry, list)
        and len(entry) in (5, 6)
        and isinstance(entry[0], str)
        and isinstance(entry[1], str)
        and finite(entry[2])
        and entry[2] >= 0
        and isinstance(entry[3], list)
        and len(entry[3]) == len(NODE_VOLATILE)
        and isinstance(entry[4], list)
        and len(entry[4]) <= MAX_ITEMS,
        "alive[]: [node_id, incarnation, age_s >= 0, [node fields], [[rank, fields…], …]"
        "(, [step batch…])]",
    )
    if len(entry) == 6:
        steps = entry[5]
        _need(isinstance(steps, list) and len(steps) <= MAX_ITEMS
              and all(isinstance(b, dict) for b in steps),
              f"alive[{entry[0]}] steps: a list of step batches (objects)")  # fmt: skip
    for w in entry[4]:
        _need(
            isinstance(w, list) and len(w) == 1 + len(WORKER_VOLATILE) and type(w[0]) is int,
            f"alive[{entry[0]}] workers: [rank, {', '.join(WORKER_VOLATILE)}]",
        )
    return list(entry)


def check_uplink(body: Any) -> dict[str, Any]:
    """A relay's uplink body, checked (ProtocolError naming the field otherwise)."""
    _need(isinstance(body, dict), "a relay uplink is a JSON object")
    v = body.get("v", 1)
    _need(type(v) is int and 1 <= v <= RELAY_PROTOCOL_VERSION,
          f"v: relay protocol {v}; this controller speaks {RELAY_PROTOCOL_VERSION}")  # fmt: skip
    _need(isinstance(body.get("relay"), str) and 0 < len(body["relay"]) <= 256,
          "relay: the relay's id, a non-empty string")  # fmt: skip
    _need(isinstance(body.get("addr"), str), "addr: the relay's host:port")
    _need(type(body.get("since", 0)) is int, "since: an integer")
    for key in ("reports", "alive"):
        items = body.get(key, [])
        _need(isinstance(items, list) and len(items) <= 1 << 20, f"{key}: a list")
    return body


__all__ = [
    "APPENDED",
    "NODE_VOLATILE",
    "RELAY_PROTOCOL_VERSION",
    "WORKER_VOLATILE",
    "AliveEntry",
    "ProtocolError",
    "alive_entry",
    "check_alive",
    "check_uplink",
    "shape_key",
]
