"""The stderr of a node's training processes, passed through their agent: the last lines of each, kept in memory.

Owns one pipe per training process as its standard error, and one thread per agent that drains them all: each
chunk read is written on to the agent's own stderr at once (where a worker's stderr went before: the local
launcher's launcher.log, a Slurm task's output), and its last ``TAIL_BYTES`` are kept per local rank, so that a
process that exits can be reported with its last words (``tail``) without a file per process nor a write per
line. While a ``capture`` is open for a local rank, what it writes is also collected apart: the in-process stack
dump of agent/stacks.py arrives that way. Does not own the processes (agent/supervisor.py).

Cost: a copy through one more pipe per chunk a training process writes to stderr (nothing per step: a training
process writes to stderr only what it logs). A write end is close-on-exec here, so no other child holds it: the
read end sees its end when the process and its own children are gone.
"""
from __future__ import annotations

import os
import select
import threading
import time

TAIL_BYTES = 16_384        # per local rank: the last this many bytes of its stderr
CAPTURE_MAX_BYTES = 262_144  # a capture keeps at most this many bytes


class _Pipe:
    def __init__(self, local: int, fd: int):
        self.local, self.fd = local, fd
        self.tail = bytearray()
        self.capture: bytearray | None = None
        self.last_read = 0.0
        self.eof = threading.Event()


class StderrTails:
    """``open(local)`` gives a write end to make a training process's stderr; ``tail(local)``, its last lines;
    ``capture(local)`` / ``captured(local)`` / ``end_capture(local)``. ``out_fd``: where every byte goes on (the
    agent's stderr, fd 2; None: nowhere)."""

    def __init__(self, out_fd: int | None = 2, keep: int = TAIL_BYTES):
        self.out_fd = out_fd
        self.keep = keep
        self._lock = threading.Lock()
        self._by_fd: dict[int, _Pipe] = {}
        self._current: dict[int, _Pipe] = {}   # local rank -> the pipe of its latest process
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._poll.register(self._wake_r, select.POLLIN)
        self._closed = False
        self._thread = threading.Thread(target=self._drain, name="stderr-tails", daemon=True)
        self._thread.start()

    def open(self, local: int) -> int:
        """A new pipe for local rank ``local``'s next process: returns its write end (close-on-exec; the caller
        makes it the process's fd 2, then closes it)."""
        r, w = os.pipe2(os.O_CLOEXEC)
        p = _Pipe(local, r)
        with self._lock:
            self._by_fd[r] = p
            self._current[local] = p
            self._poll.register(r, select.POLLIN)
        self._wake()
        return w

    def tail(self, local: int, wait: float = 0.0) -> str:
        """The last bytes local rank ``local``'s latest process wrote to stderr, as text (undecodable bytes
        replaced). ``wait``: seconds to wait at most for the pipe's end first (an exited process's last words may
        still be in the pipe)."""
        p = self._current.get(local)
        if p is None:
            return ""
        if wait > 0:
            p.eof.wait(wait)
        with self._lock:
            return bytes(p.tail).decode("utf-8", "replace")

    def capture(self, local: int) -> None:
        """From now on, collect what local rank ``local``'s latest process writes apart (``captured``)."""
        with self._lock:
            p = self._current.get(local)
            if p is not None:
                p.capture = bytearray()

    def captured(self, local: int) -> tuple[str, float]:
        """(the text collected since ``capture``, seconds since the last byte of that process was read)."""
        with self._lock:
            p = self._current.get(local)
            if p is None or p.capture is None:
                return "", 0.0
            return bytes(p.capture).decode("utf-8", "replace"), time.monotonic() - p.last_read

    def end_capture(self, local: int) -> str:
        with self._lock:
            p = self._current.get(local)
            if p is None or p.capture is None:
                return ""
            text, p.capture = bytes(p.capture).decode("utf-8", "replace"), None
            return text

    def close(self) -> None:
        """Stop the thread (pipes still open are closed; what they hold is dropped)."""
        self._closed = True
        self._wake()
        self._thread.join(2.0)

    # ---- the drain thread -------------------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _drain(self) -> None:
        while not self._closed:
            for fd, _ev in self._poll.poll():
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                p = self._by_fd.get(fd)
                if p is None:
                    continue
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    with self._lock:
                        self._poll.unregister(fd)
                        self._by_fd.pop(fd, None)
                    os.close(fd)
                    p.eof.set()
                    continue
                self._forward(data)
                with self._lock:
                    p.last_read = time.monotonic()
                    p.tail += data
                    if len(p.tail) > self.keep:
                        del p.tail[:len(p.tail) - self.keep]
                    if p.capture is not None and len(p.capture) < CAPTURE_MAX_BYTES:
                        p.capture += data[:CAPTURE_MAX_BYTES - len(p.capture)]
        with self._lock:
            for fd, p in list(self._by_fd.items()):
                os.close(fd)
                p.eof.set()
            self._by_fd.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _forward(self, data: bytes) -> None:
        if self.out_fd is None:
            return
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.out_fd, view):]
            except InterruptedError:
                continue
            except OSError:   # the agent's own stderr is gone: the tail is still kept
                return
