"""Bounded TCP I/O for the replica plane: one connection (``Link``) whose every call returns or raises
within ``POLL_S`` of a stop request, of its deadline, or of its peer going quiet for ``idle`` seconds.

Owns: connecting, framed signed messages (4-byte big-endian length + ``ipc/wire.py`` encoding:
JSON + HMAC-SHA256 with the job secret, verified before the body is parsed), and raw payload bytes
moved in pieces of at most ``CHUNK`` bytes. Does not own: what the messages mean, slots, threads
(``replicator.py``).

Why it looks like this: a peer that is SIGSTOPped still completes TCP handshakes (the kernel answers
for it) and then stops reading, so a plain blocking ``sendall``/``recv`` would wait forever; and
closing a socket from another thread does not wake a thread blocked in it on Linux. So sockets are
blocking with kernel timeouts (``SO_SNDTIMEO``/``SO_RCVTIMEO`` = ``POLL_S``): one ``send`` or
``recv_into(MSG_WAITALL)`` moves a whole ``CHUNK`` unless ``POLL_S`` passes first, and between calls
the link asks ``stop()`` and checks its deadlines. ``shutdown()`` from another thread wakes a blocked
call at once (a read sees EOF).

Moving a whole chunk per call matters: each call gives the GIL back and must take it again, which
costs up to a switch interval (5 ms) when another thread runs Python code. Python's own socket
timeouts (non-blocking socket + poll) release the GIL twice per call (poll, then send/recv) and
return after whatever the kernel had buffered. Measured here (200 MB, a pure-Python thread spinning
in the sending/receiving process, medians of 9): a restore received 510 MB/s with 4 MiB chunks, 920 MB/s with
16 MiB; push 420 and 570 MB/s.
"""
from __future__ import annotations

import errno
import select
import socket
import struct
import time

from ..errors import WireError
from ..ipc import wire
from ..ipc.schema import Message
from .headers import Ack, Go, Push, RestoreOffer
from .transports import TcpTransport

TCP = TcpTransport()

STREAM_KINDS = {c.KIND: c for c in (Push, RestoreOffer, Go, Ack)}   # what a Link's messages may be

POLL_S = 0.05                 # longest a call waits before it looks at stop() and its deadlines again
CHUNK = 16 * 1024 * 1024      # bytes handed to one send()/recv_into()
KEEP_S = 600.0                # a kept push connection with no push for this long is closed (the pusher opens a new one)
_LEN = struct.Struct("!I")


class LinkError(Exception):
    """A transfer did not complete. ``done`` is how many payload bytes had moved (when known)."""

    def __init__(self, msg: str, done: int | None = None):
        super().__init__(msg)
        self.done = done


class PeerGone(LinkError):
    """The peer refused the connection, reset it, or closed it early (a dead process)."""


class Stalled(LinkError):
    """The deadline passed, or nothing moved for ``idle`` seconds (a frozen or overloaded peer)."""


class Stopped(LinkError):
    """``stop()`` asked to give up (quiesce, close, the failure flag)."""


def fmt(address) -> str:
    return f"{address[0]}:{address[1]}"


