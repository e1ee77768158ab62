"""trainguard's wires, one module each, dataclasses both ways.

- ``desired``: controller → agent, the desired state of a node (``Run``, ``Stop``, ``Idle``,
  ``Check``, ``Shutdown``).
- ``report``: agent → controller, the heartbeat report (``validate_report``).
- ``worker``: runtime → agent, the datagrams (``Heartbeat``, ``StepEnd``, ``Alive``,
  ``WorkerEvent``, ``Batch``), signed by ``runtime/wire.py``.
- ``ckptd``: a client → the node's ckptd, one request and one reply type per operation.
- ``common``: the version, size bounds, ``ProtocolError`` and the enums the wires share.

Every message is versioned (``PROTOCOL_VERSION``); a malformed one is refused with
``ProtocolError`` naming the field and the problem.
"""

from trainguard.protocol.common import (
    MAX_ITEMS,
    MAX_NAME,
    MAX_REPORT_BYTES,
    PROTOCOL_VERSION,
    FaultCause,
    ProtocolError,
    WorkerState,
)
from trainguard.protocol.desired import (
    Check,
    CkptConf,
    Desired,
    Idle,
    Run,
    Shutdown,
    Stop,
    desired_from_json,
    desired_to_json,
)
from trainguard.protocol.report import StepRecord, validate_report

__all__ = [
    "MAX_ITEMS",
    "MAX_NAME",
    "MAX_REPORT_BYTES",
    "PROTOCOL_VERSION",
    "Check",
    "CkptConf",
    "Desired",
    "FaultCause",
    "Idle",
    "ProtocolError",
    "Run",
    "Shutdown",
    "StepRecord",
    "Stop",
    "WorkerState",
    "desired_from_json",
    "desired_to_json",
    "validate_report",
]
