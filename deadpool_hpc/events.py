"""The JSONL event log: one JSON object per line, appended atomically by every process of a run.

Each line has at least ``t`` (wall time, seconds since the epoch), ``event`` (a name from
docs/troubleshooting.md), ``pid`` and whatever the emitter adds (generation, rank, phase times).
Lines are written with a single ``os.write`` on an ``O_APPEND`` descriptor, so concurrent writers on
one machine never interleave within a line.
"""
from __future__ import annotations

import json
import os
import time
from typing import Iterator


class EventLog:
    """Append-only JSONL writer. ``base`` fields (e.g. mpi_rank) are added to every line."""

    def __init__(self, path: str, **base):
        self.path = path
        self.base = dict(base, pid=os.getpid())
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, t: float | None = None, **fields) -> dict:
        rec = {"t": time.time() if t is None else t, "event": event, **self.base, **fields}
        os.write(self._fd, (json.dumps(rec, separators=(",", ":")) + "\n").encode())
        return rec

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


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
        except FileNotFoundError:
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
