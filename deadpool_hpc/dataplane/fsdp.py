"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on the generations' process groups, pollably.

Owns: the collectives FSDP2 issues, a promoted spare's rank in FSDP2's mesh information, FSDP2's reset after a
failure. Does not own: the mesh's process group (meshgroup.py), the state FSDP2 shards (worker/protect.py), the
generations' groups (groups.py).

- The mesh (``ctx.device_mesh``) is built over a ``MeshGroup`` (meshgroup.py): one group for the life of the run
  whose collectives run on the current generation's group, pollably; every DTensor collective of the user's loop
  (``clip_grad_norm_``, ``full_tensor()``) goes there.
- FSDP2's own all-gather and reduce-scatter are replaced (``FSDPModule.set_custom_all_gather`` /
  ``set_custom_reduce_scatter``, public since torch 2.8) by ``PollableAllGather`` / ``PollableReduceScatter``, which
  do the same (issued async on the generation's group, waited on against the failure flag and the collective
  timeout; the reduce-scatter an all-reduce of which this rank keeps its chunk) and tell ``ctx.protect`` when the
  step's gradients are reduced (its commit protocol, worker/protect.py).

A spare builds its model before it knows which rank it will replace: its mesh group says rank 0 until then.
Its shards have rank 0's shapes, the largest. At promotion ``rebind`` gives the mesh group, the mesh and FSDP2's
per-group mesh information the new rank (torch internals: ``DeviceMesh``'s ``_coordinate_on_dim`` and
``FSDPMeshInfo.shard_mesh_rank``) and, where the shards are uneven (a world size that does not divide a dimension 0),
points each parameter at the new rank's rows of its padded buffer (``_reshape_shard``). torch is pinned and the
tests cover these internals (tests/unit/dataplane/test_fsdp.py; the runs: tests/e2e/test_fsdp2.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .meshgroup import MeshGroup, meshes_of, set_mesh_rank


def fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def mesh_infos(model) -> list:
    """FSDP2's mesh information of every parameter group of ``model`` (torch internals)."""
    out = []
    for m in fsdp_modules(model):
        for pg in m._get_fsdp_state()._fsdp_param_groups:
            out.append(pg.mesh_info)
            if pg.post_forward_mesh_info is not None and pg.post_forward_mesh_info is not pg.mesh_info:
                out.append(pg.post_forward_mesh_info)
    return out


def rebind(model, rank: int) -> bool:
    """This process is training rank ``rank`` now (a promoted spare): the mesh's group, the mesh's coordinate and
    FSDP2's shard rank follow, and so does each parameter's shard where the shards are uneven (a dimension 0 that
    does not divide by the world size: torch.chunk's split, the last ranks' shards shorter or empty). Every rank's
    shard lives in a buffer padded to rank 0's size (FSDP2's ``_sharded_param_data``), so only the views change:
    the sharded parameter's local tensor and FSDP2's record of its size. Returns True if some shard changed shape
    (the optimizer's state, shaped like the shards, must then be made again)."""

    changed = False
    seen = [info.mesh for info in mesh_infos(model)] + [p.device_mesh for p in model.parameters()
                                                         if hasattr(p, "device_mesh")]
    meshes = {id(m): m for mesh in seen for m in meshes_of(mesh)}   # roots and their slices (meshgroup.py)
    for mesh in meshes.values():   # torch internals: DeviceMesh._dim_group_names, _pg_registry
        groups = [mesh._get_root_mesh()._pg_registry.get(name) for name in mesh._dim_group_names]
        if groups and all(isinstance(g, MeshGroup) for g in groups):
            for g in groups:
                g.rebind(rank)
            set_mesh_rank(mesh, rank)
    for info in mesh_infos(model):
        info.shard_mesh_rank = info.shard_process_group.rank()
        if getattr(info, "replicate_process_group", None) is not None:
            info.replicate_mesh_rank = info.replicate_process_group.rank()
    for fp in fsdp_params(model):
        changed |= _reshape_shard(fp, fp.mesh_info.shard_mesh_rank)
    return changed


def fsdp_params(model) -> list:
    """FSDP2's per-parameter records (``FSDPParam``) of every parameter group of ``model`` (torch internals)."""
    return [fp for m in fsdp_modules(model) for group in m._get_fsdp_state()._fsdp_param_groups
            for fp in group.fsdp_params]


def _reshape_shard(fp, rank: int) -> bool:
    """Point ``fp``'s sharded parameter at shard rank ``rank``'s rows of its padded buffer (dim-0 sharding, as FSDP2's
    ``_init_sharded_param`` does). Torch internals: ``padded_sharded_param_size``, ``_sharded_param_data``,
    ``sharded_size``, ``contiguous_sharded_stride``, ``DTensor._local_tensor``; tests/unit/dataplane/test_fsdp.py pins
    them."""
    padded = fp.padded_sharded_param_size
    if fp.fsdp_placement.dim != 0 or not len(padded):
        return False   # FSDP2 shards other dimensions only evenly
    rows = max(0, min(padded[0], fp._orig_size[0] - rank * padded[0]))
    size = torch.Size((rows, *padded[1:]))
    if size == fp.sharded_size:
        return False
    fp.sharded_size = size
    fp.contiguous_sharded_stride = torch.empty(size, device="meta").stride()
    fp.sharded_param._local_tensor = fp._sharded_param_data.view(padded).narrow(0, 0, rows)
    fp.sharded_param.grad = None
    return True


def reset_after_failure(model) -> None:
    """Put FSDP2's per-iteration state back to the start of a step after a failure interrupted a forward or a
    backward: ``FSDPModule.reset_iter_state()`` on the root (torch >= 2.13: waits on nothing of ours, reshards every
    group, clears the iteration's trackers), then drop the gradients the interrupted backward left on the unsharded
    parameters (torch internals). Without it a survivor whose backward was cut short kept its parameters unsharded
    and trained on alone, without a collective (seen on the Slurm cluster)."""
    if not model._get_fsdp_state()._is_root:
        return   # it never ran a forward (a spare's model): nothing to reset
    model.reset_iter_state()
    for fp in fsdp_params(model):
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None
        fp.unsharded_accumulated_grad = None


class _Comm:
    def __init__(self, owner):
        self.owner = owner   # ctx.protect's state: .on_reduced() (the mesh group waits under its own watch)

    def allocate(self, size, *, dtype, device) -> torch.Tensor:  # FSDP2's Comm.allocate
        return torch.empty(size, dtype=dtype, device=device)


class PollableAllGather(_Comm):
    """FSDP2's all-gather (``set_custom_all_gather``) over ``group`` (the mesh's shard group, a MeshGroup: on the
    current generation's group, waited on pollably). Raises PeerFailure. Returns None: the collective is done when
    it returns."""

    def __call__(self, output_tensor, input_tensor, group=None, async_op=False):
        # FSDP2's input is a view of the output at this rank's place: gather from a copy
        _mesh_group(group).all_gather_single(output_tensor, input_tensor.clone())
        return None


class PollableReduceScatter(_Comm):
    """FSDP2's reduce-scatter (``set_custom_reduce_scatter``) over ``group`` (a MeshGroup): an all-reduce of the
    whole input, pollable, of which this rank keeps its chunk (meshgroup.py). Raises PeerFailure."""

    def __call__(self, output_tensor, input_tensor, group=None, op=dist.ReduceOp.SUM, async_op=False):
        if op != dist.ReduceOp.AVG and op != dist.ReduceOp.SUM:
            raise NotImplementedError(f"FSDP2 asked for a reduce-scatter with {op}; supported: SUM, AVG (no "
                                      "gradient_divide_factor, no fp16 reduce_dtype)")
        # FSDP2's input is its own padded gradient buffer, dropped after: reduced in place, as before the mesh group
        _mesh_group(group).reduce_scatter_in_place(output_tensor, input_tensor, op)
        self.owner.on_reduced()
        return None


def _mesh_group(group) -> MeshGroup:
    if not isinstance(group, MeshGroup):
        raise RuntimeError(f"FSDP2 issued a collective on a {type(group).__name__}, not on a mesh of ctx.device_mesh "
                           "or ctx.init_device_mesh (ctx.protect checks this before the first step)")
    return group
