"""The pre-flight's side of the controller's tick: start a run for new nodes (batched:
SETTLE_S after the last one appeared, or once the whole pool is there) and for quarantined
nodes due for a re-check, retry inconclusive verdicts with back-off, and hand each new
verdict to ``decide`` as an input (``Inputs.verdicts``): the driver never edits the state."""

from __future__ import annotations

from trainguard.controller.api import NodeObs
from trainguard.controller.config import JobConfig
from trainguard.controller.jobstate import JobState
from trainguard.controller.pools import is_alive, needs_recheck
from trainguard.controller.store import Store
from trainguard.health.coordinator import Preflight, Verdict

# New nodes are checked together: a run starts when the expected count has reported, or when
# no new node has appeared for this long.
SETTLE_S = 1.5
PREFLIGHT_RETRIES = 4  # inconclusive pre-flight runs of a node in a row before quarantine


class PreflightDriver:
    """Per-node bookkeeping of the pre-flight across ticks: when each node was first seen,
    and its run of inconclusive verdicts."""

    def __init__(self) -> None:
        self.first_seen: dict[str, float] = {}
        # node → (run, retry at, attempts) of its inconclusive pre-flight verdicts
        self._unsure: dict[str, tuple[int, float, int]] = {}
        self._handed: dict[str, tuple[float, tuple[str, ...]]] = {}  # verdicts decide has

    def seen(self, node: str, now: float) -> None:
        """``node`` reported at ``now`` (its first report starts its settle time)."""
        self.first_seen.setdefault(node, now)

    def tick(
        self,
        pf: Preflight,
        now: float,
        obs: dict[str, NodeObs],
        s: JobState,
        cfg: JobConfig,
        store: Store,
        check_only: bool,
    ) -> dict[str, tuple[float, tuple[str, ...]]]:
        """Advance the pre-flight run; start one for new nodes (batched) or quarantined nodes
        due for a re-check. Returns the verdicts reached since the last call, node →
        (wall time, problems), for ``Inputs.verdicts`` (``s`` is only read)."""
        alive = [n for n in sorted(obs) if is_alive(obs[n], now, cfg)]
        pf.tick(now, set(alive))
        verdicts: dict[str, tuple[float, tuple[str, ...]]] = {}
        for n in obs:
            v = pf.verdicts.get(n)
            got: tuple[float, tuple[str, ...]] | None = None
            if v is not None and v.inconclusive:
                got = self._retry_inconclusive(pf, n, v, now, store)
            elif v is not None:
                self._unsure.pop(n, None)
                got = (v.at, v.problems)
            if got is not None and self._handed.get(n) != got:
                verdicts[n] = self._handed[n] = got
        if pf.active is not None or check_only or s.phase.terminal:
            return verdicts
        new = [n for n in alive if n not in s.pools and n not in pf.verdicts]
        # A verdict handed this tick is not in ``s`` yet: count it, or the node that just
        # failed its re-check would be checked again at once.
        recheck = [
            n
            for n in alive
            if needs_recheck(s, obs[n], now, cfg, self._handed.get(n, (None, ()))[0])
        ]
        if new:
            settled = now - max(self.first_seen[n] for n in new) >= SETTLE_S
            if settled or len(new) + len(s.pools) >= cfg.nodes + cfg.standby:
                pf.start(new + recheck, "new node(s) joining the pool", now)
        elif recheck:
            pf.start(recheck, "re-check before readmission", now)
        return verdicts

    def _retry_inconclusive(
        self, pf: Preflight, node: str, v: Verdict, now: float, store: Store
    ) -> tuple[float, tuple[str, ...]] | None:
        """An inconclusive verdict (the check's machinery failed): check the node again after
        a back-off (``inconclusive_backoff_s``, doubling: 5, 10, 20, 40 s). After
        PREFLIGHT_RETRIES of them in a row it joins quarantine with that reason (re-checked
        later like any quarantined node): that failed verdict is returned. Called every
        tick."""
        seen = self._unsure.get(node)
        if seen is None or seen[0] != v.run:  # a new inconclusive verdict
            attempt = (seen[2] if seen is not None else 0) + 1
            delay = min(60.0, pf.cfg.inconclusive_backoff_s * 2 ** (attempt - 1))
            seen = self._unsure[node] = (v.run, now + delay, attempt)
            if attempt <= PREFLIGHT_RETRIES:
                store.record(
                    "preflight_inconclusive",
                    {"node": node, "run": v.run, "attempt": attempt, "retry_in_s": delay,
                     "problems": list(v.problems)},
                )  # fmt: skip
        if seen[2] > PREFLIGHT_RETRIES:
            why = (
                f"pre-flight inconclusive {PREFLIGHT_RETRIES + 1} times in a row (the check "
                f"itself failed, not a measurement): {v.problems[0]}"
            )
            return v.at, (why,)
        if now >= seen[1]:
            pf.verdicts.pop(node, None)  # unchecked again: the next run takes it
        return None
