"""The data plane: the torch.distributed process group of each generation, built and abandoned.

Owns the default process group of each generation. Its rendezvous goes through a store the caller passes (the
node agent's replicated store, worker/client.AgentStore: no store host whose death could end the job) under the
key prefix ``gen{g}``, so no key of a dead generation is ever read again (notes/ft-probes.md, pitfall 2).

On gloo nothing interrupts a blocked collective (abort, shutdown, destroy all return and change
nothing), and dropping the last reference to a group with a pending op blocks until its timeout.
So a failed generation's group is *abandoned*: a reference is kept in a graveyard and torch's
registry is cleared, then the next generation is initialised (ft-probes.md 1c'). On NCCL the group
is aborted instead, which does interrupt: every communicator of the generation together (the default group and
its sub-groups inside one ``ncclGroupStart``/``ncclGroupEnd``, as torch's ``_abort_process_group`` does: aborting
them one at a time deadlocks), by ``abort_all`` (the collective watchdog's, dataplane/watchdog.py) or at ``abandon``. An
NCCL generation is joined eagerly (``device_id``: its communicator exists once ``join`` returns), and its unique id
travels through the store under the generation's fresh prefix. These use torch internals
(``c10d._world``); the version is pinned and the end-to-end tests cover them.

Every wait here has a deadline: joining a generation (gloo's full-mesh rendezvous) is bounded by
``rendezvous_timeout`` (and the agent fails the store's waits at once when a member is lost), after which the
group's own timeout is set to the collective timeout. Memory stays flat across generations (an abandoned group
held 8-70 MB of gloo buffers, measured): once the next generation is built the abandoned groups are dropped by a
short-lived background thread. Dropping a group whose collective is
still pending blocks until that collective times out, but with the GIL released (measured: 2.2 s to drop,
longest pause of another thread 0.17 s), so training and heartbeats go on meanwhile.
"""
from __future__ import annotations

import datetime as dt
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


