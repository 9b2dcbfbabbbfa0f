"""The lifeline: when the local launcher dies, by any signal, the whole run ends.

Owns one daemon thread per node agent, started first thing in ``agent/__main__.py`` (before MPI_Init,
so a process still stuck there goes too). It uses no MPI and no timer: it blocks in ``poll`` on a
pidfd of the launcher, whose identity the local launcher puts in the environment
(``DEADPOOL_LAUNCHER=PID:START``, START = the launcher's start time in clock ticks, as in
``fence.identity``). When the launcher is gone (SIGKILL included, or already gone when the
thread starts, or its pid now names another process) the thread:

1. appends ``launcher_lost`` to the event log (``launcher``: its pid; ``targets``: the pids it fences);
2. SIGKILLs every other process of the run it knows, each checked by pid + start time
   (``fence.fence``, so a recycled pid is never hit): the peers exchanged by the control plane
   (``Lifeline.know(cp.idents)``) and the hydra processes between this agent and the launcher (its
   proxy and mpiexec), recorded when the thread starts. A SIGSTOPped peer cannot notice anything, so
   every live agent kills all the others;
3. SIGKILLs itself.

Under Slurm (no ``DEADPOOL_LAUNCHER``) nothing starts: Slurm owns the job's lifetime. The launcher
side is ``launcher_env()``; the launcher also spawns mpiexec with a parent-death signal.
"""
from __future__ import annotations

import os
import select
import signal
import threading
import time

from .fence import fence, identity, identity_of, is_alive, parent_of

ENV = "DEADPOOL_LAUNCHER"
RUN_ENV = "DEADPOOL_RUN_ID"
_FALLBACK_POLL_S = 0.5  # only where pidfd_open is missing (Linux < 5.3)


def launcher_env(run_id: str) -> dict[str, str]:
    """Environment the local launcher gives its workers: its own identity and the run id."""
    me = identity()
    return {ENV: f"{me['pid']}:{me['start']}", RUN_ENV: run_id}


def parse(value: str) -> dict:
    """``"PID:START"`` -> an identity dict of this kernel. Raises ValueError naming the value."""
    pid, sep, start = value.partition(":")
    if not sep or not pid.isdigit() or not start.lstrip("-").isdigit():
        raise ValueError(f"{ENV}={value!r}: accepted: PID:START (set by the local launcher)")
    me = identity()
    return {"host": me["host"], "boot": me["boot"], "pid": int(pid), "start": int(start)}


class Lifeline:
    """Ends this process, and the run's other processes it knows, when ``launcher`` (an identity) dies.

    events_path: the run's event log (``launcher_lost`` goes there). ``know`` adds peers and the
    EventLog whose ``base`` fields (mpi_rank, node, run) the event should carry."""

    def __init__(self, launcher: dict, events_path: str, run_id: str | None = None):
        self.launcher = launcher
        self.events_path = events_path
        self.run_id = run_id
        self._peers: list[dict] = []
        self._log = None
        self.chain = _between(os.getpid(), launcher)
        self._thread = threading.Thread(target=self._watch, name="deadpool-lifeline", daemon=True)

    def start(self) -> "Lifeline":
        self._thread.start()
        return self

    def know(self, idents: list[dict], log=None) -> None:
        """The run's processes (``cp.idents``: [{host, boot, pid, start}], one per MPI rank), and the
        event log to report in. Called once the control plane has exchanged identities."""
        me = os.getpid()
        self._peers = [i for i in idents if int(i.get("pid", -1)) != me]
        if log is not None:
            self._log = log

    def _watch(self) -> None:
        wait_gone(self.launcher)
        self._end()

    def _end(self) -> None:
        targets = self._peers + self.chain
        try:
            log = self._log
            if log is None:
                from ..events import EventLog

                # (background: a run directory that stopped answering must not keep the run from ending)
                log = EventLog(self.events_path, background=True, **({"run": self.run_id} if self.run_id else {}))
            log.emit("launcher_lost", launcher=self.launcher["pid"], targets=[int(t["pid"]) for t in targets])
            log.sync(timeout=1.0)
        except Exception:  # noqa: BLE001 - the run must end even if the log cannot be written
            pass
        for ident in targets:
            fence(ident)
        os.kill(os.getpid(), signal.SIGKILL)


def wait_gone(ident: dict) -> None:
    """Block until the process ``ident`` (pid + start time) has exited (returns at once if it has, or if
    its pid now names another process). pidfd + poll: no busy loop."""
    try:
        fd = os.pidfd_open(int(ident["pid"]))
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd here: poll /proc
        while is_alive(ident):
            time.sleep(_FALLBACK_POLL_S)
        return
    try:
        if not is_alive(ident):  # checked after opening: the pidfd names the process we checked
            return
        p = select.poll()
        p.register(fd, select.POLLIN)
        while not p.poll():
            pass
    finally:
        os.close(fd)


def _between(pid: int, top: dict) -> list[dict]:
    """Identities of the ancestors of ``pid`` strictly below ``top`` (for a node agent of the local launcher:
    its hydra proxy and mpiexec). Empty if ``top`` is not an ancestor: then nothing is presumed ours."""
    chain = []
    p = parent_of(pid)
    while p and p > 1:
        if p == int(top["pid"]):
            return chain if is_alive(top) else []
        ident = identity_of(p)
        if ident is None:
            return []
        chain.append(ident)
        p = parent_of(p)
    return []


def start(events_path: str, environ=None) -> Lifeline | None:
    """Start the lifeline if the local launcher asked for one (``DEADPOOL_LAUNCHER`` set); else None.
    A malformed value raises ValueError (the launcher always sets it well: an agent must not run on
    without the guarantee it asks for)."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV)
    if not value:
        return None
    return Lifeline(parse(value), events_path, environ.get(RUN_ENV)).start()
