"""The JSONL event log: one JSON object per line, appended atomically by every process of a run.

Each line has at least ``t`` (wall time, seconds since the epoch), ``event`` (a name from
docs/troubleshooting.md), ``pid`` and whatever the emitter adds (generation, rank, phase times).
Lines are written with a single ``os.write`` on an ``O_APPEND`` descriptor, so concurrent writers on
one machine never interleave within a line.

A write that fails never ends a process (losing a log line must not lose the run): the run directory may be full
(ENOSPC, EDQUOT), read-only (EROFS), or gone (EIO, ESTALE). Such a line is *counted* (``failed``), reported once per
distinct error on stderr, and *spilled*: sent as one datagram to the local launcher (``DEADPOOL_EVENT_SPILL``, an
abstract Unix socket; ``EventSpill`` is its receiving end), which merges the spilled lines into the live view and
the summary. Each new error also produces an ``event_log_failed`` record (counts so far), written or spilled like
any other line.

A file system that stops answering blocks ``write`` in the kernel; no timeout can cut it short on the calling
thread. A long-lived process (a node agent, a training process) therefore uses ``background=True``: ``emit``
only appends the line to a bounded in-memory queue (``QUEUE_MAX`` lines) and rings a pipe, and one writer thread
writes the queue out. ``emit`` never waits: a full queue drops the line (counted in ``dropped``) and spills it; a
write blocked for more than ``STUCK_S`` seconds makes ``emit`` spill each new line too (the launcher drops the
duplicate if the blocked write completes later). ``emit`` is safe in a signal handler (a deque append and a
non-blocking pipe write). ``sync``/``close`` wait for the queue at most their ``timeout``. Short-lived writers (the
launcher, the Slurm scripts) keep the synchronous write (``background=False``): their line is on disk when
``emit`` returns, or counted and spilled.
"""
from __future__ import annotations

import collections
import errno
import json
import os
import socket
import sys
import threading
import time
from typing import Iterator

SPILL_ENV = "DEADPOOL_EVENT_SPILL"   # the launcher's spill socket (abstract name), inherited by every process
QUEUE_MAX = 10_000                  # lines a background log holds before it drops (about 3 MB at most)
STUCK_S = 1.0                       # a write blocked this long: new lines are spilled as well as queued
SPILL_MAX = 60_000                  # bytes of one spilled datagram (a longer line is cut to its first fields)
SPILL_WAIT_S = 0.5                  # how long the writer thread waits for room in the launcher's socket queue


def _errname(exc: OSError) -> str:
    code = getattr(exc, "errno", None)
    name = errno.errorcode.get(code, "EIO") if code else type(exc).__name__
    return f"{name}: {exc.strerror or exc}"


