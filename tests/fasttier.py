"""The fast tier's guard: a test without the ``e2e`` marker starts no process (tests/README.md, "The e2e marker and
the fast tier"). ``conftest.py`` calls ``refused_while`` around each such test's setup, call and teardown, and
``refusal`` after its call.

SPAWNERS are the primitives every way of starting a process in Python ends in: ``subprocess.Popen`` (so
``subprocess.run``, ``os.popen``, asyncio's subprocesses), ``_posixsubprocess.fork_exec`` (multiprocessing's spawn
and forkserver start methods, which call it directly), ``os.fork`` / ``os.forkpty`` (multiprocessing's fork, torch
DataLoader workers, ``pty``, ``os.spawn*``), ``os.posix_spawn[p]`` and ``os.system``.
"""
from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import subprocess

import pytest

SPAWNERS = ((subprocess.Popen, "_execute_child"), (_posixsubprocess, "fork_exec"), (os, "fork"), (os, "forkpty"),
            (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"))

REFUSED = pytest.StashKey[list]()   # item.stash[REFUSED]: the refusals of this test, in order


class StartsAProcess(RuntimeError):
    """A test without the ``e2e`` marker tried to start a process."""


def _refuse(item: pytest.Item, what: str):
    def refused(*args, **kwargs):
        argv = next((a for a in args if isinstance(a, (list, tuple))), None)  # Popen's, fork_exec's, posix_spawn's
        msg = (f"{item.nodeid} starts a process ({what}{': ' + repr(list(argv))[:200] if argv else ''}) but is not "
               f"marked e2e: mark it (@pytest.mark.e2e, or pytestmark in its module; tests/README.md), or keep it "
               f"in-process")
        item.stash.setdefault(REFUSED, []).append(msg)
        raise StartsAProcess(msg)
    return refused


@contextlib.contextmanager
def refused_while(item: pytest.Item):
    """Inside: every SPAWNERS primitive raises StartsAProcess naming ``item``; restored on the way out."""
    mp = pytest.MonkeyPatch()
    try:
        for owner, name in SPAWNERS:
            if hasattr(owner, name):
                mp.setattr(owner, name, _refuse(item, f"{getattr(owner, '__name__', owner)}.{name}"))
        yield
    finally:
        mp.undo()


def refusal(item: pytest.Item) -> str | None:
    """The first refusal of ``item``, if any (a test that caught StartsAProcess is failed all the same)."""
    refused = item.stash.get(REFUSED, [])
    return refused[0] if refused else None
