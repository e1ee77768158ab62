"""Types every wire shares: the protocol version, size bounds, the refusal error, and the enums
that travel in messages (worker states, fault causes)."""

from __future__ import annotations

import enum
import json
import math
from typing import Any

PROTOCOL_VERSION = 1
MAX_REPORT_BYTES = 16 << 20  # a report with a long backlog of step records after an outage
MAX_ITEMS = 100_000  # workers, events, step batches or checkpoint entries in one report
MAX_NAME = 253  # a node id or address: a DNS name at most


class WorkerState(enum.StrEnum):
    """A worker process as its agent sees it."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    PARKED = "parked"  # left its training function after a fault; waits to resume (in process)


class ProtocolError(ValueError):
    """A report that does not follow the protocol; the message names the field."""


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ProtocolError(what)


INT64 = 1 << 63  # integers on every wire fit a signed 64-bit integer (SQLite's, C's)


def _strict_int(text: str) -> int:
    v = int(text)
    if not -INT64 <= v < INT64:
        raise ProtocolError(f"integer {text[:30]}… does not fit 64 bits")
    return v


def finite(v: object) -> bool:
    """A JSON number that is finite (a time, a duration, a deadline)."""
    return type(v) in (int, float) and math.isfinite(v)  # type: ignore[arg-type]


def loads(text: str | bytes) -> Any:
    """JSON as every wire takes it: ``json.loads`` that refuses integers outside 64 bits
    (ProtocolError: no SQLite column or C integer holds them). ``NaN`` and infinities are
    read (a loss or a gradient norm may be one: that is what the anomaly and SDC checks look
    for); each wire's ``from_json`` requires finite times and deadlines (``finite``)."""
    return json.loads(text, parse_int=_strict_int)


class FaultCause(enum.StrEnum):
    """Why a generation ended in a fault (``Fault.cause``)."""

    WORKER_CRASH = "worker_crash"  # a worker killed by a signal
    SDC = "sdc"  # silent data corruption: replicas' state fingerprints differ
    WORKER_EXIT = "worker_exit"  # a worker exited non-zero, or exited 0 while its peers ran
    HANG = "hang"  # no progress past the hang timeout
    NODE_LOST = "node_lost"  # no heartbeat for node_timeout_s, or a rebooted agent
    NODE_FENCED = "node_fenced"  # the node stopped its workers: it lost the controller
    RENDEZVOUS_TIMEOUT = "rendezvous_timeout"  # not every rank started in time
    COLLECTIVE = "collective"  # a collective failed on a rank that lives on (in process)
