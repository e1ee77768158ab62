"""The agent's side of in-process recovery: abort the survivors, park them, resume them.

A ``Stop`` whose ``keep`` names ranks of this node (the controller's choice: every rank whose
script runs under ``trainguard.run`` and that did not fail) is carried out in steps, one per
pass of the agent's loop, never blocking it:

1. the other workers of the generation (the failed ones) are killed at once;
2. each kept worker gets an ``Abort`` (``protocol/control.py``), resent every ``RESEND_S``
   until it parks (its heartbeat or its ``inprocess_parked`` event says so);
3. one that has not parked within the stop's ``abort_timeout_s`` is killed: an
   ``inprocess_escalated`` event with the reason; it is restarted the old way.

The stop ends when every kept worker parked or was killed; the parked processes then wait in
``WorkerGroup.parked`` and the next ``Run`` hands each its new environment in a ``Resume``
(resent until a datagram of the new generation arrives, killed past the same deadline).
A parked process is resumed only into the same rank of a world of the same size; otherwise
(the world shrank or grew) it is killed and the rank gets a new process.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from typing import Any

from trainguard.agent import workers as wk
from trainguard.agent.group import WorkerGroup
from trainguard.protocol import Stop
from trainguard.protocol.control import Abort, Resume
from trainguard.runtime import wire

RESEND_S = 0.2  # an unanswered Abort or Resume is sent again this often (UDP)


class InProcessStops:
    """Aborts and resumes of this node's kept workers (see the module docstring)."""

    def __init__(
        self,
        group: WorkerGroup,
        sock: socket.socket,
        token: bytes,
        on_event: Callable[..., None],
    ) -> None:
        self._group, self._sock, self._token, self._on_event = group, sock, token, on_event
        self._generation: int | None = None  # the generation being aborted
        self._aborting: dict[int, float] = {}  # rank → deadline to park
        self._next_send: dict[int, float] = {}
        self._reason = ""
        self.abort_timeout_s = 10.0  # of the last Stop: also the deadline of a Resume
        # rank → (datagram, deadline) of a Resume not yet answered
        self._resuming: dict[int, tuple[bytes, float]] = {}

    def abort_done(self, d: Stop, why: str) -> bool:
        """Carry ``d`` one step further for this node's workers; True once every kept worker
        parked or was killed (the caller then stops the group, parking those)."""
        group, now = self._group, time.monotonic()
        if self._generation != d.generation:
            self._generation, self._reason = d.generation, why
            self.abort_timeout_s = d.abort_timeout_s
            keep = {r for r in d.keep if _abortable(group.workers.get(r))}
            killed = sorted(set(group.workers) - keep)
            group.kill(set(killed), grace_s=d.grace_s)
            self._aborting = {r: now + d.abort_timeout_s for r in keep}
            self._next_send = {}
            self._on_event("inprocess_abort", generation=d.generation, keep=sorted(keep),
                           killed=killed, reason=why)  # fmt: skip
            for rank in sorted(set(d.keep) & set(group.workers) - keep):  # the controller's
                w = group.workers[rank]  # view was older than this agent's: say which part
                self._on_event("inprocess_escalated", generation=d.generation, rank=rank,
                               pid=w.proc.pid, reason=_not_abortable(w))  # fmt: skip
        for rank, deadline in list(self._aborting.items()):
            w = group.workers[rank]
            if w.state != "running":  # parked, or its process ended meanwhile
                del self._aborting[rank]
                if w.state != "parked":  # e.g. the script caught the error and returned
                    self._on_event(
                        "inprocess_escalated", generation=d.generation, rank=rank,
                        pid=w.proc.pid, reason=f"its process exited (status {w.exit_code}) "
                        "instead of parking (the script's training function caught the "
                        "failure and returned?): restarted as a new process",
                    )  # fmt: skip
            elif now >= deadline:
                del self._aborting[rank]
                group.kill({rank}, grace_s=0.0)
                self._on_event(
                    "inprocess_escalated", generation=d.generation, rank=rank, pid=w.proc.pid,
                    reason=f"did not leave its training function within {d.abort_timeout_s:g}s "
                    "of the abort (a call no abort reaches?): killed, restarted as a new process",
                )  # fmt: skip
            elif now >= self._next_send.get(rank, 0.0):
                self._send(w, Abort(generation=d.generation, reason=self._reason).to_json())
                self._next_send[rank] = now + RESEND_S
        return not self._aborting

    def parked(self) -> set[int]:
        """Ranks of the group's workers that parked (the stop keeps their processes)."""
        return {r for r, w in self._group.workers.items() if w.state == "parked"}

    def resume(self, generation: int) -> Callable[[wk.Worker, dict[str, Any]], bool]:
        """``WorkerGroup.start``'s ``resume`` for ``generation``: send the parked worker its
        new environment (what differs from the one it ran with)."""

        def go(old: wk.Worker, spec: dict[str, Any]) -> bool:
            env: dict[str, str] = spec["env"]
            diff = {k: v for k, v in env.items() if old.env.get(k) != v}
            unset = tuple(k for k in old.env if k not in env)
            try:
                data = wire.encode(
                    self._token, Resume(generation=generation, env=diff, unset=unset).to_json()
                )
            except ValueError:  # an environment past the datagram limit: a new process
                return False
            if old.addr is None:
                return False
            self._resuming[old.rank] = (data, time.monotonic() + self.abort_timeout_s)
            self._sendto(data, old.addr)
            self._next_send[old.rank] = time.monotonic() + RESEND_S
            return True

        return go

    def retransmit(self) -> None:
        """Resend each unanswered Resume; kill a resumed worker silent past its deadline."""
        now = time.monotonic()
        for rank, (data, deadline) in list(self._resuming.items()):
            w = self._group.workers.get(rank)
            if w is None or w.resumed_from is None or w.last_hb_mono is not None:
                del self._resuming[rank]  # answered (a datagram of the new generation), or gone
            elif w.state != "running":
                del self._resuming[rank]
            elif now >= deadline:
                del self._resuming[rank]
                self._group.kill({rank}, grace_s=0.0)
                self._on_event(
                    "inprocess_escalated", generation=self._group.generation, rank=rank,
                    pid=w.proc.pid, reason=f"did not answer its resume within "
                    f"{self.abort_timeout_s:g}s: killed, restarted as a new process",
                )  # fmt: skip
            elif now >= self._next_send.get(rank, 0.0) and w.addr is not None:
                self._sendto(data, w.addr)
                self._next_send[rank] = now + RESEND_S

    def _send(self, w: wk.Worker, body: dict[str, Any]) -> None:
        if w.addr is not None:
            with contextlib.suppress(ValueError):  # past the datagram limit: never an Abort
                self._sendto(wire.encode(self._token, body), w.addr)

    def _sendto(self, data: bytes, addr: tuple[str, int]) -> None:
        with contextlib.suppress(OSError):  # UDP: resent until answered
            self._sock.sendto(data, addr)


def _abortable(w: wk.Worker | None) -> bool:
    """A worker that can be kept: alive, under ``trainguard.run``, its address known."""
    return w is not None and w.state in ("running", "parked") and w.inprocess and w.addr is not None


def _not_abortable(w: wk.Worker) -> str:
    """Why a rank the controller kept cannot be aborted here (``_abortable`` is False)."""
    if w.state not in ("running", "parked"):
        return (f"its process had already {w.state} (status {w.exit_code}) when the abort "
                "came: restarted as a new process")  # fmt: skip
    if not w.inprocess:
        return "it no longer runs under trainguard.run: restarted as a new process"
    return "its control address is not known yet: restarted as a new process"
