"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on the generations' process groups, pollably.

Owns: the ``DeviceMesh`` a training function passes to ``fully_shard`` (``ctx.device_mesh``) and the collectives
FSDP2 issues. Does not own: the state FSDP2 shards (worker/protect.py), the generations' groups (groups.py).

FSDP2 keeps the process group of the mesh it was given at ``fully_shard`` time for the life of the model, and
waits for its all-gathers and reduce-scatters inside its own hooks. Here every generation builds a new default
group, and no wait of the training thread may block without watching the failure flag. So:

- the mesh is built over a *stand-in* group (``StandInGroup``): a ``torch.distributed.ProcessGroup`` that knows
  this process's training rank and the world size and carries no traffic. It stays valid across generations
  (a survivor keeps its rank; a promoted spare gets its rank at promotion, ``rebind``);
- FSDP2's all-gather and reduce-scatter are replaced (``FSDPModule.set_custom_all_gather`` /
  ``set_custom_reduce_scatter``, public since torch 2.8) by ``PollableAllGather`` / ``PollableReduceScatter``,
  which run on the current generation's default group through ``collectives`` (issued async, waited on against
  the failure flag and the collective timeout). gloo's reduce-scatter work never reports ``is_completed`` before
  ``wait`` (docs/architecture.md), so the reduce-scatter is an all-reduce of the padded gradient of which this
  rank keeps its chunk: the same sums on every rank, in an order that depends only on the world size, so a
  recovered run stays bitwise equal to a failure-free one.

A spare builds its model before it knows which rank it will replace: its stand-in group says rank 0 until then.
Its shards have rank 0's shapes, which are every rank's when each sharded dimension divides by the world size
(``uneven_shards``; worker/protect.py refuses a model where it does not). At promotion ``rebind`` gives the
stand-in group, the mesh and FSDP2's per-group mesh information the new rank (torch internals: ``DeviceMesh``'s
``_coordinate_on_dim`` and ``FSDPMeshInfo.shard_mesh_rank``; torch is pinned and the end-to-end tests cover them).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import collectives

STAND_IN_NAME = "deadpool_stand_in"


class StandInGroup(dist.ProcessGroup):
    """A process group of ``size`` ranks in which this process is ``rank``, that carries no traffic: the group
    of ``ctx.device_mesh``. ``rank()`` follows ``rebind``."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size

    def rank(self) -> int:  # noqa: D102 - ProcessGroup's
        return self._rank

    def size(self) -> int:  # noqa: D102
        return self._size

    @property
    def group_name(self) -> str:
        return STAND_IN_NAME

    def getBackendName(self) -> str:  # noqa: N802 - ProcessGroup's name
        return "deadpool"

    def register(self) -> None:
        """Enter this group in torch's registry (DeviceMesh looks groups up there). Called again after each
        generation's join, which clears the registry (groups.py)."""
        w = c10d._world
        w.pg_map[self] = ("deadpool", None)
        w.pg_names[self] = STAND_IN_NAME
        w.pg_group_ranks[self] = {i: i for i in range(self._size)}
        w.pg_backend_config[self] = "deadpool"
        try:
            c10d._unregister_process_group(STAND_IN_NAME)   # an earlier registration (another mesh, a test)
        except (RuntimeError, KeyError):
            pass
        c10d._register_process_group(STAND_IN_NAME, self)


def device_mesh(group: StandInGroup, device_type: str = "cpu"):
    """A 1-D DeviceMesh of ``device_type`` ("cpu", "cuda") over ``group`` (every training rank)."""
    from torch.distributed.device_mesh import DeviceMesh

    group.register()
    return DeviceMesh.from_group(group, device_type)


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


def uneven_shards(model, world_size: int) -> list[str]:
    """Parameters of ``model`` whose dimension 0 does not divide by ``world_size`` ("name [shape]")."""
    out = []
    for name, p in model.named_parameters():
        shape = tuple(p.shape)   # a DTensor's global shape
        if shape and shape[0] % world_size:
            out.append(f"{name} {list(shape)}")
    return out


def rebind(model, rank: int) -> None:
    """This process is training rank ``rank`` now (a promoted spare): the stand-in group, the mesh's coordinate and
    FSDP2's shard rank follow. Shapes do not change (even shards, ``uneven_shards``)."""
    for info in mesh_infos(model):
        group = info.shard_process_group
        if isinstance(group, StandInGroup):
            group._rank = rank
        info.mesh._rank = rank
        info.mesh._coordinate_on_dim = (rank,)
        info.shard_mesh_rank = rank


def reset_after_failure(model) -> None:
    """Put FSDP2's per-iteration state back to the start of a step after a failure interrupted a forward or a
    backward: ``FSDPModule.reset_iter_state()`` on the root (torch >= 2.13: waits on nothing of ours, reshards every
    group, clears the iteration's trackers), then drop the gradients the interrupted backward left on the unsharded
    parameters (torch internals). Without it a survivor whose backward was cut short kept its parameters unsharded
    and trained on alone, without a collective (seen on the Slurm cluster)."""
    if not model._get_fsdp_state()._is_root:
        return   # it never ran a forward (a spare's model): nothing to reset
    model.reset_iter_state()
    for m in fsdp_modules(model):
        for group in m._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
                fp.unsharded_accumulated_grad = None


class _Comm:
    def __init__(self, owner):
        self.owner = owner   # has .watch (collectives.Watch) and .on_reduced()

    def allocate(self, size, *, dtype, device) -> torch.Tensor:  # FSDP2's Comm.allocate
        return torch.empty(size, dtype=dtype, device=device)


class PollableAllGather(_Comm):
    """FSDP2's all-gather (``set_custom_all_gather``), on the current generation's group, waited on pollably.
    Raises PeerFailure (collectives.wait). Returns None: the collective is done when it returns."""

    def __call__(self, output_tensor, input_tensor, group=None, async_op=False):
        # FSDP2's input is a view of the output at this rank's place: gather from a copy
        collectives.all_gather(output_tensor, input_tensor.clone(), self.owner.watch)
        return None


class PollableReduceScatter(_Comm):
    """FSDP2's reduce-scatter (``set_custom_reduce_scatter``): an all-reduce of the whole input, pollable, of which
    this rank keeps its chunk (module docstring). Raises PeerFailure."""

    def __call__(self, output_tensor, input_tensor, group=None, op=dist.ReduceOp.SUM, async_op=False):
        # FSDP2 asks for an average of fp32/bf16 gradients; gloo sums, so the sum is divided here
        avg = op == dist.ReduceOp.AVG
        if not avg and op != dist.ReduceOp.SUM:
            raise NotImplementedError(f"FSDP2 asked for a reduce-scatter with {op}; supported: SUM, AVG (no "
                                      "gradient_divide_factor, no fp16 reduce_dtype)")
        collectives.all_reduce(input_tensor, self.owner.watch)
        if avg:
            input_tensor.div_(dist.get_world_size())
        n = output_tensor.numel()
        r = dist.get_rank()
        output_tensor.copy_(input_tensor[r * n:(r + 1) * n])
        self.owner.on_reduced()
        return None
