"""The process group behind ``ctx.device_mesh``: one group for the life of the run, whose collectives run on the
current generation's group, pollably.

Owns: ``MeshGroup`` and the ``DeviceMesh`` built over it. Does not own: the generations' groups (groups.py), the
FSDP2 specifics (fsdp.py).

FSDP2, DTensor and tensor parallelism keep the process group of the mesh they were given for the life of the model,
and every DTensor collective (``clip_grad_norm_``'s norm, ``full_tensor()``, a redistribute, TP's all-reduce) goes to
it: Python callers through ``torch.distributed.all_reduce(group=...)`` and the like, DTensor's functional collectives
from C++ by the group's name (``torch.ops._c10d_functional.*``), which reach a Python subclass of
``torch.distributed.ProcessGroup`` through its virtual methods. Here every generation builds a new default group
(a hot swap), and no wait of the training thread may block without watching the failure flag. So the mesh's
group is a ``MeshGroup``: a ``ProcessGroup`` subclass (the design of torchft's ``ProcessGroupWrapper``, a group
whose backend is swapped at each generation) that

- knows this process's training rank (``rank()``, which follows a promotion: ``rebind``) and the world size;
- forwards each collective to the current generation's group, issued with ``async_op`` and waited on with
  ``collectives.wait`` against the failure flag and the collective timeout (a lost peer raises ``PeerFailure`` out of
  the DTensor operation, e.g. out of ``clip_grad_norm_``; pybind11 keeps the exception's type across the C++ frames),
  and returns the completed ``Work``;
- does gloo's reduce-scatter as an all-reduce of the whole input of which this rank keeps its chunk (gloo's
  reduce-scatter work never reports ``is_completed`` before ``wait``, so it cannot be polled; docs/architecture.md):
  the same sums on every rank, in an order that depends only on the world size, so a recovered run stays bitwise
  equal to a failure-free one (twice the bytes of a reduce-scatter);
- refuses, naming the call, what it cannot poll: point-to-point ``send``/``recv``.

Overridable from C++ (torch 2.13, ``torch/csrc/distributed/c10d/PyProcessGroup.hpp``): allreduce,
allreduce_coalesced, allgather, allgather_into_tensor_coalesced, reduce_scatter, reduce_scatter_tensor_coalesced,
alltoall_base, broadcast, barrier; from Python (``distributed_c10d``) also all_gather_single, reduce_scatter_single,
all_to_all_single, scatter, gather, reduce. A test pins the list (tests/unit/dataplane/test_meshgroup.py).

Before ``ctx.run`` joins the run's first generation there is no group of the world size: a collective over the mesh
then raises ``RuntimeError`` saying so.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from . import collectives

MESH_GROUP_NAME = "deadpool_mesh"


def _default_group():
    return c10d._get_default_group() if dist.is_initialized() else None


def check_mesh_shape(mesh_shape, mesh_dim_names, world_size: int) -> tuple[int, ...]:
    """``mesh_shape`` as a tuple of ints, checked: positive sizes whose product is ``world_size``, and for more than
    one dimension as many distinct ``mesh_dim_names``. Raises ValueError naming the bad value."""
    try:
        shape = tuple(int(n) for n in mesh_shape)
    except (TypeError, ValueError):
        shape = ()
    if not shape or min(shape) < 1 or math.prod(shape) != world_size:
        raise ValueError(f"ctx.init_device_mesh(mesh_shape={mesh_shape!r}): the mesh must hold every training rank "
                         f"once; accepted: positive sizes whose product is the world size {world_size}")
    if len(shape) > 1 and (mesh_dim_names is None or len(mesh_dim_names) != len(shape)
                           or len(set(mesh_dim_names)) != len(shape)):
        raise ValueError(f"ctx.init_device_mesh(mesh_dim_names={mesh_dim_names!r}): accepted: {len(shape)} distinct "
                         "names, one per dimension of the mesh")
    return shape


def mesh_lines(layout: torch.Tensor, dim: int) -> list[tuple[int, ...]]:
    """The lines of ``layout`` (a mesh's global ranks, shape = the mesh's shape) along dimension ``dim``: the ranks
    of each of that dimension's groups, in a fixed order."""
    return [tuple(r.tolist()) for r in layout.movedim(dim, -1).reshape(-1, layout.shape[dim])]


