"""The node agent's supervisor: starts this node's training processes and sees at once when one fails.

Owns: spawning the P training processes (``python -m deadpool_hpc.worker.entry RUN_DIR LOCAL_RANK``, with the
agent's channel name in the environment and a parent-death signal, so none outlives its agent; under the local
launcher, forked by its fork server instead, which kills each one when its agent's connection closes:
process/forkserver.py), watching each
one's exit through a pidfd (``poll`` returns it the moment the kernel reaps nothing but knows: no heartbeat
deadline), reading their progress pages for hangs (``--hang-timeout``), the evidence of a failure (each process's
stderr passes through the agent, which keeps its last lines: agent/stderrtail.py; a hung process's stacks:
agent/stacks.py), and killing them. Does not own: what a failure means for the job (agent/node.py declares the
node failed), the channel (agent/channel.py).

A training process's exit by any signal or code while the run is on is a failure of its node: spares are nodes
(DESIGN.md), so the agent fences the whole node. Measured cost of watching: one ``poll`` with a zero timeout
per agent loop iteration.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time

from ..cause import bound_tail
from ..errors import WireError
from ..process import forkserver
from . import stacks
from .stderrtail import StderrTails

PR_SET_PDEATHSIG = 1


class Supervisor:
    """P training processes of one node. ``env``: their environment; ``run_dir``; ``hang_timeout`` (seconds, 0:
    off); ``progress(local) -> ProgressPage | None`` (the channel's view of each process's page)."""

    def __init__(self, run_dir: str, P: int, env: dict, hang_timeout: float, progress):
        self.run_dir = run_dir
        self.P = P
        self.env = env
        self.hang_timeout = hang_timeout
        self.progress = progress
        self.procs: dict[int, subprocess.Popen | forkserver.ForkedProcess] = {}
        self._pidfds: dict[int, int] = {}
        self._poll = select.poll()
        self._by_fd: dict[int, int] = {}
        self.exited: dict[int, int] = {}   # local rank -> exit status (negative: the signal)
        self.tails: StderrTails | None = None   # each process's stderr, through this agent (started with them)

    def start(self) -> None:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        parent = os.getpid()

        def preexec() -> None:  # die with the agent, even if it is SIGKILLed
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)

        server = self.env.get(forkserver.ENV)
        if self.tails is None:
            self.tails = StderrTails()
        for local in range(self.P):
            # its agent may read its stacks (agent/stacks.py: py-spy, a child of the agent, under Yama's ptrace_scope 1)
            env = dict(self.env, DEADPOOL_LOCAL_RANK=str(local), DEADPOOL_AGENT_PID=str(parent))
            env.pop(forkserver.ENV, None)
            p = None
            err = self.tails.open(local)   # its stderr: a pipe to this agent, which passes it on (stderrtail.py)
            try:
                if server:   # the local launcher's fork server: torch already imported (worker/forkserver.py)
                    try:
                        p = forkserver.spawn(server, [self.run_dir, str(local)], env,
                                             bytes.fromhex(env["DEADPOOL_JOB_SECRET"]), stderr=err)
                    except (OSError, TimeoutError, WireError) as exc:   # started the usual way below
                        print(f"node agent: fork server {server!r} unavailable ({exc}); starting a fresh interpreter",
                              file=sys.stderr, flush=True)
                if p is None:
                    # a session of its own: hydra signals the agent's process group (SIGUSR1 when a peer's process
                    # dies), and Slurm's step signals are the agent's to act on
                    p = subprocess.Popen([sys.executable, "-m", "deadpool_hpc.worker.entry", self.run_dir, str(local)],
                                         env=env, stdin=subprocess.DEVNULL, stderr=err, preexec_fn=preexec,
                                         start_new_session=True)
            finally:
                os.close(err)
            self.procs[local] = p
            # a forked process comes with its pidfd: it may have exited, and been reaped by the server, already
            fd = p.pidfd if isinstance(p, forkserver.ForkedProcess) else os.pidfd_open(p.pid)
            self._pidfds[local] = fd
            self._by_fd[fd] = local
            self._poll.register(fd, select.POLLIN)

    def restart(self) -> None:
        """Start fresh training processes after every one of the previous ones was killed and reaped (a node back
        in the spare pool, agent/comeback.py); their exits are forgotten."""
        for fd, _local in list(self._by_fd.items()):
            self._poll.unregister(fd)
            os.close(fd)
        self._by_fd.clear()
        self._pidfds.clear()
        self.procs.clear()
        self.exited.clear()
        self.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def poll(self) -> list[tuple[int, int]]:
        """Training processes that exited since the last call: [(local rank, status)] (status < 0: killed by that
        signal). Never blocks."""
        out = []
        for fd, _ev in self._poll.poll(0):
            local = self._by_fd.pop(fd)
            self._poll.unregister(fd)
            os.close(fd)
            self._pidfds.pop(local, None)
            try:   # a forked process's status comes from the fork server: bounded, should the server be gone or stuck
                rc = self.procs[local].wait(5.0)
            except subprocess.TimeoutExpired:
                rc = -int(signal.SIGKILL)
            self.exited[local] = rc
            out.append((local, rc))
        return out

    def stderr_tail(self, local: int, wait: float = 0.0) -> str:
        """The last lines local rank ``local``'s process wrote to stderr (cause.bound_tail: at most TAIL_LINES
        lines, TAIL_MAX_CHARS characters); ``wait``: seconds to wait at most for the end of its stderr first."""
        return bound_tail(self.tails.tail(local, wait)) if self.tails is not None else ""

    def stack(self, local: int, timeout: float = stacks.STACK_TIMEOUT_S) -> stacks.Stack:
        """Every thread's stack of local rank ``local``'s live process (agent/stacks.py), within ``timeout`` s."""
        p = self.procs[local]
        return stacks.take(p.pid, p.send_signal, self.tails, local, timeout)

    def hung(self, armed_locals) -> list[tuple[int, float]]:
        """[(local rank, seconds without progress)] of the processes in ``armed_locals`` whose progress page has
        not changed for ``hang_timeout`` seconds."""
        if not self.hang_timeout:
            return []
        out = []
        for local in armed_locals:
            page = self.progress(local)
            if page is not None and local not in self.exited:
                stuck = page.stalled_for()
                if stuck > self.hang_timeout:
                    out.append((local, stuck))
        return out

    def alive(self) -> list[int]:
        return [local for local in self.procs if local not in self.exited]

    def signal_all(self, sig: int) -> None:
        for local, p in self.procs.items():
            if local not in self.exited:
                try:
                    p.send_signal(sig)   # Popen: not once reaped; forked: through its pidfd, never a reused pid
                except ProcessLookupError:
                    pass

    def kill_all(self, wait: float = 5.0) -> None:
        """SIGKILL every training process still alive and reap it (at most ``wait`` seconds)."""
        self.signal_all(signal.SIGKILL)
        end = time.monotonic() + wait
        for local, p in self.procs.items():
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def wait_all(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) for every training process to exit on its own. True if all did."""
        end = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True
