"""``ctx.protect``: the user's own model, optimizer, LR scheduler and data loader, kept alive like the ZeRO shard.

Owns: turning the user's training state into the snapshot payload the replica plane already moves (a fixed list of
tensors + the RNG bytes, ``replica/snapshot.StateLayout``) and back, and the data-parallel gradient average of a
``DistributedDataParallel`` model, done with the context's pollable collectives. Does not own: slots, replication,
recovery (``worker/context.py``), the process groups (``dataplane/groups.py``).

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

import base64
import copy
import hashlib
import json
import math
import random
import struct

import torch
from torch import nn

from ..dataplane import collectives
from ..errors import ReplicaError
from ..placement import held_by, holders_of
from ..replica.snapshot import checksum

BLOB_MIN = 64 << 10          # bytes reserved for the JSON document, at least


def _ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def _is_fsdp1(model) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _is_fsdp2(model) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _local(t):
    """A DTensor's local shard (FSDP2's parameters and their optimizer state), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and isinstance(t, torch.Tensor) else t


def _locals(obj, padded: dict | None = None):
    """``obj`` (nested dicts/lists of a state dict) with every DTensor replaced by its local shard; ``padded``: filled
    with id(local shard) -> the shard's padded shape (``_padded_shape``)."""
    if isinstance(obj, torch.Tensor):
        t = _local(obj)
        if padded is not None and t is not obj:
            padded[id(t)] = _padded_shape(obj)
        return t
    if isinstance(obj, dict):
        return {k: _locals(v, padded) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_locals(v, padded) for v in obj]
    return obj


