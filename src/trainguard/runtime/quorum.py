"""The replica groups' quorum ledger: which groups train together, epoch by epoch, kept in the
generation's TCPStore (the one node rank 0's agent hosts, ``MASTER_ADDR:MASTER_PORT``).

An epoch is an immutable record under ``trainguard/replica/q/<E>``: ``{"epoch", "members",
"why"}``, members the ids of the replica groups that average their gradients in it. Epoch 0
holds every group. A change (a group out, a group back) creates epoch E+1 with
``compare_set(key, "", record)``: of two writers racing for the same E+1 exactly one wins, and
the loser re-reads and retries against the winner's record, so the ledger is one line of
history every reader sees the same. ``trainguard/replica/latest`` is a hint (written after a
win, may lag by a record); readers walk forward from it.

Who writes: a node agent, the moment one of its workers of group g dies (``leave``: the
survivors' pending all-reduce fails at once, and they wait for the next epoch); a returning
group's ranks when they are up (``join``); the members of an epoch whose collective failed
while no agent wrote a change (a partition, a hung member: no process died), after each
reported itself alive under ``trainguard/replica/alive/<E>/<g>`` (``report_alive``):
``evict`` makes E+1 of those that reported. A group cut off from the store cannot report nor
write, so the side that holds the store goes on and the other waits, restarts and rejoins
(the store is the arbiter, as torchft's lighthouse is). Readers: ``runtime/replica.py`` (each step's
agreement). Costs: a read is 1-2 store round trips (~80 µs each on loopback, measured).
"""

from __future__ import annotations

import datetime
import json
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

PREFIX = "trainguard/replica"
LATEST = f"{PREFIX}/latest"


class QuorumError(RuntimeError):
    """The ledger could not be read or written within its deadline (the store is gone: the
    generation ends; global recovery follows)."""


@dataclass(frozen=True)
class Epoch:
    """One quorum epoch: ``members``, sorted replica-group ids; ``why`` the change that made it."""

    epoch: int
    members: tuple[int, ...]
    why: str

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "members": list(self.members), "why": self.why})

    @staticmethod
    def from_json(raw: bytes | str) -> Epoch:
        d = json.loads(raw)
        return Epoch(int(d["epoch"]), tuple(int(m) for m in d["members"]), str(d["why"]))


def key(epoch: int) -> str:
    return f"{PREFIX}/q/{epoch}"


class BoundedStore:
    """A TCPStore client whose every call returns within ``timeout_s`` seconds or raises
    QuorumError. torch's own timeout does not bound a call on a connection whose peer was cut
    off (packets dropped, no reset): measured here, ``check`` blocked past 10 s with a 3 s
    timeout (TCP retransmits for ~15 min). So calls run, in turn, on one daemon thread and
    the caller waits with a deadline; after a timeout that thread may stay blocked (later
    calls time out too: the connection is lost), and it dies with the process. ``raw``: the
    TCPStore itself (for ``dist.PrefixStore``)."""

    def __init__(self, raw: Any, timeout_s: float) -> None:
        self.raw, self.timeout_s = raw, timeout_s
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="trainguard-quorum-store", daemon=True).start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, args, out, done = item
            try:
                out.append((True, fn(*args)))
            except BaseException as e:  # noqa: BLE001  (handed to the caller)
                out.append((False, e))
            done.set()

    def _call(self, name: str, *args: Any) -> Any:
        out: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._calls.put((getattr(self.raw, name), args, out, done))
        if not done.wait(self.timeout_s):
            raise QuorumError(
                f"the quorum store did not answer ({name}) within {self.timeout_s:g} s: this "
                "node is cut off from node rank 0's, or the generation is ending"
            )
        ok, value = out[0]
        if not ok:
            raise value
        return value

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def close(self) -> None:
        """Stop the call thread (after the call in progress, if any)."""
        self._calls.put(None)


