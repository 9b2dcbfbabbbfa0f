"""Diagnostics through ``logging``: one stderr handler per process, named after the process.

Owns the configuration of the ``deadpool_hpc`` logger; modules log to ``logging.getLogger(__name__)``. Facts a
run is judged by (failures, decisions, recoveries) go to the event log (events.py), not here: this is for what
a person reads when something looks wrong. Each process's entry point calls ``setup`` once (the node agent, a
training process, the launchers), and again once it knows more about itself (a node agent learns its node from
MPI). Level: ``DEADPOOL_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR; default INFO, which shows every line these
processes printed before logging was used). The handler goes where the process's stderr goes: a task or
launcher log, or the terminal.
"""
from __future__ import annotations

import logging
import os
import sys

ENV = "DEADPOOL_LOG_LEVEL"
_handler: logging.Handler | None = None


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (a test may replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup(process: str) -> logging.Logger:
    """Log ``deadpool_hpc.*`` records to stderr as ``TIME [deadpool PROCESS] LEVEL module: message``; calling it
    again renames the process (one handler in all). Returns the package logger."""
    global _handler
    root = logging.getLogger("deadpool_hpc")
    text = os.environ.get(ENV, "INFO").strip().upper()
    level = logging.getLevelName(text)
    bad = not isinstance(level, int)
    if _handler is None:
        _handler = _Stderr()
        root.addHandler(_handler)
        root.propagate = False  # a user's train function may configure the root logger: no lines twice
    _handler.setFormatter(logging.Formatter(f"%(asctime)s [deadpool {process}] %(levelname)s %(name)s: %(message)s"))
    root.setLevel(logging.INFO if bad else level)
    if bad:
        root.warning("%s=%r is not a level; accepted: DEBUG, INFO, WARNING, ERROR (using INFO)", ENV, text)
    return root
