"""Node pools (the seed's lists): admission after pre-flight, quarantine (faulty) and its
re-checks with back-off, retirement, and the node queries the state machine asks: is a
node alive, rebooted, a healthy standby; how many ranks the generation has. Pure.

Each tick, ``update_pools`` looks at the nodes whose pool may change: with the nodes'
deadlines (``summary.Liveness``) these are found without a scan or sort of every node
(issue 31: 16,384 nodes)."""

from __future__ import annotations

from trainguard.controller.api import (
    NodeObs,
    Phase,
    Pool,
)
from trainguard.controller.config import JobConfig
from trainguard.controller.jobstate import (
    Event,
    JobState,
    held_out,
)
from trainguard.controller.summary import LiveTick


def is_alive(o: NodeObs, now: float, cfg: JobConfig) -> bool:
    """A report of the node arrived within ``node_timeout_s`` (config) before ``now``, and it
    was not its agent's last (``leaving``: the agent exits; its node is gone at once, never
    taken back as reachable again)."""
    return not o.leaving and now - o.last_seen <= cfg.timeouts.node_timeout_s


def update_pools(
    s: JobState,
    obs: dict[str, NodeObs],
    now: float,
    cfg: JobConfig,
    events: list[Event],
    live: LiveTick | None = None,
) -> None:
    """The pools after the reports, node by node in the order the nodes were last seen: a new
    node admitted (``_admit``), a quarantined one back and re-checked (``_recheck``), a
    standby gone silent quarantined; each live node's agent incarnation recorded. ``live``:
    the liveness of ``obs``'s nodes (``Liveness.at``): only the nodes whose pool or
    incarnation may change are looked at (``_changed``); without it, every node is, sorted
    (the same result)."""
    if live is None or live.timeout_s != cfg.timeouts.node_timeout_s:
        nodes = sorted(obs.items(), key=lambda kv: kv[1].last_seen)
    else:
        nodes = _changed(s, obs, live)
    for node_id, o in nodes:
        alive = is_alive(o, now, cfg)
        pool = s.pools.get(node_id)
        if pool is None and alive:
            _admit(s, o, now, cfg, events)
        elif pool == Pool.FAULTY and alive:
            fresh = s.faulty_incarnations.get(node_id) != o.incarnation
            due = now >= s.recheck_at.get(node_id, now) or _joining(s, o)
            if fresh or due:
                _recheck(s, o, now, cfg, events, fresh)
        elif pool == Pool.STANDBY and not alive and not (o.leaving and s.phase.terminal):
            why = "its agent exited" if o.leaving else f"no heartbeat for {now - o.last_seen:.1f}s"
            mark_faulty(s, node_id, now, cfg, events, why)
        if alive:
            s.incarnations[node_id] = o.incarnation


def _changed(s: JobState, obs: dict[str, NodeObs], live: LiveTick) -> list[tuple[str, NodeObs]]:
    """The nodes ``update_pools`` may change, in its order (by last seen, then as ``obs``
    lists them): standbys not alive (``live.dead``), nodes without a pool, quarantined ones,
    and, when an agent incarnation differs from the recorded one, those nodes. Every other
    node is alive, pooled and not quarantined, with its incarnation recorded: nothing to do.
    The membership checks run in C (dict views)."""
    pools = s.pools
    cand = {n for n in live.dead if pools.get(n) == Pool.STANDBY}
    if not pools.keys() >= obs.keys():
        cand.update(obs.keys() - pools.keys())
    faulty = [n for n in s.recheck_at if pools.get(n) == Pool.FAULTY]
    if len(faulty) != list(pools.values()).count(Pool.FAULTY):  # one without a re-check time
        faulty = [n for n, p in pools.items() if p == Pool.FAULTY]
    cand.update(n for n in faulty if n in obs)
    if not live.index.incarnations_within(s.incarnations):
        cand.update(n for n, o in obs.items() if s.incarnations.get(n) != o.incarnation)
    nodes = sorted(((n, obs[n]) for n in cand), key=lambda kv: kv[1].last_seen)
    if len({o.last_seen for _, o in nodes}) < len(nodes):  # ties: in obs's order, as a scan
        pos = {n: i for i, n in enumerate(obs)}
        nodes.sort(key=lambda kv: (kv[1].last_seen, pos[kv[0]]))
    return nodes


def _admit(s: JobState, o: NodeObs, now: float, cfg: JobConfig, events: list[Event]) -> None:
    """A node seen for the first time joins standby, once it passed pre-flight (if on); a
    node that failed pre-flight joins quarantined (faulty), re-checked later."""
    node = o.node_id
    if cfg.preflight.level != "off" and node not in s.checked_at:
        return  # being checked
    s.join_order.append(node)
    s.incarnations[node] = o.incarnation
    if cfg.preflight.level != "off" and s.check_problems.get(node):
        events.append(("node_joined", {"node": node, "addr": o.addr, "pool": "faulty"}))
        why = "failed pre-flight: " + "; ".join(s.check_problems[node])
        mark_faulty(s, node, now, cfg, events, why)
        return
    s.pools[node] = Pool.STANDBY
    events.append(("node_joined", {"node": node, "addr": o.addr, "pool": "standby"}))
    if cfg.preflight.level != "off":
        events.append(
            (
                "pool_changed",
                {"node": node, "from": None, "to": "standby", "reason": "passed pre-flight"},
            )
        )


