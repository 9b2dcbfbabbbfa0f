"""MPI bootstrap for the control plane: the UCX send guard that keeps a peer's death over UCX's TCP transport from
killing the survivors (``load_send_guard``), refusing a transport on which a peer's death still kills them
(``check_transport``, also the launchers' pre-flight), importing mpi4py with the settings a fault-tolerant job needs
(``import_mpi``), and removing the names of MPICH's shared-memory segments once every local process is past
``MPI_Init`` (``unlink_mpi_shm``). Owns nothing after start-up; control/plane.py calls the last two once.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess

from ..errors import ConfigError
from . import pmi_relay

# UCX transport names that carry messages through shared memory (UCX's aliases and its mm transports)
_UCX_SHM = frozenset({"sm", "shm", "mm", "posix", "sysv", "xpmem"})
CHECK_OFF = "DEADPOOL_MPI_TRANSPORT_CHECK"   # "0": start on a transport that check_transport refuses
GUARD_OFF = "DEADPOOL_UCX_SEND_GUARD"   # "0": do not load the send guard (then UCX over TCP is refused)

# The UCX send guard: MPICH 5.0.2's UCX netmod creates its endpoints without an error handler, so once a peer is
# dead (its TCP connection reset) every send to it returns an error status from ucp_tag_send_nbx, and MPICH's isend
# then writes into the request that the failed call never created: SIGSEGV (transport_hazard). The guard defines
# the two send functions MPICH calls, calls UCX's own, and turns an error status into NULL ("sent at once"): the
# message to the dead peer is dropped, which is what the control plane expects of a send to a dead peer (its
# heartbeats, not MPI, tell it the peer is gone). Loaded with RTLD_GLOBAL before mpi4py loads libmpi, so that
# libmpi's calls bind to it. Any other status passes through unchanged.
_GUARD_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
typedef void *(*send_fn)(void *, const void *, size_t, uint64_t, const void *);
static int dropped;
static void *guard(const char *name, send_fn *real, void *ep, const void *buf, size_t n, uint64_t tag,
                   const void *param) {
    if (*real == NULL) {
        void *ucp = dlopen("libucp.so.0", RTLD_NOW | RTLD_NOLOAD);
        *real = ucp ? (send_fn)dlsym(ucp, name) : NULL;
        if (*real == NULL) { fprintf(stderr, "deadpool ucx send guard: UCX's %s not found\n", name); abort(); }
    }
    void *r = (*real)(ep, buf, n, tag, param);
    if ((uintptr_t)r >= (uintptr_t)-100) {   /* UCS_PTR_IS_ERR: the endpoint failed, its peer is gone */
        if (dropped++ == 0)
            fprintf(stderr, "deadpool ucx send guard: a send to a failed UCX endpoint dropped (status %d); "
                    "later drops are not reported\n", (int)(intptr_t)r);
        return NULL;
    }
    return r;
}
static send_fn real_send, real_sync;
void *ucp_tag_send_nbx(void *ep, const void *b, size_t n, uint64_t t, const void *p)
{ return guard("ucp_tag_send_nbx", &real_send, ep, b, n, t, p); }
void *ucp_tag_send_sync_nbx(void *ep, const void *b, size_t n, uint64_t t, const void *p)
{ return guard("ucp_tag_send_sync_nbx", &real_sync, ep, b, n, t, p); }
"""


def send_guard_path(environ=os.environ) -> str:
    """Where the send guard's shared library is kept: ``$DEADPOOL_CACHE`` (else ``~/.cache/deadpool-hpc``), named
    by a hash of its source, so that a changed source is built again."""
    base = environ.get("DEADPOOL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deadpool-hpc")
    return os.path.join(base, f"ucx_send_guard-{hashlib.sha256(_GUARD_C.encode()).hexdigest()[:16]}.so")


def build_send_guard(environ=os.environ) -> str | None:
    """The send guard's shared library, built with the C compiler ``cc`` (``$CC``) the first time (about 0.1 s;
    concurrent builders each write their own file and rename it into place). Returns its path, or None when it
    cannot be built (no compiler, a failed build, an unwritable cache): then UCX over TCP stays unsafe."""
    path = send_guard_path(environ)
    if os.path.exists(path):
        return path
    cc = shutil.which(environ.get("CC") or "cc")
    if cc is None:
        return None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp + ".c", "w") as f:
            f.write(_GUARD_C)
        out = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, tmp + ".c", "-ldl"], capture_output=True,
                             text=True, timeout=60)
        os.unlink(tmp + ".c")
        if out.returncode != 0:
            logging.getLogger(__name__).warning("the UCX send guard did not build (%s exit %d): %s", cc,
                                                out.returncode, out.stderr.strip()[-500:])
            return None
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        logging.getLogger(__name__).warning("the UCX send guard did not build: %s", exc)
        return None
    return path


def load_send_guard(environ=os.environ) -> str | None:
    """Build (``build_send_guard``) and load the send guard into this process, RTLD_GLOBAL, before libmpi is
    loaded. Returns its path, or None (``DEADPOOL_UCX_SEND_GUARD=0``, or it could not be built)."""
    import ctypes

    if environ.get(GUARD_OFF, "1") == "0":
        return None
    path = build_send_guard(environ)
    if path is not None:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path


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


def check_transport(environ=os.environ, guarded: bool | None = None) -> None:
    """Raise ConfigError when the MPI transport ``environ`` selects would turn one node's death into the whole
    job's (``transport_hazard``); the message names the setting and what is accepted. UCX over TCP is safe with the
    send guard: ``guarded`` says whether it is loaded (None: whether it can be built here and is not turned off,
    the launchers' pre-flight). ``DEADPOOL_MPI_TRANSPORT_CHECK=0`` in ``environ`` skips the check (a run that
    accepts that any node's death may end it)."""
    if environ.get(CHECK_OFF, "1") == "0":
        return
    why = transport_hazard(environ)
    if why is None:
        return
    if why.startswith("UCX_TLS="):
        if guarded is None:
            guarded = environ.get(GUARD_OFF, "1") != "0" and build_send_guard(environ) is not None
        if guarded:
            return
        why += (f", and the UCX send guard that prevents it is not loaded ({GUARD_OFF}=0, or no C compiler: "
                f"``cc`` or $CC)")
    raise ConfigError(f"unsafe MPI transport for the control plane: {why}; accepted: MPICH's UCX netmod (the "
                      f"default) with the UCX send guard (built with cc), or UCX_TLS unset or naming a shared-memory "
                      f"transport (sm, shm, posix, sysv); {CHECK_OFF}=0 starts anyway (then a node's death may end "
                      f"the run). See docs/troubleshooting.md, MPI transport settings")


def import_mpi():
    """mpi4py's MPI, initialised as the control plane needs it (eager UCX transfers, PMI requests relayed under srun,
    MPI_THREAD_MULTIPLE, no MPI_Finalize at exit). Raises ConfigError, before MPI starts, on a transport that a
    node's death would bring down with it (``check_transport``). Loads the UCX send guard first
    (``load_send_guard``): without it, over UCX's TCP transport, a peer's death kills this process."""
    guard = load_send_guard()
    if guard is None and os.environ.get(GUARD_OFF, "1") != "0":   # UCX may still pick TCP between machines
        logging.getLogger(__name__).warning(
            "the UCX send guard is not loaded (no C compiler `cc`/$CC, or its build failed): over UCX's TCP "
            "transport a node's death kills every survivor (docs/troubleshooting.md, MPI transport settings)")
    check_transport(guarded=guard is not None)
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
