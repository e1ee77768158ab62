"""A real S3 endpoint on loopback: moto's standalone server as its own process (the server
s3fs's own tests use). For the cold tier's tests and ``benchmarks/storage.py``."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_server(start_timeout_s: float = 60.0) -> Iterator[str]:
    """Start ``moto_server`` on a free loopback port; yield its endpoint URL; kill it on exit.
    Raises RuntimeError if it does not answer within ``start_timeout_s``."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server on port {port} did not start") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.kill()
        proc.wait(timeout=30)