class Link:
    """One stream connection (TCP, or another transport's socket) with bounded calls.

    stop: callable returning a reason (str) to give up, or None. deadline: time.monotonic() value after
    which any call raises Stalled. idle: seconds without progress after which a call raises Stalled.
    """

    def __init__(self, sock: socket.socket, peer: str, stop=None, deadline: float | None = None,
                 idle: float | None = None):
        self.sock = sock
        self.peer = peer
        self.stop = stop or (lambda: None)
        self.deadline = deadline
        self.idle = idle
        self.last = time.monotonic()
        sock.settimeout(None)
        tv = struct.pack("ll", 0, int(POLL_S * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    @classmethod
    def connect(cls, address, stop=None, deadline: float | None = None, idle: float | None = None,
                transport=None) -> "Link":
        """Connect to ``address`` (a transport's JSON address; TCP: [host, port]) without ever blocking longer than
        POLL_S at a time. ``transport``: replica/transports.py (default TCP)."""
        transport = transport or TCP
        peer = transport.peer(address)
        try:
            sock, sockaddr = transport.open(address)
        except OSError as exc:
            raise PeerGone(f"cannot resolve replica peer {peer}: {exc}") from exc
        try:
            sock.setblocking(False)
            err = sock.connect_ex(sockaddr)
            if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
                raise PeerGone(f"cannot connect to replica peer {peer}: {errno.errorcode.get(err, err)}")
            link = cls(sock, peer, stop, deadline, idle)
            poller = select.poll()   # not select.select: it fails on descriptors >= 1024
            poller.register(sock, select.POLLOUT)
            while err != 0:
                link.check()
                if poller.poll(POLL_S * 1000):
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise PeerGone(f"cannot connect to replica peer {peer}: {errno.errorcode.get(err, err)}")
                    break
            link.last = time.monotonic()
            return link
        except BaseException:
            sock.close()
            raise

    def check(self, done: int | None = None) -> None:
        """Raise Stopped / Stalled if it is time to give up."""
        reason = self.stop()
        if reason:
            raise Stopped(f"{reason}", done)
        now = time.monotonic()
        if self.deadline is not None and now > self.deadline:
            raise Stalled(f"deadline passed talking to {self.peer}", done)
        if self.idle is not None and now - self.last > self.idle:
            raise Stalled(f"nothing moved to or from {self.peer} for {self.idle:g} s", done)

    def send(self, data, on_sent=None) -> None:
        """Send all of ``data`` (bytes-like). ``on_sent(total_sent)`` is called after each piece."""
        mv = memoryview(data).cast("B")
        off, n = 0, len(mv)
        while off < n:
            self.check(off)
            try:
                k = self.sock.send(mv[off:off + CHUNK])
            except (BlockingIOError, TimeoutError, InterruptedError):
                continue
            except OSError as exc:
                self.check(off)
                raise PeerGone(f"{self.peer} dropped the connection after {off} of {n} bytes: {exc}", off) from exc
            if k:
                off += k
                self.last = time.monotonic()
                if on_sent is not None:
                    on_sent(off)

    def recv_into(self, buf, on_recv=None) -> None:
        """Fill all of ``buf`` (writable bytes-like). ``on_recv(total_received)`` after each piece."""
        mv = memoryview(buf).cast("B")
        off, n = 0, len(mv)
        while off < n:
            self.check(off)
            try:
                k = self.sock.recv_into(mv[off:off + CHUNK], 0, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError, InterruptedError):
                continue
            except OSError as exc:
                self.check(off)
                raise PeerGone(f"{self.peer} dropped the connection after {off} of {n} bytes: {exc}", off) from exc
            if k == 0:
                self.check(off)
                raise PeerGone(f"{self.peer} closed the connection after {off} of {n} bytes", off)
            off += k
            self.last = time.monotonic()
            if on_recv is not None:
                on_recv(off)

    def send_msg(self, msg: Message, secret: bytes) -> None:
        """Send one framed message (replica/headers.py)."""
        data = wire.encode(msg.KIND, msg.to_wire(), secret)
        self.send(_LEN.pack(len(data)) + data)

    def recv_msg(self, secret: bytes) -> Push | RestoreOffer | Go | Ack:
        """Receive one framed message (replica/headers.py); raises WireError if its length or signature is wrong,
        or it is not one of the stream's kinds with a well-formed body (naming the kind and the key)."""
        head = bytearray(_LEN.size)
        self.recv_into(head)
        (n,) = _LEN.unpack(head)
        if not wire.TAG_BYTES < n <= wire.MAX_MESSAGE_BYTES:
            raise WireError(f"replica message from {self.peer} announces {n} bytes; accepted: "
                            f"{wire.TAG_BYTES + 1}..{wire.MAX_MESSAGE_BYTES}")
        raw = bytearray(n)
        self.recv_into(raw)
        kind, body = wire.decode(raw, n, secret)
        cls = STREAM_KINDS.get(kind)
        if cls is None:
            raise WireError(f"replica message from {self.peer} is of kind {kind!r}; accepted: {sorted(STREAM_KINDS)}")
        try:
            return cls.from_wire(body)
        except ValueError as exc:
            raise WireError(f"replica message from {self.peer}: {exc}") from exc

    def shutdown(self) -> None:
        """Wake any call blocked on this link (safe from another thread; the owner still closes it)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
