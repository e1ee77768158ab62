"""The controller's side of relays (issue 31; the wire: ``protocol/relay.py``).

``RelayBook`` knows each relay (its address, when it last sent an uplink) and which relay
each node's reports last came through, and numbers the desired-state changes so a relay is
sent only those of its own nodes it has not had. ``apply_alive`` folds one alive entry into
a node's observation in place: the volatile fields of its workers, its clock, its last-seen
time (the agent's report time as the relay measured it, so a node behind a relay is judged
lost on the same clock as one that reports directly).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainguard.controller.api import STEPS_SEEN_GENERATIONS, NodeObs
from trainguard.controller.summary import summarize
from trainguard.protocol.common import ProtocolError, _need, finite
from trainguard.protocol.relay import NODE_VOLATILE, WORKER_VOLATILE, AliveEntry
from trainguard.protocol.report import _WORKER_FIELDS, _fits

_KINDS = [_WORKER_FIELDS[k] for k in WORKER_VOLATILE]


@dataclasses.dataclass(slots=True)
class RelayInfo:
    """A relay as the controller knows it: ``addr`` (host:port its agents reach), ``last_seen``
    (controller wall clock of its last uplink), ``lost`` (said once it fell silent)."""

    addr: str
    last_seen: float
    lost: bool = False


class RelayBook:
    """Relays, the node → relay routes and the desired-state change numbers (``seq``)."""

    def __init__(self) -> None:
        self.relays: dict[str, RelayInfo] = {}
        self.route: dict[str, str] = {}  # node → the relay its last report came through
        self._members: dict[str, set[str]] = {}  # relay → its nodes
        self.seq = 0  # grows with every desired-state change of any node
        self._changed_at: dict[str, int] = {}  # node → seq of its last desired-state change

    def seen(self, relay: str, addr: str, now: float) -> bool:
        """An uplink from ``relay`` at ``now``. Returns True if it is new or was lost."""
        info = self.relays.get(relay)
        fresh = info is None or info.lost
        self.relays[relay] = RelayInfo(addr=addr, last_seen=now)
        return fresh

    def through(self, node: str, relay: str | None) -> bool:
        """``node``'s latest report came through ``relay`` (None: directly). Returns whether
        its route changed; a relay it joins is sent its desired state (``changed``), whatever
        that relay's ``since``."""
        old = self.route.get(node)
        if old == relay:
            return False
        if old is not None:
            self._members.get(old, set()).discard(node)
        if relay is None:
            self.route.pop(node, None)
        else:
            self.route[node] = relay
            self._members.setdefault(relay, set()).add(node)
            self.changed(node)  # news to this relay, whatever its ``since``
        return True

    def changed(self, node: str) -> None:
        """``node``'s desired state changed (a new version)."""
        self.seq += 1
        self._changed_at[node] = self.seq

    def newer(self, relay: str, since: int) -> list[str]:
        """The nodes of ``relay`` whose desired state changed after ``since``."""
        if since >= self.seq:
            return []
        return [n for n in self._members.get(relay, ()) if self._changed_at.get(n, 0) > since]

    def lost(self, now: float, timeout_s: float) -> list[str]:
        """Relays silent for more than ``timeout_s`` not said yet (each said once)."""
        out = []
        for rid, info in self.relays.items():
            if not info.lost and now - info.last_seen > timeout_s:
                info.lost = True
                out.append(rid)
        return out


def apply_alive(o: NodeObs, entry: AliveEntry, now: float) -> None:
    """Fold alive entry ``entry`` (``protocol.relay.check_alive``) into ``o`` in place:
    ``last_seen`` = ``now`` − the entry's age (never earlier than it was), the report clock's
    skew, each listed worker's volatile fields, the newest step of its generation. Raises
    ProtocolError naming the field when a value does not fit its type."""
    _, _, age, node_vals, workers = entry[:5]  # a 6th item, step records, is taken apart
    t_time, _ckptd_at = node_vals[: len(NODE_VOLATILE)]
    _need(t_time is None or finite(t_time), "alive[].time: seconds since the epoch")
    _need(_ckptd_at is None or finite(_ckptd_at), "alive[].ckptd_at: seconds since the epoch")
    updates = []
    for w in workers:
        vals = w[1:]
        for k, kind, v in zip(WORKER_VOLATILE, _KINDS, vals, strict=True):
            if v is not None and not _fits(v, kind):  # None: absent from the report
                raise ProtocolError(f"alive[{o.node_id}] rank {w[0]}.{k}: {kind}")
        target = o.workers.get(w[0])
        if target is None:
            raise ProtocolError(f"alive[{o.node_id}]: rank {w[0]} is not among its workers")
        updates.append((target, vals))
    seen = now - float(age)
    if seen > o.last_seen:
        o.last_seen = seen
        if t_time is not None:
            o.clock_skew_s = round(float(t_time) - now + float(age), 3)
        if _ckptd_at is not None:
            o.ckptd_at = float(_ckptd_at)
    if t_time is not None and (o.reported_at is None or t_time > o.reported_at):
        o.reported_at = float(t_time)
    newest = None
    for target, vals in updates:
        for k, kind, v in zip(WORKER_VOLATILE, _KINDS, vals, strict=True):
            if v is not None or kind.endswith("| None"):  # an absent flag keeps its default
                setattr(target, k, v)
        if target.step is not None and (newest is None or target.step > newest):
            newest = target.step
    gen = o.generation
    if gen is not None and newest is not None and newest > o.steps_seen.get(gen, -1):
        o.steps_seen[gen] = newest
        for g in sorted(o.steps_seen)[:-STEPS_SEEN_GENERATIONS]:
            del o.steps_seen[g]
    summarize(o)  # the tick reads the node's summary, not its workers


def desired_batch(
    book: RelayBook, relay: str, since: int, desired: dict[str, tuple[int, Any]], to_json: Any
) -> dict[str, Any]:
    """The answer to a relay: ``seq`` and the desired states of its nodes newer than
    ``since`` (``{node: {"version", "desired"}}``, ``to_json`` of each): a node that just
    joined it counts as changed (``RelayBook.through``)."""
    nodes = book.newer(relay, since)
    return {
        "seq": book.seq,
        "desired": {
            n: {"version": desired[n][0], "desired": to_json(desired[n][1])}
            for n in sorted(nodes)
            if n in desired
        },
    }


def superseded(o: NodeObs | None, incarnation: str, t: float | None) -> bool:
    """A relayed report made (agent clock ``t``) before the one ``o`` was made from, by the
    same agent: a late copy (the relay was frozen while the agent sent the report again,
    directly). Its events are in the newer report (an agent keeps the events of a report it
    was not answered for and sends them again), so it is dropped whole."""
    return (
        o is not None
        and o.incarnation == incarnation
        and t is not None
        and o.reported_at is not None
        and t < o.reported_at
    )
