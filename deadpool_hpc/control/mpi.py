"""MPI bootstrap for the control plane: refusing an MPI transport on which a peer's death kills the survivors
(``check_transport``, also the launchers' pre-flight), importing mpi4py with the settings a fault-tolerant job needs
(``import_mpi``), and removing the names of MPICH's shared-memory segments once every local process is past
``MPI_Init`` (``unlink_mpi_shm``). Owns nothing after start-up; control/plane.py calls the last two once.
"""
from __future__ import annotations

import os

from ..errors import ConfigError
from . import pmi_relay

# UCX transport names that carry messages through shared memory (UCX's aliases and its mm transports)
_UCX_SHM = frozenset({"sm", "shm", "mm", "posix", "sysv", "xpmem"})
CHECK_OFF = "DEADPOOL_MPI_TRANSPORT_CHECK"   # "0": start on a transport that check_transport refuses


def transport_hazard(environ=os.environ) -> str | None:
    """Why the MPI transport that ``environ`` selects kills the survivors of a node's death, or None.

    Measured with the MPICH 5.0.2 wheel (UCX 1.20.1 inside), 3 ranks, one SIGKILLed, survivors sending to it:
    - UCX over TCP (``UCX_TLS=tcp``): the survivors' TCP connections to the dead rank are reset, UCX marks its
      endpoint failed (MPICH creates every endpoint without an error handler: "error 'Connection reset by remote
      peer' on tcp/eth0 will not be handled since no error callback is installed"), and the next send to it returns
      an error from ``ucp_tag_send_nbx``; MPICH's isend then writes into the request it never created: SIGSEGV in
      ``PMPI_Isend`` (address 0x110), no survivor left in 5 runs of 5, whatever the call (Isend, Send, Issend,
      Send_init+Start).
      Shared memory (UCX's posix/sysv transports, what UCX picks between ranks of one machine) never fails an
      endpoint: the survivors live on and the local runs hot-swap.
    - MPICH's OFI netmod (``MPIR_CVAR_CH4_NETMOD=ofi``; providers tcp, sockets, tcp;ofi_rxm): the first call after
      the death returns "OFI poll failed (... Connection reset by peer)", then MPICH aborts the process.
    ``MPIR_CVAR_ENABLE_FT=1`` does not help: MPICH asserts (ch4_request.h line 16) on either netmod.

    A transport is judged by the environment only: ``UCX_TLS`` naming tcp (or ``all``, or excluding with ``^``)
    and no shared-memory transport, or the OFI netmod. With ``UCX_TLS`` unset, UCX picks shared memory between
    ranks of one machine (the local emulation) and TCP between machines without InfiniBand: see
    docs/troubleshooting.md (MPI transport settings)."""
    netmod = (environ.get("MPIR_CVAR_CH4_NETMOD") or environ.get("MPICH_CH4_NETMOD") or "").strip().lower()
    if netmod == "ofi":
        return ("MPIR_CVAR_CH4_NETMOD=ofi: MPICH's OFI netmod aborts every process whose peer died (measured: "
                "'OFI poll failed ... Connection reset by peer', then Abort)")
    tls = environ.get("UCX_TLS", "").strip().lower()
    if not tls:
        return None
    negate = tls.startswith("^")
    names = {t.strip() for t in tls.lstrip("^").split(",") if t.strip()}
    if negate:
        tcp, shm = "tcp" not in names, not (names & {"sm", "shm", "mm"})
    else:
        tcp, shm = bool(names & {"tcp", "all"}), bool(names & (_UCX_SHM | {"all"}))
    if tcp and not shm:
        return (f"UCX_TLS={environ['UCX_TLS']}: over UCX's TCP transport a node's death kills every survivor "
                f"(MPICH 5.0.2's UCX netmod: SIGSEGV in MPI_Isend to the dead rank)")
    return None


def check_transport(environ=os.environ) -> None:
    """Raise ConfigError when the MPI transport ``environ`` selects would turn one node's death into the whole
    job's (``transport_hazard``); the message names the setting and what is accepted. ``DEADPOOL_MPI_TRANSPORT_CHECK=0``
    in ``environ`` skips the check (a run that accepts that any failure ends it)."""
    if environ.get(CHECK_OFF, "1") == "0":
        return
    why = transport_hazard(environ)
    if why is not None:
        raise ConfigError(f"unsafe MPI transport for the control plane: {why}; accepted: UCX_TLS unset or naming a "
                          f"shared-memory transport (sm, shm, posix, sysv), MPICH's UCX netmod (the default); "
                          f"{CHECK_OFF}=0 starts anyway (then any node's death ends the run). "
                          f"See docs/troubleshooting.md, MPI transport settings")


def import_mpi():
    """mpi4py's MPI, initialised as the control plane needs it (eager UCX transfers, PMI requests relayed under srun,
    MPI_THREAD_MULTIPLE, no MPI_Finalize at exit). Raises ConfigError, before MPI starts, on a transport that a
    node's death would bring down with it (``check_transport``)."""
    check_transport()
    import mpi4py

    # Measured with the MPICH wheel's UCX netmod: a rendezvous transfer whose sender dies kills the
    # receiver (cross-memory attach: "process_vm_readv ... No such process", then SIGTERM). Control
    # messages are small; send every message eagerly.
    os.environ.setdefault("UCX_RNDV_THRESH", "inf")
    pmi_relay.install()  # under srun: keeps every PMI-1 request within Slurm's 1024-byte read (pmi_relay.py)
    mpi4py.rc.thread_level = "multiple"
    mpi4py.rc.finalize = False  # survivors exit with os._exit; MPI_Finalize with dead peers may hang
    from mpi4py import MPI

    return MPI


def unlink_mpi_shm(maps: str = "/proc/self/maps") -> list[str]:
    """Remove the names of the MPICH shared-memory segments this process maps (``/dev/shm/mpich_shm_*``); the
    mappings stay valid. Returns the paths removed.

    Call it once every local process has finished ``MPI_Init`` (after a collective over ``COMM_WORLD``): MPICH
    attaches these segments by name only during init, and unlinks them only in ``MPI_Finalize``, which an agent never
    calls (it leaves with ``os._exit``: peers may be dead). Measured here (MPICH 5.0.2 wheel): each agent left one
    1 MB segment (16 MB in larger runs) in ``/dev/shm`` per run, killed or not; a day of tests had left 12,516 of them,
    14 GB of the machine's 24 GB of memory, since ``/dev/shm`` is memory."""
    removed = []
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if "/dev/shm/mpich_shm_" in line and not line.rstrip().endswith("(deleted)")}
    except OSError:
        return removed
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # another local process of the job removed it first
            pass
    return removed
