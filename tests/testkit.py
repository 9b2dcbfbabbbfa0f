"""Small pieces shared by unit tests that start helpers of their own (unit/agent/test_channel.py's agents,
unit/replica/test_replicator.py's peers): the shared secret they sign with, an event log that keeps what it is told,
a bounded wait, and the body of a fixture that makes helpers and ends each one after the test."""
from __future__ import annotations

import time

SECRET = b"test-secret-0123456789abcdef-32b"   # 32 bytes, as a run's secret


class Log:
    """An event log in memory: ``emit(name, **fields)`` keeps ``dict(fields, event=name)`` in ``events``."""

    def __init__(self):
        self.events = []

    def emit(self, name, **fields):
        self.events.append(dict(fields, event=name))

    def named(self, name):
        """The events called ``name``, in the order emitted."""
        return [e for e in self.events if e["event"] == name]


def wait_until(pred, timeout: float, what: str) -> None:
    """Polls ``pred()`` every 10 ms until it is true; fails the test, naming ``what``, after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


def made_and_ended(make, end):
    """A fixture's body (``yield from made_and_ended(Peer, Peer.reap)``): the test gets ``make``, and each thing it
    made is ended with ``end(thing)`` after the test, in the order made."""
    made = []

    def keep(**kw):
        thing = make(**kw)
        made.append(thing)
        return thing

    yield keep
    for thing in made:
        end(thing)
