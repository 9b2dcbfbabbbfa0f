"""``ctx.protect``: the user's own model, optimizer, LR scheduler and data loader, kept alive like the ZeRO shard.

Owns: turning the user's training state into the snapshot payload the replica plane already moves (a fixed list of
tensors + the RNG bytes, ``replica/snapshot.StateLayout``) and back, and the data-parallel gradient average of a
``DistributedDataParallel`` model, done with the context's pollable collectives. Does not own: slots, replication,
recovery (``worker/context.py``), the process groups (``dataplane/groups.py``). This module holds the checks, the
binding to a rank and the restore's order; each kind of state has its module in ``worker/state/``: ``layout.py``
(the snapshot layout), ``shares.py`` (the state every data-parallel rank holds alike: DDP), ``shards.py`` (the state
FSDP2 shards: FSDP, HSDP, TP x FSDP), ``document.py`` (what exists once per rank: the JSON document). The order of a
step around this state (commit waits, early claim, snapshot) is ``worker/steps.py``'s.

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
import json
import struct

import torch
from torch import nn

from ..errors import ReplicaError
from ..placement import held_by
from .state.document import RankDocument, check_loader, decode, distributed_sampler, is_stateful, type_name
from .state.layout import SnapshotLayout
from .state.loader import LoaderGuard
from .steps import NO_HOOKS, StepHooks
from .state.shards import ShardedState, is_fsdp1, is_fsdp2, local_shard, replicate_group
from .state.shares import DataParallelShares, ddp_class


class Protected(SnapshotLayout, DataParallelShares, ShardedState):
    """The state ``ctx.protect`` keeps: see the module docstring; each kind of state in its own module of
    worker/state/: the snapshot layout, the data-parallel shares and the FSDP2 shards mixed in here, the per-rank JSON
    document's state held (``document``, a ``RankDocument``). A ``StepState`` (worker/steps.py), as ``ShardedAdamW`` is:
    ``bind(rank, watch)``, ``state_tensors()`` (snapshot), ``restore_targets()`` + ``gather()`` (restore),
    ``end_of_run()``, ``param_digest()``; during a step
    it calls ``hooks`` (the context's ``StepSequence``): before the first collective, after the gradient all-reduce,
    before the update."""

    def __init__(self, world_size: int, model, optimizer, scheduler=None, dataloader=None, extra=None, *,
                 python_rng: bool = False, numpy_rng: bool = False, ring: tuple[int, int, int] = (1, 1, 0),
                 first_rank: int | None = None):
        self.world_size = world_size
        # (ranks per node, active nodes, K replicas): whose shares this rank keeps (module docstring)
        self.ring = ring
        self.k = ring[2] if world_size > 1 else 0
        self.held: list[int] = []
        self._plans: dict[int, tuple] = {}
        self._hdr = struct.Struct("<Q")   # the JSON region starts with the document's length
        self._check(model, optimizer, scheduler, dataloader, extra)
        self.model, self.optimizer = model, optimizer
        # every iter(loader) from now on is re-armed by a restore (state/loader.py); refuses an iterator made before
        self.loader_guard = None if dataloader is None else LoaderGuard(
            dataloader, is_stateful(dataloader), distributed_sampler(dataloader))
        if self.loader_guard is not None:
            self.loader_guard.follow_rank(first_rank, world_size)
        self.ddp = isinstance(model, ddp_class())
        self.inner = model.module if self.ddp else model
        # FSDP2 over ctx.device_mesh: every tensor of the state is this rank's shard, unique to it (replicated
        # whole, no shares); FSDP2's collectives run pollably on the generation's group (dataplane/fsdp.py)
        self.sharded = is_fsdp2(model)
        # HSDP: the shards are the same on every rank of a replicate group (a *column* of the mesh), so they are kept
        # in the rank's own snapshot and never sent, like DDP's shares, whole: one kept region (state/shares.py)
        self.column = replicate_group(model) if self.sharded else None
        if self.column is not None:
            self._check_columns_span_nodes()
        self.m = 1 if self.column is not None else 1 + self.k   # kept regions in the payload's local prefix
        self._have = [True] * self.m   # which kept regions the next restore has (bind)
        self._digest: str | None = None
        # everything but the model's and optimizer's tensors: the per-rank JSON document's state (state/document.py)
        self.document = RankDocument(optimizer, self.inner, scheduler, self.loader_guard, extra,
                                     python_rng=python_rng, numpy_rng=numpy_rng)
        self.rank: int | None = None
        self.watch = None
        self.hooks: StepHooks = NO_HOOKS   # set by the context (worker/steps.py StepSequence)
        self._restoring = False
        self._queued = False
        self._cache_sig, self._cache = None, None
        self._pieces = None   # ((signature, owners), the shares' pieces): see state_tensors
        self._zeros = None    # the JSON region's padding (state_tensors)
        self._pad = None      # zero bytes after short FSDP2 shards (_zero_bytes)
        self.params = [p for p in self.inner.parameters() if p.requires_grad]
        # the state lives in host memory: its snapshot is a memory copy, done inline (StepSequence.snapshot); a device's
        # is a device-to-host transfer, left to the background copier
        self.on_host = all(t.device.type == "cpu" for t in self.inner.parameters())
        self._sig_tensors = [local_shard(t) for t in list(self.inner.parameters()) + list(self.inner.buffers())]
        if self.sharded:
            self._layout_from_real_dry_run()
            self._install_fsdp_comms()
        else:
            self._layout_from_dry_run()
        if self.ddp:
            model.require_backward_grad_sync = False   # DDP's reducer stays idle: the average is done here
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
            model.register_forward_pre_hook(self._forward_starts)
        optimizer.register_step_pre_hook(self._pre_step)

    # ---- checks (before anything is changed) ---------------------------------------------------------------------
    def _check(self, model, optimizer, scheduler, dataloader, extra) -> None:
        DDP = ddp_class()
        if not isinstance(model, nn.Module):
            raise TypeError(f"protect(model=...): got a {type_name(model)}; accepted: a torch.nn.Module, wrapped in "
                            "torch.nn.parallel.DistributedDataParallel when world_size > 1")
        if is_fsdp1(model):
            raise ValueError(f"protect(model={type(model).__name__}): FSDP1 (FullyShardedDataParallel) is not "
                             "supported; accepted: FSDP2 (torch.distributed.fsdp.fully_shard(module, "
                             "mesh=ctx.device_mesh)) or DistributedDataParallel(model) (docs/your-loop.md)")
        if is_fsdp2(model):
            self._check_fsdp2(model)
        elif self.world_size > 1 and not isinstance(model, DDP):
            raise ValueError(f"protect(model={type(model).__name__}): world_size is {self.world_size} but the model "
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
                            "torch.optim.Optimizer with state_dict()/load_state_dict(); accepted: a "
                            "torch.optim.Optimizer (AdamW, SGD, ...)")
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


    # ---- the state, as one nested dict ---------------------------------------------------------------------------


    def _dry_step(self, optimizer) -> None:
        """One optimizer step that changes no parameter and creates the optimizer's state: zero gradients, lr 0
        (AdamW's decoupled weight decay multiplies by 1 - 0 * wd, its update adds 0)."""
        lrs = []
        with torch.no_grad():
            for g in optimizer.param_groups:
                for p in g["params"]:
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
                lrs.append(g.get("lr"))
                if "lr" in g:
                    g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        restoring, self._restoring = self._restoring, True   # no commit wait, no claim: not a training step
        try:
            optimizer.step()
        finally:
            self._restoring = restoring
            for g, lr in zip(optimizer.param_groups, lrs):
                if lr is not None:
                    g["lr"] = lr
                for p in g["params"]:
                    p.grad = None


    # ---- snapshot ------------------------------------------------------------------------------------------------


    # ---- restore -------------------------------------------------------------------------------------------------

    def gather(self) -> None:
        """Apply the payload read into ``restore_targets()``: model, optimizer, scheduler, loader, extra, RNGs.
        Gradients are dropped (a failed step may have left some)."""
        scratch, self._scratch = self._scratch, None
        self._cache_sig, self._cache, self._pieces = None, None, None
        blob = scratch[-1]
        (n,) = self._hdr.unpack(bytes(blob[:self._hdr.size].numpy()))
        doc = json.loads(bytes(blob[self._hdr.size:self._hdr.size + n].numpy()))
        kept = scratch[:self.m]
        # this process restored its own snapshot (stamped with the cut step once complete): its shares are there;
        # a replica sent by its source carries none; a checkpoint's record says which are (bind)
        full = self._exchange_shares(kept, self._have)
        tensors = [None] * len(self.entries)
        for i in self._common:
            off, n = self._span[i]
            _, dtype, shape = self.entries[i]
            tensors[i] = full[off:off + n].view(dtype).reshape(shape)
        for pos, i in enumerate(self._unique):
            tensors[i] = scratch[self.m + pos]
        tree = decode(doc["tree"], tensors)
        small = decode(doc["small"], None)
        self._restoring = True
        try:
            if self.sharded:
                from ..dataplane.fsdp import reset_after_failure

                reset_after_failure(self.model)   # a failure may have cut a forward or backward short
                self._load_shards(tree)
            else:
                self._load_full(tree)
        finally:
            self._restoring = False
        self.document.load(small)
        self._queued = False


    # ---- the step ------------------------------------------------------------------------------------------------

    def bind(self, rank: int, watch, from_replica: bool = False, kept: list[bool] | None = None) -> None:
        """This process is now training rank ``rank``; ``watch``: what the gradient all-reduce waits under;
        ``from_replica``: the state it restores next is a replica sent by its source (no shares of its own); ``kept``:
        else, which of the 1 + K shares in it are this rank's (a checkpoint's record: ``persist.save_shard``;
        default all)."""
        self.rank, self.watch = rank, watch
        self._have = [False] * self.m if from_replica else [bool(x) for x in (kept or [True] * self.m)]
        if len(self._have) != self.m:
            raise ReplicaError(f"protect: the snapshot to restore says {len(self._have)} shares were kept; this "
                               f"layout keeps {self.m}")
        if self.sharded:
            from ..dataplane.fsdp import rebind

            if rebind(self.model, rank):   # uneven shards: this rank's have other shapes than the ones it had
                self.optimizer.state.clear()   # made again, with the new shapes, by the restore's dry step
                self._cache_sig, self._cache, self._pieces = None, None, None
        if self.k and self.column is None:
            P, nodes, k = self.ring
            self.held = held_by(rank, P, nodes, k)
        self._queued = False
        if self.loader_guard is not None:
            self.loader_guard.follow_rank(rank, self.world_size)


    def _pre_step(self, optimizer, args, kwargs) -> None:
        if not self._restoring:   # (a restore's dry step is no training step)
            self.hooks.before_update()   # wait for the commit, claim the next snapshot's slot (worker/steps.py)

    def end_of_run(self) -> None:
        """(every rank, after the last step) FSDP2: make ``param_digest`` cover every rank's shards."""
        if self.sharded:
            self.gather_digests()

    def param_digest(self) -> str:
        """sha256 over the model's parameters (``parameters()`` order, raw bytes). FSDP2: over every rank's
        digest of its shards, in rank order, once ``gather_digests`` ran (else this rank's shards only)."""
        if self._digest is not None:
            return self._digest
        h = hashlib.sha256()
        for p in self.inner.parameters():
            h.update(local_shard(p).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


