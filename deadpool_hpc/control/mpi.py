"""MPI bootstrap for the control plane: importing mpi4py with the settings a fault-tolerant job needs
(``import_mpi``), and removing the names of MPICH's shared-memory segments once every local process is past
``MPI_Init`` (``unlink_mpi_shm``). Owns nothing after start-up; control/plane.py calls both once.
"""
from __future__ import annotations

import os

from . import pmi_relay


def import_mpi():
    """mpi4py's MPI, initialised as the control plane needs it (eager UCX transfers, PMI requests relayed under srun,
    MPI_THREAD_MULTIPLE, no MPI_Finalize at exit)."""
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
            paths = {line.split()[-1] for line in f
                     if "/dev/shm/mpich_shm_" in line and not line.rstrip().endswith("(deleted)")}
    except OSError:
        return removed
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # another local process of the job removed it first
            pass
    return removed
