"""Fork server for training processes under the local launcher: torch is imported once per run, not once per process.

A training process spends most of its start-up importing: ``import torch`` (1.2-1.4 CPU-s here) and, for a
DistributedDataParallel model, ``torch._dynamo`` (DDP's constructor imports it: 1.0 CPU-s). Under the local
launcher every emulated node shares one machine's cores, so 3 + 2 nodes pay ~12 CPU-s before the first step
(2 cores: ~6 s of wall time). The launcher starts one fork server per attempt (``serve``); it imports what the
training processes need, once, and each node agent asks it to fork its training processes (``spawn``) instead of
starting a fresh interpreter. This is the idea of Python's ``multiprocessing`` "forkserver" start method with its
preload list (https://docs.python.org/3/library/multiprocessing.html#contexts-and-start-methods), applied to our
process tree. Under Slurm there is none: each node has its own cores, and its agent starts its processes itself.

This module is the mechanism: the launcher's ``start``, the agent's ``spawn``, the server's loop (``serve``). The
program, which knows what to preload and what a forked process runs, is ``worker/forkserver.py``.

What a forked training process keeps of a fresh one, so that nothing in the fault model changes:
- its own session (``setsid``), the agent's stdout and the stderr the agent gives it (passed as file descriptors), the
  agent's
  environment (replaced whole: ``os.environ``, ``PYTHONPATH`` entries added to ``sys.path``) and working
  directory, fresh seeds for Python's ``random`` and numpy's global generator;
- it dies with its agent: the server SIGKILLs it the moment the agent's connection closes (an agent killed by
  SIGKILL closes it too), and with the server (parent-death signal), which dies with the launcher;
- its agent sees its exit at once (a pidfd works on any process, not only a child) and its exit status, which
  the server reaps and sends on the same connection.

Protocol: one ``AF_UNIX``/``SOCK_SEQPACKET`` connection per training process, in the abstract namespace. Each
message is ``ipc/wire.py`` JSON + HMAC with the job's secret (no pickle). Agent -> server: ``spawn`` {argv:
[RUN_DIR, LOCAL_RANK], env, cwd} with the agent's fd 1 and its stderr for the process (fd 2, or the pipe of
agent/stderrtail.py) attached (SCM_RIGHTS); server -> agent:
``spawned`` {pid} with a pidfd of the child attached, later ``exited`` {pid, rc} (rc as ``subprocess.Popen.returncode``:
negative for a signal).
"""
from __future__ import annotations

import os
import random
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass

from ..errors import WireError
from ..ipc.schema import FORKSERVER, Message
from ..ipc.wire import MAX_MESSAGE_BYTES, decode, encode


@dataclass(frozen=True)
class Spawn(Message, plane=FORKSERVER, kind="spawn"):
    """(an agent -> the server) Fork a training process running ``argv`` with environment ``env`` in ``cwd``; its
    stdout and stderr come as the 2 descriptors sent with it."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str


@dataclass(frozen=True)
class Spawned(Message, plane=FORKSERVER, kind="spawned"):
    """(the server -> the agent) Forked: process ``pid``, whose pidfd comes with it."""

    pid: int


@dataclass(frozen=True)
class Exited(Message, plane=FORKSERVER, kind="exited"):
    """(the server -> the agent) Process ``pid`` ended with ``rc`` (``Popen.returncode``: negative = the signal)."""

    pid: int
    rc: int


def _message(cls, body: dict):
    """``cls.from_wire(body)``, a malformed body a WireError."""
    try:
        return cls.from_wire(body)
    except ValueError as exc:
        raise WireError(f"fork server message: {exc}") from exc

ENV = "DEADPOOL_FORKSERVER"   # the server's abstract socket name, set by the local launcher for its agents
PR_SET_PDEATHSIG = 1
REQUEST_TIMEOUT_S = 5.0   # a connection's spawn request must arrive within this many seconds


def listen(name: str | None = None) -> tuple[socket.socket, str]:
    """A listening socket for a fork server and its name (abstract namespace; random when ``name`` is None)."""
    name = name or f"deadpool-fork-{secrets.token_hex(8)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind("\0" + name)
    sock.listen(64)
    return sock, name


def start(env: dict, stdout=None, preexec_fn=None) -> tuple[subprocess.Popen, str]:
    """Start a fork server (``python -m deadpool_hpc.worker.forkserver FD``) on a socket bound here, so that an
    agent may connect before the server has finished its imports (the connection waits in the backlog).
    Returns (its process, the name to put in the agents' environment as ``DEADPOOL_FORKSERVER``)."""
    sock, name = listen()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "deadpool_hpc.worker.forkserver", str(sock.fileno())],
                                env=env, pass_fds=(sock.fileno(),), stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=subprocess.STDOUT if stdout is not None else None,
                                start_new_session=True, preexec_fn=preexec_fn)
    finally:
        sock.close()
    return proc, name


