"""TCP links between the control plane's members and an agent outside their MPI world: a replacement node that
joined the running job (control/joining.py, docs/replacement-nodes.md).

A link is one TCP connection carrying ``ipc/frames.py`` frames (a 4-byte length, then a signed ``ipc/wire.py``
message: JSON + HMAC-SHA256 with the job's secret; no pickle). A frame with a bad MAC or length closes the link.
After the admission's handshake (blocking, with a deadline: ``Handshake``) a link is non-blocking and owned by
one thread, the control thread (control/peers.py): ``send`` queues and writes what the socket takes, ``receive``
reads what has arrived; neither ever waits. A peer that stops reading costs at most ``MAX_BACKLOG`` bytes, then
the link closes (``LinkClosed``), which is a suspicion of that peer, as a closed ring link is.
"""
from __future__ import annotations

import socket
import time

from ..errors import ChannelError
from ..ipc.frames import FrameReader, encode_frame

MAX_BACKLOG = 8 << 20   # bytes queued for a peer that does not read before its link is given up


class LinkClosed(ConnectionError):
    """The link's peer closed it, sent a frame that failed its check, or stopped reading."""


class Link:
    """One framed, signed TCP connection (``sock``, connected) to agent ``node`` (None until known); ``rest``: bytes
    already read from it (``Handshake.rest``). Not thread-safe: one thread sends and receives."""

    def __init__(self, sock: socket.socket, secret: bytes, node: int | None = None, rest: bytes = b""):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.node = node
        self.secret = secret
        self.reader = FrameReader(secret)
        self.reader.feed(rest)   # what a Handshake read past the admission
        self.out = bytearray()
        self.closed = False

    def send(self, kind: str, body: dict) -> None:
        """Queue one message and write what the socket takes now. Raises LinkClosed when the link is gone (or its
        peer left more than MAX_BACKLOG bytes unread), WireError for a message over ``wire.MAX_MESSAGE_BYTES``."""
        if self.closed:
            raise LinkClosed(f"link to agent {self.node} is closed")
        self.out += encode_frame(kind, body, self.secret)
        self.flush()

    def flush(self) -> bool:
        """Write what the socket takes of the queued bytes; True when nothing is left. Raises LinkClosed."""
        while self.out and not self.closed:
            try:
                n = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.close()
                raise LinkClosed(f"link to agent {self.node}: {exc}") from exc
            del self.out[:n]
        if len(self.out) > MAX_BACKLOG:
            self.close()
            raise LinkClosed(f"agent {self.node} left {len(self.out)} bytes unread (limit {MAX_BACKLOG})")
        return not self.out

    def receive(self) -> list[tuple[str, dict]]:
        """Every verified message that has arrived, oldest first. Raises LinkClosed at the peer's end of stream, a
        socket error, or a frame that fails its check (messages before it are dropped with the link)."""
        if self.closed:
            raise LinkClosed(f"link to agent {self.node} is closed")
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.close()
                raise LinkClosed(f"link to agent {self.node}: {exc}") from exc
            if not data:
                self.close()
                raise LinkClosed(f"agent {self.node} closed its link")
            self.reader.feed(data)
        try:
            return list(self.reader.messages())
        except ChannelError as exc:
            self.close()
            raise LinkClosed(f"link to agent {self.node}: {exc}") from exc

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


def listen(host: str) -> tuple[socket.socket, list]:
    """A non-blocking TCP listener on ``host`` (an ephemeral port). Returns (socket, [host, port])."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, 0))
    srv.listen(16)
    srv.setblocking(False)
    return srv, [host, srv.getsockname()[1]]


class Handshake:
    """The first messages of one connection, blocking, each with a deadline (an admission: control/joining.py).
    What was read past them stays in ``rest()``, for the Link that takes the connection over."""

    def __init__(self, sock: socket.socket, secret: bytes):
        self.sock = sock
        self.secret = secret
        self.reader = FrameReader(secret)

    def send(self, kind: str, body: dict, timeout: float) -> None:
        """Send one message within ``timeout`` seconds. Raises TimeoutError, LinkClosed."""
        self.sock.settimeout(max(0.01, timeout))
        try:
            self.sock.sendall(encode_frame(kind, body, self.secret))
        except socket.timeout as exc:
            raise TimeoutError(f"no room to send {kind!r} within {timeout:g} s") from exc
        except OSError as exc:
            raise LinkClosed(str(exc)) from exc

    def receive(self, timeout: float) -> tuple[str, dict]:
        """The next message, within ``timeout`` seconds. Raises LinkClosed (end of stream, a bad frame),
        TimeoutError (nothing in time)."""
        end = time.monotonic() + timeout
        while True:
            try:
                for msg in self.reader.messages():
                    return msg
            except ChannelError as exc:
                raise LinkClosed(str(exc)) from exc
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {timeout:g} s")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout as exc:
                raise TimeoutError(f"no answer within {timeout:g} s") from exc
            except OSError as exc:
                raise LinkClosed(str(exc)) from exc
            if not data:
                raise LinkClosed("the peer closed the connection")
            self.reader.feed(data)

    def rest(self) -> bytes:
        """The bytes read past the messages received (frames the peer sent next)."""
        return bytes(self.reader.buf)


__all__ = ["Handshake", "Link", "LinkClosed", "MAX_BACKLOG", "listen"]
