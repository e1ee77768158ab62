"""What lets the controller's decision tick (``decide``) read nodes, not workers (issue 31:
16,384 nodes × 8 workers, a tick every 0.1–1 s).

- ``summarize(o)`` condenses one node's workers into ``o.summary`` (``api.NodeSummary``), in
  O(workers of that node): ``ingest.observe`` makes it with each report, and whoever changes
  the workers' volatile fields (``protocol.relay.WORKER_VOLATILE``) or the node's own fields
  in place makes it again by calling ``summarize`` (a relay's alive entry, ``apply_alive``).
- ``gen_view(s, obs)``: the current generation's workers as the summaries show them
  (``GenView``): one pass over the assigned nodes, done in C (``map``, ``operator``) when
  every node is quiet, the steady state of a running job; the checks then read the workers
  of the few nodes with something going on only.
- ``Liveness``: every node's deadline (``last_seen + node_timeout_s``) in a min-heap with lazy
  deletion, kept by the intake (``Intake.take``), so the nodes not alive are found from the
  few deadlines that passed, not by a scan of every node. A report that moves a node's
  ``last_seen`` on leaves its entry stale; the entry is checked when it falls due and queued
  again at the node's new deadline, so in-place changes of ``last_seen`` need no call here.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import operator
import threading

from trainguard.controller.api import NO_STEP, NodeObs, NodeSummary, WorkerObs
from trainguard.controller.jobstate import JobState

_INF = math.inf
# A deadline within this many seconds of now is looked at: ``last_seen + timeout`` and the
# liveness rule's ``now - last_seen <= timeout`` (pools.is_alive) may round differently; the
# rule itself then decides.
SLACK_S = 1e-3

_calm_of = operator.attrgetter("summary.calm")
_first, _second, _third = (operator.itemgetter(i) for i in range(3))


def idle_s(w: WorkerObs) -> float:
    """Seconds ``w`` has done nothing: with the runtime, since its last step or a heartbeat
    that showed its main thread working (its reporter thread's own CPU is not work); without,
    since its process tree last used CPU (the agent's ages; None counts as 0)."""
    idle = w.progress_age_s if w.runtime else w.cpu_idle_s
    return 0.0 if idle is None else idle


def summarize(o: NodeObs) -> None:
    """(Re)make ``o.summary`` from ``o.workers`` and the node's ``hang``, ``generation`` and
    ``fenced_generation``: O(workers of ``o``). Call it again after changing any of them in
    place (a worker's step, ages, ``in_trainguard``, ``proc_state``…)."""
    o.summary = _make(o)


def _make(o: NodeObs) -> NodeSummary:
    """The summary of ``o`` as it is now."""
    n = running = done = bad = runtime = 0
    top = NO_STEP
    waits = False
    idle = cpu = _INF
    for w in o.workers.values():
        n += 1
        if w.step is not None and w.step > top:
            top = w.step
        state = w.state
        if state == "running":
            running += 1
            runtime += w.runtime
            waits = waits or w.in_trainguard
            idle = min(idle, idle_s(w))
            cpu = -_INF if w.cpu_idle_s is None else min(cpu, w.cpu_idle_s)
        elif state == "succeeded":
            done += 1
        elif state in ("failed", "parked"):
            bad += 1
    if o.generation is not None:
        top = max(top, o.steps_seen.get(o.generation, NO_STEP))
    quiet = n > 0 and runtime == n and not o.hang and o.fenced_generation != o.generation
    return NodeSummary(
        workers=n, running=running, succeeded=done, failed=bad, runtime_running=runtime,
        max_step=top, in_trainguard=waits, idle_min_s=idle, cpu_idle_min_s=cpu,
        quiet=quiet, calm=(o.generation if quiet else None, n, top),
    )  # fmt: skip


def summary_of(o: NodeObs) -> NodeSummary:
    """``o.summary``, or (an observation built by hand, without one) the summary its workers
    make now, not stored: such an observation may be changed in place without a call to
    ``summarize``."""
    return o.summary if o.summary is not None else _make(o)


@dataclasses.dataclass(kw_only=True, slots=True)
class GenView:
    """The current generation's workers (those the assigned nodes report for it) in a few
    numbers, from the node summaries. Counts are of workers; the node lists are in the
    assignment's order. ``max_step``: the newest step of the generation any assigned node
    showed (its workers' or ``steps_seen``; NO_STEP: none). ``in_trainguard``, ``idle_min_s``
    and ``cpu_idle_min_s`` are over the running workers (``NodeSummary``); when every node is
    quiet they are not gathered (-inf: the checks that read them need a hung node, a
    succeeded worker or a worker without the runtime first)."""

    count: int = 0
    running: int = 0
    succeeded: int = 0
    runtime_running: int = 0
    in_trainguard: bool = False
    idle_min_s: float = _INF
    cpu_idle_min_s: float = _INF
    max_step: int = NO_STEP
    failed: list[str] = dataclasses.field(default_factory=list)  # a failed or parked worker
    hung: list[str] = dataclasses.field(default_factory=list)  # their hang watch fired
    fenced: list[str] = dataclasses.field(default_factory=list)  # fenced this generation


def gen_view(s: JobState, obs: dict[str, NodeObs]) -> GenView:
    """The generation's ``GenView``: O(assigned nodes), in C when every assigned node reports
    the generation and is quiet; else one pass in Python over the nodes' summaries."""
    calm = _calm(s, obs)
    return calm if calm is not None else _view(s, obs)


def _calm(s: JobState, obs: dict[str, NodeObs]) -> GenView | None:
    """The view when every assigned node reports, runs the generation and is quiet (every
    worker running with the runtime, no hang, not fenced), else None."""
    gen, a = s.generation, s.assignment
    if not obs.keys() >= a.keys():
        return None
    if not a:
        return GenView()
    try:
        calm = list(map(_calm_of, map(obs.__getitem__, a)))
    except AttributeError:  # an observation without a summary (built by hand)
        return None
    if list(map(_first, calm)).count(gen) != len(calm):
        return None
    count = sum(map(_second, calm))
    top = max(map(_third, calm))  # each node's newest step: of its generation, this one
    return GenView(count=count, running=count, runtime_running=count, idle_min_s=-_INF,
                   cpu_idle_min_s=-_INF, max_step=top)  # fmt: skip


def _view(s: JobState, obs: dict[str, NodeObs]) -> GenView:
    """The view, one node at a time."""
    gen = s.generation
    v = GenView()
    for n in s.assignment:
        o = obs.get(n)
        if o is None:
            continue
        if o.fenced_generation == gen:
            v.fenced.append(n)
        seen = o.steps_seen.get(gen)
        if seen is not None and seen > v.max_step:
            v.max_step = seen
        if o.generation != gen:
            continue
        if o.hang:
            v.hung.append(n)
        m = summary_of(o)
        if m.failed:
            v.failed.append(n)
        v.count += m.workers
        v.running += m.running
        v.succeeded += m.succeeded
        v.runtime_running += m.runtime_running
        v.in_trainguard = v.in_trainguard or m.in_trainguard
        v.idle_min_s = min(v.idle_min_s, m.idle_min_s)
        v.cpu_idle_min_s = min(v.cpu_idle_min_s, m.cpu_idle_min_s)
        v.max_step = max(v.max_step, m.max_step)  # its generation's: this one
    return v


class Liveness:
    """Which nodes are not alive (``pools.is_alive``: no report for over ``timeout_s``,
    ``node_timeout_s`` of the job's config, or its agent's last report said it is leaving),
    from a min-heap of (deadline, node) with lazy
    deletion instead of a scan. ``track`` is called with each new observation (the intake);
    ``dead`` answers for the observations a tick decides on. ``incarnations``: each node's
    newest agent incarnation tracked. Thread-safe: reports are taken on the event loop while
    ``decide`` runs in a worker thread.

    Invariant: every node ``track``ed is in the heap (at most one live entry, ``_queued``: its
    deadline, never later than its current ``last_seen + timeout_s``) or in ``_dead``. Work:
    O(log nodes) per new node and per deadline that falls due (once a node timeout per node),
    O(dead nodes) per tick. ``last_seen`` may move on in place (relays); it never moves back
    without a ``track`` of the observation."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.incarnations: dict[str, str] = {}
        self._heap: list[tuple[float, str]] = []
        self._queued: dict[str, float] = {}  # node → the deadline of its live heap entry
        self._dead: set[str] = set()
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def at(self, obs: dict[str, NodeObs], now: float) -> LiveTick:
        """The liveness of ``obs``'s nodes at ``now`` for one tick (``dead`` once)."""
        return LiveTick(timeout_s=self.timeout_s, dead=frozenset(self.dead(obs, now)), index=self)

    def track(self, o: NodeObs) -> None:
        """``o`` is its node's newest observation (a report was taken)."""
        with self._lock:
            self._track(o)

    def _track(self, o: NodeObs) -> None:
        n = o.node_id
        self.incarnations[n] = o.incarnation
        self._known.add(n)
        if n in self._dead:
            return  # back from the dead: ``dead`` sees it at the next tick
        due = o.last_seen + (0.0 if o.leaving else self.timeout_s)  # a leaving agent: now
        queued = self._queued.get(n)
        if queued is None or due < queued:
            self._queued[n] = due
            heapq.heappush(self._heap, (due, n))

    def incarnations_within(self, known: dict[str, str]) -> bool:
        """Whether every node's newest incarnation is the one ``known`` holds (in C)."""
        with self._lock:
            return self.incarnations.items() <= known.items()

    def incarnations_cover(self, known: dict[str, str]) -> bool:
        """Whether each node ``known`` names still has the incarnation it holds (in C)."""
        with self._lock:
            return known.items() <= self.incarnations.items()

    def dead(self, obs: dict[str, NodeObs], now: float) -> set[str]:
        """The nodes of ``obs`` not alive at ``now`` (wall clock, s): exactly those for which
        ``pools.is_alive`` is False. ``obs``: the observations as ``track`` saw them, or a
        snapshot of them (a node tracked since is left for a later tick)."""
        t = self.timeout_s
        with self._lock:
            if not obs.keys() <= self._known:  # observations this index never saw
                for n in obs.keys() - self._known:
                    self._track(obs[n])
            heap, queued, dead = self._heap, self._queued, self._dead
            again: list[tuple[float, str]] = []
            while heap and heap[0][0] <= now + SLACK_S:
                due, n = heapq.heappop(heap)
                if queued.get(n) != due:
                    continue  # stale: an earlier deadline replaced it
                o = obs.get(n)
                if o is None:
                    again.append((due, n))  # tracked after this snapshot was taken
                elif not o.leaving and now - o.last_seen <= t:  # last_seen moved on: new due
                    queued[n] = o.last_seen + t
                    again.append((queued[n], n))
                else:
                    del queued[n]
                    dead.add(n)
            for n in list(dead):
                o = obs.get(n)
                if o is not None and not o.leaving and now - o.last_seen <= t:  # reported again
                    dead.discard(n)
                    queued[n] = o.last_seen + t
                    again.append((queued[n], n))
            for entry in again:
                heapq.heappush(heap, entry)
            return {n for n in dead if n in obs}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LiveTick:
    """The nodes' liveness for the observations of one tick (``Liveness.at``): ``dead``, the
    nodes not alive (``pools.is_alive``: no report for over ``timeout_s``); ``index``, the
    ``Liveness`` (its incarnations: which agents restarted). Incarnations are never reused
    and a tick's observations are never newer than the index, so a node whose newest
    incarnation is the one a state recorded shows that one in the tick's observations too."""

    timeout_s: float
    dead: frozenset[str]
    index: Liveness
