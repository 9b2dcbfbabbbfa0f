"""The worker context: what a training function sees, and the step loop that makes it survive.

A training process is torch and a thin client of its node agent (worker/client.py); it does not call MPI.
``Context.run(step_fn)`` runs ``step_fn(step)`` for each step, and around each step it injects the faults due,
snapshots the state unique to this rank into the agent's shared slot and waits for the agent's ``committed`` before
the optimizer updates: the per-step snapshot protocol, whose side here is ``SnapshotWriter`` (replica/writer.py,
which describes the protocol and its interface with the agent's snapshot desk). With ``ctx.protect`` on host memory
the copy is made right after the update, on the training thread, into a slot claimed while the optimizer ran;
otherwise, and whenever that slot is not granted in time, by the writer's copy thread overlapping
the next forward and backward. When the agent says a peer failed (or a collective fails), it leaves
the generation, tells its agent how far it got, and waits for its next role: train (join the new generation's
process group through the agent-backed store, restore the cut step from the shared slot the agent filled,
gather, resume), stay a spare, save and leave (75: requeue), or finish. A failure while it joins or restores
ends that round; the agent starts the next (worker/recovery.py's ``Recovery``, which the context holds). Spare
processes build the model and buffers, then wait in ``run``. The order of a step around the state (wait committed,
all-reduce, claim, update, snapshot) is ``StepSequence``'s (worker/steps.py); the state is a ``StepState`` of
either kind (``ctx.protect``'s ``Protected``, ``ctx.zero_adamw``'s ``ShardedAdamW``).
The contract is in docs/worker-contract.md.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time

import torch

from ..dataplane import collectives
from ..dataplane.collectives import Watch
from ..dataplane.groups import device_for
from ..errors import PeerFailure
from ..faultinject.inject import RankFaults
from ..faultinject.messages import NicDown
from ..ipc.messages import Failure, Finish, LinkAsk, MatmulAsk, Train, Trained
from ..replica.devicecopy import DeviceCopier
from ..replica.snapshot import Slot, StateLayout
from ..replica.writer import SnapshotWriter
from . import preflight
from .recovery import Recovery
from .steps import StepSequence, StepState
from .zero import ShardedAdamW

def _local_default_group() -> None:
    """A default process group of this process alone, until the first generation's replaces it: a
    DistributedDataParallel built by the training function before ``ctx.run`` (a spare's too) needs one to exist.
    ``ctx.protect`` keeps DDP's reducer idle, so DDP never communicates on it (docs/your-loop.md).

    Built on gloo's default device, not the site's ``GLOO_SOCKET_IFNAME``: a group that never talks does not depend
    on the data-plane interface, so a node whose interface is down comes up and is found by the pre-flight's link
    check (agent/preflight.py), which names the fault, rather than by a start-up crash."""
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        ifname = os.environ.pop("GLOO_SOCKET_IFNAME", None)   # read by gloo's C++ (getenv) when the group is built
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        finally:
            if ifname is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname


class Context:
    """Per-process handle given to the training function (docs/worker-contract.md).

    rank: training rank (None while a spare); world_size: number of training ranks; device; generation;
    config (RunConfig); process_group (the current generation's default group); watch (the Watch every
    collective of a step waits under: ``collectives.all_reduce(t, ctx.watch)``); step (the current step);
    device_mesh, init_device_mesh, protect, zero_adamw, run. For the entry point (worker/entry.py), properties of
    its own: exit_code, attached, refusal. Everything else is private: the step's order (``StepSequence``,
    worker/steps.py) and this process's roles and recoveries (``Recovery``, worker/recovery.py) are objects it
    holds.
    """

    def __init__(self, cfg, client, groups, log, node: int, local: int, backend: str = "gloo"):
        self.config = cfg
        self.device = device_for(backend)
        self.world_size = cfg.layout.world_size
        self._client = client
        self._groups = groups
        self._log = log
        self._node, self._local = node, local
        self._state: StepState | None = None   # what ctx.protect / ctx.zero_adamw made (worker/steps.py)
        self._failure = threading.Event()
        self.watch = Watch(self._failure, cfg.timeouts.wait_timeout, client.progress.beat)
        self._steps = StepSequence(world_size=cfg.layout.world_size, replicate=cfg.replication.replicate,
                                   interleave=cfg.internal.interleave_replication,
                                   wait_timeout=cfg.timeouts.wait_timeout,
                                   generation=lambda: self.generation, failure=self._failure, watch=self.watch,
                                   beat=client.progress.beat)
        self._faults = RankFaults(cfg.internal.faults, node=node, local=local,
                                  ranks_per_node=cfg.layout.ranks_per_node, log=log,
                                  send=client.send)
        self._attached = False   # ctx.run has attached this process to its agent's slots (start-up is over for it)
        self._refusal = None     # what ctx.protect / zero_adamw / run refused (a job-wide error, not a node's)
        self._writer: SnapshotWriter | None = None   # the snapshot protocol's side of this process (``run``)
        self._layout: StateLayout | None = None
        self._slots: list[Slot] = []
        self._mesh = None   # ctx.device_mesh
        self._meshes: dict = {}      # ctx.init_device_mesh's, by shape
        self._mesh_groups: list = []   # every mesh's groups (dataplane/meshgroup.py)
        # the roles of this process and its half of each recovery (worker/recovery.py): its rank and generation
        self._recovery = Recovery(cfg, client, groups, log, self._faults, self._steps, self._failure, self.watch,
                                  node=node, first_rank=self._first_rank, mesh_groups=self._mesh_groups)
        client.on(Failure.KIND, self._recovery.on_failure)
        # worker/preflight.py; a malformed ask raises ValueError here, and the client logs it (its ``on``)
        client.on(MatmulAsk.KIND, lambda body: preflight.answer(client, self.device, MatmulAsk.from_wire(body)))
        client.on(LinkAsk.KIND, lambda body: preflight.link_answer(client, LinkAsk.from_wire(body)))
        # a test's --nic-down nodeI@STEP (faultinject/inject.py): from now on, every gloo group this process builds
        client.on(NicDown.KIND, lambda body: os.environ.__setitem__("GLOO_SOCKET_IFNAME",
                                                                    NicDown.from_wire(body).ifname))
        _local_default_group()

    # ---- what the training function uses ---------------------------------------------------
    @property
    def rank(self) -> int | None:
        """The training rank (None while a spare)."""
        return self._recovery.rank

    @property
    def generation(self) -> int:
        """The generation number (0, then +1 per membership change)."""
        return self._recovery.generation

    @property
    def step(self) -> int:
        """The current step: the state holds this many updates; ``step_fn(step)`` trains the next one."""
        return self._steps.step

    @property
    def device_mesh(self):
        """The 1-D DeviceMesh of the training ranks, for ``fully_shard(module, mesh=ctx.device_mesh)`` (FSDP2).
        Its group (dataplane/meshgroup.py) outlives the generations: every collective over the mesh (FSDP2's, a
        DTensor's such as ``clip_grad_norm_``'s norm or ``full_tensor()``) runs on the current generation's group,
        pollably, inside ``ctx.run``. Before the run's first role this process is the rank the job's first
        generation gives it (a spare: rank 0 until its promotion, when its state is restored)."""
        if self._mesh is None:
            self._mesh = self.init_device_mesh((self.world_size,), None)
        return self._mesh

    def init_device_mesh(self, mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...] | None = None):
        """An N-D DeviceMesh of the training ranks in row-major order (as
        ``torch.distributed.device_mesh.init_device_mesh``), e.g. ``(2, 2), ("replicate", "shard")`` for HSDP
        (``fully_shard(module, mesh=mesh)``: replicate across dimension 0, shard within dimension 1). Each dimension's
        group outlives the generations and runs its collectives on that dimension's sub-group of the current
        generation, pollably. One mesh per shape. Raises ValueError if the shape's product is not the world size or
        the names do not match it."""
        from ..dataplane.meshgroup import MESH_GROUP_NAME, MeshGroup, check_mesh_shape, device_mesh

        shape = check_mesh_shape(mesh_shape, mesh_dim_names, self.world_size)
        if shape in self._meshes:
            return self._meshes[shape]
        rank = self.rank if self.rank is not None else (self._first_rank or 0)   # (a spare: rank 0)
        layout = torch.arange(self.world_size).view(shape)
        if len(shape) == 1:
            groups = MeshGroup(rank, self.world_size, self.watch)
        else:
            groups = [MeshGroup(rank, n, self.watch, name=f"{MESH_GROUP_NAME}_{name}", layout=layout, dim=d,
                                current=self._groups.subgroup)
                      for d, (n, name) in enumerate(zip(shape, mesh_dim_names))]
        self._mesh_groups += groups if isinstance(groups, list) else [groups]
        self._meshes[shape] = device_mesh(groups, self.device.type, mesh_dim_names=mesh_dim_names)
        return self._meshes[shape]

    @property
    def process_group(self):
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_group()

    def zero_adamw(self, model: torch.nn.Module, **kwargs) -> ShardedAdamW:
        """A ZeRO-1 AdamW over ``model`` whose shard is the state this context protects."""
        self._refuse_second("zero_adamw")
        with self._refusing():
            self._check_device("zero_adamw", model)
            opt = ShardedAdamW(model, self.world_size, **kwargs)
        self._hold(opt)
        return opt

    def protect(self, model, optimizer, scheduler=None, dataloader=None, extra=None, *, python_rng: bool = False,
                numpy_rng: bool = False) -> None:
        """Protect the user's own loop: ``model`` (DistributedDataParallel when world_size > 1), a torch.optim
        ``optimizer``, and optionally an LR ``scheduler``, a ``dataloader`` (StatefulDataLoader, or a DataLoader
        with a DistributedSampler), ``extra`` (anything with state_dict/load_state_dict), Python's / numpy's global
        RNG. Their state (through torch.distributed.checkpoint.state_dict), the torch CPU RNG and the CUDA
        generators are snapshotted, replicated and restored around every step of ``ctx.run``; DDP's gradient
        average is done with pollable collectives. Raises TypeError/ValueError naming what is not accepted.
        docs/your-loop.md."""
        from .protect import Protected

        self._refuse_second("protect")
        cfg = self.config
        with self._refusing():
            self._check_device("protect", model)
            state = Protected(self.world_size, model, optimizer, scheduler, dataloader, extra,
                              python_rng=python_rng, numpy_rng=numpy_rng,
                              ring=(cfg.layout.ranks_per_node, cfg.layout.nodes, cfg.replica_holders),
                              first_rank=self._first_rank)
        self._hold(state)

    # ---- what the entry point reads (worker/entry.py) ------------------------------------------------------------
    @property
    def exit_code(self) -> int:
        """The process's exit code once the training function returned (75: saved and requeued)."""
        return self._recovery.exit_code

    @property
    def attached(self) -> bool:
        """``ctx.run`` attached this process to its agent's slots: its start-up is over."""
        return self._attached

    @property
    def refusal(self):
        """What ctx.protect / zero_adamw / run refused (an exception, True, or None): a job-wide error."""
        return self._refusal

    # ---- setting up ------------------------------------------------------------------------------------------------
    @property
    def _first_rank(self) -> int | None:
        """The training rank the job's first generation gives this process (None: a spare's)."""
        cfg = self.config
        return self._node * cfg.layout.ranks_per_node + self._local if self._node < cfg.layout.nodes else None

    def _hold(self, state: StepState) -> None:
        """The user's function built its model and handed it over: the step sequence drives ``state`` from now on;
        the start-up's ``build`` moment (faults)."""
        self._state = state
        self._steps.hold(state)
        self._faults.at_phase("build", 1, self._first_rank)

    @contextlib.contextmanager
    def _refusing(self):
        """What ctx.protect / ctx.zero_adamw refuse (TypeError, ValueError) is refused on every node alike: the job
        ends (worker/entry.py), unlike a failure of one node during its start-up."""
        try:
            yield
        except (TypeError, ValueError) as exc:
            self._refusal = exc
            raise

    def _check_device(self, what: str, model) -> None:
        """Refuse (ValueError: the parameter, its device, ctx.device) a model with a parameter elsewhere than
        ``self.device``: its snapshot copies and collectives run on ctx.device (dataplane/backend.py)."""
        from ..dataplane.backend import misplaced_parameter

        if hasattr(model, "named_parameters"):   # what is not a module, protect's own check names
            problem = misplaced_parameter(model, self.device, getattr(self._groups, "backend", "gloo"))
            if problem is not None:
                raise ValueError(f"ctx.{what}(model={type(model).__name__}): {problem}")

    def _refuse_second(self, what: str) -> None:
        if self._state is not None:
            first = "ctx.zero_adamw" if isinstance(self._state, ShardedAdamW) else "ctx.protect"
            self._refusal = True
            raise ValueError(f"ctx.{what}: {first} was already called; a context protects one model and optimizer "
                             "(call ctx.protect once, or ctx.zero_adamw once)")

    def run(self, step_fn) -> None:
        """Run ``step_fn(step) -> dict`` (it must call ``opt.step(step, loss)``) from the current step to
        ``config.steps``, surviving peer failures. Returns when the run is complete everywhere (or this process has
        no further part in it: a spare never promoted, a saved checkpoint)."""
        if self._state is None:
            self._refusal = True
            raise RuntimeError("Context.run needs the state to protect: call ctx.protect(model, optimizer, ...) or "
                               "ctx.zero_adamw(model) first")
        from .state.loader import check_no_stray_iterators

        guard = self._state.loader_guard
        with self._refusing():   # a loader iterator no restore would move: refused before step 0 (state/loader.py)
            check_no_stray_iterators([guard] if guard is not None else [])
        rng = torch.get_rng_state()   # the initial state's RNG (a fresh start restores it)
        shapes = self._state.layout_tensors()
        local_nbytes = self._state.local_nbytes   # ctx.protect's shares: kept, never sent
        self._layout = StateLayout(shapes, rng.numel(), local_nbytes)
        bufs = self._client.attach_slots(self._layout.nbytes, self.config.timeouts.startup_timeout,
                                         tensors=[[str(t.dtype).replace("torch.", ""), list(t.shape)] for t in shapes],
                                         rng_nbytes=rng.numel(), local_nbytes=local_nbytes)
        self._slots = [Slot(self._layout.nbytes, b.tensor) for b in bufs]
        self._attached = True
        self._bufs = bufs
        self._writer = SnapshotWriter(self._client.progress, self._client.bell, self._slots, self._layout,
                                      lost=self._client.lost, grant_timeout=self.config.timeouts.collective_timeout,
                                      copier=DeviceCopier(self.device, pin=bufs))   # replica/devicecopy.py
        self._steps.attach(self._writer)
        self._recovery.attach(self._state, self._writer, self._layout, self._slots, rng)
        role = self._recovery.next_role(self.config.timeouts.startup_timeout)
        if isinstance(role, Train):
            try:
                self._start(role)
            except PeerFailure as exc:  # a peer lost before the first step: e.g. the holder of this rank's step 0
                if not self._recovery.recover(str(exc)):
                    return
        elif not self._recovery.follow(role):
            return
        self._loop(step_fn)

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self, step_fn) -> None:
        cfg = self.config
        while True:
            try:
                while self.step < cfg.train.steps:
                    self._one_step(step_fn)
                self._client.progress.disarm()
                collectives.all_reduce(torch.zeros(1), self.watch)  # everyone has finished
                self._state.end_of_run()   # FSDP2: the final digest covers every rank's shards
                break
            except PeerFailure as exc:
                if not self._recovery.recover(str(exc)):
                    return
        self._finish()

    def _start(self, role: Train) -> None:
        """Generation 0 (or the first of a requeued attempt): join, load a checkpoint, first snapshot."""
        self._recovery.start(role)
        self._steps.snapshot()
        self._faults.at_phase("first", 1, self.rank)  # (faults) the first snapshot is written, not yet committed
        self._steps.wait_committed()  # a fault at the first step needs it
        self._log.emit("started", rank=self.rank, generation=self.generation, world_size=self.world_size,
                       step=self.step)

    def _one_step(self, step_fn) -> None:
        s = self.step
        page = self._client.progress
        page.set_step(s)
        page.beat()
        page.arm()
        if self._failure.is_set():
            raise PeerFailure("a peer failed")
        rec = self._recovery
        if rec.resumed is not None:
            self._faults.at_phase("resume", rec.role.restore.round, self.rank)
        if s > rec.high_water:  # faults fire on the first pass through their step, never on a recomputation
            view = rec.role.view
            self._faults.at_step(s, self.rank, set(view.active_nodes), list(view.spare_nodes))
        t = time.perf_counter()
        waited = self.watch.waited
        try:
            metrics = dict(step_fn(s) or {})
        except PeerFailure:
            raise
        except Exception as exc:  # e.g. an error of a collective the user issued, when a peer has failed
            if self._failure.is_set():
                raise PeerFailure(f"a peer failed during step {s}: {type(exc).__name__}: {exc}") from exc
            raise
        tokens = metrics.pop("tokens", None)  # this rank's tokens in the step, if the step function says
        dt = time.perf_counter() - t
        rec.trained = True
        self._steps.step = s + 1
        self._steps.snapshot()
        # the straggler check's figures (agent/stragglers.py): the step's wall time and, less its waits on peers
        # (collectives, the replica commit), this rank's own work
        wall = time.perf_counter() - t
        page.add_step(wall - (self.watch.waited - waited), wall)
        if rec.resumed is not None:
            r, rec.resumed = rec.resumed, None
            self._log.emit("resumed", generation=self.generation, rank=self.rank, step=self.step,
                           t_fail=r["t_fail"], recomputed_steps=r["recomputed_steps"])
        if self.rank == 0 and (s % self.config.output.log_every == 0 or self.step == self.config.train.steps):
            rate = {"tokens_per_s": self.world_size * tokens / dt if dt > 0 else 0.0} if tokens else {}
            self._log.emit("step", step=self.step, generation=self.generation, step_s=dt, **rate,
                           **{k: v for k, v in metrics.items() if isinstance(v, (int, float))})

    # ---- the end -----------------------------------------------------------------------------
    def _finish(self) -> None:
        if self.rank == 0:
            # first: hashing a large model takes a while
            self._client.send(Trained.KIND, Trained(self.step).to_wire())
            replicate = self.config.replication.replicate
            self._log.emit("finished", generation=self.generation, steps=self.step,
                           param_digest=self._state.param_digest(), world_size=self.world_size,
                           spares_left=self._recovery.role.view.spares_left,
                           bytes_per_rank_per_step=self._layout.wire_nbytes if replicate else 0,
                           local_bytes_per_rank_per_step=self._layout.local_nbytes if replicate else 0,
                           replica_wait_s=self._steps.wait_s, snapshots=self._writer.counts)
            self._log.sync()
            return
        try:
            while not isinstance(self._recovery.next_role(self.config.timeouts.collective_timeout), Finish):
                pass
        except Exception:  # noqa: BLE001 - the run is over either way; the agent ends us if it must
            pass
