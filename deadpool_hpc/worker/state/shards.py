"""The state sharded by FSDP2 (1-D FSDP, HSDP, tensor parallel x FSDP): every tensor is this rank's shard.

Owns: the checks of an FSDP2 model (``check_fsdp2``: the mesh groups of ctx.device_mesh / ctx.init_device_mesh), and
``ShardedState``: HSDP's replicate groups, the layout state (a dry step of the real optimizer, undone; shard shapes
padded to the largest rank's, ``_padded_shape``, so the layout is the same on every rank), FSDP2's pollable
collectives, a rebind to another rank, loading saved shards in place (a padded saved shard gives its first rows,
``_fit_copy``) and the digest over every rank's shards. Does not own: the mesh's groups (dataplane/meshgroup.py),
FSDP2's internals (dataplane/fsdp.py), the commit wait before the forward (worker/protect.py's hooks).
"""
from __future__ import annotations

import hashlib
import math

import torch

from ...dataplane import collectives
from ...errors import ReplicaError
from .document import set_param_groups
from .optim import dry_step


def is_fsdp1(model) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def is_fsdp2(model) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def local_shard(t):
    """A DTensor's local shard (FSDP2's parameters and their optimizer state), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and isinstance(t, torch.Tensor) else t


def local_shards(obj, padded: dict | None = None):
    """``obj`` (nested dicts/lists of a state dict) with every DTensor replaced by its local shard; ``padded``: filled
    with id(local shard) -> the shard's padded shape (``_padded_shape``)."""
    if isinstance(obj, torch.Tensor):
        t = local_shard(obj)
        if padded is not None and t is not obj:
            padded[id(t)] = _padded_shape(obj)
        return t
    if isinstance(obj, dict):
        return {k: local_shards(v, padded) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_shards(v, padded) for v in obj]
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


def pad_pieces(t: torch.Tensor, shape: tuple, zeros) -> list[torch.Tensor]:
    """``t`` (a shard shorter than ``shape`` along dim 0) as 1-D uint8 pieces filling ``shape``'s bytes: its own
    bytes, then ``zeros(n)`` (a view of n zero bytes)."""
    own = t.detach().contiguous().reshape(-1).view(torch.uint8)
    rest = math.prod(shape) * t.element_size() - own.numel()
    return [own, zeros(rest)] if rest else [own]


def _fit_copy(live: torch.Tensor, saved: torch.Tensor) -> None:
    """Copy a saved shard into the live one; a saved shard padded to the largest rank's shape (``_padded_shape``)
    gives its first ``live.shape[0]`` rows."""
    if live.dim() and saved.dim() and live.shape[0] < saved.shape[0]:
        saved = saved.narrow(0, 0, live.shape[0])
    live.copy_(saved)


def replicate_group(model):
    """HSDP's replicate group (a MeshGroup of more than one rank) if every FSDP2 module of ``model`` has the same
    one, else None (1-D FSDP, or tensor parallel x FSDP: nothing is held twice)."""
    from ...dataplane.fsdp import mesh_infos
    from ...dataplane.meshgroup import MeshGroup

    groups = [getattr(info, "replicate_process_group", None) for info in mesh_infos(model)]
    first = groups[0] if groups else None
    if not isinstance(first, MeshGroup) or first.size() < 2:
        return None
    same = all(isinstance(g, MeshGroup) and g.dim == first.dim and torch.equal(g.layout, first.layout)
               for g in groups)
    return first if same else None


def check_fsdp2(model) -> None:
    """An FSDP2 model ctx.protect can keep: ``fully_shard`` on the root module, every group one of ctx.device_mesh's
    or ctx.init_device_mesh's. Raises ValueError naming what is not accepted."""
    from torch.distributed.fsdp import FSDPModule

    from ...dataplane.fsdp import mesh_infos
    from ...dataplane.meshgroup import MeshGroup

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