class GenerationGroups:
    """Builds the default process group of each generation; never reuses a store key or group.

    backend: "gloo" (CPU) or "nccl". timeout: collective timeout in seconds (an abandoned gloo op
    lingers until it expires; detection never waits for it).
    """

    def __init__(self, backend: str = "gloo", timeout: float = 60.0, rendezvous_timeout: float = 10.0,
                 device: torch.device | None = None):
        # gloo connects every pair inside init_process_group (eager). TORCH_GLOO_LAZY_INIT=1 (connect at the first
        # collective) would make a member lost while the group forms fail a polled collective instead of stalling
        # init (measured: 47-51 s with a 10 s timeout), but on the Slurm cluster the first collective after a hot swap
        # then never completed in 3 of 5 runs (a pair that never connected; pytorch/gloo#520: the lazy listener side
        # has no timeout), and a stall that ends beats a hang. A user who sets the variable gets lazy pairs.
        self.backend = backend
        self.device = device   # nccl: this process's GPU (eager init binds the communicator to it)
        self._aborted: int | None = None   # the generation whose communicators abort_all aborted
        self._abort_lock = threading.Lock()
        self.timeout = dt.timedelta(seconds=timeout)
        self.rendezvous_timeout = dt.timedelta(seconds=rendezvous_timeout)
        self.generation: int | None = None
        self._graveyard: list = []   # abandoned groups with the works they may still run (gloo)
        self._sub: dict[tuple[int, ...], object] = {}   # this generation's sub-groups by their ranks (subgroup)

    def join(self, generation: int, store, rank: int, world_size: int, timeout: float | None = None):
        """Initialise the default process group of ``generation`` as ``rank`` of ``world_size``, rendezvousing
        through ``store`` (a torch.distributed Store: the node agent's, worker/client.AgentStore), under the key
        prefix ``gen{generation}``. Returns the process group. Raises PeerFailure if the rendezvous fails (the
        agent fails the store's waits at once when a member is lost) or does not complete within
        ``timeout`` seconds (default: ``rendezvous_timeout``; the first join of a run passes the start-up deadline,
        since the members start at their own pace and a member lost then is the start-up deadline's to report).
        """
        from ..errors import PeerFailure

        if dist.is_initialized():
            self.abandon()
        limit = self.rendezvous_timeout.total_seconds() if timeout is None else timeout
        t0 = time.monotonic()
        eager = {"device_id": self.device} if self.backend == "nccl" and self.device is not None else {}
        try:
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"gen{generation}", store),
                                    rank=rank, world_size=world_size, timeout=dt.timedelta(seconds=limit), **eager)
        except (RuntimeError, ValueError) as exc:  # PeerFailure (a RuntimeError), DistStoreError, gloo errors
            self._clear_registry()
            raise PeerFailure(f"joining generation {generation}'s process group failed after "
                              f"{time.monotonic() - t0:.1f} s (limit {limit:.0f} s): "
                              f"{str(exc).splitlines()[0][:200]}") from exc
        self._release_graveyard()
        self._sub = {}
        pg = c10d._get_default_group()
        c10d._set_pg_timeout(self.timeout, pg)  # the rendezvous deadline was short; collectives get theirs
        self.generation = generation
        return pg

    def build_subgroups(self, lines: list[tuple[int, ...]]) -> None:
        """Build this generation's sub-groups, one per tuple of ranks in ``lines`` (a mesh dimension's lines, e.g.
        HSDP's replicate and shard groups), with ``torch.distributed.new_group``: every rank calls this with the same
        lines in the same order, after ``join``; gloo connects each within the rendezvous deadline. A line of every
        rank is the default group itself. Raises PeerFailure if one fails."""
        from ..errors import PeerFailure

        world = dist.get_world_size()
        for line in lines:
            line = tuple(line)
            if line in self._sub:
                continue
            if len(line) == world:
                self._sub[line] = c10d._get_default_group()
                continue
            try:
                self._sub[line] = dist.new_group(list(line), timeout=self.rendezvous_timeout)
            except (RuntimeError, ValueError) as exc:
                raise PeerFailure(f"building the sub-group of ranks {list(line)} failed: "
                                  f"{str(exc).splitlines()[0][:200]}") from exc

    def subgroup(self, ranks) -> object | None:
        """This generation's group of ``ranks`` (``build_subgroups``), None if there is none."""
        return self._sub.get(tuple(ranks))

    def abandon(self) -> None:
        """Leave the current group without waiting for its pending ops (see module docstring). Under NCCL, once its
        communicators are aborted, check that this process's CUDA context still runs work: raises DeviceUnusable
        (dataplane/backend.py) when it does not, and the process must then exit (``CUDA_UNUSABLE_EXIT``). The NCCL
        branch is written, not run on a device."""
        if not dist.is_initialized():
            return
        pg = c10d._get_default_group()
        self._graveyard.append(pg)
        self._graveyard.extend(g for g in self._sub.values() if g is not pg)
        self._sub = {}
        if self.backend == "nccl":
            self.abort_all()
        self._clear_registry()
        if self.backend == "nccl" and self.device is not None:
            from .backend import DeviceUnusable, cuda_context_problem

            problem = cuda_context_problem(self.device)
            if problem is not None:
                raise DeviceUnusable(f"the CUDA context of {self.device} is unusable after the NCCL abort: {problem}")

    def abort_all(self) -> bool:
        """(NCCL; any thread) Abort every communicator of the current generation together, so that kernels waiting on
        a dead peer return with an error. Once per generation; True if it aborted now. gloo: nothing to abort
        (its groups are abandoned), False. UNTESTED on a GPU: written, not run on a device."""
        if self.backend != "nccl":
            return False
        with self._abort_lock:
            g = self.generation
            if g is None or self._aborted == g or not dist.is_initialized():
                return False
            self._aborted = g
            default = c10d._get_default_group()
            groups = [default] + [pg for pg in self._sub.values() if pg is not default]
            backends = []
            for pg in groups:   # this generation's NCCL groups only: the registry also holds the mesh groups
                try:
                    backends.append(pg._get_backend(torch.device("cuda")))
                except RuntimeError:
                    pass
            if not backends:
                return True
            # inside one ncclGroupStart/End, as torch's _abort_process_group does for the whole registry
            backends[0]._group_start()
            try:
                for b in backends:
                    try:
                        b.abort()
                    except RuntimeError:
                        pass
            finally:
                backends[0]._group_end()
            return True

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
    """The device a rank's tensors live on for ``backend`` (CPU for gloo; for nccl ``cuda:i`` with ``i`` the index
    worker/entry.py's ``bind_device`` chose (``DEADPOOL_DEVICE_INDEX``, else ``LOCAL_RANK``) modulo the GPU count:
    dataplane/backend.py ``device_of``, ``device_index``)."""
    from .backend import DEVICE_INDEX_ENV, device_of

    return device_of(backend, int(os.environ.get(DEVICE_INDEX_ENV, os.environ.get("LOCAL_RANK", "0"))))
