"""The agent channel's frames and address, both ends (``agent/channel.py``, the agent's server; ``worker/client.py``,
a training process's client).

Socket: ``AF_UNIX``/``SOCK_STREAM`` in the abstract namespace (``\\0`` + name): nothing on disk to clean up,
gone with the agent. The name travels to the training processes in ``DEADPOOL_AGENT_SOCK`` *without* the
leading NUL (an environment variable cannot hold one); both ends add it (``address_of``).

Frame: a 4-byte big-endian length, then an ``ipc/wire.py`` message (JSON + HMAC-SHA256 with the job secret;
no pickle), at most ``wire.MAX_MESSAGE_BYTES``. A message that carries fds (SCM_RIGHTS, sent with the frame's
first byte) says how many in its signed body (``"_fds": n``); the receiver replaces that count by the list of
fds it got, in order. The kinds in ``RESERVED`` are the channel's own (its admission): only the channel sends them.
"""
from __future__ import annotations

import os
import struct
from collections import deque

from ..errors import ChannelError, WireError
from . import wire

HEADER = struct.Struct(">I")
MAX_FDS = 8                 # fds per message (the agent sends at most 2 slots or 1 page at once)
FD_KEY = "_fds"
ENV = "DEADPOOL_AGENT_SOCK"
RESERVED = frozenset({"hello", "welcome", "refused", "closed"})   # kinds only the channel itself sends


def address_of(name: str) -> str:
    """The abstract-namespace address of channel ``name`` (with or without a leading NUL or ``@``)."""
    name = name.lstrip("\0@")
    if not name or "\0" in name or len(name.encode()) > 100:
        raise ValueError(f"channel name {name!r} must be 1-100 bytes with no NUL (as in ${ENV})")
    return "\0" + name


def encode_frame(kind: str, body: dict, secret: bytes, nfds: int = 0) -> bytes:
    """Length-prefixed wire message. ``nfds``: number of fds sent with it (recorded, signed, in the body).
    Raises WireError if the message exceeds ``wire.MAX_MESSAGE_BYTES``, ValueError for too many fds."""
    if nfds:
        if nfds > MAX_FDS:
            raise ValueError(f"{nfds} fds in one message; at most {MAX_FDS}")
        body = dict(body, **{FD_KEY: nfds})
    msg = wire.encode(kind, body, secret)
    return HEADER.pack(len(msg)) + msg


class FrameReader:
    """Bytes (and fds) read from one stream socket in, verified messages out.

    ``feed(data, fds)`` appends; ``messages()`` yields ``(kind, body)`` for every complete frame, removing each
    before it is yielded, and raises ChannelError at the first bad one (too long, bad HMAC, bad JSON, fds
    missing). fds still held when the reader is closed are closed.
    """

    def __init__(self, secret: bytes):
        self.secret = secret
        self.buf = bytearray()
        self.fds: deque[int] = deque()

    def feed(self, data, fds=()) -> None:
        self.buf += data
        self.fds.extend(fds)

    def messages(self):
        while len(self.buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf)
            if n <= wire.TAG_BYTES or n > wire.MAX_MESSAGE_BYTES:
                raise ChannelError(f"frame length {n} is outside {wire.TAG_BYTES + 1}..{wire.MAX_MESSAGE_BYTES} bytes")
            if len(self.buf) < HEADER.size + n:
                return
            raw = bytes(self.buf[HEADER.size:HEADER.size + n])
            del self.buf[:HEADER.size + n]
            try:
                kind, body = wire.decode(raw, n, self.secret)
            except WireError as exc:
                raise ChannelError(str(exc)) from exc
            if FD_KEY in body:
                k = body[FD_KEY]
                if not isinstance(k, int) or k < 0 or k > len(self.fds):
                    raise ChannelError(f"message {kind!r} announces {k!r} fds; {len(self.fds)} arrived")
                body[FD_KEY] = [self.fds.popleft() for _ in range(k)]
            yield kind, body

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popleft())
        self.buf.clear()