class ForkedProcess:
    """A training process forked by the server, seen by its agent like a ``subprocess.Popen``: ``pid``,
    ``returncode``, ``poll()``, ``wait(timeout)`` (raises subprocess.TimeoutExpired), ``send_signal(sig)``; and
    ``pidfd``, a pidfd of it made by the server right after the fork (the caller owns it: it stays valid, and
    readable once the process exited, even when the server reaped it before the agent looked)."""

    def __init__(self, conn: socket.socket, pid: int, secret: bytes, pidfd: int):
        self._conn, self.pid, self._secret, self.pidfd = conn, pid, secret, pidfd
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        """Signal it through its pidfd (never another process that reused its pid); nothing once it has exited."""
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
        except OSError:   # ProcessLookupError included: it has exited
            pass

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"forked training process {self.pid}", timeout)
            self._read()
        return self.returncode

    def _read(self) -> None:
        data = self._conn.recv(MAX_MESSAGE_BYTES)
        if not data:   # the server is gone, and with it (parent-death signal) this process
            self.returncode = -signal.SIGKILL
        else:
            kind, body = decode(data, len(data), self._secret)
            exited = _message(Exited, body) if kind == Exited.KIND else None
            if exited is None or exited.pid != self.pid:
                raise WireError(f"fork server sent {kind!r} {body} for process {self.pid}; expected 'exited'")
            self.returncode = exited.rc
        self._conn.close()


def spawn(name: str, argv: list[str], env: dict, secret: bytes, timeout: float = 60.0,
          stderr: int = 2) -> ForkedProcess:
    """Ask the fork server ``name`` for a training process running ``worker.entry`` with ``argv`` (RUN_DIR,
    LOCAL_RANK), ``env`` and this process's working directory and stdout; its stderr is this process's file
    descriptor ``stderr`` (default: this process's own stderr). Waits for its pid (the server may still be
    importing: at most ``timeout`` seconds). Raises OSError when the server cannot be reached, TimeoutError when it
    does not answer, WireError on a bad answer."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect("\0" + name)
        msg = encode(Spawn.KIND, Spawn(tuple(str(a) for a in argv), dict(env), os.getcwd()).to_wire(), secret)
        socket.send_fds(conn, [msg], [1, stderr])
        if not select.select([conn], [], [], timeout)[0]:
            raise TimeoutError(f"fork server {name!r} did not answer within {timeout:.0f} s")
        data, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE_BYTES, 1)
        if not data:
            raise OSError(f"fork server {name!r} closed the connection without forking")
        kind, body = decode(data, len(data), secret)
        try:
            if kind != Spawned.KIND or len(fds) != 1:
                raise WireError(f"fork server answered {kind!r} {body} with {len(fds)} descriptors; expected "
                                f"'spawned' with its pidfd")
            spawned = _message(Spawned, body)
        except WireError:
            for f in fds:
                os.close(f)
            raise
        return ForkedProcess(conn, spawned.pid, secret, fds[0])
    except BaseException:
        conn.close()
        raise


def die_with(parent: int) -> None:
    """Parent-death signal (SIGKILL) for this process; exits at once if ``parent`` is already gone."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:   # it died before prctl took effect
        os._exit(1)


