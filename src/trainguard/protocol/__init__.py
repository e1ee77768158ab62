"""trainguard's wires, one module each, dataclasses both ways.

- ``desired``: controller → agent, the desired state of a node (``Run``, ``Stop``, ``Idle``,
  ``Check``, ``Shutdown``).
- ``report``: agent → controller, the heartbeat report (``AgentReport``; ``report_from_json``
  checks it on receipt).
- ``worker``: runtime → agent, the datagrams (``Heartbeat``, ``StepEnd``, ``Alive``,
  ``WorkerEvent``, ``Batch``), signed by ``runtime/wire.py``.
- ``ckptd``: a client → the node's ckptd, one request and one reply type per operation.
- ``inject``: a fault drill (``InjectSpec``), carried by the config, ``Run`` and events.
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
    loads,
)
from trainguard.protocol.desired import (
    Check,
    CheckTask,
    CkptConf,
    Desired,
    DesiredReply,
    Idle,
    Run,
    Shutdown,
    Stop,
    desired_from_json,
    desired_to_json,
    reply_from_json,
    reply_to_json,
)
from trainguard.protocol.inject import InjectSpec
from trainguard.protocol.report import (
    AgentReport,
    CheckResult,
    CkptdStatus,
    HealthReport,
    ProbeReport,
    ReportEvent,
    StepBatch,
    StepRecord,
    WorkerReport,
    report_from_json,
    report_to_json,
)

__all__ = [
    "AgentReport",
    "DesiredReply",
    "reply_from_json",
    "reply_to_json",
    "CheckResult",
    "CheckTask",
    "CkptdStatus",
    "HealthReport",
    "InjectSpec",
    "ProbeReport",
    "ReportEvent",
    "StepBatch",
    "WorkerReport",
    "report_from_json",
    "report_to_json",
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
    "loads",
    "desired_from_json",
    "desired_to_json",
]