class ShardedState:
    """FSDP2's sharded state: ``model`` (an FSDP2 root module, ``check_fsdp2``; ``module``: the same module) and its
    ``optimizer`` (a torch.optim one), over ``world_size`` ranks, ``ranks_per_node`` of them on a node. Raises
    ValueError for an HSDP replicate group whose ranks all live on one node. ``column``: HSDP's replicate group
    (a MeshGroup), else None."""

    def __init__(self, model, module, optimizer, world_size: int, ranks_per_node: int = 1):
        self._model, self._module, self._optimizer = model, module, optimizer
        self._world_size = world_size
        self._watch = None
        # HSDP: the shards are the same on every rank of a replicate group (a *column* of the mesh), so they are kept
        # in the rank's own snapshot and never sent, like DDP's shares, whole: one kept region (state/shares.py)
        self.column = replicate_group(model)
        if self.column is not None:
            self._check_columns_span_nodes(ranks_per_node)

    def columns(self) -> list[tuple[int, ...]] | None:
        """HSDP: the replicate groups' ranks (a column of the mesh each: the same shards), in a fixed order; else
        None."""
        from ...dataplane.meshgroup import mesh_lines

        return None if self.column is None else mesh_lines(self.column.layout, self.column.dim)

    def _check_columns_span_nodes(self, P: int) -> None:
        """HSDP keeps the shards only in the snapshots of their replicate group's ranks: a group whose ranks all
        live on one node would lose them with that node. Raises ValueError naming the group."""
        for line in self.columns():
            if len({r // P for r in line}) < 2:
                raise ValueError(f"protect(model=...): the replicate group of ranks {list(line)} lives on one node "
                                 f"(node {line[0] // P}, {P} ranks per node), so losing that node would lose its "
                                 "shards, which HSDP keeps only in its ranks' own snapshots; accepted: a mesh whose "
                                 "replicate dimension spans nodes, e.g. ctx.init_device_mesh((nodes, ranks per "
                                 "node), (\"replicate\", \"shard\"))")

    def dry_run_state(self) -> tuple[dict, dict, object, dict]:
        """What the payload layout is made of (layout.py ``SnapshotLayout``): (model state dict, optimizer state
        dict, ``unique(path)``, ``padded``), local shards. A sharded module cannot be deep-copied with its process
        group, so the dry step runs on the real optimizer, whose state is then emptied again (its first real step is
        bitwise a plain run's). Every tensor is this rank's shard: all per rank (HSDP: the replicate group's,
        buffers per rank)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        had_state = bool(self._optimizer.state)
        if not had_state:
            dry_step(self._optimizer)
        padded: dict = {}
        model_sd = local_shards(get_model_state_dict(self._model), padded)
        optim_sd = local_shards(get_optimizer_state_dict(self._model, self._optimizer), padded)
        if not had_state:
            self._optimizer.state.clear()
        if self.column is None:   # every tensor is this rank's alone: replicated whole
            unique = lambda path: True  # noqa: E731
        else:   # HSDP: the shards are the replicate group's (kept, never sent); buffers are per rank
            buffers = {f"/model/{n}" for n, _ in self._module.named_buffers()}
            unique = lambda path: path in buffers  # noqa: E731
        return model_sd, optim_sd, unique, padded

    def install_comms(self, owner) -> None:
        """FSDP2's all-gathers and reduce-scatters, pollable, on the generation's group (dataplane/fsdp.py);
        ``owner.on_reduced()`` is called after each gradient reduce-scatter."""
        from ...dataplane.fsdp import PollableAllGather, PollableReduceScatter, fsdp_modules

        for m in fsdp_modules(self._model):
            m.set_custom_all_gather(PollableAllGather(owner))
            m.set_custom_reduce_scatter(PollableReduceScatter(owner))

    def bind(self, rank: int, watch) -> bool:
        """This process is now rank ``rank``; ``watch``: what ``gather_digest`` waits under. Returns True when this
        rank's shards have other shapes than the ones it had (uneven shards): the optimizer's state is then dropped,
        made again with the new shapes by the restore's dry step (``load``)."""
        from ...dataplane.fsdp import rebind

        self._watch = watch
        if rebind(self._model, rank):
            self._optimizer.state.clear()
            return True
        return False

    def load(self, tree: dict) -> None:
        """Put FSDP2 back to the start of a step (a failure may have cut a forward or backward short), then copy the
        saved shards of ``tree`` (layout.py ``SnapshotLayout.decode``'s) into the live ones, in place: DCP's
        set_*_state_dict would treat the local tensors as whole ones and redistribute them over the mesh, whose group
        carries no traffic (dataplane/fsdp.py). A spare's optimizer gets its state from a dry step first. Raises
        ReplicaError naming a model tensor the model does not have."""
        from ...dataplane.fsdp import reset_after_failure

        reset_after_failure(self._model)
        osd = tree["optim"]
        with torch.no_grad():
            live = self._model.state_dict()
            for name, saved in tree["model"].items():
                if name not in live:
                    raise ReplicaError(f"protect: the snapshot has a model tensor {name} the model does not have")
                _fit_copy(local_shard(live[name]), saved)
            if tree["optim_empty"]:
                self._optimizer.state.clear()
            else:
                if not self._optimizer.state:
                    dry_step(self._optimizer)
                by_name = dict(self._model.named_parameters())
                for fqn, saved in osd["state"].items():
                    st = self._optimizer.state[by_name[fqn]]
                    for k, v in saved.items():
                        if isinstance(v, torch.Tensor) and isinstance(st.get(k), torch.Tensor):
                            _fit_copy(local_shard(st[k]), v)
                        else:
                            st[k] = v
        set_param_groups(self._optimizer, osd["param_groups"])

    def gather_digest(self, mine: str) -> str:
        """(every rank, at the end of the run) sha256 (hex) over every rank's ``mine`` (the sha256 of its shards,
        hex), in rank order: all-gathered pollably. Raises PeerFailure."""
        own = torch.frombuffer(bytearray(bytes.fromhex(mine)), dtype=torch.uint8)
        every = torch.empty(32 * self._world_size, dtype=torch.uint8)
        collectives.all_gather(every, own, self._watch)
        return hashlib.sha256(every.numpy().tobytes()).hexdigest()
