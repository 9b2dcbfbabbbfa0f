"""What a training process's own children (DataLoader workers, ``os.fork``, ``multiprocessing`` with fork) get of it:
none of its agent's descriptors, and its death.

Owns: the set of descriptors a training process holds from its node agent (the channel's socket, the doorbell
eventfd: ``keep_from_children``), and the at-fork handler (``install``, once, in a training process) that runs in
every child that process forks through ``os.fork`` (multiprocessing's fork and forkserver start methods, torch's
DataLoader workers included):

- the agent's descriptors are replaced in the child by ``/dev/null`` (``dup2``, close-on-exec). Closing them would
  leave the child's copies of the Python objects that own them (a socket object) to close, later, whatever fd then
  has that number; the agent's socket is then held by the training process alone, so its death is its end of the
  channel, whatever its children do. ``O_CLOEXEC`` / ``set_inheritable(False)`` only help ``exec``, not ``fork``;
- the child gets a parent-death signal (SIGKILL): it ends with the training process, so no loader worker outlives a
  swap or a run. The kernel sends it when the *thread* that forked the child ends: fork from the training thread (a
  DataLoader iterator made in ``train(ctx)`` or in the step is), not from a short-lived thread of your own.

Not covered: ``subprocess`` (it forks in C without the at-fork handlers; it closes every descriptor but 0-2 unless
``close_fds=False``, and its child does not die with the training process: end it yourself).
"""
from __future__ import annotations

import os
import signal

_fds: set[int] = set()
_installed = False
_parent = 0
PR_SET_PDEATHSIG = 1


def keep_from_children(fd: int) -> None:
    """``fd`` (a descriptor from the node agent) is replaced by /dev/null in every child forked from now on."""
    _fds.add(int(fd))


def release(fd: int) -> None:
    """``fd`` is about to be closed by its owner: stop replacing it in children."""
    _fds.discard(int(fd))


def _before() -> None:
    global _parent
    _parent = os.getpid()


def _in_child() -> None:
    import ctypes

    fds = sorted(_fds)
    _fds.clear()   # the child's own children have nothing of the agent's left to drop
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):   # pragma: no cover - not Linux
        pass
    if _parent and os.getppid() != _parent:   # the training process died before prctl took effect
        os._exit(1)
    if not fds:
        return
    nul = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in fds:
            try:
                os.dup2(nul, fd, inheritable=False)
            except OSError:
                pass
    finally:
        os.close(nul)


def install() -> None:
    """Register the at-fork handlers in this process (a training process; idempotent)."""
    global _installed
    if not _installed:
        os.register_at_fork(before=_before, after_in_child=_in_child)
        _installed = True
