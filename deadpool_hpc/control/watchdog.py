"""Liveness by progress: the training thread's last sign of progress, watched from the agent thread.

A heartbeat proves the *process* lives; it says nothing of its training thread, which may sit in a
``time.sleep``, a deadlock or a wedged library call while the heartbeat thread goes on (issue 11, item 2:
such a rank was never suspected). The training thread calls ``beat`` at every step boundary and while it
waits in one of our bounded waits (collectives, replica commits: waiting on peers is progress of a kind,
and each of those waits has its own deadline); the agent thread calls ``poll`` every iteration, and once
the watchdog is armed and no beat came for ``timeout`` seconds it calls ``on_hang(stuck_s, where)`` once.
The control plane then declares its own process failed and ends it (plane.ControlPlane._on_hang), so
the others recover at once instead of waiting on a rank that will never come.

Armed only while training (between steps and inside them), not while a spare waits or during a recovery,
whose waits have deadlines of their own.
"""
from __future__ import annotations

import time


class Watchdog:
    """timeout: seconds without a beat before ``on_hang`` fires (0 turns the watchdog off)."""

    def __init__(self, timeout: float, on_hang):
        self.timeout = timeout
        self.on_hang = on_hang
        self.t = time.monotonic()
        self.where = ""
        self.armed = False

    def beat(self, where: str | None = None) -> None:
        """The training thread is making progress (called from it; a store of two attributes)."""
        self.t = time.monotonic()
        if where is not None:
            self.where = where

    def arm(self, where: str) -> None:
        self.beat(where)
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def credit(self, seconds: float) -> None:
        """The agent thread itself was starved for ``seconds``: do not count that time against the training thread."""
        self.t += seconds

    def poll(self) -> bool:
        """Called by the agent thread each iteration; fires ``on_hang`` once. Returns False (never busy)."""
        if self.armed and self.timeout:
            stuck = time.monotonic() - self.t
            if stuck > self.timeout:
                self.armed = False
                self.on_hang(stuck, self.where)
        return False
