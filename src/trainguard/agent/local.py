"""Local recovery on the agent's side (replica groups, ``runtime/replica.py``): a worker of
replica group g that fails is not a fault of the job while another group is live. Here, in the
same pass that saw it exit (so no report shows it failed):

1. group g leaves the quorum: the next epoch, written to the generation's TCPStore
   (``runtime/quorum.py``), lists the others only; the survivors, whose pending all-reduce with
   g failed, take that epoch and go on training without g;
2. g's other ranks on this node are killed (a group lies within one node);
3. g's ranks start anew in the same generation (``TRAINGUARD_REPLICA_INCARNATION`` one higher:
   their rendezvous is the group's own); they join the quorum and heal from a live group.

Not here (the fault stays, and the controller recovers every rank from a checkpoint): no other
group is live, no live group holds the trained state any more (``quorum.state_lost``: the
source of a heal died and every group left is new), or g restarted ``max_local_restarts`` times
in this generation already. When the
store does not answer within ``STORE_TIMEOUT_S`` (this node is cut off from node rank 0's, or
the generation is ending) g restarts all the same, without step 1: the survivors that reach the
store leave g out themselves (``quorum.evict``), and the new ranks join once the store answers
again (each failed try is one restart of the budget); a generation that is ending is stopped by
the controller meanwhile.

The agent's loop never waits on the store longer than that: the client is made on a thread
when the generation starts (the store may come up later than this agent, or never, across a
partition), and each call on it has its deadline (``quorum.BoundedStore``); a loop that waited
on a cut-off store would miss its heartbeats and have its node called lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from trainguard.agent import workers as wk
from trainguard.agent.group import WorkerGroup
from trainguard.protocol import Run
from trainguard.runtime import quorum
from trainguard.runtime.quorum import QuorumError

log = logging.getLogger("trainguard.agent")
STORE_TIMEOUT_S = 1.0  # per store call from the agent's loop (a healthy store answers in ms)
CONNECT_TIMEOUT_S = 600.0  # the client's connect, on its own thread, for the generation


def _what(w: wk.Worker) -> str:
    code = w.exit_code or 0
    how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return f"rank {w.rank} {how}"


class LocalRecovery:
    """Restarts of this node's replica groups in the running generation.

    ``spec(run, local_rank, incarnation)``: how to start a rank (``Agent._spec``);
    ``event(kind, **fields)``: the agent's event record."""

    def __init__(
        self,
        group: WorkerGroup,
        spec: Callable[[Run, int, int], dict[str, Any]],
        event: Callable[..., None],
    ) -> None:
        self._group, self._spec, self._event = group, spec, event
        self.generation: int | None = None
        self.incarnation: dict[int, int] = {}  # replica group → its latest restart here
        self.restarts: dict[int, int] = {}
        self._given_up: set[int] = set()  # groups left to the controller in this generation
        self._lock = threading.Lock()
        self._client: quorum.BoundedStore | None = None  # the generation's store, once made
        self._connector: threading.Thread | None = None

    def start(self, d: Run) -> None:
        """A generation starts: every group at incarnation 0, budgets full; the generation's
        store client is made on a thread (``store``)."""
        self.generation, self.incarnation, self.restarts = d.generation, {}, {}
        self._given_up = set()
        self.close()
        if d.replica_groups > 1:
            self._reconnect(d, drop=False, new_generation=True)

    def _connect(self, generation: int, host: str, port: int) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while time.monotonic() < deadline and self.generation == generation:
            try:
                client = quorum.connect(host, port, STORE_TIMEOUT_S)
            except (RuntimeError, OSError, ValueError):  # not up yet, or out of reach
                time.sleep(0.5)
                continue
            with self._lock:
                if self.generation == generation and self._client is None:
                    self._client = client
                    return
            client.close()
            return

    def _reconnect(self, d: Run, *, drop: bool, new_generation: bool = False) -> None:
        """A new client for the next try: the one that failed is dropped (``drop``: its call
        thread may be stuck, its connection reset); a connect thread starts unless one of this
        generation runs (an older generation's ends on its own within 0.5 s)."""
        if drop:
            self.close()
        if not new_generation and self._connector is not None and self._connector.is_alive():
            return
        if d.master_addr is None or d.master_port is None:
            return
        self._connector = threading.Thread(
            target=self._connect, args=(d.generation, d.master_addr, d.master_port),
            name="trainguard-quorum-connect", daemon=True,
        )  # fmt: skip
        self._connector.start()

    def close(self) -> None:
        """Let go of the generation's store client."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def failed(self, d: Run) -> None:
        """Restart each replica group with a failed worker here, where local recovery applies
        (module docstring); else leave it failed for the controller."""
        if d.replica_groups <= 1 or d.generation != self.generation:
            return
        size = d.world_size // d.replica_groups
        bad = sorted({w.rank // size for w in self._group.workers.values() if w.state == "failed"})
        for g in bad:
            if g not in self._given_up:
                self._restart(d, g, size)

    def _restart(self, d: Run, g: int, size: int) -> None:
        ranks = sorted(
            (w for w in self._group.workers.values() if w.rank // size == g), key=lambda w: w.rank
        )
        failed = [w for w in ranks if w.state == "failed"]
        why = _what(failed[0])
        if self.restarts.get(g, 0) >= d.replica_max_local_restarts:
            self._fallback(d, g, why, f"group {g} restarted {self.restarts[g]} times already")
            return
        if d.master_addr is None or d.master_port is None:
            self._fallback(d, g, why, "no store yet")
            return
        epoch: quorum.Epoch | None = None
        with self._lock:
            store = self._client
        try:
            if store is None:
                raise QuorumError("no connection to it in this generation yet")
            if (lost := quorum.state_lost(store)) is not None:
                self._fallback(d, g, why, lost)
                return
            live = [m for m in quorum.latest(store).members if m != g]
            if not live:
                self._fallback(d, g, why, "no other replica group is live")
                return
            epoch = quorum.leave(store, g, why, STORE_TIMEOUT_S)
        except (RuntimeError, OSError, ValueError) as e:  # QuorumError is a RuntimeError
            first = str(e).strip().splitlines()
            log.warning("[gen %d] replica group %d: the quorum store is unreachable (%s); "
                        "restarting it all the same", d.generation, g,
                        first[0][:200] if first else type(e).__name__)  # fmt: skip
            self._reconnect(d, drop=store is not None)
        self._group.kill({w.rank for w in ranks if w.state == "running"}, grace_s=0.0)
        inc = self.incarnation[g] = self.incarnation.get(g, 0) + 1
        self.restarts[g] = self.restarts.get(g, 0) + 1
        t_fault = min((w.exited_at for w in failed if w.exited_at is not None), default=None)
        for w in ranks:
            self._group.replace(w.rank, w.local_rank, self._spec(d, w.local_rank, inc),
                                incarnation=inc, replica_group=g)  # fmt: skip
        self._event("group_restarted", generation=d.generation, group=g,
                    ranks=[w.rank for w in ranks], incarnation=inc,
                    epoch=epoch.epoch if epoch else None,
                    members=list(epoch.members) if epoch else None, reason=why,
                    store_reached=epoch is not None, t_fault=t_fault)  # fmt: skip
        log.info("[gen %d] replica group %d: %s; restarted (incarnation %d), the others go on "
                 "in epoch %s", d.generation, g, why, inc, epoch.epoch if epoch else "?")  # fmt: skip

    def _fallback(self, d: Run, g: int, why: str, because: str) -> None:
        self._given_up.add(g)
        self._event("group_fallback", generation=d.generation, group=g, reason=why,
                    because=because)  # fmt: skip
        log.warning("[gen %d] replica group %d: %s; global recovery: %s", d.generation, g, why,
                    because)  # fmt: skip