def _child(conn: socket.socket, fds: list[int], req: Spawn, closing: list, server: int, run) -> None:
    """In the forked process: become what ``python -m deadpool_hpc.worker.entry RUN_DIR LOCAL`` would be, and
    ``run(argv)`` it."""
    code = 1
    try:
        os.setsid()
        die_with(server)
        for s in closing:
            s.close() if isinstance(s, socket.socket) else os.close(s)
        conn.close()
        devnull = os.open(os.devnull, os.O_RDONLY)
        for target, fd in zip((0, 1, 2), [devnull] + fds):
            os.dup2(fd, target)
        for fd in [devnull] + fds:
            os.close(fd)
        # a fresh interpreter's dispositions: SIGINT raises KeyboardInterrupt, SIGPIPE stays ignored (as Python
        # sets it at start-up: a write to a closed socket raises), the others are the defaults
        for sig in (signal.SIGTERM, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        env = req.env
        os.environ.clear()
        os.environ.update(env)
        os.chdir(req.cwd)
        for p in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
            if p not in sys.path:
                sys.path.insert(0, p)
        random.seed()   # and numpy's global generator, as a fresh interpreter has (str hashes keep the server's seed)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        run(list(req.argv))   # ends with os._exit
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a fresh interpreter would print it and exit 1
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def serve(listener: socket.socket, secret: bytes, run) -> None:
    """The server's loop: fork a training process per ``spawn``, which calls ``run(argv)`` (it must not return: it
    ends with ``os._exit``), report its exit, kill it when its agent's connection closes. Returns never; the
    launcher kills it (and its children die with it)."""
    conns: dict[int, socket.socket] = {}     # fd -> agent connection
    child_of: dict[int, int] = {}            # agent connection fd -> child pid
    pidfds: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, connection fd)
    poller = select.poll()
    poller.register(listener.fileno(), select.POLLIN)
    while True:
        for fd, _ev in poller.poll():
            if fd == listener.fileno():
                conn, _ = listener.accept()
                fds: list[int] = []
                try:
                    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                          struct.calcsize("3i")))
                    if uid != os.getuid():
                        raise WireError(f"a connection from uid {uid}, not this job's {os.getuid()}")
                    conn.settimeout(REQUEST_TIMEOUT_S)   # a peer that connects and sends nothing stalls no one
                    msg, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE_BYTES, 2)
                    kind, body = decode(msg, len(msg), secret)
                    if kind != Spawn.KIND or len(fds) != 2:
                        raise WireError(f"expected 'spawn' with 2 file descriptors, got {kind!r} with {len(fds)}")
                    req = _message(Spawn, body)
                    conn.settimeout(None)
                except (OSError, WireError) as exc:
                    print(f"fork server: request refused: {exc}", file=sys.stderr, flush=True)
                    for f in fds:
                        os.close(f)
                    conn.close()
                    continue
                server = os.getpid()
                pid = os.fork()
                if pid == 0:
                    _child(conn, fds, req, [listener, *conns.values(), *pidfds], server, run)
                for f in fds:
                    os.close(f)
                pidfd = os.pidfd_open(pid)
                conns[conn.fileno()] = conn
                child_of[conn.fileno()] = pid
                pidfds[pidfd] = (pid, conn.fileno())
                poller.register(pidfd, select.POLLIN)
                poller.register(conn.fileno(), select.POLLIN)
                try:   # with a pidfd of its own: valid even if the child exits (and is reaped here) before it is read
                    socket.send_fds(conn, [encode(Spawned.KIND, Spawned(pid).to_wire(), secret)], [pidfd])
                except OSError:
                    pass   # the agent is gone: its connection's hang-up kills the child below
            elif fd in pidfds:   # a child exited: reap it, tell its agent
                pid, cfd = pidfds.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                conn = conns.pop(cfd, None)
                child_of.pop(cfd, None)
                if conn is not None:
                    poller.unregister(cfd)
                    try:
                        conn.send(encode(Exited.KIND, Exited(pid, rc).to_wire(), secret))
                    except OSError:
                        pass
                    conn.close()
            elif fd in conns:   # the agent closed its end (it ended, or died): its training process dies with it
                pid = child_of.pop(fd)
                poller.unregister(fd)
                conns.pop(fd).close()
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
