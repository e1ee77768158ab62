"""What a child of the node agent does first: die with the agent (a warm spare, a pre-flight
check, the in-job GEMM probe), as workers die with a powered-off host.

Here, below ``agent/`` and ``health/``, because both start such children: the agent's spare
(``agent/spare.py``) and the check and probe processes (``health/node.py``,
``health/probe.py``)."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when ``parent`` (the process that
    started it) dies; exit at once if it is gone already. Linux only (elsewhere: nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # non-Linux: rely on the agent's kill path
        return
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)
