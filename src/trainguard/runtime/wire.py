"""Authenticated JSON datagrams between a worker's runtime and its node agent.

A datagram is ``hex(hmac_sha256(token, body)) + b"\\n" + body`` where ``body`` is
UTF-8 JSON. The agent verifies the HMAC before parsing the JSON (ARCHITECTURE §5:
nothing received is decoded before it is authenticated). Datagrams stay below
64 KiB, the UDP limit on loopback. ``encode_message`` and ``decode_message`` carry the typed
messages of ``protocol/worker.py`` (what the runtime and the agent use); ``encode`` and
``decode`` are the framing under them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
from typing import Any

from trainguard.protocol.common import ProtocolError, loads
from trainguard.protocol.worker import Sender, WorkerMessage, message_from_json, message_to_json

MAX_DATAGRAM_BYTES = 60_000


class WireAuthError(ValueError):
    """A datagram whose HMAC does not match the job token (dropped by the receiver)."""


def encode(token: bytes, message: dict[str, Any]) -> bytes:
    """Serialize and sign ``message``. Raises ValueError if it exceeds MAX_DATAGRAM_BYTES."""
    body = json.dumps(message, separators=(",", ":")).encode()
    mac = hmac.new(token, body, hashlib.sha256).hexdigest().encode()
    data = mac + b"\n" + body
    if len(data) > MAX_DATAGRAM_BYTES:
        raise ValueError(f"datagram of {len(data)} bytes exceeds {MAX_DATAGRAM_BYTES}")
    return data


def decode(token: bytes, data: bytes) -> dict[str, Any]:
    """Verify and parse a datagram. Raises WireAuthError on a bad or missing HMAC, then
    ProtocolError (a ValueError) for a body that is not a JSON object or holds an integer past
    64 bits (``protocol.loads``)."""
    mac, sep, body = data.partition(b"\n")
    if not sep:
        raise WireAuthError("datagram without a signature")
    want = hmac.new(token, body, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(mac, want):
        raise WireAuthError("datagram signature does not match the job token")
    message = loads(body)
    if not isinstance(message, dict):
        raise ProtocolError("datagram body is not a JSON object")
    return message


def encode_message(token: bytes, sender: Sender, msg: WorkerMessage) -> bytes:
    """``msg`` from ``sender`` as a signed datagram. Raises ValueError past MAX_DATAGRAM_BYTES."""
    return encode(token, message_to_json(sender, msg))


def decode_message(token: bytes, data: bytes) -> tuple[Sender, WorkerMessage]:
    """Authenticate, then parse a datagram. Raises WireAuthError on a bad or missing HMAC,
    ProtocolError (a ValueError) naming the field of a malformed message, ValueError on
    JSON that does not parse."""
    return message_from_json(decode(token, data))


# A UDP receive buffer of the datagrams' readers (a relay's alive datagrams, an agent's
# workers' beats). A rack's nodes send a heartbeat's datagrams within
# a second; while the relay is busy (an uplink's answer, a burst of whole reports) they wait
# here, and past its size the kernel drops them (each costs its agent an ack timeout, then a
# direct report). The default (net.core.rmem_default, 208 KiB: ~200 datagrams) dropped 137,000
# in one run of 4,096 simulated nodes (benchmarks/controller_scale.py); 8 MiB holds a
# heartbeat of 8,000 nodes.
RECEIVE_BUFFER_BYTES = 8 << 20
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux's number where Python lacks it


def receive_buffer(sock: socket.socket, size: int = RECEIVE_BUFFER_BYTES) -> int:
    """Give UDP socket ``sock`` a receive buffer of ``size`` bytes: SO_RCVBUFFORCE (root or
    CAP_NET_ADMIN: past ``net.core.rmem_max``), else SO_RCVBUF (capped by it). Returns what
    the kernel granted (it reports twice the size asked, its bookkeeping included)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, size)
    except OSError:  # not privileged
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