def _padded_shape(dt) -> tuple:
    """The shape of a DTensor's local shard on the rank with the largest one (mesh coordinate 0 on every sharded
    dimension): torch.chunk's split, ``ceil(size / mesh size)`` along each ``Shard(d)``, which FSDP2 pads every
    rank's shard to (torch's ``_chunk_with_empty``). The same on every rank, so the snapshot layout is."""
    from torch.distributed.tensor import Shard

    shape = list(dt.shape)
    for mesh_dim, placement in enumerate(dt.placements):
        if isinstance(placement, Shard):
            shape[placement.dim] = -(-shape[placement.dim] // dt.device_mesh.size(mesh_dim))
    return tuple(shape)


def _pad_pieces(t: torch.Tensor, shape: tuple, zeros) -> list[torch.Tensor]:
    """``t`` (a shard shorter than ``shape`` along dim 0) as 1-D uint8 pieces filling ``shape``'s bytes: its own
    bytes, then ``zeros(n)`` (a view of n zero bytes)."""
    own = t.detach().contiguous().reshape(-1).view(torch.uint8)
    rest = math.prod(shape) * t.element_size() - own.numel()
    return [own, zeros(rest)] if rest else [own]


def _name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


# ---- the JSON codec: nested state dicts <-> JSON, tensors by index (layout) or inline (small state) -------------
def _encode(obj, path: str, sink):
    """JSON-able form of ``obj``. Tensors go to ``sink(path, tensor) -> index`` if given, else inline (base64)."""
    if isinstance(obj, torch.Tensor):
        if sink is not None:
            return {"$t": sink(path, obj)}
        t = obj.detach().cpu().contiguous()
        return {"$x": [str(t.dtype).replace("torch.", ""), list(t.shape),
                       base64.b64encode(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").decode()]}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, float, str)):
        return obj
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, f"{path}/{k}", sink) for k, v in obj.items()}
        return {"$d": [[_encode(k, path, None), _encode(v, f"{path}/{k}", sink)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"$tuple": [_encode(v, f"{path}/{i}", sink) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}/{i}", sink) for i, v in enumerate(obj)]
    if hasattr(obj, "item") and getattr(obj, "shape", None) == ():   # a numpy scalar
        return obj.item()
    raise TypeError(f"protect: the state at {path or '/'} holds a {_name(obj)}; accepted: tensors, numbers, "
                    "strings, None, and dicts/lists/tuples of them")


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _decode(obj, tensors):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "$t" in obj:
            return tensors[obj["$t"]]
        if "$x" in obj:
            dtype, shape, data = obj["$x"]
            raw = bytearray(base64.b64decode(data))
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return t.view(getattr(torch, dtype)).reshape(shape).clone()
        if "$tuple" in obj:
            return tuple(_decode(v, tensors) for v in obj["$tuple"])
        if "$d" in obj:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["$d"]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


def _storage_key(t: torch.Tensor):
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


class Protected:
    """The state ``ctx.protect`` keeps: see the module docstring. The context drives it like ``ShardedAdamW``:
    ``bind(rank, watch)``, ``state_tensors()`` (snapshot), ``restore_targets()`` + ``gather()`` (restore),
    ``before_update`` (set by the context: wait for the replica's commit), ``param_digest()``."""

    def __init__(self, world_size: int, model, optimizer, scheduler=None, dataloader=None, extra=None, *,
                 python_rng: bool = False, numpy_rng: bool = False, ring: tuple[int, int, int] = (1, 1, 0)):
        self.world_size = world_size
        # (ranks per node, active nodes, K replicas): whose shares this rank keeps (module docstring)
        self.ring = ring
        self.k = ring[2] if world_size > 1 else 0
        self.held: list[int] = []
        self._have = [True] * (1 + self.k)   # which kept shares the next restore has (bind)
        self._plans: dict[int, tuple] = {}
        self._hdr = struct.Struct("<Q")   # the JSON region starts with the document's length
        self._check(model, optimizer, scheduler, dataloader, extra)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.dataloader, self.extra = dataloader, extra
        self.ddp = isinstance(model, _ddp_class())
        self.inner = model.module if self.ddp else model
        # FSDP2 over ctx.device_mesh: every tensor of the state is this rank's shard, unique to it (replicated
        # whole, no shares); FSDP2's collectives run pollably on the generation's group (dataplane/fsdp.py)
        self.sharded = _is_fsdp2(model)
        self._digest: str | None = None
        self.python_rng, self.numpy_rng = python_rng, numpy_rng
        self.cuda = torch.cuda.is_available()
        self.rank: int | None = None
        self.watch = None
        self.before_update = lambda: None
        self.claim_next = lambda: None   # set by the context: reserve the next snapshot's slot (Context._claim_next)
        self._reduced = False            # this step's gradient all-reduce completed
        self._restoring = False
        self._queued = False
        self._cache_sig, self._cache = None, None
        self._pieces = None   # ((signature, owners), the shares' pieces): see state_tensors
        self._zeros = None    # the JSON region's padding (state_tensors)
        self._pad = None      # zero bytes after short FSDP2 shards (_zero_bytes)
        self.params = [p for p in self.inner.parameters() if p.requires_grad]
        # the state lives in host memory: its snapshot is a memory copy, done inline (Context._snapshot); a device's
        # is a device-to-host transfer, left to the background copier
        self.on_host = all(t.device.type == "cpu" for t in self.inner.parameters())
        self._sig_tensors = [_local(t) for t in list(self.inner.parameters()) + list(self.inner.buffers())]
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
        DDP = _ddp_class()
        if not isinstance(model, nn.Module):
            raise TypeError(f"protect(model=...): got a {_name(model)}; accepted: a torch.nn.Module, wrapped in "
                            "torch.nn.parallel.DistributedDataParallel when world_size > 1")
        if _is_fsdp1(model):
            raise ValueError(f"protect(model={type(model).__name__}): FSDP1 (FullyShardedDataParallel) is not "
                             "supported; accepted: FSDP2 (torch.distributed.fsdp.fully_shard(module, "
                             "mesh=ctx.device_mesh)) or DistributedDataParallel(model) (docs/your-loop.md)")
        if _is_fsdp2(model):
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
        if not isinstance(optimizer, torch.optim.Optimizer) or not _stateful(optimizer):
            raise TypeError(f"protect(optimizer=...): got a {_name(optimizer)}, which is not a torch.optim.Optimizer "
                            "with state_dict()/load_state_dict(); accepted: a torch.optim.Optimizer (AdamW, SGD, ...)")
        owned = {id(p) for p in model.parameters()}
        stray = [i for g in optimizer.param_groups for i, p in enumerate(g["params"]) if id(p) not in owned]
        if stray:
            raise ValueError(f"protect(optimizer={type(optimizer).__name__}): {len(stray)} of its parameters are not "
                             "parameters of the model; accepted: an optimizer over model.parameters()")
        if scheduler is not None:
            if not _stateful(scheduler):
                raise TypeError(f"protect(scheduler=...): got a {_name(scheduler)} without state_dict()/"
                                "load_state_dict(); accepted: a torch.optim.lr_scheduler scheduler, or None")
            if getattr(scheduler, "optimizer", optimizer) is not optimizer:
                raise ValueError("protect(scheduler=...): the scheduler drives another optimizer than the one given")
        if dataloader is not None:
            self._check_loader(dataloader)
        if extra is not None and not _stateful(extra):
            raise TypeError(f"protect(extra=...): got a {_name(extra)} without state_dict()/load_state_dict(); "
                            "accepted: an object with both (torch.distributed.checkpoint.stateful.Stateful), or None")

    def _check_fsdp2(self, model) -> None:
        from torch.distributed.fsdp import FSDPModule

        from ..dataplane.fsdp import mesh_infos
        from ..dataplane.meshgroup import MeshGroup

        if not isinstance(model, FSDPModule):
            raise ValueError(f"protect(model={type(model).__name__}): only some of its submodules are sharded with "
                             "fully_shard; accepted: fully_shard on the root module too (it drives the others)")
        infos = mesh_infos(model)
        used = [g for info in infos for g in (getattr(info, "shard_process_group", None),
                                              getattr(info, "replicate_process_group", None)) if g is not None]
        groups = {type(g).__name__ for g in used if not isinstance(g, MeshGroup)}
        if groups:
            raise ValueError("protect(model=...): fully_shard was called with another mesh than ctx.device_mesh or "
                             f"ctx.init_device_mesh(...)'s (its groups: {sorted(groups)}); accepted: "
                             "fully_shard(module, mesh=ctx.device_mesh), or mesh=ctx.init_device_mesh((R, S), "
                             "(\"replicate\", \"shard\")) for HSDP, on every sharded module")

    @staticmethod
    def _check_loader(loader) -> None:
        if _stateful(loader):
            return   # torchdata's StatefulDataLoader, or any loader that saves and restores its position
        sampler = _distributed_sampler(loader)
        if sampler is not None:
            return
        what = "a plain iterator" if hasattr(loader, "__next__") else f"a {_name(loader)}"
        raise TypeError(f"protect(dataloader=...): got {what}, whose position cannot be saved or restored; "
                        "accepted: torchdata's StatefulDataLoader (anything with state_dict()/load_state_dict()), "
                        "a torch DataLoader whose sampler is a DistributedSampler (its epoch and rank are kept; "
                        "derive the position in the epoch from the step), or None (data drawn as a function of "
                        "the step, e.g. deadpool_hpc.train.Batches.get(step, ctx.rank))")

    # ---- the state, as one nested dict ---------------------------------------------------------------------------
    def _small_state(self) -> dict:
        """Everything but the model and optimizer tensors (goes into the JSON document)."""
        out: dict = {}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        loader = self.dataloader
        if loader is not None:
            if _stateful(loader):
                out["dataloader"] = loader.state_dict()
            else:
                out["sampler_epoch"] = _distributed_sampler(loader).epoch
        if self.extra is not None:
            out["extra"] = self.extra.state_dict()
        rng: dict = {}
        if self.cuda:
            rng["cuda"] = torch.cuda.get_rng_state_all()
        if self.python_rng:
            rng["python"] = random.getstate()
        if self.numpy_rng:
            import numpy as np

            name, keys, pos, has_gauss, gauss = np.random.get_state()
            rng["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
        out["rng"] = rng
        return out

    def _layout_from_dry_run(self) -> None:
        """Fix the payload layout: the model's tensors, and the optimizer state's as a dry step on a copy creates
        them (module docstring, "Layout")."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        twin_model, twin_opt = copy.deepcopy((self.inner, self.optimizer))
        twin_opt.__dict__.pop("step", None)        # an LR scheduler's wrapper would call the real optimizer
        twin_opt._optimizer_step_pre_hooks.clear()
        twin_opt._optimizer_step_post_hooks.clear()
        self._dry_step(twin_opt)
        model_sd = get_model_state_dict(self.model)
        optim_sd = get_optimizer_state_dict(twin_model, twin_opt)
        del twin_model, twin_opt
        buffers = {f"/model/{n}" for n, _ in self.inner.named_buffers()}
        self._fix_layout(model_sd, optim_sd, unique=lambda path: path in buffers)

    def _fix_layout(self, model_sd: dict, optim_sd: dict, unique, padded: dict | None = None) -> None:
        """The payload's layout from the state dicts' tensors; ``unique(path)``: the tensor is this rank's own
        (replicated whole), else the same on every rank (cut into shares); ``padded``: id(tensor) -> the shape its
        place has (an FSDP2 shard: the largest rank's, ``_padded_shape``), else the tensor's own."""
        self.entries: list[tuple[str, torch.dtype, tuple]] = []
        self._index: dict[str, int] = {}
        padded = padded or {}

        def add(path, t):
            self._index[path] = len(self.entries)
            self.entries.append((path, t.dtype, padded.get(id(t), tuple(t.shape))))
            return 0

        tree = self._split({"model": model_sd, "optim": optim_sd}, add)
        doc = self._document(tree, self._small_state())
        self.blob_nbytes = max(BLOB_MIN, 4 * len(doc) + 4096 + self._hdr.size)
        self.blob_nbytes += -self.blob_nbytes % 8
        # 8-byte elements first, then 4, 2, 1: every view into the payload (and into the gathered state) is aligned
        esize = [torch.empty(0, dtype=dtype).element_size() for _, dtype, _ in self.entries]
        self.order = sorted(range(len(self.entries)), key=lambda i: -esize[i])
        # parameters and optimizer state are the same on every rank (DDP): each rank's payload holds 1/world_size
        # of their bytes; buffers (per rank, as DDP without broadcast_buffers keeps them) are held whole
        self._common = [i for i in self.order if not unique(self.entries[i][0])]
        self._unique = [i for i in self.order if unique(self.entries[i][0])]
        self._span: dict[int, tuple[int, int]] = {}
        off = 0
        for i in self._common:
            n = math.prod(self.entries[i][2]) * esize[i]
            self._span[i] = (off, n)
            off += n
        self.common_nbytes = off
        self.shard_nbytes = max(8, -(-off // (self.world_size * 8)) * 8)
        self.local_nbytes = (1 + self.k) * self.shard_nbytes   # the shares kept, never sent

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

    def _layout_from_real_dry_run(self) -> None:
        """FSDP2's layout: a sharded module cannot be deep-copied with its process group, so the dry step runs on the
        real optimizer, whose state is then emptied again (its first real step is bitwise a plain run's). Every
        tensor is this rank's shard: all per rank, none shared."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        had_state = bool(self.optimizer.state)
        if not had_state:
            self._dry_step(self.optimizer)
        padded: dict = {}
        model_sd = _locals(get_model_state_dict(self.model), padded)
        optim_sd = _locals(get_optimizer_state_dict(self.model, self.optimizer), padded)
        if not had_state:
            self.optimizer.state.clear()
        self._fix_layout(model_sd, optim_sd, unique=lambda path: True, padded=padded)

    def _install_fsdp_comms(self) -> None:
        from ..dataplane.fsdp import PollableAllGather, PollableReduceScatter, fsdp_modules

        for m in fsdp_modules(self.model):
            m.set_custom_all_gather(PollableAllGather(self))
            m.set_custom_reduce_scatter(PollableReduceScatter(self))
        # the first collective of a step is the forward's all-gather: wait for the replica's commit before it
        self.model.register_forward_pre_hook(self._forward_starts_sharded, prepend=True)

    def on_reduced(self) -> None:
        """(FSDP2) A gradient reduce-scatter of this step completed (dataplane/fsdp.py)."""
        self._reduced = True

    def _forward_starts_sharded(self, module, args) -> None:
        self._reduced = False
        if self.rank is not None and not self._restoring:
            self.before_update()

    def _split(self, state: dict, sink) -> object:
        """Encode ``state``; tensor leaves go to ``sink(path, tensor) -> index``; a tensor already seen (a tied
        weight under a second name) is referenced, not stored twice."""
        seen: dict = {}

        def once(path, t):
            key = _storage_key(t)
            if key not in seen:
                seen[key] = sink(path, t)
            return seen[key]

        return _encode(state, "", once)

    @staticmethod
    def _document(tree, small: dict) -> bytes:
        return _dumps({"tree": tree, "small": _encode(small, "", None)}).encode()

    def layout_tensors(self) -> list[torch.Tensor]:
        """Meta tensors describing the payload's state tensors, in payload order: this rank's share of the common
        state (bytes) and the K shares it keeps for the ranks whose replica it holds (the local prefix,
        ``local_nbytes``), the per-rank tensors, the JSON region."""
        return [torch.empty(self.shard_nbytes, dtype=torch.uint8, device="meta") for _ in range(1 + self.k)] + \
            [torch.empty(self.entries[i][2], dtype=self.entries[i][1], device="meta") for i in self._unique] + \
            [torch.empty(self.blob_nbytes, dtype=torch.uint8, device="meta")]

    # ---- snapshot ------------------------------------------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """The current state, in payload order. Tensors are the live ones (the optimizer does not update before the
        replica is committed); the shares are lists of 1-D uint8 pieces of them, and so is the JSON region (a fresh
        tensor of the document, then zeros)."""
        sig = self._signature()
        if sig is not None and sig == self._cache_sig:
            # the same tensors as last time: only the param groups' scalars (lr, ...) and the small state are read
            # and encoded again; the rest of the document (the tensors' places, ~100 entries) is the cached JSON
            found, model_json, state_json, names = self._cache
            groups = [dict(_encode(_without_params(g), "", None), params=n)
                      for g, n in zip(self.optimizer.param_groups, names)]
            doc = ('{"tree":{"model":%s,"optim":{"state":%s,"param_groups":%s},"optim_empty":false},"small":%s}' % (
                model_json, state_json, _dumps(groups), _dumps(_encode(self._small_state(), "", None)))).encode()
        else:
            found, tree = self._collect()
            self._cache_sig = sig if not tree["optim_empty"] else None
            if self._cache_sig is not None:
                self._cache = (found, _dumps(tree["model"]), _dumps(tree["optim"]["state"]),
                               [g["params"] for g in tree["optim"]["param_groups"]])
            doc = self._document(tree, self._small_state())
        if len(doc) + self._hdr.size > self.blob_nbytes:
            raise ValueError(f"protect: the non-tensor state is {len(doc)} bytes of JSON, more than the "
                             f"{self.blob_nbytes - self._hdr.size} reserved at protect() (4x its size then)")
        # this rank's share of the common state and the shares it keeps for others: byte ranges of the live tensors
        # (the background copy reads them before the update, which waits for the commit); the same views while the
        # state's tensors are the same ones (``_signature``)
        owners = [self.rank] + self.held
        if sig is not None and self._pieces is not None and self._pieces[0] == (sig, owners):
            out = list(self._pieces[1])
        else:
            out = [self._share(r, found) for r in owners]
            # only views can be reused: a non-contiguous tensor's piece is a copy, taken afresh every step
            views = all(found[i].is_contiguous() for i in self._common if i in found)
            self._pieces = ((sig, owners), out) if sig is not None and views else None
            out = list(out)
        for i in self._unique:
            t = found.get(i)
            shape = self.entries[i][2]
            if t is None:
                out.append(torch.zeros(shape, dtype=self.entries[i][1]))
            elif tuple(t.shape) != shape:   # an FSDP2 shard shorter than the largest rank's: padded with zeros
                out.append(_pad_pieces(t, shape, self._zero_bytes))
            else:
                out.append(t.detach())
        # the JSON region: the document's length and the document, then zeros (a view of one tensor kept for it)
        head = torch.frombuffer(bytearray(self._hdr.pack(len(doc)) + doc), dtype=torch.uint8)
        if self._zeros is None or self._zeros.numel() != self.blob_nbytes:
            self._zeros = torch.zeros(self.blob_nbytes, dtype=torch.uint8)
        return out + [[head, self._zeros[head.numel():]]]

    def _zero_bytes(self, n: int) -> torch.Tensor:
        """A view of ``n`` zero bytes (one buffer kept for the padding of short shards)."""
        if self._pad is None or self._pad.numel() < n:
            self._pad = torch.zeros(max(n, 4096), dtype=torch.uint8)
        return self._pad[:n]

    def _share(self, r: int, found: dict) -> list[torch.Tensor]:
        """Bytes [r * shard_nbytes, (r + 1) * shard_nbytes) of the common state: 1-D uint8 pieces, views of the
        live tensors where they exist (zeros for state not there yet, e.g. no optimizer state before the first step,
        never read back, and for the padding of the last share)."""
        plan = self._plans.get(r)
        if plan is None:   # which byte range of which tensor: fixed by the layout, computed once per share
            lo, hi = r * self.shard_nbytes, (r + 1) * self.shard_nbytes
            plan, pos = [], lo
            for i in self._common:
                off, n = self._span[i]
                a, b = max(off, lo), min(off + n, hi)
                if a < b:
                    plan.append((i, a - off, b - off))
                    pos = b
            self._plans[r] = plan = (plan, hi - max(pos, lo))
        ranges, pad = plan
        pieces = []
        for i, a, b in ranges:
            t = found.get(i)
            if t is None:
                pieces.append(torch.zeros(b - a, dtype=torch.uint8))
            else:
                pieces.append(t.detach().contiguous().reshape(-1).view(torch.uint8)[a:b])
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8))
        return pieces

    def _signature(self):
        """Which tensors hold the model's and optimizer's state now (None: not cacheable, e.g. a non-tensor value
        in the optimizer's state). Equal signatures: the tensors found by the last ``_collect`` are still the ones."""
        sig = [t.data_ptr() for t in self._sig_tensors]
        for st in self.optimizer.state.values():
            for v in st.values():
                if not isinstance(v, torch.Tensor):
                    return None
                sig.append(id(v))
                sig.append(_local(v).data_ptr())
        sig.append(len(self.optimizer.state))
        return tuple(sig)

    def _collect(self):
        """The state through torch.distributed.checkpoint.state_dict: (tensors by layout index, encoded tree)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        model_sd = get_model_state_dict(self.model)
        empty = not self.optimizer.state
        if empty:   # before the first real step: DCP would run its own dry step on the real optimizer
            optim_sd = {"param_groups": [_without_params(g) for g in self.optimizer.param_groups]}
        else:
            optim_sd = get_optimizer_state_dict(self.model, self.optimizer)
        if self.sharded:   # FSDP2: the local shards of the DTensors
            model_sd, optim_sd = _locals(model_sd), _locals(optim_sd)
        found: dict[int, torch.Tensor] = {}

        def sink(path, t):
            i = self._index.get(path)
            if i is None:
                raise ValueError(f"protect: the state tensor {path} appeared after protect() fixed the snapshot "
                                 "layout; the optimizer's state must be the one its first step creates")
                # (e.g. an optimizer whose state grows later is not supported)
            _, dtype, shape = self.entries[i]
            if t.dtype != dtype or (tuple(t.shape) != shape and not (
                    self.sharded and t.dim() and t.shape[1:] == shape[1:] and t.shape[0] <= shape[0])):
                raise ValueError(f"protect: the state tensor {path} changed from {dtype} {list(shape)} to "
                                 f"{t.dtype} {list(t.shape)} after protect() fixed the snapshot layout")
            found[i] = t
            return i

        tree = self._split({"model": model_sd, "optim": optim_sd}, sink)
        tree["optim_empty"] = empty
        return found, tree

    # ---- restore -------------------------------------------------------------------------------------------------
    def restore_targets(self) -> list[torch.Tensor]:
        """Fresh tensors a payload is read into (``gather`` then applies them)."""
        self._scratch = [torch.empty(t.shape, dtype=t.dtype) for t in self.layout_tensors()]
        return self._scratch

    def gather(self) -> None:
        """Apply the payload read into ``restore_targets()``: model, optimizer, scheduler, loader, extra, RNGs.
        Gradients are dropped (a failed step may have left some)."""
        scratch, self._scratch = self._scratch, None
        self._cache_sig, self._cache, self._pieces = None, None, None
        blob = scratch[-1]
        (n,) = self._hdr.unpack(bytes(blob[:self._hdr.size].numpy()))
        doc = json.loads(bytes(blob[self._hdr.size:self._hdr.size + n].numpy()))
        kept = scratch[:1 + self.k]
        # this process restored its own snapshot (stamped with the cut step once complete): its shares are there;
        # a replica pulled from a holder carries none; a checkpoint's record says which are (bind)
        full = self._exchange_shares(kept, self._have)
        tensors = [None] * len(self.entries)
        for i in self._common:
            off, n = self._span[i]
            _, dtype, shape = self.entries[i]
            tensors[i] = full[off:off + n].view(dtype).reshape(shape)
        for pos, i in enumerate(self._unique):
            tensors[i] = scratch[1 + self.k + pos]
        tree = _decode(doc["tree"], tensors)
        small = _decode(doc["small"], None)
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
        self._load_small(small)

    def _load_full(self, tree: dict) -> None:
        """The model and optimizer state through DCP's set_*_state_dict (DDP and plain modules)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, tree["model"])
        osd = tree["optim"]
        if tree["optim_empty"]:
            self.optimizer.state.clear()
            _set_groups(self.optimizer, osd["param_groups"])
        else:
            if not self.optimizer.state:
                # a spare's optimizer has no state yet: fill it first, or DCP makes it with a dry step of the
                # real optimizer (lr 0); load_state_dict then replaces it as usual
                for live, saved in zip(self.optimizer.param_groups, osd["param_groups"]):
                    for p, fqn in zip(live["params"], saved["params"]):
                        if fqn in osd["state"]:
                            self.optimizer.state[p] = dict(osd["state"][fqn])
            set_optimizer_state_dict(self.model, self.optimizer, osd)

    def _load_shards(self, tree: dict) -> None:
        """(FSDP2) Copy the saved shards into the live ones, in place: DCP's set_*_state_dict would treat the local
        tensors as whole ones and redistribute them over the mesh, whose group carries no traffic
        (dataplane/fsdp.py). A spare's optimizer gets its state from a dry step first."""
        osd = tree["optim"]
        with torch.no_grad():
            live = self.model.state_dict()
            for name, saved in tree["model"].items():
                if name not in live:
                    raise ReplicaError(f"protect: the snapshot has a model tensor {name} the model does not have")
                _fit_copy(_local(live[name]), saved)
            if tree["optim_empty"]:
                self.optimizer.state.clear()
            else:
                if not self.optimizer.state:
                    self._dry_step(self.optimizer)
                by_name = dict(self.model.named_parameters())
                for fqn, saved in osd["state"].items():
                    st = self.optimizer.state[by_name[fqn]]
                    for k, v in saved.items():
                        if isinstance(v, torch.Tensor) and isinstance(st.get(k), torch.Tensor):
                            _fit_copy(_local(st[k]), v)
                        else:
                            st[k] = v
        _set_groups(self.optimizer, osd["param_groups"])

    def _load_small(self, small: dict) -> None:
        """Gradients dropped; scheduler, loader, extra and RNGs from the JSON document."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.inner.parameters():
            p.grad = None
        if self.scheduler is not None:
            self.scheduler.load_state_dict(small["scheduler"])
        if self.dataloader is not None:
            if "dataloader" in small:
                self.dataloader.load_state_dict(small["dataloader"])
            else:
                _distributed_sampler(self.dataloader).set_epoch(small["sampler_epoch"])
        if self.extra is not None:
            self.extra.load_state_dict(small["extra"])
        rng = small["rng"]
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])
        if "python" in rng:
            random.setstate(rng["python"])
        if "numpy" in rng:
            import numpy as np

            name, keys, pos, has_gauss, gauss = rng["numpy"]
            np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
        self._queued = False

    # ---- the step ------------------------------------------------------------------------------------------------
    def _exchange_shares(self, kept: list[torch.Tensor], have: list[bool]) -> torch.Tensor:
        """Every rank's share of the common state, at the restored step. A pollable all-gather of which shares each
        rank kept (``have``) with their CRC-32C, taken now, then one all-to-all that moves only the shares a rank
        lacks: share j comes from rank j, else from a holder of rank j's replica, and goes to every rank that kept no
        copy of it (a survivor lacks W - 1 - K shares, a promoted spare all W). Raises ReplicaError naming the share
        no live rank kept, or one that arrived with another checksum than its sender's."""
        W, m, shard = self.world_size, 1 + self.k, self.shard_nbytes
        if W == 1:
            if not have[0]:
                raise ReplicaError("protect: the restored snapshot carries no share of the parameters and "
                                   "optimizer state")
            return kept[0]
        mine_info = torch.tensor(have + [checksum(t.numpy()) if h else 0 for t, h in zip(kept, have)],
                                 dtype=torch.int64)
        info = torch.zeros(W * 2 * m, dtype=torch.int64)
        collectives.all_gather(info, mine_info, self.watch)
        info = info.view(W, 2 * m).tolist()
        flags, crcs = [row[:m] for row in info], [row[m:] for row in info]
        P, nodes, k = self.ring
        keeps = [[r] + held_by(r, P, nodes, k) for r in range(W)]   # the shares rank r keeps, in its kept order

        def good_copy(r: int, j: int) -> int | None:
            """Where in rank r's kept shares a copy of share j is (None: r has none)."""
            return next((i for i, jj in enumerate(keeps[r]) if jj == j and flags[r][i]), None)

        out = torch.empty(W * shard, dtype=torch.uint8)
        to, frm = [[] for _ in range(W)], [[] for _ in range(W)]   # share ids sent to / received from each rank
        sent_from = {}  # share id this rank sends -> where in its kept shares its copy is
        for j in range(W):
            src = next((r for r in [j] + holders_of(j, P, nodes, k) if good_copy(r, j) is not None), None)
            if src is None:
                raise ReplicaError(f"protect: rank {j}'s share of the parameters and optimizer state is lost: "
                                   f"neither rank {j} nor a holder of its replica ({holders_of(j, P, nodes, k)}) "
                                   "kept a copy")
            mine = good_copy(self.rank, j)
            if mine is not None:
                out[j * shard:(j + 1) * shard] = kept[mine]
            elif src != self.rank:
                frm[src].append(j)
            if src == self.rank:
                sent_from[j] = mine
                for q in range(W):
                    if q != src and good_copy(q, j) is None:
                        to[q].append(j)
        send = [kept[sent_from[j]] for q in range(W) for j in to[q]]
        inp = torch.cat(send) if send else torch.empty(0, dtype=torch.uint8)
        got = torch.empty(sum(len(f) for f in frm) * shard, dtype=torch.uint8)
        collectives.all_to_all(got, inp, [len(f) * shard for f in frm], [len(t) * shard for t in to], self.watch)
        pos = 0
        for q in range(W):
            for j in frm[q]:
                piece = got[pos:pos + shard]
                want, crc = crcs[q][good_copy(q, j)], checksum(piece.numpy())
                if crc != want:
                    raise ReplicaError(f"protect: rank {j}'s share of the parameters and optimizer state arrived "
                                       f"from rank {q} with CRC-32C {crc:#010x}, not the {want:#010x} rank {q} "
                                       "took before sending it")
                out[j * shard:(j + 1) * shard] = piece
                pos += shard
        return out

    def bind(self, rank: int, watch, pulled: bool = False, kept: list[bool] | None = None) -> None:
        """This process is now training rank ``rank``; ``watch``: what the gradient all-reduce waits under;
        ``pulled``: the state it restores next is a replica pulled from a holder (no shares of its own); ``kept``:
        else, which of the 1 + K shares in it are this rank's (a checkpoint's record: ``persist.save_shard``;
        default all)."""
        self.rank, self.watch = rank, watch
        self._have = [False] * (1 + self.k) if pulled else [bool(x) for x in (kept or [True] * (1 + self.k))]
        if len(self._have) != 1 + self.k:
            raise ReplicaError(f"protect: the snapshot to restore says {len(self._have)} shares were kept; this "
                               f"layout keeps {1 + self.k}")
        if self.sharded:
            from ..dataplane.fsdp import rebind

            if rebind(self.model, rank):   # uneven shards: this rank's have other shapes than the ones it had
                self.optimizer.state.clear()   # made again, with the new shapes, by the restore's dry step
                self._cache_sig, self._cache, self._pieces = None, None, None
        if self.k:
            P, nodes, k = self.ring
            self.held = held_by(rank, P, nodes, k)
        self._queued = False
        sampler = _distributed_sampler(self.dataloader) if self.dataloader is not None else None
        if sampler is not None:
            sampler.rank, sampler.num_replicas = rank, self.world_size

    def _forward_starts(self, module, args) -> None:
        self._queued = False   # a backward that failed half-way never ran its callback
        self._reduced = False

    def _grad_ready(self, param) -> None:
        if not self._queued and self.world_size > 1 and self.rank is not None:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average_gradients)

    def _average_gradients(self) -> None:
        """(end of backward) Sum every gradient over the ranks, pollably, and divide by the world size. First wait
        for this rank's replica of the step to be committed: the all-reduce completes nowhere before every rank's is,
        so no survivor can be more than one snapshot ahead of a lost rank's newest replica (module docstring)."""
        self._queued = False
        self.before_update()
        by_dtype: dict[torch.dtype, list] = {}
        for p in self.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        with torch.no_grad():
            for dtype, params in by_dtype.items():
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in params])
                collectives.all_reduce(flat, self.watch)
                flat.div_(self.world_size)
                off = 0
                for p in params:
                    n = p.numel()
                    g = flat[off:off + n].view_as(p)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
                    off += n
        self._reduced = True

    def _pre_step(self, optimizer, args, kwargs) -> None:
        if not self._restoring:
            self.before_update()   # the replica of the current state must be committed first
            # past this step's all-reduce every rank's replica of the step is committed (or there is one rank); one
            # all-reduce allows one early claim (an update with no backward of its own, e.g. a second opt.step(),
            # claims nothing)
            if self._reduced or self.world_size == 1:
                self._reduced = False
                self.claim_next()

    def param_digest(self) -> str:
        """sha256 over the model's parameters (``parameters()`` order, raw bytes). FSDP2: over every rank's
        digest of its shards, in rank order, once ``gather_digests`` ran (else this rank's shards only)."""
        if self._digest is not None:
            return self._digest
        h = hashlib.sha256()
        for p in self.inner.parameters():
            h.update(_local(p).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def gather_digests(self) -> None:
        """(FSDP2, every rank, at the end of the run) Make ``param_digest`` cover the whole model: all-gather every
        rank's digest of its shards, pollably. Raises PeerFailure."""
        self._digest = None
        mine = torch.frombuffer(bytearray(bytes.fromhex(self.param_digest())), dtype=torch.uint8)
        every = torch.empty(32 * self.world_size, dtype=torch.uint8)
        collectives.all_gather(every, mine, self.watch)
        self._digest = hashlib.sha256(every.numpy().tobytes()).hexdigest()


def _fit_copy(live: torch.Tensor, saved: torch.Tensor) -> None:
    """Copy a saved shard into the live one; a saved shard padded to the largest rank's shape (``_padded_shape``)
    gives its first ``live.shape[0]`` rows."""
    if live.dim() and saved.dim() and live.shape[0] < saved.shape[0]:
        saved = saved.narrow(0, 0, live.shape[0])
    live.copy_(saved)


def _distributed_sampler(loader):
    from torch.utils.data.distributed import DistributedSampler

    for s in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(s, DistributedSampler):
            return s
    return None


def _without_params(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _set_groups(optimizer, groups: list[dict]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"protect: the snapshot has {len(groups)} param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    for live, saved in zip(optimizer.param_groups, groups):
        for k, v in saved.items():
            if k != "params":
                live[k] = v