def needs_recheck(
    s: JobState, o: NodeObs, now: float, cfg: JobConfig, checked_at: float | None = None
) -> bool:
    """A quarantined node that is reachable, due for its re-check (or back with a fresh agent)
    and passes its host checks, but has no pre-flight verdict newer than its fault.
    ``checked_at``: its newest verdict's time when the caller knows one ``s`` does not have
    yet (a verdict handed to ``decide`` in this very tick)."""
    if cfg.preflight.level == "off" or s.pools.get(o.node_id) != Pool.FAULTY or not o.health_ok:
        return False
    fresh = s.faulty_incarnations.get(o.node_id) != o.incarnation
    due = now >= s.recheck_at.get(o.node_id, now) or _joining(s, o)
    at = max(s.checked_at.get(o.node_id, -1.0), -1.0 if checked_at is None else checked_at)
    checked = at > s.faulty_since.get(o.node_id, 0.0)
    return (fresh or due) and not checked


def _recheck(
    s: JobState, o: NodeObs, now: float, cfg: JobConfig, events: list[Event], fresh: bool
) -> None:
    """Return a quarantined node to standby when its host checks pass and (pre-flight on) a
    pre-flight newer than its fault passed; else back off before the next re-check."""
    node = o.node_id
    checked = cfg.preflight.level == "off" or s.checked_at.get(node, -1.0) > s.faulty_since.get(
        node, 0.0
    )
    if o.health_ok and not checked:
        return  # the coordinator is checking it
    failed = [] if o.health_ok else list(o.health_problems) or ["host checks fail"]
    if cfg.preflight.level != "off":
        failed += s.check_problems.get(node, [])
    if not failed:
        s.pools[node] = Pool.STANDBY
        s.recheck_at.pop(node, None)
        why = "node returned with a fresh agent" if fresh else "reachable again"
        passed = (
            "host checks pass"
            if cfg.preflight.level == "off"
            else "host checks and pre-flight pass"
        )
        events.append(
            (
                "pool_changed",
                {"node": node, "from": "faulty", "to": "standby", "reason": f"{why}; {passed}"},
            )
        )
        return
    if cfg.preflight.level != "off" and s.check_problems.get(node):  # a failed pre-flight: a fault
        s.node_faults[node] = s.node_faults.get(node, 0) + 1
        if s.node_faults[node] >= cfg.pool.retire_after:
            s.pools[node] = Pool.RETIRED
            s.recheck_at.pop(node, None)
            why = f"retired: failed {s.node_faults[node]} checks (last: {'; '.join(failed)})"
            events.append(
                ("pool_changed", {"node": node, "from": "faulty", "to": "retired", "reason": why})
            )
            return
    delay = _recheck_delay(cfg, s.node_faults.get(node, 1)) * 2
    s.recheck_at[node] = now + delay
    s.faulty_since[node] = now  # the next re-check needs a newer verdict
    events.append(("recheck_failed", {"node": node, "problems": failed, "next_in_s": delay}))


def _joining(s: JobState, o: NodeObs) -> bool:
    """A node quarantined only for silence (no failed pre-flight, its host checks pass) while
    the job is still waiting for its nodes: re-checked as soon as it reports again, without
    the back-off (a node whose host checks fail keeps it: one re-check a back-off, not one a
    tick). No
    generation exists yet for a flapping node to break, and a join of thousands of agents
    loses some for a moment (16,384 simulated nodes on 2 cores: 2,624 went silent for over
    the node timeout while joining, were quarantined for ``recheck_s`` = 30 s, and the job
    failed at its 30 s join timeout while they were reporting again). Losses still count
    toward ``retire_after``."""
    return s.phase == Phase.PENDING and o.health_ok and not s.check_problems.get(o.node_id)


def _recheck_delay(cfg: JobConfig, faults: int) -> float:
    return min(600.0, cfg.pool.recheck_s * 2 ** max(0, faults - 1))


def mark_faulty(
    s: JobState, node: str, now: float, cfg: JobConfig, events: list[Event], reason: str
) -> None:
    """Move a node to the faulty pool (re-checked later), or retire it after
    ``cfg.pool.retire_after`` faults."""
    before = s.pools.get(node)
    k = s.node_faults[node] = s.node_faults.get(node, 0) + 1
    s.faulty_incarnations[node] = s.gen_incarnations.get(node) or s.incarnations.get(node, "")
    s.faulty_since[node] = now
    if k >= cfg.pool.retire_after:
        s.pools[node] = Pool.RETIRED
        s.recheck_at.pop(node, None)
        why = f"retired: lost {k} times (last: {reason})"
    else:
        s.pools[node] = Pool.FAULTY
        s.recheck_at[node] = now + _recheck_delay(cfg, k)
        why = f"{reason}; re-check in {_recheck_delay(cfg, k):.0f}s"
    events.append(
        (
            "pool_changed",
            {
                "node": node,
                "from": before.value if before else None,
                "to": s.pools[node].value,
                "reason": why,
            },
        )
    )


def rebooted(s: JobState, node_id: str, obs: dict[str, NodeObs]) -> bool:
    """The node's agent restarted since the generation began: its workers died with it."""
    o = obs.get(node_id)
    return (
        o is not None
        and node_id in s.gen_incarnations
        and o.incarnation != s.gen_incarnations[node_id]
    )


def healthy_standby(s: JobState, obs: dict[str, NodeObs], now: float, cfg: JobConfig) -> list[str]:
    """Live standbys, the ones used first first: fewest faults (a node back from quarantine
    comes after every node that never failed: its re-check passed, but it failed once), then
    the order they joined."""
    out = held_out(s)
    live = [
        n
        for n in s.join_order
        if s.pools.get(n) == Pool.STANDBY and n in obs and is_alive(obs[n], now, cfg) and n != out
    ]
    return sorted(live, key=lambda n: s.node_faults.get(n, 0))  # stable: join order kept


def world_of(s: JobState, cfg: JobConfig) -> int:
    """Ranks of the current generation (fewer than ``cfg.world_size`` while shrunk)."""
    return (len(s.assignment) or cfg.nodes) * cfg.nproc_per_node
