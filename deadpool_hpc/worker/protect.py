"""``ctx.protect``: the user's own model, optimizer, LR scheduler and data loader, kept alive like the ZeRO shard.

Owns: turning the user's training state into the snapshot payload the replica plane already moves (a fixed list of
tensors + the RNG bytes, ``replica/snapshot.StateLayout``) and back, and the data-parallel gradient average of a
``DistributedDataParallel`` model, done with the context's pollable collectives. Does not own: slots, replication,
recovery (``worker/context.py``), the process groups (``dataplane/groups.py``). This module holds the checks, the
binding to a rank, the restore's order and the torch hooks that call the step's order back; each kind of state is an
object of its own module in ``worker/state/``, held here: ``layout.py`` (``SnapshotLayout``: the snapshot layout),
``shares.py`` (``DataParallelShares``: the state every data-parallel rank holds alike, DDP's gradient average),
``shards.py`` (``ShardedState``: the state FSDP2 shards: FSDP, HSDP, TP x FSDP), ``document.py`` (``RankDocument``:
what exists once per rank: the JSON document). The order of a step around this state (commit waits, early claim,
snapshot) is ``worker/steps.py``'s.

State goes in and out through ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` /
``get_optimizer_state_dict`` and their ``set_`` twins: they know DDP's ``module.`` prefix and every torch.optim
optimizer, and key the optimizer state by parameter name). The payload holds:

- the tensors of the model and optimizer state dicts, each at a fixed place (the layout is fixed before the first
  step; see "Layout" below; a tensor shared by two names, a tied weight, is stored once). Parameters and optimizer
  state are the same on every DDP rank, so they are never sent: their bytes are cut into world_size *shares*, and
  rank r's own snapshot (the node's shared-memory slot) keeps share r plus the shares of the K ranks whose replica
  it holds (``held_by``: the same ring as the replicas, control/agreement.py). This is the payload's *local* prefix
  (``StateLayout.local_nbytes``): a memory copy on the node, complete once the slot is stamped with its step (the
  stamp is set only after the whole payload is in), and never sent while training. A restore all-gathers which
  shares each rank kept, each with a CRC-32C taken then, and moves only the missing ones in one all-to-all,
  pollably: share j from rank j if rank j restored its own snapshot, else from a holder of rank j's replica, to every
  rank without a copy of it, so a lost rank's share survives exactly when its replica does; a receiver checks each
  share against its sender's CRC-32C. (The shares are not checksummed at every snapshot: that took 0.65 ms of the
  training thread's CPU per step of the micro GPT, a third of the copy, to guard bytes that stay in the node's
  memory until a restore; ``benchmarks/overhead.py``.) The model's buffers, per rank, are held whole and
  replicated;
- a JSON document (no pickle) of everything else: the optimizer's param groups (lr, betas, ...) and non-tensor
  state, the scheduler's, data loader's and ``extra``'s state dicts (their small tensors inline, base64), the
  CUDA generators, Python's and numpy's RNG when asked for; in a fixed-size region of its own;
- the torch CPU RNG (the context's RNG region, as for ZeRO).

Layout. torch.optim creates its state (AdamW's exp_avg, exp_avg_sq, step) lazily at the first ``step()``, but the
snapshot slots are sized before it. ``protect`` therefore deep-copies the model and optimizer together and runs one
*dry* step on the copy (zero gradients, lr 0), reads the copy's state dict, and drops the copy: the real
optimizer is untouched (its first real step is bitwise the one of a plain run), at the transient cost of one copy
of the parameters and optimizer state. A snapshot taken before the first real step records "no optimizer state
yet", and restoring it empties the optimizer's state again.

Gradients. DDP's own reducer issues blocking gloo collectives that nothing interrupts when a peer dies or
freezes, on the process group DDP was built with (a generation's group is replaced at every recovery), and it sums
each element in an order that depends on its offset inside DDP's buckets, whose layout changes after the first
iteration (so a rank that joins later would sum differently). So the reducer is left idle
(``require_backward_grad_sync = False``, which also skips its bucket rebuild broadcast), and at the end of every
backward (an autograd engine callback queued by the first gradient) the gradients are averaged here: flattened in
``parameters()`` order, all-reduced with ``dataplane.collectives.all_reduce`` (issued async, polled against the
failure flag and the collective timeout), divided by the world size, written back. A peer failure raises
``PeerFailure`` out of ``loss.backward()``; ``ctx.run`` recovers.

The commit. Before a rank joins the gradient all-reduce of step s (and again before the optimizer updates, a step
pre-hook), its replica of step s must be committed at its holders. Waiting only before the update is not enough
for DDP: nothing after the update synchronizes the ranks, so two ranks could finish step s and write snapshot s+1
while a third, killed at that moment, never got its snapshot s to its holder; the survivors' two own slots then
hold s and s+1, the lost rank's replica s-1 and s-2, and no step exists for every rank (seen in a test). With the
wait before the all-reduce, which completes nowhere before every rank joined, every rank's s is committed before
anyone updates past it (the ZeRO step gets the same from its all-gather after the update).
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from ..errors import ReplicaError
from .state.document import RankDocument, check_loader, distributed_sampler, is_stateful, type_name
from .state.layout import SnapshotLayout
from .state.loader import LoaderGuard
from .state.shards import ShardedState, check_fsdp2, is_fsdp1, is_fsdp2, local_shard
from .state.shares import DataParallelShares, ddp_class, dry_run_state, load_full
from .steps import NO_HOOKS, StepHooks


def check(world_size: int, model, optimizer, scheduler=None, dataloader=None, extra=None) -> None:
    """What ``ctx.protect`` accepts, checked before anything is changed (module docstring). Raises TypeError or
    ValueError naming the bad value and what is accepted."""
    DDP = ddp_class()
    if not isinstance(model, nn.Module):
        raise TypeError(f"protect(model=...): got a {type_name(model)}; accepted: a torch.nn.Module, wrapped in "
                        "torch.nn.parallel.DistributedDataParallel when world_size > 1")
    if is_fsdp1(model):
        raise ValueError(f"protect(model={type(model).__name__}): FSDP1 (FullyShardedDataParallel) is not "
                         "supported; accepted: FSDP2 (torch.distributed.fsdp.fully_shard(module, "
                         "mesh=ctx.device_mesh)) or DistributedDataParallel(model) (docs/your-loop.md)")
    if is_fsdp2(model):
        check_fsdp2(model)
    elif world_size > 1 and not isinstance(model, DDP):
        raise ValueError(f"protect(model={type(model).__name__}): world_size is {world_size} but the model "
                         "is not wrapped in DistributedDataParallel nor sharded with fully_shard, so its gradients "
                         "would never be averaged over ranks; accepted: DistributedDataParallel(model), "
                         "fully_shard(model, mesh=ctx.device_mesh) (a plain nn.Module only when world_size is 1)")
    if isinstance(model, DDP):
        if model.broadcast_buffers and any(True for _ in model.module.buffers()):
            raise ValueError(f"protect(model=DistributedDataParallel({type(model.module).__name__})): the "
                             "module has buffers and broadcast_buffers=True (a blocking broadcast every "
                             "forward); accepted: DistributedDataParallel(..., broadcast_buffers=False)")
        if model.find_unused_parameters or model.static_graph:
            raise ValueError("protect(model=DistributedDataParallel(...)): find_unused_parameters and "
                             "static_graph are not supported; accepted: the defaults (both False)")
    from .zero import ShardedAdamW

    if isinstance(optimizer, ShardedAdamW):
        raise TypeError("protect(optimizer=ShardedAdamW): ctx.zero_adamw's optimizer is protected already; "
                        "accepted: a torch.optim.Optimizer")
    if not isinstance(optimizer, torch.optim.Optimizer) or not is_stateful(optimizer):
        raise TypeError(f"protect(optimizer=...): got a {type_name(optimizer)}, which is not a "
                        "torch.optim.Optimizer with state_dict()/load_state_dict(); accepted: a torch.optim.Optimizer "
                        "(AdamW, SGD, ...)")
    owned = {id(p) for p in model.parameters()}
    stray = [i for g in optimizer.param_groups for i, p in enumerate(g["params"]) if id(p) not in owned]
    if stray:
        raise ValueError(f"protect(optimizer={type(optimizer).__name__}): {len(stray)} of its parameters are not "
                         "parameters of the model; accepted: an optimizer over model.parameters()")
    if scheduler is not None:
        if not is_stateful(scheduler):
            raise TypeError(f"protect(scheduler=...): got a {type_name(scheduler)} without state_dict()/"
                            "load_state_dict(); accepted: a torch.optim.lr_scheduler scheduler, or None")
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("protect(scheduler=...): the scheduler drives another optimizer than the one given")
    if dataloader is not None:
        check_loader(dataloader)
    if extra is not None and not is_stateful(extra):
        raise TypeError(f"protect(extra=...): got a {type_name(extra)} without state_dict()/load_state_dict(); "
                        "accepted: an object with both (torch.distributed.checkpoint.stateful.Stateful), or None")


class Protected:
    """The state ``ctx.protect`` keeps (module docstring), over ``world_size`` ranks; ``ring``: (ranks per node,
    active nodes, K replicas), whose shares this rank keeps; ``first_rank``: the rank the job's first generation
    gives this process (None: a spare). Raises TypeError or ValueError (``check``) before anything is changed.

    It holds one object per kind of state (worker/state/): the snapshot layout (``SnapshotLayout``), the
    data-parallel shares (``DataParallelShares``), the FSDP2 shards (``ShardedState``, FSDP2 models only) and the
    per-rank JSON document (``document``, a ``RankDocument``). A ``StepState`` (worker/steps.py), as
    ``ShardedAdamW`` is: ``bind(rank, watch)``, ``layout_tensors()``, ``state_tensors()`` (snapshot),
    ``restore_targets()`` + ``gather()`` (restore), ``end_of_run()``, ``param_digest()``, and ``hooks``,
    ``local_nbytes``, ``on_host``, ``sharded``, ``loader_guard``; during a step it calls ``hooks`` (the context's
    ``StepSequence``): before the first collective, after the gradient all-reduce (``on_reduced`` for FSDP2's
    reduce-scatter, dataplane/fsdp.py), before the update. ``entries``, ``common_nbytes``, ``shard_nbytes``,
    ``blob_nbytes``: the layout's (layout.py)."""

    def __init__(self, world_size: int, model, optimizer, scheduler=None, dataloader=None, extra=None, *,
                 python_rng: bool = False, numpy_rng: bool = False, ring: tuple[int, int, int] = (1, 1, 0),
                 first_rank: int | None = None):
        check(world_size, model, optimizer, scheduler, dataloader, extra)
        self.world_size = world_size
        self.model, self.optimizer = model, optimizer
        # every iter(loader) from now on is re-armed by a restore (state/loader.py); refuses an iterator made before
        self.loader_guard = None if dataloader is None else LoaderGuard(
            dataloader, is_stateful(dataloader), distributed_sampler(dataloader))
        if self.loader_guard is not None:
            self.loader_guard.follow_rank(first_rank, world_size)
        ddp = isinstance(model, ddp_class())
        self._module = model.module if ddp else model
        # FSDP2 over ctx.device_mesh: every tensor of the state is this rank's shard, unique to it (replicated
        # whole, no shares); FSDP2's collectives run pollably on the generation's group (dataplane/fsdp.py)
        self.sharded = is_fsdp2(model)
        self._shards = ShardedState(model, self._module, optimizer, world_size, ring[0]) if self.sharded else None
        self._shares = DataParallelShares(world_size, ring, self._shards.columns() if self.sharded else None)
        # everything but the model's and optimizer's tensors: the per-rank JSON document's state (state/document.py)
        self.document = RankDocument(optimizer, self._module, scheduler, self.loader_guard, extra,
                                     python_rng=python_rng, numpy_rng=numpy_rng)
        self.rank: int | None = None
        self.watch = None
        self.hooks: StepHooks = NO_HOOKS   # set by the context (worker/steps.py StepSequence)
        self._have = [True] * self._shares.kept   # which kept shares the next restore has (bind)
        self._restoring = False   # a restore is under way: its dry step and forward are no training step
        self._queued = False      # the gradient average is queued for the end of this backward
        self._digest: str | None = None   # FSDP2: over every rank's shards (end_of_run)
        self._params = [p for p in self._module.parameters() if p.requires_grad]
        # the state lives in host memory: its snapshot is a memory copy, done inline (StepSequence.snapshot); a device's
        # is a device-to-host transfer, left to the background copier
        self.on_host = all(t.device.type == "cpu" for t in self._module.parameters())
        if self.sharded:
            model_sd, optim_sd, unique, padded = self._shards.dry_run_state()
        else:
            (model_sd, optim_sd, unique), padded = dry_run_state(model, self._module, optimizer), None
        self._layout = SnapshotLayout(model, self._module, optimizer, model_sd, optim_sd, unique=unique,
                                      small=self.document.state, parts=self._shares.parts, kept=self._shares.kept,
                                      sharded=self.sharded, padded=padded)
        if self.sharded:
            self._shards.install_comms(self)
            # the first collective of a step is the forward's all-gather: wait for the replica's commit before it
            model.register_forward_pre_hook(self._forward_starts_sharded, prepend=True)
        if ddp:
            model.require_backward_grad_sync = False   # DDP's reducer stays idle: the average is done here
            for p in self._params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
            model.register_forward_pre_hook(self._forward_starts)
        optimizer.register_step_pre_hook(self._pre_step)

    # ---- the layout (layout.py) ----------------------------------------------------------------------------------
    @property
    def entries(self) -> list[tuple[str, torch.dtype, tuple]]:
        """(path, dtype, shape) of every tensor of the state, in layout order (a tied weight once)."""
        return self._layout.entries

    @property
    def local_nbytes(self) -> int:
        """Bytes of the payload's local prefix: the shares kept in the node's slot, never sent."""
        return self._layout.local_nbytes

    @property
    def common_nbytes(self) -> int:
        """Bytes of the state that is the same on every data-parallel rank (cut into shares)."""
        return self._layout.common_nbytes

    @property
    def shard_nbytes(self) -> int:
        """Bytes of one share (a multiple of 8)."""
        return self._layout.shard_nbytes

    @property
    def blob_nbytes(self) -> int:
        """Bytes of the payload's JSON region."""
        return self._layout.blob_nbytes

    def layout_tensors(self) -> list[torch.Tensor]:
        """Meta tensors of the payload's dtypes and shapes, in payload order (layout.py)."""
        return self._layout.layout_tensors()

    # ---- snapshot ------------------------------------------------------------------------------------------------
    def state_tensors(self) -> list:
        """The current state, in payload order: this rank's kept shares, its own tensors, the JSON region
        (layout.py). Raises ValueError when the state no longer fits the layout fixed at protect()."""
        return self._layout.state_tensors(self._shares.owners())

    # ---- restore -------------------------------------------------------------------------------------------------
    def restore_targets(self) -> list[torch.Tensor]:
        """Fresh tensors a payload is read into (``gather`` then applies them)."""
        return self._layout.restore_targets()

    def gather(self) -> None:
        """Apply the payload read into ``restore_targets()``: model, optimizer, scheduler, loader, extra, RNGs; the
        shares this rank lacks are exchanged with the others first (a collective every rank joins). Gradients are
        dropped (a failed step may have left some). Raises ReplicaError (a share lost or corrupted) or PeerFailure."""
        restored = self._layout.take_restored()
        # this process restored its own snapshot (stamped with the cut step once complete): its shares are there;
        # a replica sent by its source carries none; a checkpoint's record says which are (bind)
        full = self._shares.exchange(restored.kept, self._have)
        tree, small = self._layout.decode(restored, full)
        self._restoring = True
        try:
            if self._shards is not None:
                self._shards.load(tree)
            else:
                load_full(self.model, self.optimizer, tree)
        finally:
            self._restoring = False
        self.document.load(small)
        self._queued = False

    # ---- the step ------------------------------------------------------------------------------------------------
    def bind(self, rank: int, watch, from_replica: bool = False, kept: list[bool] | None = None) -> None:
        """This process is now training rank ``rank``; ``watch``: what the gradient all-reduce waits under;
        ``from_replica``: the state it restores next is a replica sent by its source (no shares of its own); ``kept``:
        else, which of the 1 + K shares in it are this rank's (a checkpoint's record: ``persist.save_shard``;
        default all). Raises ReplicaError when ``kept`` does not match the layout."""
        self.rank, self.watch = rank, watch
        m = self._shares.kept
        self._have = [False] * m if from_replica else [bool(x) for x in (kept or [True] * m)]
        if len(self._have) != m:
            raise ReplicaError(f"protect: the snapshot to restore says {len(self._have)} shares were kept; this "
                               f"layout keeps {m}")
        if self._shards is not None and self._shards.bind(rank, watch):
            self._layout.forget()   # uneven shards: this rank's have other shapes than the ones it had
        self._shares.bind(rank, watch)
        self._queued = False
        if self.loader_guard is not None:
            self.loader_guard.follow_rank(rank, self.world_size)

    # the torch hooks: where a step of the user's loop calls the step's order back (worker/steps.py)
    def _pre_step(self, optimizer, args, kwargs) -> None:
        if not self._restoring:   # (a restore's dry step is no training step)
            self.hooks.before_update()   # wait for the commit, claim the next snapshot's slot (worker/steps.py)

    def _forward_starts(self, module, args) -> None:
        self._queued = False   # a backward that failed half-way never ran its callback
        self.hooks.forward_starts()

    def _grad_ready(self, param) -> None:
        if not self._queued and self.world_size > 1 and self.rank is not None:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average_gradients)

    def _average_gradients(self) -> None:
        """(end of backward) Average the gradients over the ranks (shares.py). First wait for this rank's replica of
        the step to be committed: the all-reduce completes nowhere before every rank's is, so no survivor can be more
        than one snapshot ahead of a lost rank's newest replica (module docstring)."""
        self._queued = False
        self.hooks.before_collective()
        self._shares.average_gradients(self._params)
        self.hooks.reduced()

    def _forward_starts_sharded(self, module, args) -> None:
        self.hooks.forward_starts()
        if self.rank is not None and not self._restoring:
            self.hooks.before_collective()

    def on_reduced(self) -> None:
        """(FSDP2) A gradient reduce-scatter of this step completed (dataplane/fsdp.py)."""
        self.hooks.reduced()

    # ---- the end -------------------------------------------------------------------------------------------------
    def end_of_run(self) -> None:
        """(every rank, after the last step) FSDP2: make ``param_digest`` cover every rank's shards (an all-gather,
        pollable: raises PeerFailure)."""
        if self._shards is not None:
            self._digest = None
            self._digest = self._shards.gather_digest(self.param_digest())

    def param_digest(self) -> str:
        """sha256 over the model's parameters (``parameters()`` order, raw bytes). FSDP2: over every rank's
        digest of its shards, in rank order, once ``end_of_run`` ran (else this rank's shards only)."""
        if self._digest is not None:
            return self._digest
        h = hashlib.sha256()
        for p in self._module.parameters():
            h.update(local_shard(p).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
