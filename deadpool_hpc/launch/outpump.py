"""launcher.log through a pipe: the run's output (mpiexec, the fork server, every worker's stdout and stderr) goes
to a pipe that the launcher drains, and the launcher writes it to ``RUN_DIR/launcher.log``.

Why: with the file as their stdout, a full run directory made hydra's own writes fail (ENOSPC), and mpiexec
ended the whole job (exit 255) although every process was healthy; a file system that stops answering would
block every process that prints. Here no process of the run ever writes to the run directory for its output:
the pump's reader thread reads the pipe at once into a bounded buffer (``BUFFER_MAX`` bytes), and a writer thread
writes the buffer to the file. A write that fails (full, read-only, EIO) or a buffer that is full (the writer is
blocked) drops the output, counted in ``dropped_bytes``; the first error is said once on the launcher's stderr.
Nothing raises.
"""
from __future__ import annotations

import collections
import os
import sys
import threading

BUFFER_MAX = 4 << 20   # bytes held while the file's writer is behind or blocked


class OutputPump:
    """``fd``: the write end to give the run's processes as stdout/stderr (close it here once they have it:
    ``handed_over``). ``close(timeout)`` stops the pump, waiting at most ``timeout`` s for the buffer to be written.
    ``stats()``: {written_bytes, dropped_bytes, error}."""

    def __init__(self, path: str):
        self.path = path
        self._r, self.fd = os.pipe2(os.O_CLOEXEC)
        self.written = self.dropped = 0
        self.error: str | None = None
        self._buf: collections.deque = collections.deque()
        self._held = 0
        self._cv = threading.Condition()
        self._eof = False
        try:
            self._out: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self._out = None
            self._fail(exc)
        self._reader = threading.Thread(target=self._read, name="deadpool-output-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="deadpool-output-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    def handed_over(self) -> None:
        """The run's processes have the write end: close this process's copy (the pipe ends when theirs do)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._r, 1 << 16)
            except OSError:
                data = b""
            with self._cv:
                if not data:
                    self._eof = True
                    self._cv.notify()
                    return
                if self._held + len(data) > BUFFER_MAX or self._out is None:
                    self.dropped += len(data)
                else:
                    self._buf.append(data)
                    self._held += len(data)
                    self._cv.notify()

    def _write(self) -> None:
        while True:
            with self._cv:
                while not self._buf and not self._eof:
                    self._cv.wait()
                if not self._buf:
                    return
                data = self._buf.popleft()
            try:
                n = os.write(self._out, data) if self._out is not None else 0
                self.written += n
                self.dropped += len(data) - n
            except OSError as exc:
                self.dropped += len(data)
                self._fail(exc)
            with self._cv:
                self._held -= len(data)

    def _fail(self, exc: OSError) -> None:
        if self.error is None:
            self.error = f"{exc.strerror or exc}"
            try:
                print(f"deadpool: {self.path}: {self.error}; the run's output is dropped (counted) and the run goes on",
                      file=sys.stderr, flush=True)
            except (OSError, ValueError):
                pass

    def close(self, timeout: float = 2.0) -> None:
        """Stop reading (what the run's processes still hold open is cut), write what is buffered within ``timeout``
        seconds, close the file (not if its writer is blocked in it)."""
        self.handed_over()
        self._reader.join(timeout)
        if self._reader.is_alive():   # a process of the run still holds the pipe: stop listening to it
            with self._cv:
                self._eof = True
                self._cv.notify()
        self._writer.join(timeout)
        if not self._writer.is_alive() and self._out is not None:
            try:
                os.close(self._out)
            except OSError:
                pass
            self._out = None

    def stats(self) -> dict:
        return {"written_bytes": self.written, "dropped_bytes": self.dropped, "error": self.error}