def bounded(fn: Any, timeout_s: float, what: str) -> Any:
    """``fn()`` on a daemon thread of its own, waited for at most ``timeout_s`` seconds: for a
    call of torch's that can block past its own timeout on a cut-off connection (making an
    epoch's gloo process group through the store). Raises QuorumError at the deadline (the
    thread may stay blocked; it dies with the process), or what ``fn`` raised."""
    out: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            out.append((False, e))
        done.set()

    threading.Thread(target=run, name="trainguard-quorum-bounded", daemon=True).start()
    if not done.wait(timeout_s):
        raise QuorumError(f"{what} did not finish within {timeout_s:g} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value


def connect_raw(host: str, port: int, timeout_s: float = 30.0) -> Any:
    """A plain TCPStore client (for ``dist.PrefixStore``: a process group's rendezvous)."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def connect(host: str, port: int, timeout_s: float = 30.0) -> BoundedStore:
    """A client of the generation's TCPStore at ``host:port``; each call returns within
    ``timeout_s`` seconds or raises QuorumError (``BoundedStore``). Raises RuntimeError from
    torch when the store cannot be reached within ``timeout_s``."""
    return BoundedStore(connect_raw(host, port, timeout_s), timeout_s)


def ensure(store: Any, groups: int) -> Epoch:
    """Epoch 0, every group a member (written by the first to come; the others read it)."""
    first = Epoch(0, tuple(range(groups)), "start")
    store.compare_set(key(0), "", first.to_json())
    return latest(store)


def read(store: Any, epoch: int) -> Epoch | None:
    """Epoch ``epoch``'s record, None if it does not exist yet."""
    k = key(epoch)
    return Epoch.from_json(store.get(k)) if store.check([k]) else None


def latest(store: Any) -> Epoch:
    """The newest epoch. Raises QuorumError when there is none (``ensure`` not called)."""
    hint = int(store.get(LATEST)) if store.check([LATEST]) else 0
    cur = read(store, hint)
    if cur is None:
        raise QuorumError(f"quorum epoch {hint} is missing from the store")
    while (nxt := read(store, cur.epoch + 1)) is not None:
        cur = nxt
    return cur


def wait_after(store: Any, epoch: int, deadline: float, poll_s: float = 0.002) -> Epoch:
    """Epoch ``epoch + 1`` once it exists (epochs are walked one at a time: every member takes
    the same next one). Raises QuorumError at ``deadline`` (``time.monotonic``)."""
    while (nxt := read(store, epoch + 1)) is None:
        if time.monotonic() >= deadline:
            raise QuorumError(f"no quorum epoch after {epoch} within the deadline")
        time.sleep(poll_s)
        poll_s = min(poll_s * 1.5, 0.05)
    return nxt


def _change(store: Any, members: Any, why: str, deadline_s: float) -> Epoch:
    """Create the next epoch with ``members(current)`` (None: no change needed); retried
    against the winner's record when another writer made that epoch first."""
    deadline = time.monotonic() + deadline_s
    while True:
        cur = latest(store)
        want = members(cur)
        if want is None:
            return cur
        new = Epoch(cur.epoch + 1, tuple(sorted(want)), why)
        got = store.compare_set(key(new.epoch), "", new.to_json())
        if Epoch.from_json(got) == new:
            store.set(LATEST, str(new.epoch))
            return new
        if time.monotonic() >= deadline:
            raise QuorumError(f"could not write quorum epoch {new.epoch} ({why})")


def leave(store: Any, group: int, why: str, deadline_s: float = 10.0) -> Epoch:
    """Group ``group`` out from the next epoch (a no-op if it is not a member)."""
    return _change(
        store,
        lambda cur: [m for m in cur.members if m != group] if group in cur.members else None,
        why,
        deadline_s,
    )


def join(store: Any, group: int, why: str, deadline_s: float = 10.0) -> Epoch:
    """Group ``group`` in from the next epoch (a no-op if it is a member already)."""
    return _change(
        store,
        lambda cur: [*cur.members, group] if group not in cur.members else None,
        why,
        deadline_s,
    )


def alive_key(epoch: int, group: int) -> str:
    return f"{PREFIX}/alive/{epoch}/{group}"


def report_alive(store: Any, epoch: int, group: int) -> None:
    """Group ``group`` is up and reaches the store after epoch ``epoch``'s collective failed
    (any of its ranks may write it). Raises RuntimeError when the store does not answer."""
    store.set(alive_key(epoch, group), "1")


def alive(store: Any, epoch: int, members: tuple[int, ...]) -> list[int]:
    """The ``members`` of epoch ``epoch`` that reported themselves alive after its failure."""
    return [m for m in members if store.check([alive_key(epoch, m)])]


def evict(store: Any, epoch: int, keep: list[int], why: str) -> Epoch:
    """Epoch ``epoch + 1`` with only ``keep`` (the members that reported alive), unless another
    writer made ``epoch + 1`` first: then that record (one line of history either way)."""
    new = Epoch(epoch + 1, tuple(sorted(keep)), why)
    got = Epoch.from_json(store.compare_set(key(new.epoch), "", new.to_json()))
    if got == new:
        store.set(LATEST, str(new.epoch))
    return got


def report_started(store: Any, group: int) -> None:
    """Group ``group``'s rank is up in this generation (before epoch 0 forms)."""
    store.set(f"{PREFIX}/started/{group}", "1")


def wait_started(store: Any, groups: int, deadline: float, poll_s: float = 0.01) -> list[int]:
    """Until every group reported started, epoch 1 exists (a group died meanwhile: its agent
    wrote it), or ``deadline``; returns the groups not started (``[]``: all are)."""
    while True:
        missing = [g for g in range(groups) if not store.check([f"{PREFIX}/started/{g}"])]
        if not missing or read(store, 1) is not None or time.monotonic() >= deadline:
            return missing
        time.sleep(poll_s)
        poll_s = min(poll_s * 1.5, 0.1)


LOST = f"{PREFIX}/state_lost"


def mark_state_lost(store: Any, why: str) -> None:
    """No live group holds the trained state any more (every member of an epoch is new): from
    now on, in this generation, a group's failure is global recovery's, from the checkpoint
    (``agent/local.py`` reads it; without it two new groups restart each other forever)."""
    store.set(LOST, why)


def state_lost(store: Any) -> str | None:
    """Why the trained state is lost in this generation, or None."""
    return store.get(LOST).decode() if store.check([LOST]) else None
