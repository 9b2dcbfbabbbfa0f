"""The data plane: the torch.distributed process group of each generation, built and abandoned.

Owns the default process group and the TCPStores that rendezvous it. Each generation ``g`` gets a
fresh store served by a *living* process (the coordinator of the recovery, or MPI rank 0 at start)
and the key prefix ``gen{g}``, so no key of a dead generation is ever read again
(notes/ft-probes.md, pitfall 2), and no single process's death ends the job (a store dies with its
host, but gloo only needs it at rendezvous).

On gloo nothing interrupts a blocked collective (abort, shutdown, destroy all return and change
nothing), and dropping the last reference to a group with a pending op blocks until its timeout.
So a failed generation's group is *abandoned*: a reference is kept in a graveyard and torch's
registry is cleared, then the next generation is initialised (ft-probes.md 1c'). On NCCL the group
is aborted (``ProcessGroup.abort``) instead, which does interrupt. These use torch internals
(``c10d._world``); the version is pinned and the end-to-end tests cover them.

Every wait here has a deadline: joining a generation (store connect + gloo's full-mesh rendezvous) is bounded
by ``rendezvous_timeout`` (a member that dies mid-rendezvous makes the others fail within it, never hang;
torch releases the GIL meanwhile, measured, so heartbeats go on), after which the group's own timeout is
set to the collective timeout. Memory stays flat across generations (an abandoned group held 8-70 MB of
gloo buffers, measured): only the newest hosted store is kept (and closed as soon as a member is lost), and once the next generation is built
the abandoned groups are dropped by a short-lived background thread. Dropping a group whose collective is
still pending blocks until that collective times out, but with the GIL released (measured: 2.2 s to drop,
longest pause of another thread 0.17 s), so training and heartbeats go on meanwhile.
"""
from __future__ import annotations

import datetime as dt
import os
import socket
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def store_host() -> str:
    """Address other nodes use to reach a store served here: $DEADPOOL_STORE_HOST, else this host's IP."""
    env = os.environ.get("DEADPOOL_STORE_HOST")
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class GenerationGroups:
    """Builds the default process group of each generation; never reuses a store key or group.

    backend: "gloo" (CPU) or "nccl". timeout: collective timeout in seconds (an abandoned gloo op
    lingers until it expires; detection never waits for it).
    """

    def __init__(self, backend: str = "gloo", timeout: float = 60.0, rendezvous_timeout: float = 10.0):
        # gloo connects every pair inside init_process_group (eager). TORCH_GLOO_LAZY_INIT=1 (connect at the first
        # collective) would make a member lost while the group forms fail a polled collective instead of stalling
        # init (measured: 47-51 s with a 10 s timeout), but on the Slurm cluster the first collective after a hot swap
        # then never completed in 3 of 5 runs (a pair that never connected; pytorch/gloo#520: the lazy listener side
        # has no timeout), and a stall that ends beats a hang. A user who sets the variable gets lazy pairs.
        self.backend = backend
        self.timeout = dt.timedelta(seconds=timeout)
        self.rendezvous_timeout = dt.timedelta(seconds=rendezvous_timeout)
        self.generation: int | None = None
        self._hosted: list = []      # the store this process serves for the newest generation (coordinator)
        self._lock = threading.Lock()
        self._client = None          # the current generation's store client
        self._graveyard: list = []   # abandoned groups with the works they may still run (gloo)

    def host_store(self) -> list:
        """Start a TCPStore server in this process on a free port. Returns [host, port]."""
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=self.rendezvous_timeout)
        with self._lock:
            self._hosted = [store]  # a generation's store is needed only until its group is built
        return [store_host(), store.port]

    def drop_stores(self) -> None:
        """Stop the stores this process serves (any thread). A member lost during a rendezvous would leave the
        others in ``init_process_group`` until ``rendezvous_timeout``; closing the store makes every member's
        rendezvous fail at once instead (measured: 0.8 s after the close, against the full timeout), and the
        next recovery round hosts a new one. Harmless once the group is built: gloo does not use it again."""
        with self._lock:
            dead, self._hosted = self._hosted, []
        del dead

    def join(self, generation: int, store_addr, rank: int, world_size: int, failure=None):
        """Initialise the default process group of ``generation`` as ``rank`` of ``world_size``.

        store_addr: [host, port] of the generation's store. failure: the control plane's failure flag, watched
        while connecting to the store (in tries of at most 1 s: a dead store host is retried by torch until
        the timeout). Returns the process group. Raises PeerFailure if the failure flag rises while connecting,
        or the rendezvous does not complete within ``rendezvous_timeout`` seconds (a member died or froze).
        """
        from ..errors import PeerFailure

        if dist.is_initialized():
            self.abandon()
        host, port = store_addr
        limit = self.rendezvous_timeout.total_seconds()
        t0 = time.monotonic()
        end = t0 + limit
        try:
            while True:
                try:
                    client = dist.TCPStore(host, int(port), is_master=False, timeout=dt.timedelta(
                        seconds=max(0.1, min(1.0, end - time.monotonic()))))
                    break
                except RuntimeError:
                    if (failure is not None and failure.is_set()) or time.monotonic() >= end:
                        raise
            client.set_timeout(dt.timedelta(seconds=max(0.1, end - time.monotonic())))
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"gen{generation}", client),
                                    rank=rank, world_size=world_size, timeout=self.rendezvous_timeout)
        except (RuntimeError, ValueError) as exc:  # DistStoreError / DistNetworkError / gloo errors
            self._clear_registry()
            raise PeerFailure(f"joining generation {generation}'s process group failed after "
                              f"{time.monotonic() - t0:.1f} s (limit {limit:.0f} s): {str(exc).splitlines()[0][:200]}") from exc
        self._client = client
        self._release_graveyard()
        pg = c10d._get_default_group()
        c10d._set_pg_timeout(self.timeout, pg)  # the rendezvous deadline was short; collectives get theirs
        self.generation = generation
        return pg

    def abandon(self) -> None:
        """Leave the current group without waiting for its pending ops (see module docstring)."""
        if not dist.is_initialized():
            return
        pg = c10d._get_default_group()
        self._graveyard.append(pg)
        if self.backend == "nccl":
            try:
                pg.abort()
            except RuntimeError:
                pass
        self._clear_registry()

    def _release_graveyard(self) -> None:
        dead, self._graveyard = self._graveyard, []
        if dead:
            threading.Thread(target=_drop_all, args=(dead,), name="deadpool-pg-reaper", daemon=True).start()

    def _clear_registry(self) -> None:
        c10d._update_default_pg(None)
        w = c10d._world
        for m in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag,
                  w.tags_to_pg, w.pg_coalesce_state):
            m.clear()
        c10d._unregister_all_process_groups()
        w.group_count = 0
        self.generation = None


def _drop_all(groups: list) -> None:
    """Drop the last references to abandoned groups, one by one (each destructor may wait for its pending work),
    then hand the freed heap back to the system (glibc's malloc_trim; freed memory otherwise stays resident)."""
    while groups:
        groups.pop()
    release_free_memory()


def release_free_memory() -> None:
    """glibc ``malloc_trim(0)``: return free heap pages to the system (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def device_for(backend: str) -> torch.device:
    """The device a rank's tensors live on for ``backend`` (CPU for gloo; the local GPU for nccl)."""
    if backend == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
    return torch.device("cpu")
