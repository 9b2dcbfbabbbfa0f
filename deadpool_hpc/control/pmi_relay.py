"""A PMI-1 relay between the MPICH wheel and Slurm's ``mpi/pmi2`` plugin: makes MPI_Init reliable under srun.

The fault it removes (measured on the local cluster, Slurm 22.05 + MPICH 5.0.2 wheel):

* slurmstepd reads each PMI-1 request with a single ``read()`` of at most 1024 bytes and parses it as
  one whole line (Slurm ``src/plugins/mpi/pmi2/pmi1.c``, ``handle_pmi1_cmd``), and it advertises
  ``vallen_max=1024`` in its ``cmd=maxes`` reply;
* MPICH puts its business card (the UCX worker address, about 4 KB) as segments of
  ``(vallen_max - 2) / 2`` = 511 bytes, hex-encoded with run-length compression (MPICH
  ``src/util/mpir_pmi.c``, ``put_ex``): a ``cmd=put kvsname=.. key=..-seg-i/n value=..`` line of up
  to about 1080 bytes;
* whether a segment's line exceeds 1024 bytes depends on how well its bytes compress, so MPI_Init
  failed in some runs only: slurmd logged ``mpi/pmi2: value not properly terminated in client
  request``, read the line's tail as a new request, and every rank aborted in
  ``MPIDI_UCX_comm_addr_exchange``.

The relay sits on the task's PMI socket (``PMI_FD``) and passes every byte through, except that it
lowers ``vallen_max`` in the ``cmd=maxes`` reply to ``VALLEN_MAX`` (512; ``DEADPOOL_PMI_VALLEN_MAX``
overrides it). MPICH then cuts segments of
255 bytes, and no request line exceeds about 600 bytes. It is a separate process, not a thread,
because mpi4py calls MPI_Init with the GIL held. It ignores the signals Slurm sends to a whole step
(SIGUSR2 before a time limit, SIGTERM before a kill), dies with the rank (``PR_SET_PDEATHSIG``), and closes
Slurm's socket when the rank's side closes, so slurmstepd sees a dead rank exactly as before.

This file is also the relay's program: ``python -I pmi_relay.py UP_FD DOWN_FD PARENT_PID VALLEN_MAX``. It
imports nothing from the package, so it starts in a few tens of milliseconds.
"""
from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys

VALLEN_MAX = 512          # bytes; what the relay advertises to MPICH instead of Slurm's 1024
SLURM_READ_MAX = 1024     # bytes; slurmstepd's single read() of one PMI-1 request

_MAXES = re.compile(rb"^(cmd=maxes\b.*\bvallen_max=)(\d+)")
_relay_fd = None          # the rank's end of the relay socket, kept open for the life of the process
_children: list = []
# Slurm signals every process of a step (--signal, scancel --signal, the TERM before a kill): the relay must
# outlive them while its rank lives; it ends on EOF from the rank or PR_SET_PDEATHSIG.
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def rewrite_reply(line: bytes, vallen_max: int = VALLEN_MAX) -> bytes:
    """One reply line from Slurm to the rank (``bytes`` ending in ``\\n``), with ``vallen_max``
    lowered to ``vallen_max`` in a ``cmd=maxes`` reply; every other line is returned unchanged.

    Raises ValueError if ``vallen_max`` is not a positive int.
    """
    if not isinstance(vallen_max, int) or vallen_max <= 0:
        raise ValueError(f"vallen_max must be a positive int (bytes), got {vallen_max!r}")
    m = _MAXES.match(line)
    if m is None or int(m.group(2)) <= vallen_max:
        return line
    return m.group(1) + str(vallen_max).encode() + line[m.end(2):]


def wanted(environ=os.environ) -> bool:
    """True for a task that srun started with a PMI socket: ``PMI_FD`` and ``SLURM_STEP_ID`` set.
    ``DEADPOOL_PMI_RELAY=0`` turns the relay off."""
    return (environ.get("DEADPOOL_PMI_RELAY", "1") != "0" and "PMI_FD" in environ
            and "SLURM_STEP_ID" in environ)


def install(environ=os.environ) -> int | None:
    """Put the relay between this process and slurmstepd, before MPI_Init. Returns the relay's pid,
    or None when the process is not an srun task with a PMI socket (see ``wanted``), or when it has
    already been installed. Must be called before mpi4py initialises MPI.

    Raises RuntimeError if ``PMI_FD`` is not an open file descriptor, ValueError if
    ``DEADPOOL_PMI_VALLEN_MAX`` is not a positive integer.
    """
    global _relay_fd
    if _relay_fd is not None or not wanted(environ):
        return None
    try:
        up = int(environ["PMI_FD"])
        os.fstat(up)
    except (ValueError, OSError) as e:
        raise RuntimeError(f"PMI_FD={environ.get('PMI_FD')!r} is not an open file descriptor: {e}") from e
    vallen = environ.get("DEADPOOL_PMI_VALLEN_MAX", str(VALLEN_MAX))
    if not vallen.isdigit() or int(vallen) <= 0:
        raise ValueError(f"DEADPOOL_PMI_VALLEN_MAX={vallen!r}: expected a positive number of bytes, e.g. 512")
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    down = theirs.fileno()
    # the relay ignores the step's signals (below); block them across the spawn so that none lands
    # before it does (a blocked mask is inherited through exec; a pending ignored signal is dropped)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _IGNORED)
    try:
        proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(up), str(down),
                                 str(os.getpid()), vallen],
                                pass_fds=(up, down), stdin=subprocess.DEVNULL, close_fds=True)
    except OSError:
        mine.close()
        theirs.close()
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    _children.append(proc)             # keeps the Popen, so its exit status is collected, not left a zombie
    theirs.close()
    os.close(up)                       # the relay now holds Slurm's end alone
    _relay_fd = mine.detach()          # MPICH reads PMI_FD and uses this descriptor directly
    environ["PMI_FD"] = str(_relay_fd)
    return proc.pid


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:         # the parent died before prctl took effect
        os._exit(0)


def _send_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def relay(up: int, down: int, vallen_max: int = VALLEN_MAX) -> None:
    """Copy bytes between ``down`` (the rank) and ``up`` (slurmstepd) until either side closes.
    Requests go up whole, one line per write; replies come down line by line through
    ``rewrite_reply``."""
    pending = {up: b"", down: b""}
    poller = select.poll()  # not select(): descriptors may be numbered above 1024 in a big process
    for fd in (up, down):
        poller.register(fd, select.POLLIN)
    while True:
        for fd, _ev in poller.poll():
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:                                       # one side closed: end both
                if pending[fd]:
                    _send_all(down if fd == up else up, pending[fd])
                return
            buf = pending[fd] + data
            *lines, pending[fd] = buf.split(b"\n")
            for line in lines:
                line += b"\n"
                if fd == up:
                    _send_all(down, rewrite_reply(line, vallen_max))
                else:
                    if len(line) > SLURM_READ_MAX:
                        sys.stderr.write(f"deadpool pmi_relay: a {len(line)}-byte PMI request exceeds "
                                         f"Slurm's {SLURM_READ_MAX}-byte read: {line[:60]!r}...\n")
                    _send_all(up, line)


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        sys.stderr.write("usage: pmi_relay.py UP_FD DOWN_FD PARENT_PID VALLEN_MAX\n")
        return 2
    up, down, parent, vallen_max = (int(a) for a in argv)
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _IGNORED)
    _die_with_parent(parent)
    try:
        relay(up, down, vallen_max)
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
