"""The local channel, agent side: a Unix socket over which a node agent talks to its training processes.

Owns: the listening socket, admission of a connection (same uid, the job's secret, a valid ``hello``, one
connection per local rank), the per-connection outboxes, and one progress page per local rank (``ipc/shm.py``),
sent with the ``welcome``. Does not own: the frame format (``ipc/frames.py``), what the messages mean (the agent's
main loop), the training processes' lifetimes (the agent's supervisor), the generation's key/value store
(``agent/store.py``), nor anything MPI.

Socket and frames: an abstract Unix socket, length-prefixed signed messages (``ipc/frames.py``, shared with
``worker/client.py``). Only the agent sends fds; the agent reads with plain ``recv`` so any fd a training process
sends is dropped by the kernel.

Admission, checked in order, any failure answered with a ``refused {why}`` frame (readable only with the
secret), an ``agent_refused`` event (``reason``, ``peer_pid``, ``peer_uid``) and a closed socket:
SO_PEERCRED shows this uid; the first frame arrives within ``hello_timeout`` seconds, passes its HMAC and is
``hello {local_rank: int >= 0 (< ranks when given), pid: int}`` with ``pid`` the connecting process's (per
SO_PEERCRED); no open connection has this local rank (one whose process has exited is not open: a process is
judged by its pidfd, not by its socket's EOF, which its forked children, e.g. DataLoader workers, could delay).
Accepted: the agent answers ``welcome {local_rank,
agent_pid, page_bytes}`` with the progress page's fd, and ``poll`` reports ``(local_rank, "hello", {local_rank,
pid, uid})``. When a connection ends, for whatever reason (its process's exit, seen on its pidfd, included),
``poll`` reports ``(local_rank, "closed", {why})`` once. A local rank may connect again once its previous connection is
closed (the agent decides whether to allow that; by the design a training process's exit ends its agent).

Threads: ``poll`` is called by one thread (the agent's channel loop); ``send``, ``closed``, ``progress`` and
``drop`` from any. Nothing blocks: sockets are non-blocking, ``send`` queues the frame and writes what the
kernel takes at once, the rest goes out from ``poll``. A training process that stops reading (SIGSTOP) is
dropped once ``max_outbox`` bytes wait for it, never waited for.

Measured (``benchmarks/channel.py``, 2 shared cores at load ~6, medians of 5 rounds of 1000): a ping/pong round
trip from a training process to the agent's poll thread and back, 140 µs; a bare socketpair, 10 µs. The rest is
the wire format (JSON + HMAC: ~20 µs to encode, ~17 µs to decode on this loaded machine) and the client's hand-off
from its reader thread. Messages here are per step at most, so this is far below a step's time.
"""
from __future__ import annotations

import array
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from collections import deque

from ..errors import ChannelError
from ..ipc.frames import RESERVED, FrameReader, address_of, encode_frame
from ..ipc.messages import Hello, Refused, Welcome
from ..ipc.shm import PAGE_BYTES, ProgressPage

logger = logging.getLogger(__name__)

_READ_CHUNK = 64 * 1024
_MAX_PENDING = 32           # connections awaiting their hello


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


class _Conn:
    __slots__ = ("sock", "reader", "out", "out_bytes", "local_rank", "pid", "uid", "t0", "doomed", "writing",
                 "pidfd")

    def __init__(self, sock, reader, pid, uid):
        self.sock = sock
        self.reader = reader
        self.out: deque = deque()       # [memoryview of the unsent rest of a frame, fds not yet sent]
        self.out_bytes = 0
        self.local_rank: int | None = None
        self.pid = pid
        self.uid = uid
        self.t0 = time.monotonic()
        self.doomed: str | None = None  # set (any thread) when the connection must go; poll closes it
        self.writing = False            # registered for EVENT_WRITE
        self.pidfd: int | None = None   # the accepted process's pidfd: readable once it has exited


class _Exited:
    """Selector data of an accepted process's pidfd."""
    __slots__ = ("conn",)

    def __init__(self, conn: _Conn):
        self.conn = conn


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):   # gone already, or no pidfd here (Linux < 5.3): the socket's EOF only
        return None


def _exited(fd: int | None) -> bool:
    """Whether the process of pidfd ``fd`` has exited (a pidfd is readable from then on)."""
    if fd is None:
        return False
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