class MeshGroup(dist.ProcessGroup):
    """The group of dimension ``dim`` of a mesh whose global ranks are ``layout`` (default: a 1-D mesh of ``size``
    ranks) for the process of global training rank ``rank``, for the life of the run; each collective runs on
    ``current(ranks)`` (default: the generation's default group; it must have ``size`` ranks), ``ranks`` being this
    process's line of the mesh along ``dim``, and is waited on under ``watch`` (collectives.Watch). Raises PeerFailure
    (a peer lost, the collective failed or timed out) and RuntimeError (no generation's group of ``size`` ranks
    exists yet; an unsupported call)."""

    def __init__(self, rank: int, size: int, watch, name: str = MESH_GROUP_NAME, current=None,
                 layout: torch.Tensor | None = None, dim: int = 0):
        self.layout = layout if layout is not None else torch.arange(size)
        self.dim = dim
        self._size, self._name = size, name
        if self.layout.shape[dim] != size:
            raise ValueError(f"MeshGroup: dimension {dim} of the mesh {list(self.layout.shape)} has "
                             f"{self.layout.shape[dim]} ranks, not {size}")
        self.rebind(rank)
        super().__init__(self._rank, size)
        self.watch = watch
        self._current = current if current is not None else (lambda ranks: _default_group())

    def rebind(self, rank: int) -> None:
        """This process is global training rank ``rank`` now (a promoted spare): its coordinate along the group's
        dimension and its line of the mesh follow. Raises ValueError if ``rank`` is not in the mesh."""
        coords = (self.layout == rank).nonzero()
        if coords.size(0) != 1:
            raise ValueError(f"rank {rank} is not in the mesh {self.layout.tolist()}")
        self.global_rank = rank
        self._rank = int(coords[0, self.dim])
        self.ranks = next(line for line in mesh_lines(self.layout, self.dim) if rank in line)
        ranks = c10d._world.pg_group_ranks
        if self in ranks:   # registered already: torch's global -> group rank map follows (dist.get_rank(group))
            ranks[self] = {g: i for i, g in enumerate(self.ranks)}

    # ---- identity ------------------------------------------------------------------------------------------------
    def rank(self) -> int:  # noqa: D102 - ProcessGroup's
        return self._rank

    def size(self) -> int:  # noqa: D102
        return self._size

    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:  # noqa: N802 - ProcessGroup's name
        return "deadpool"

    def register(self) -> None:
        """Enter this group in torch's registry (DeviceMesh and the functional collectives look groups up there, the
        latter by name). Called again after each generation's join, which clears the registry (groups.py)."""
        w = c10d._world
        w.pg_map[self] = ("deadpool", None)
        w.pg_names[self] = self._name
        w.pg_group_ranks[self] = {g: i for i, g in enumerate(self.ranks)}
        w.pg_backend_config[self] = "deadpool"
        try:
            c10d._unregister_process_group(self._name)   # an earlier registration (another mesh, a test)
        except (RuntimeError, KeyError):
            pass
        c10d._register_process_group(self._name, self)

    # ---- forwarding ----------------------------------------------------------------------------------------------
    def _target(self, call: str):
        pg = self._current(self.ranks)
        if pg is None or pg.size() != self._size:
            have = "none" if pg is None else f"{pg.size()} rank(s)"
            raise RuntimeError(f"{call} over ctx.device_mesh ({self._size} ranks) outside ctx.run: this process has "
                               f"no training generation's group yet (it has {have}); accepted: collectives over the "
                               "mesh inside the step function ctx.run calls; a model built before ctx.run must not "
                               "communicate (e.g. parallelize_module(..., src_data_rank=None): every rank builds the "
                               "same model from the same seed and keeps its piece; docs/your-loop.md)")
        return pg

    def _done(self, work):
        collectives.wait(work, self.watch)
        return work

    def allreduce(self, tensors, opts=None):  # noqa: D102 - ProcessGroup's
        opts = opts if opts is not None else dist.AllreduceOptions()
        pg = self._target("all_reduce")
        if opts.reduceOp == dist.ReduceOp.AVG:   # gloo has no AVG: sum, then divide
            sum_opts = dist.AllreduceOptions()
            sum_opts.reduceOp = dist.ReduceOp.SUM
            work = self._done(pg.allreduce(tensors, sum_opts))
            for t in tensors:
                t.div_(self._size)
            return work
        return self._done(pg.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors, opts=None):  # noqa: D102
        work = None
        for t in tensors:
            o = dist.AllreduceOptions()
            if opts is not None:
                o.reduceOp = opts.reduceOp
            work = self.allreduce([t], o)
        return work if work is not None else self._empty()

    def allgather(self, output_tensors, input_tensors, opts=None):  # noqa: D102
        return self._done(self._target("all_gather").allgather(output_tensors, input_tensors,
                                                               opts if opts is not None else c10d.AllgatherOptions()))

    def all_gather_single(self, output, input, opts=None):  # noqa: D102, A002 - torch's names
        pg = self._target("all_gather_into_tensor")
        return self._done(pg.all_gather_single(output, input, opts if opts is not None else c10d.AllgatherOptions()))

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):  # noqa: D102
        work = None
        for out, inp in zip(outputs, inputs):
            work = self.all_gather_single(out, inp)
        return work if work is not None else self._empty()

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: D102, A002
        """An all-reduce of a copy of ``input`` (``size`` chunks along dim 0, flat), of which this rank keeps chunk
        ``rank`` (module docstring); ``input`` is left as it was."""
        return self.reduce_scatter_in_place(output, input.clone(), opts.reduceOp if opts is not None else
                                            dist.ReduceOp.SUM)

    def reduce_scatter_in_place(self, output, input, op=dist.ReduceOp.SUM):  # noqa: A002
        """``reduce_scatter_single`` that all-reduces ``input`` itself (a buffer its caller drops after, as FSDP2's
        reduce-scatter input): no copy of it."""
        o = dist.AllreduceOptions()
        o.reduceOp = op
        work = self.allreduce([input], o)
        n = output.numel()
        output.copy_(input.reshape(-1)[self._rank * n:(self._rank + 1) * n].view_as(output))
        return work

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):  # noqa: D102
        work = None
        for out, inp in zip(outputs, inputs):
            work = self.reduce_scatter_single(out, inp, opts)
        return work if work is not None else self._empty()

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def reduce_scatter(self, output_tensors, input_lists, opts=None):  # noqa: D102
        work = None
        for out, chunks in zip(output_tensors, input_lists):
            work = self.reduce_scatter_single(out, torch.cat([c.reshape(-1) for c in chunks]), opts)
        return work if work is not None else self._empty()

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: D102, A002
        pg = self._target("all_to_all_single")
        return self._done(pg.alltoall_base(output, input, list(output_split_sizes), list(input_split_sizes),
                                           opts if opts is not None else dist.AllToAllOptions()))

    all_to_all_single = alltoall_base

    def broadcast(self, tensors, opts=None):  # noqa: D102
        return self._done(self._target("broadcast").broadcast(tensors,
                                                              opts if opts is not None else dist.BroadcastOptions()))

    def barrier(self, opts=None):  # noqa: D102
        return self._done(self._target("barrier").barrier(opts if opts is not None else dist.BarrierOptions()))

    def scatter(self, output_tensors, input_tensors, opts=None):  # noqa: D102 - e.g. distribute_tensor's
        return self._done(self._target("scatter").scatter(output_tensors, input_tensors,
                                                          opts if opts is not None else dist.ScatterOptions()))

    def gather(self, output_tensors, input_tensors, opts=None):  # noqa: D102
        return self._done(self._target("gather").gather(output_tensors, input_tensors,
                                                        opts if opts is not None else dist.GatherOptions()))

    def reduce(self, tensors, opts=None):  # noqa: D102
        return self._done(self._target("reduce").reduce(tensors, opts if opts is not None else dist.ReduceOptions()))

    def send(self, tensors, dst, tag=0):  # noqa: D102
        raise RuntimeError(f"send to rank {dst} over ctx.device_mesh: point-to-point operations cannot be polled "
                           "against the failure flag on gloo; accepted: collectives (all_reduce, all_gather, "
                           "reduce_scatter, all_to_all, broadcast, barrier)")

    def recv(self, tensors, src, tag=0):  # noqa: D102
        raise RuntimeError(f"recv from rank {src} over ctx.device_mesh: point-to-point operations cannot be polled "
                           "against the failure flag on gloo; accepted: collectives (all_reduce, all_gather, "
                           "reduce_scatter, all_to_all, broadcast, barrier)")

    def _empty(self):
        return self._done(self._target("a coalesced collective").barrier(dist.BarrierOptions()))


