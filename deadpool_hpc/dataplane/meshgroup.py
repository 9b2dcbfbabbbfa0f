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
all_to_all_single. A test pins the list (tests/test_meshgroup.py).

Before ``ctx.run`` joins the run's first generation there is no group of the world size: a collective over the mesh
then raises ``RuntimeError`` saying so.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import collectives

MESH_GROUP_NAME = "deadpool_mesh"


def _default_group():
    return c10d._get_default_group() if dist.is_initialized() else None


class MeshGroup(dist.ProcessGroup):
    """A process group of ``size`` ranks in which this process is ``rank``, for the life of the run; each collective
    runs on ``current()`` (default: the generation's default group; it must have ``size`` ranks) and is waited on
    under ``watch`` (collectives.Watch). Raises PeerFailure (a peer lost, the collective failed or timed out) and
    RuntimeError (no generation's group of ``size`` ranks exists yet; an unsupported call)."""

    def __init__(self, rank: int, size: int, watch, name: str = MESH_GROUP_NAME, current=_default_group):
        super().__init__(rank, size)
        self._rank, self._size, self._name = rank, size, name
        self.watch = watch
        self._current = current

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
        w.pg_group_ranks[self] = {i: i for i in range(self._size)}
        w.pg_backend_config[self] = "deadpool"
        try:
            c10d._unregister_process_group(self._name)   # an earlier registration (another mesh, a test)
        except (RuntimeError, KeyError):
            pass
        c10d._register_process_group(self._name, self)

    # ---- forwarding ----------------------------------------------------------------------------------------------
    def _target(self, call: str):
        pg = self._current()
        if pg is None or pg.size() != self._size:
            have = "none" if pg is None else f"{pg.size()} rank(s)"
            raise RuntimeError(f"{call} over ctx.device_mesh ({self._size} ranks) outside ctx.run: this process has "
                               f"no training generation's group yet (it has {have}); accepted: collectives over the "
                               "mesh inside the step function ctx.run calls (docs/your-loop.md)")
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
        """An all-reduce of ``input`` (``size`` chunks along dim 0, flat), of which this rank keeps chunk ``rank``
        (module docstring)."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        o = dist.AllreduceOptions()
        o.reduceOp = op
        whole = input.clone()
        work = self.allreduce([whole], o)
        n = output.numel()
        output.copy_(whole.reshape(-1)[self._rank * n:(self._rank + 1) * n].view_as(output))
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


def device_mesh(group: MeshGroup, device_type: str = "cpu"):
    """A 1-D DeviceMesh of ``device_type`` ("cpu", "cuda") over ``group`` (every training rank)."""
    from torch.distributed.device_mesh import DeviceMesh

    group.register()
    return DeviceMesh.from_group(group, device_type)