class ChannelServer:
    """The agent's end of the local channel. See the module docstring for the protocol.

    secret: the job's secret (bytes). name: the abstract socket name without the NUL (default
    ``deadpool-<12 hex>-<pid>``); ``.name`` is the value for ``DEADPOOL_AGENT_SOCK``. log: an EventLog-like object
    (``emit(event, **fields)``) for ``agent_refused``; None: the ``logging`` logger only. hello_timeout: seconds a
    new connection has to send its hello. max_outbox: bytes queued for one training process before it is
    considered not reading and dropped. ranks: if given, local ranks must be < ranks.

    Raises ValueError for a bad name, OSError (EADDRINUSE) if the name is taken.
    """

    def __init__(self, secret: bytes, name: str | None = None, *, log=None, hello_timeout: float = 5.0,
                 max_outbox: int = 4 << 20, ranks: int | None = None):
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("the channel needs the job secret as non-empty bytes")
        self.secret = secret
        self.address = address_of(name or f"deadpool-{secrets.token_hex(6)}-{os.getpid()}")
        self.name = self.address[1:]
        self.log = log
        self.hello_timeout = hello_timeout
        self.max_outbox = max_outbox
        self.ranks = ranks
        self._lock = threading.Lock()        # _by_rank, _closed_ranks, outboxes, _events
        self._poll_lock = threading.Lock()   # one poll at a time; close waits for it
        self._closing = False
        self._by_rank: dict[int, _Conn] = {}
        self._closed_ranks: set[int] = set()
        self._pages: dict[int, ProgressPage] = {}
        self._pending: dict[socket.socket, _Conn] = {}
        self._events: list = []              # (local_rank, "closed", body) produced outside poll's thread
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            self._sock.bind(self.address)
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)

    # ---- views (any thread) --------------------------------------------------------------
    def connected(self) -> list[int]:
        """Local ranks with an open, accepted connection, in increasing order."""
        with self._lock:
            return sorted(r for r, c in self._by_rank.items() if c.doomed is None)

    def closed(self, local_rank: int) -> bool:
        """True once ``local_rank`` had an accepted connection that has ended (and none is open now); False while
        it is connected or before it ever connected."""
        with self._lock:
            c = self._by_rank.get(local_rank)
            if c is not None:
                return c.doomed is not None
            return local_rank in self._closed_ranks

    def peer(self, local_rank: int) -> dict | None:
        """``{pid, uid}`` of the process connected as ``local_rank`` (None if none)."""
        with self._lock:
            c = self._by_rank.get(local_rank)
            return None if c is None else {"pid": c.pid, "uid": c.uid}

    def progress(self, local_rank: int) -> ProgressPage | None:
        """The progress page shared with ``local_rank``'s process (kept after it disconnects, until ``close``)."""
        with self._lock:
            return self._pages.get(local_rank)

    def forget(self, local_rank: int) -> None:
        """Drop the progress page of ``local_rank``'s ended process (a node back in the spare pool starts a new one:
        until it connects, the old page, armed and still, would read as a hang)."""
        with self._lock:
            page = None if local_rank in self._by_rank else self._pages.pop(local_rank, None)
        if page is not None:
            page.close()

    # ---- sending (any thread) -------------------------------------------------------------
    def send(self, local_rank: int, kind: str, body: dict, fds=()) -> bool:
        """Queue message ``kind`` for ``local_rank`` and write what the kernel takes now (never blocks). ``fds``:
        open fds to pass with it (SCM_RIGHTS). They are duplicated when queued, so the caller may close its own at
        once; the receiver gets its own copies.

        Returns False if ``local_rank`` has no open connection, or if this message would take its outbox past
        ``max_outbox`` bytes (the connection is then dropped: ``poll`` reports it closed). Raises WireError for
        a message over ``wire.MAX_MESSAGE_BYTES``, ValueError for a reserved kind or too many fds.
        """
        if kind in RESERVED:
            raise ValueError(f"message kind {kind!r} is reserved for the channel itself")
        frame = encode_frame(kind, body, self.secret, len(fds))
        with self._lock:
            c = self._by_rank.get(local_rank)
            if c is None or c.doomed is not None:
                return False
            return self._queue(c, frame, fds)

    def drop(self, local_rank: int, why: str) -> None:
        """Close ``local_rank``'s connection (any thread); ``poll`` reports ``closed {why}``."""
        with self._lock:
            c = self._by_rank.get(local_rank)
            if c is not None and c.doomed is None:
                c.doomed = why
        self._wake()

    def _queue(self, c: _Conn, frame: bytes, fds) -> bool:
        """(under _lock) Append a frame to ``c``'s outbox and flush."""
        if c.out_bytes + len(frame) > self.max_outbox:
            c.doomed = (f"training process not reading: {c.out_bytes} bytes wait for it, the limit is "
                        f"{self.max_outbox}")
            self._wake()
            return False
        was_empty = not c.out
        c.out.append([memoryview(frame), [os.dup(fd) for fd in fds]])
        c.out_bytes += len(frame)
        if was_empty:
            self._flush(c)
            if c.out:
                self._wake()   # poll registers for EVENT_WRITE
        return c.doomed is None

    def _flush(self, c: _Conn) -> None:
        """(under _lock) Write queued frames until the kernel takes no more."""
        while c.out and c.doomed is None:
            data, fds = c.out[0]
            try:
                if fds:
                    n = c.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
                                       socket.MSG_NOSIGNAL)
                    c.out[0][1] = []
                    for fd in fds:   # our duplicates: the kernel passed its own references
                        os.close(fd)
                else:
                    n = c.sock.send(data, socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                c.doomed = f"send failed: {exc}"
                self._wake()
                return
            c.out_bytes -= n
            if n == len(data):
                c.out.popleft()
            else:
                c.out[0][0] = data[n:]

    def wake(self) -> None:
        """End a ``poll`` that waits now (or the next one) at once; safe from any thread."""
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass   # already awake (buffer full) or closing

    # ---- the polling thread -----------------------------------------------------------------
    def poll(self, timeout: float) -> list[tuple[int, str, dict]]:
        """Accept connections, read, write queued frames, and return the messages that arrived, in order:
        ``(local_rank, kind, body)``, including ``(L, "hello", {local_rank, pid, uid})`` for an accepted process
        and ``(L, "closed", {why})`` for an ended connection. Waits at most ``timeout`` seconds for something to
        happen (may return an empty list sooner). Returns [] once closed.
        """
        with self._poll_lock:
            if self._closing:
                return []
            out: list = []
            self._reap(out)
            with self._lock:
                conns = list(self._by_rank.values()) + list(self._pending.values())
                for c in conns:
                    want = bool(c.out)
                    if want != c.writing:
                        ev = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
                        self._sel.modify(c.sock, ev, c)
                        c.writing = want
            if self._pending:
                oldest = min(c.t0 for c in self._pending.values())
                timeout = max(0.0, min(timeout, oldest + self.hello_timeout - time.monotonic()))
            for key, mask in self._sel.select(timeout):
                if key.fileobj is self._sock:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                elif isinstance(key.data, _Exited):   # the process exited: its children may still hold the socket
                    c = key.data.conn
                    with self._lock:
                        if c.doomed is None:
                            c.doomed = f"training process pid {c.pid} exited (its pidfd)"
                else:
                    c = key.data
                    if mask & selectors.EVENT_WRITE:
                        with self._lock:
                            self._flush(c)
                    if mask & selectors.EVENT_READ and c.doomed is None:
                        self._read(c, out)
            now = time.monotonic()
            for c in list(self._pending.values()):
                if c.doomed is None and now - c.t0 > self.hello_timeout:
                    self._refuse(c, f"no hello within {self.hello_timeout:g} s")
            self._reap(out)
            return out

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:   # EMFILE and the like: leave it in the backlog, say why
                logger.warning("channel %s: accept failed: %s", self.name, exc)
                return
            sock.setblocking(False)
            try:
                pid, uid, _gid = peer_cred(sock)
            except OSError:
                pid, uid = -1, -1
            c = _Conn(sock, FrameReader(self.secret), pid, uid)
            self._pending[sock] = c
            self._sel.register(sock, selectors.EVENT_READ, c)
            if uid != os.getuid():
                self._refuse(c, f"peer uid {uid} is not this job's uid {os.getuid()}")
            elif len(self._pending) > _MAX_PENDING:
                self._refuse(c, f"more than {_MAX_PENDING} connections are waiting for their hello")

    def _read(self, c: _Conn, out: list) -> None:
        got = 0
        while got < 4 * _READ_CHUNK:   # fairness: one connection cannot hold the loop
            try:
                data = c.sock.recv(_READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._end(c, f"receive failed: {exc}")
                return
            if not data:
                self._end(c, "connection closed by the training process (EOF)")
                return
            got += len(data)
            c.reader.feed(data)
            try:
                for kind, body in c.reader.messages():
                    if c.local_rank is None:
                        self._hello(c, kind, body, out)
                        if c.doomed is not None:
                            return
                    elif kind in RESERVED:
                        raise ChannelError(f"message kind {kind!r} is reserved for the channel")
                    else:
                        out.append((c.local_rank, kind, body))
            except ChannelError as exc:
                self._end(c, f"bad frame: {exc}")
                return

    def _hello(self, c: _Conn, kind: str, body: dict, out: list) -> None:
        if kind != Hello.KIND:
            return self._refuse(c, f"first message is {kind!r}; expected 'hello'")
        try:
            hello = Hello.from_wire(body)
        except ValueError as exc:
            return self._refuse(c, str(exc))
        lr, pid = hello.local_rank, hello.pid
        if lr < 0 or (self.ranks is not None and lr >= self.ranks):
            accepted = "0..%d" % (self.ranks - 1) if self.ranks else "an integer >= 0"
            return self._refuse(c, f"hello's local_rank {lr!r} is not {accepted}")
        if pid != c.pid:
            return self._refuse(c, f"hello's pid {pid!r} is not the connecting process's pid {c.pid}")
        with self._lock:
            other = self._by_rank.get(lr)
            if other is not None and other.doomed is None and _exited(other.pidfd):
                # the old process is dead; what still holds its socket open is a child it forked (the pidfd is the
                # judge, not the socket's EOF)
                other.doomed = f"training process pid {other.pid} exited (its pidfd)"
            if other is not None and other.doomed is None:
                busy = other.pid
            else:
                busy = None
                del self._pending[c.sock]
                c.local_rank = lr
                if other is not None:   # doomed, not yet reaped: end it now
                    self._close_conn(other)
                    self._events.append((lr, "closed", {"why": other.doomed}))
                self._by_rank[lr] = c
                self._closed_ranks.discard(lr)
                c.pidfd = _open_pidfd(c.pid)
                if c.pidfd is not None:
                    self._sel.register(c.pidfd, selectors.EVENT_READ, _Exited(c))
                old = self._pages.pop(lr, None)
                page = self._pages[lr] = ProgressPage.create()
                welcome = Welcome(local_rank=lr, agent_pid=os.getpid(), page_bytes=PAGE_BYTES)
                self._queue(c, encode_frame(Welcome.KIND, welcome.to_wire(), self.secret, 1), [page.fd])
        if busy is not None:
            return self._refuse(c, f"local rank {lr} is already connected (pid {busy})")
        if old is not None:
            old.close()
        out.append((lr, "hello", {"local_rank": lr, "pid": c.pid, "uid": c.uid}))

    def _refuse(self, c: _Conn, reason: str) -> None:
        """Answer ``refused {why}`` (best effort), log ``agent_refused``, close a not-yet-accepted connection."""
        try:
            c.sock.send(encode_frame(Refused.KIND, Refused(reason).to_wire(), self.secret), socket.MSG_NOSIGNAL)
        except OSError:
            pass
        logger.warning("channel %s refused a connection (pid %s, uid %s): %s", self.name, c.pid, c.uid, reason)
        if self.log is not None:
            self.log.emit("agent_refused", reason=reason, peer_pid=c.pid, peer_uid=c.uid)
        self._pending.pop(c.sock, None)
        c.doomed = reason
        self._close_conn(c)

    def _end(self, c: _Conn, why: str) -> None:
        """A connection ended (EOF, error, bad frame): pending ones count as refused, accepted ones as closed."""
        if c.local_rank is None:
            self._refuse(c, f"{why} before its hello" if "EOF" in why else why)
            return
        with self._lock:
            if c.doomed is None:
                c.doomed = why

    def _reap(self, out: list) -> None:
        """(poll's thread) Close doomed accepted connections; report each once."""
        with self._lock:
            for lr, c in list(self._by_rank.items()):
                if c.doomed is not None:
                    del self._by_rank[lr]
                    self._closed_ranks.add(lr)
                    self._close_conn(c)
                    self._events.append((lr, "closed", {"why": c.doomed}))
            events, self._events = self._events, []
        out.extend(events)

    def _close_conn(self, c: _Conn) -> None:
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()
        c.reader.close()
        if c.pidfd is not None:
            try:
                self._sel.unregister(c.pidfd)
            except (KeyError, ValueError):
                pass
            os.close(c.pidfd)
            c.pidfd = None
        for _, fds in c.out:
            for fd in fds:
                os.close(fd)
        c.out.clear()
        c.out_bytes = 0

    def close(self) -> None:
        """Close every connection, the pages and the socket (idempotent; any thread: waits for a running ``poll``
        to return, i.e. at most its timeout). Training processes see EOF at once."""
        self._wake()
        with self._poll_lock:
            if self._closing:
                return
            self._closing = True
            with self._lock:
                for c in list(self._by_rank.values()) + list(self._pending.values()):
                    self._close_conn(c)
                self._by_rank.clear()
                self._pending.clear()
                pages, self._pages = list(self._pages.values()), {}
            for p in pages:
                p.close()
            self._sel.close()
            for s in (self._sock, self._wake_r, self._wake_w):
                s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