class EventLog:
    """Append-only JSONL writer. ``base`` fields (e.g. mpi_rank) are added to every line.

    ``background``: write from a writer thread (see the module docstring); ``spill``: the launcher's spill socket
    name (default: ``$DEADPOOL_EVENT_SPILL``; "" for none). Never raises OSError for the run directory's sake:
    ``failed`` (lines not written), ``dropped`` (lines a full queue refused), ``spilled`` (lines sent to the
    launcher) and ``last_error`` say what happened."""

    def __init__(self, path: str, background: bool = False, spill: str | None = None, **base):
        self.path = path
        self.base = dict(base, pid=os.getpid())
        self.failed = 0
        self.dropped = 0
        self.spilled = 0
        self.last_error: str | None = None
        self._errors: set[str] = set()
        self._fd: int | None = None
        self._torn = False            # a short write left a partial line: the next line starts with "\n"
        self._next_open = 0.0
        if not background:   # (a background log opens the file on its writer thread: an open may block too)
            self._open()
        spill = os.environ.get(SPILL_ENV, "") if spill is None else spill
        self._spill_addr = ("\0" + spill) if spill else None
        self._spill_sock: socket.socket | None = None
        self._q: collections.deque | None = None
        self._busy_since: float | None = None
        self._queued = self._done = 0   # lines queued, lines the writer is done with (written or failed)
        self._closed = False
        if background:
            self._q = collections.deque()
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(self._wake_w, False)
            threading.Thread(target=self._writer, name="deadpool-events", daemon=True).start()

    # ---- the callers' side -------------------------------------------------------------------------------------
    def emit(self, event: str, t: float | None = None, **fields) -> dict:
        """Log one event; returns its record. Never blocks on the file system with ``background``."""
        rec = {"t": time.time() if t is None else t, "event": event, **self.base, **fields}
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        if self._q is None:
            self._write(line)
            return rec
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > STUCK_S:
            self._spill(line)   # the writer is stuck in the kernel: the launcher hears of it now
        if len(self._q) >= QUEUE_MAX:
            self.dropped += 1
            self._spill(line)
            self._report(OSError(errno.ENOBUFS, f"the event queue is full ({QUEUE_MAX} lines): a write blocks"))
            return rec
        self._enqueue(line)
        return rec

    def _enqueue(self, line: bytes) -> None:
        self._q.append(line)
        self._queued += 1
        try:
            os.write(self._wake_w, b"x")
        except OSError:   # the pipe is full: the writer has a wake-up pending already
            pass

    def flush(self, timeout: float = 2.0) -> bool:
        """Wait until every queued line is written (or failed), at most ``timeout`` seconds; True if it was."""
        end = time.monotonic() + timeout
        target = self._queued
        while self._done < target:
            if time.monotonic() > end:
                return False
            time.sleep(0.002)
        return True

    def sync(self, timeout: float = 2.0) -> bool:
        """``flush``, then fsync the file, both within ``timeout`` seconds (a thread does the fsync: a file system
        that stopped answering must not keep a process from exiting). True if both completed."""
        t0 = time.monotonic()
        done = self.flush(timeout)
        fd = self._fd
        if fd is None:
            return False
        th = threading.Thread(target=self._fsync, args=(fd,), name="deadpool-events-fsync", daemon=True)
        th.start()
        th.join(max(0.0, timeout - (time.monotonic() - t0)))
        return done and not th.is_alive()

    def close(self, timeout: float = 2.0) -> None:
        """``flush`` (at most ``timeout`` s), report the counts if any line failed, close the file."""
        self.flush(timeout)
        self._closed = True
        if self.failed or self.dropped:
            self._final_report()
        fd, self._fd = self._fd, None
        if fd is not None and self._busy_since is None:
            try:
                os.close(fd)
            except OSError:
                pass
        if self._q is not None:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass

    def counts(self) -> dict:
        """What went wrong so far: {failed, dropped, spilled, last_error}."""
        return {"failed": self.failed, "dropped": self.dropped, "spilled": self.spilled, "last_error": self.last_error}

    # ---- the writing ---------------------------------------------------------------------------------------------
    def _writer(self) -> None:
        while not self._closed:
            try:
                os.read(self._wake_r, 4096)
            except OSError:
                return
            while self._q:
                line = self._q.popleft()
                self._busy_since = time.monotonic()
                try:
                    self._write(line)
                finally:
                    self._busy_since = None
                    self._done += 1

    def _open(self) -> None:
        if time.monotonic() < self._next_open:
            return
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self._next_open = time.monotonic() + 1.0   # a read-only directory is retried once a second at most
            self.last_error = _errname(exc)

    def _write(self, line: bytes) -> bool:
        if self._fd is None:
            self._open()
        try:
            if self._fd is None:
                raise OSError(errno.EBADF, f"cannot open {self.path} ({self.last_error})")
            data = (b"\n" + line) if self._torn else line
            n = os.write(self._fd, data)
            if n < len(data):   # the disk filled up within the line: it is torn, the next one starts afresh
                self._torn = True
                raise OSError(errno.ENOSPC, f"short write ({n} of {len(data)} bytes)")
            self._torn = False
            return True
        except OSError as exc:
            self.failed += 1
            self._spill(line, wait=True)
            self._report(exc)
            return False

    def _fsync(self, fd: int) -> None:
        try:
            os.fsync(fd)
        except OSError as exc:
            self.last_error = _errname(exc)

    def _spill(self, line: bytes, wait: bool = False) -> None:
        """Send ``line`` to the launcher (one datagram); counted in ``spilled``, else ``dropped`` when there is no
        launcher to tell or its socket's queue stays full. ``wait``: up to SPILL_WAIT_S for room (the writer
        thread, or a synchronous log: a Unix datagram queue holds only net.unix.max_dgram_qlen datagrams, 10 by
        default, until the launcher's receiving thread takes them); else never waits (emit's own thread)."""
        if self._spill_addr is None:
            return
        try:
            if self._spill_sock is None:
                self._spill_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._spill_sock.settimeout(SPILL_WAIT_S)
            if len(line) > SPILL_MAX:
                rec = json.loads(line)
                line = (json.dumps({k: rec[k] for k in ("t", "event", "pid", "run", "node", "mpi_rank") if k in rec}
                                   | {"truncated": True}) + "\n").encode()
            self._spill_sock.sendto(line, 0 if wait else socket.MSG_DONTWAIT, self._spill_addr)
            self.spilled += 1
        except (OSError, ValueError):
            self.dropped += 1

    def _report(self, exc: OSError) -> None:
        """The first line lost to each distinct error: say so on stderr and in an ``event_log_failed`` record."""
        err = _errname(exc)
        self.last_error = err
        if err in self._errors or len(self._errors) > 8:
            return
        self._errors.add(err)
        _stderr(f"deadpool: event log {self.path}: {err}; the lines not written are counted and sent to the "
                f"launcher; this process goes on")
        rec = {"t": time.time(), "event": "event_log_failed", **self.base, "path": self.path, "error": err,
               **self.counts()}
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        if self._q is not None:
            self._spill(line)          # (and queued, once the writer may write again)
            if len(self._q) < QUEUE_MAX:
                self._enqueue(line)
        else:
            self._spill(line)

    def _final_report(self) -> None:
        rec = {"t": time.time(), "event": "event_log_failed", **self.base, "path": self.path, "final": True,
               "error": self.last_error, **self.counts()}
        _stderr(f"deadpool: event log {self.path}: {self.failed} line(s) not written, {self.dropped} dropped, "
                f"{self.spilled} sent to the launcher (last error: {self.last_error})")
        self._spill((json.dumps(rec, separators=(",", ":")) + "\n").encode())


