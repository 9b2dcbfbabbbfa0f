"""Message encoding for every connection of a run: JSON + HMAC-SHA256 with the per-job secret. No pickle.

Used by the control plane's MPI messages (control/peers.py), the agent channel's frames (ipc/frames.py), the ring
link (agent/ringlink.py), the replica stream (replica/stream.py) and the fork server (process/forkserver.py).

A message is ``json_bytes || tag`` where ``tag = HMAC-SHA256(secret, json_bytes)`` (32 bytes).
Every receiver verifies the tag before it parses anything, so a process that does not hold the
job's secret cannot inject heartbeats, failure notices or decisions. Messages are small (< 64 KiB).
"""
from __future__ import annotations

import hashlib
import hmac
import json

from ..errors import WireError

TAG_BYTES = 32
MAX_MESSAGE_BYTES = 64 * 1024


def encode(kind: str, body: dict, secret: bytes) -> bytes:
    """Return the wire bytes for message ``kind`` carrying ``body`` (JSON-serialisable dict).

    Raises WireError if the encoded message exceeds MAX_MESSAGE_BYTES.
    """
    payload = json.dumps({"k": kind, "b": body}, separators=(",", ":"), sort_keys=True).encode()
    msg = payload + hmac.new(secret, payload, hashlib.sha256).digest()
    if len(msg) > MAX_MESSAGE_BYTES:
        raise WireError(f"control message {kind!r} is {len(msg)} bytes; the limit is {MAX_MESSAGE_BYTES}")
    return msg


def decode(buf, nbytes: int, secret: bytes) -> tuple[str, dict]:
    """Verify and parse ``nbytes`` of ``buf``. Returns ``(kind, body)``.

    Raises WireError when the message is too short, the tag does not match (wrong or missing
    secret) or the JSON is malformed.
    """
    if nbytes <= TAG_BYTES:
        raise WireError(f"control message of {nbytes} bytes is shorter than its {TAG_BYTES}-byte tag")
    raw = bytes(buf[:nbytes])
    payload, tag = raw[:-TAG_BYTES], raw[-TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.new(secret, payload, hashlib.sha256).digest()):
        raise WireError("control message rejected: its HMAC does not match this job's secret")
    try:
        obj = json.loads(payload)
        return str(obj["k"]), dict(obj["b"])
    except (ValueError, KeyError, TypeError) as exc:
        raise WireError(f"control message is not valid JSON of the form {{k, b}}: {exc}") from exc