def device_mesh(group: MeshGroup | list[MeshGroup], device_type: str = "cpu", mesh_dim_names=None):
    """A DeviceMesh of ``device_type`` ("cpu", "cuda") over ``group`` (1-D: every training rank) or over one
    MeshGroup per dimension (N-D, ``mesh_dim_names`` required), whose coordinate is this process's training rank's,
    and so are its slices' (``mesh["tp"]``): torch computes a mesh's coordinate from the default group's rank, which
    before the first generation is a placeholder's (``RankedMesh``). Raises ValueError from DeviceMesh for a bad
    layout."""
    groups = group if isinstance(group, list) else [group]
    for g in groups:
        g.register()
    if isinstance(group, list):
        mesh = DeviceMesh.from_group(groups, device_type, mesh=groups[0].layout, mesh_dim_names=mesh_dim_names)
    else:
        mesh = DeviceMesh.from_group(group, device_type)
    mesh.__class__ = RankedMesh
    set_mesh_rank(mesh, groups[0].global_rank)
    return mesh


def set_mesh_rank(mesh, rank: int) -> None:
    """Make ``mesh`` (a DeviceMesh over MeshGroups, or a slice of one) see this process as global rank ``rank``: its
    rank and its coordinate in the slice holding ``rank`` (torch internals ``DeviceMesh._rank``,
    ``_coordinate_on_dim``, ``_layout.remap_to_tensor(_rank_map)``; tests/e2e/test_fsdp2.py and
    tests/unit/dataplane/test_meshgroup.py pin them)."""
    full = mesh._layout.remap_to_tensor(mesh._rank_map)   # (slices, *mesh shape): every slice's global ranks
    coords = (full == rank).nonzero()
    mesh._rank = rank
    mesh._coordinate_on_dim = tuple(coords[0, 1:].tolist()) if coords.size(0) else None


def meshes_of(mesh) -> list:
    """``mesh``'s root and every slice taken of it through ``RankedMesh`` (``mesh["tp"]``)."""
    root = mesh._get_root_mesh()
    return [root] + list(root.__dict__.get("_deadpool_slices", {}).values())


class RankedMesh(DeviceMesh):
    """The DeviceMesh of the meshes built here: a slice of one (``mesh["tp"]``, ``mesh["dp"]``) gets this process's
    training rank and coordinate, not the placeholder default group's, and is kept on its root, one per set of
    dimension names (slicing again, e.g. in every step, returns it), so a promotion can rebind it (``meshes_of``).
    torch internal: ``DeviceMesh._create_sub_mesh``, pinned by tests/unit/dataplane/test_meshgroup.py."""

    def _create_sub_mesh(self, layout, submesh_dim_names):
        slices = self._get_root_mesh().__dict__.setdefault("_deadpool_slices", {})
        key = tuple(submesh_dim_names)
        if key not in slices:
            sub = super()._create_sub_mesh(layout, submesh_dim_names)
            sub.__class__ = RankedMesh
            set_mesh_rank(sub, self._rank)
            slices[key] = sub
        return slices[key]