def _stderr(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):   # stderr is a file on the same full disk, or closed
        pass


class EventSpill:
    """The launcher's end of the spill socket: an abstract Unix datagram socket named ``name`` (a run's id makes it
    unique). ``poll()`` returns the records received since the last call, never waiting. ``env()``: what the run's
    processes need to find it."""

    def __init__(self, name: str):
        self.name = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind("\0" + name)
        self._got: list[dict] = []
        self._lock = threading.Lock()
        self._closed = False
        # a thread takes each datagram as it comes: the kernel queues only max_dgram_qlen (10 by default)
        threading.Thread(target=self._receive, name="deadpool-spill", daemon=True).start()

    def env(self) -> dict[str, str]:
        return {SPILL_ENV: self.name}

    def _receive(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(1 << 17)
            except OSError:
                return
            try:
                rec = json.loads(data)
            except ValueError:
                continue
            with self._lock:
                self._got.append(rec)

    def poll(self) -> list[dict]:
        """The records received since the last call."""
        with self._lock:
            out, self._got = self._got, []
        return out

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def merge(disk: list[dict], spilled: list[dict]) -> list[dict]:
    """The run's records: those read from the file and those spilled, each once (a spilled line whose blocked
    write completed later is in both), in time order."""
    seen = {(e.get("t"), e.get("pid"), e.get("event")) for e in disk}
    extra = [e for e in spilled if (e.get("t"), e.get("pid"), e.get("event")) not in seen]
    if not extra:
        return disk
    return sorted(disk + extra, key=lambda e: e.get("t", 0))


def read_events(path: str) -> Iterator[dict]:
    """Yield the records of an event log; a torn last line (writer killed mid-write) is skipped."""
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except ValueError:
                continue


class EventTail:
    """Incremental reader of a growing event log: ``poll()`` returns only the records added since
    the last call (a partly written last line waits for the next call)."""

    def __init__(self, path: str):
        self.path = path
        self._pos = 0
        self._partial = b""

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._pos)
                data = fh.read()
        except OSError:   # not there yet, or the file system stopped answering this read
            return []
        self._pos += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out
