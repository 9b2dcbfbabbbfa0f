"""Fencing: make sure a process declared failed can never act again.

A process declared failed may still exist (a frozen node, a partitioned one). If it lives on this
kernel (same boot id), it is SIGKILLed by pid, after checking the pid still names the same process
(its start time), so a recycled pid is never hit. Otherwise fencing is left to the scheduler (see
launch/slurm: drain the node); the control plane drops the fenced rank's messages either way.
"""
from __future__ import annotations

import os
import signal
import socket


def identity() -> dict:
    """This process's identity for fencing: host name, kernel boot id, pid and start time (ticks)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return {"host": socket.gethostname(), "boot": boot, "pid": os.getpid(), "start": _start_ticks(os.getpid())}


def _start_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return -1


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), or None."""
    try:
        with open(f"/proc/{int(pid)}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError, ValueError):
        return None


def identity_of(pid: int) -> dict | None:
    """The identity (as ``identity()``) of another process of this kernel, or None if there is none."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    me = identity()
    return {"host": me["host"], "boot": me["boot"], "pid": int(pid), "start": int(fields[19])}


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (0 for the kernel's own), or None if ``pid`` is gone."""
    fields = _stat(pid)
    return int(fields[1]) if fields is not None else None


def descendants(pid: int) -> list[dict]:
    """Identities of every live process below ``pid`` (children first), read once from /proc."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            ppid = parent_of(int(name))
            if ppid is not None:
                kids.setdefault(ppid, []).append(int(name))
    out, todo = [], list(kids.get(int(pid), []))
    while todo:
        p = todo.pop(0)
        ident = identity_of(p)
        if ident is not None:
            out.append(ident)
        todo += kids.get(p, [])
    return out


def is_alive(ident: dict) -> bool:
    """True if the process described by ``ident`` (pid + start time) still runs (a zombie does not)."""
    try:
        with open(f"/proc/{int(ident['pid'])}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError, KeyError, ValueError):
        return False
    return fields[0] not in ("Z", "X") and int(fields[19]) == ident.get("start")


def same_process(ident: dict) -> bool:
    """True if ``ident`` names a process that runs now on this kernel (same boot id, pid and start time)."""
    if not ident or not ident.get("boot") or ident["boot"] != identity()["boot"]:
        return False
    return _start_ticks(int(ident["pid"])) == ident.get("start")


def fence(ident: dict) -> bool:
    """SIGKILL the process described by ``ident`` if it runs on this kernel. True if a signal was sent."""
    if not same_process(ident) or int(ident["pid"]) == os.getpid():
        return False
    pid = int(ident["pid"])
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
