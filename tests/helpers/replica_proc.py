"""A replica client in a process of its own, so a test can SIGKILL or SIGSTOP it for real.

    replica_proc.py push ADDR SLOT RANK STEP GEN SUMS_JSON
    replica_proc.py hold ADDR N NONCE_BYTES

The job token comes from ``TRAINGUARD_TOKEN``.

``push`` sends ``SLOT`` with ``replica.push`` (what a ckptd's Replicator does) and prints one
JSON line: ``{"ok": true, "seconds": s}`` or ``{"error": "<type>: <message>", "seconds": s}``.
``hold`` opens ``N`` connections, reads each one's challenge and never answers it (a frozen
pushing ckptd), then prints ``held N``. Both then wait for stdin to close before exiting, so
the test can look at the process (its locks, its sockets) while it lives.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path


def _push(argv: list[str]) -> dict[str, object]:
    from trainguard.checkpoint import replica  # torch: only the pusher pays for the import

    addr, slot, rank, step, gen, sums = argv
    token = os.environ["TRAINGUARD_TOKEN"]
    t0 = time.monotonic()
    try:
        replica.push(addr, token, Path(slot), int(rank), int(step), int(gen), json.loads(sums))
    except Exception as e:  # reported, not raised: the test reads what the pusher saw
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    return {"ok": True, "seconds": time.monotonic() - t0}


def _hold(addr: str, n: int, nonce_bytes: int) -> list[socket.socket]:
    host, port = addr.rsplit(":", 1)
    held = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=60)
        got = b""
        while len(got) < nonce_bytes:  # the server's thread for it has started
            chunk = s.recv(nonce_bytes - len(got))
            if not chunk:
                raise ConnectionError("closed before the challenge")
            got += chunk
        held.append(s)
    return held


def main() -> int:
    mode, *rest = sys.argv[1:]
    if mode == "push":
        print(json.dumps(_push(rest)), flush=True)
    elif mode == "hold":
        held = _hold(rest[0], int(rest[1]), int(rest[2]))
        print(f"held {len(held)}", flush=True)
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    sys.stdin.read()  # until the test closes our stdin (or kills us)
    return 0


if __name__ == "__main__":
    sys.exit(main())
