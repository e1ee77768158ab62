"""Wall-clock seconds that a step of the system clock does not move.

NTP, or an operator, may step ``CLOCK_REALTIME`` by any amount at any moment (a host whose
clock was an hour wrong is put right at once). A duration or deadline taken as a difference of
``time.time()`` readings across such a step is wrong by the step: a node would look silent for
an hour, a step would take an hour, or minus one. Everything trainguard judges by (heartbeat
ages, step durations, hang and straggler windows, recovery phases) reads ``wall()`` instead:
Unix seconds that advance exactly as ``time.monotonic()`` does, anchored to the real clock
once, when this process first asks. A step of the real clock after that anchor is not seen
by this process (its timestamps stay on the clock it started with); a process started later
anchors to the corrected clock, and the controller measures each node's offset (clock skew)
from the times its agent reports, as before.
"""

from __future__ import annotations

import time

_ANCHOR = (time.time(), time.monotonic())  # (real clock, monotonic clock) at import


def wall() -> float:
    """Unix seconds (float) on this process's steady wall clock: the real clock at the anchor
    plus the monotonic seconds since. Never steps; never raises."""
    return _ANCHOR[0] + (time.monotonic() - _ANCHOR[1])
