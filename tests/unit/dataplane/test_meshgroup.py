"""Issue 25: the process group behind ``ctx.device_mesh`` (dataplane/meshgroup.py) carries every collective of the
user's mesh to the current generation's group, pollably.

Two real processes over gloo: ``clip_grad_norm_`` over FSDP2-sharded gradients and ``full_tensor()`` through a
``MeshGroup`` give bitwise the results of the same calls over torch's own mesh of the default group, the calls reach
the ``MeshGroup`` (from C++, through DTensor's functional collectives, and from Python), and a raised failure flag
ends ``clip_grad_norm_`` with ``PeerFailure``. In process: the calls torch's C++ forwards to a Python process group
(pinned), and a collective before any generation's group is refused with the reason.
"""
import os
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from deadpool_hpc.dataplane.collectives import Watch
from deadpool_hpc.dataplane.meshgroup import MeshGroup, device_mesh


def _model(mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 3))   # 12 and 3 rows: even on 2 ranks
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _step(model, rank):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).float().pow(2).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)   # the norm: an all-reduce over the mesh
    return norm.full_tensor(), [p.grad.full_tensor() for p in model.parameters()]


def _worker(rank: int, store_path: str, out_dir: str, mode: str) -> None:
    """One of two real processes. mode "plain": torch's own mesh over the default group (the reference); "mesh": a
    MeshGroup's, then a failure flag raised. Separate processes: DTensor caches its plans by the mesh's layout, so a
    second mesh of the same ranks in one process would reuse the first one's group."""
    from torch.distributed.device_mesh import init_device_mesh

    from deadpool_hpc.errors import PeerFailure

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    out = {}
    if mode == "plain":
        out["norm"], out["grads"] = _step(_model(init_device_mesh("cpu", (2,))), rank)
    else:
        watch = Watch(threading.Event(), 30.0)
        group = MeshGroup(rank, 2, watch)
        calls = []
        for name in ("allreduce", "all_gather_single", "allgather_into_tensor_coalesced", "reduce_scatter_single",
                     "all_gather_single_coalesced"):   # torch's C++ looks this alias up first
            real = getattr(group, name)
            setattr(group, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
        model = _model(device_mesh(group))
        out["norm"], out["grads"] = _step(model, rank)
        out["calls"] = sorted(set(calls))
        before = len(calls)
        watch.failure.set()   # a peer lost (rank 1 never joins the all-reduce): rank 0's wait gives up at once
        try:
            if rank == 1:
                raise PeerFailure("a peer failed during a collective (rank 1 stays out)")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            out["failed"] = "no error"
        except PeerFailure as exc:
            out["failed"] = "PeerFailure: " + str(exc)
        except Exception as exc:   # noqa: BLE001 - the test reports what came out
            out["failed"] = f"{type(exc).__name__}: {exc}"
        out["failed_in"] = calls[before:]
    torch.save(out, os.path.join(out_dir, f"{mode}{rank}.pt"))
    if mode == "mesh" and rank == 1:   # stay until rank 0 has given up its all-reduce (it must see the flag, not us go)
        import time

        end = time.monotonic() + 30
        while not os.path.exists(os.path.join(out_dir, "mesh0.pt")) and time.monotonic() < end:
            time.sleep(0.05)
    os._exit(0)   # no teardown: rank 0's abandoned all-reduce would abort it (dataplane/groups.py)


@pytest.mark.e2e
def test_clip_grad_norm_and_full_tensor_run_on_the_generation_group_bitwise_and_pollably(tmp_path):
    import torch.multiprocessing as mp

    for mode in ("plain", "mesh"):
        mp.start_processes(_worker, args=(str(tmp_path / f"store-{mode}"), str(tmp_path), mode), nprocs=2,
                           start_method="spawn", join=True)
    for rank in range(2):
        want, got = torch.load(tmp_path / f"plain{rank}.pt"), torch.load(tmp_path / f"mesh{rank}.pt")
        assert float(got["norm"]) > 0.01, "the gradients were not clipped: the test would not see the clip"
        assert torch.equal(got["norm"], want["norm"]), (rank, float(got["norm"]), float(want["norm"]))
        assert all(torch.equal(a, b) for a, b in zip(got["grads"], want["grads"])), f"rank {rank}: other gradients"
        # FSDP2's all-gather and reduce-scatter (ctx.protect replaces them by its own hooks; here, no protect, they
        # reach the group), clip_grad_norm_'s all-reduce and full_tensor()'s all-gather, from C++
        assert {"allreduce", "all_gather_single", "reduce_scatter_single",
                "all_gather_single_coalesced"} <= set(got["calls"]), got["calls"]
    got = torch.load(tmp_path / "mesh0.pt")
    assert got["failed_in"] == ["allreduce"], got["failed_in"]
    assert got["failed"].startswith("PeerFailure: a peer failed during a collective"), got["failed"]


def test_the_calls_torch_forwards_to_a_python_process_group_are_overridden():
    """torch 2.13's C++ reaches a Python ProcessGroup only through these virtual methods
    (torch/csrc/distributed/c10d/PyProcessGroup.hpp) and Python's distributed_c10d through these names: a torch that
    renames one fails here, not in a user's run."""
    names = ["allreduce", "allreduce_coalesced", "allgather", "allgather_into_tensor_coalesced", "reduce_scatter",
             "reduce_scatter_tensor_coalesced", "alltoall_base", "broadcast", "barrier", "all_gather_single",
             "reduce_scatter_single", "all_to_all_single", "send", "recv", "scatter", "gather", "reduce"]
    for name in names:
        assert hasattr(dist.ProcessGroup, name), f"torch's ProcessGroup has no {name} any more"
        assert name in vars(MeshGroup), f"MeshGroup does not forward {name}"
    header = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "distributed", "c10d",
                          "PyProcessGroup.hpp")
    if os.path.exists(header):
        text = open(header).read()
        for name in ("allreduce", "allgather", "barrier", "broadcast", "reduce_scatter", "allreduce_coalesced",
                     "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "alltoall_base"):
            assert name in text, name


def test_a_collective_before_the_first_generation_is_refused_with_the_reason():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)   # the placeholder group
    try:
        group = MeshGroup(0, 4, Watch(threading.Event(), 5.0))
        with pytest.raises(RuntimeError, match=r"all_reduce over ctx.device_mesh \(4 ranks\) outside ctx.run: .*"
                                               r"it has 1 rank\(s\).*accepted: collectives over the mesh inside"):
            group.allreduce([torch.ones(2)])
        with pytest.raises(RuntimeError, match=r"send to rank 1 over ctx.device_mesh: point-to-point"):
            group.send([torch.ones(2)], 1)
    finally:
        dist.destroy_process_group()


def test_a_2d_mesh_group_follows_its_rank_to_its_coordinate_and_line():
    """HSDP's (2, 2) mesh [[0, 1], [2, 3]]: dimension 0 (replicate) groups (0, 2) and (1, 3), dimension 1 (shard)
    (0, 1) and (2, 3); a spare built as rank 0 and promoted to rank 3 takes rank 3's coordinates and lines."""
    from deadpool_hpc.dataplane.meshgroup import mesh_lines

    layout = torch.arange(4).view(2, 2)
    assert mesh_lines(layout, 0) == [(0, 2), (1, 3)] and mesh_lines(layout, 1) == [(0, 1), (2, 3)]
    watch = Watch(threading.Event(), 5.0)
    rep, shard = (MeshGroup(0, 2, watch, name=f"t{d}", layout=layout, dim=d) for d in (0, 1))
    assert (rep.rank(), rep.ranks, shard.rank(), shard.ranks) == (0, (0, 2), 0, (0, 1))
    for g in (rep, shard):
        g.rebind(3)
    assert (rep.rank(), rep.ranks, shard.rank(), shard.ranks) == (1, (1, 3), 1, (2, 3))
    with pytest.raises(ValueError, match=r"rank 4 is not in the mesh \[\[0, 1\], \[2, 3\]\]"):
        rep.rebind(4)


@pytest.mark.parametrize("shape,names,match", [
    ((3, 2), ("replicate", "shard"), r"mesh_shape=\(3, 2\).*product is the world size 4"),
    ((4, 0), ("a", "b"), r"mesh_shape=\(4, 0\).*positive sizes"),
    ("abc", None, r"mesh_shape='abc'"),
    ((2, 2), None, r"mesh_dim_names=None.*2 distinct names"),
    ((2, 2), ("x", "x"), r"mesh_dim_names=\('x', 'x'\)"),
])
def test_a_mesh_that_does_not_hold_the_job_s_ranks_is_refused(shape, names, match):
    from deadpool_hpc.dataplane.meshgroup import check_mesh_shape

    with pytest.raises(ValueError, match=match):
        check_mesh_shape(shape, names, 4)
    assert check_mesh_shape([2, 2], ("replicate", "shard"), 4) == (2, 2)


def test_a_slice_of_a_mesh_knows_the_training_rank_before_the_first_generation():
    """Before ctx.run the default group is a placeholder of the process alone (rank 0), from which torch computes a
    mesh slice's coordinate; tensor parallelism picks each parameter's piece by it at build time. A mesh built here
    (RankedMesh) gives its slices this process's training rank (3 of a (dp 2, tp 2) mesh: dp 1, tp 1), records them
    for a promotion's rebind, and set_mesh_rank moves them all to another rank. Pins DeviceMesh._create_sub_mesh,
    _rank, _coordinate_on_dim, _layout, _rank_map."""
    from deadpool_hpc.dataplane.meshgroup import meshes_of, set_mesh_rank

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)   # the placeholder group
    try:
        layout = torch.arange(4).view(2, 2)
        watch = Watch(threading.Event(), 5.0)
        groups = [MeshGroup(3, 2, watch, name=f"pin_{n}", layout=layout, dim=d) for d, n in enumerate(("dp", "tp"))]
        mesh = device_mesh(groups, "cpu", mesh_dim_names=("dp", "tp"))
        assert list(mesh.get_coordinate()) == [1, 1]
        tp, dp = mesh["tp"], mesh["dp"]
        assert list(tp.get_coordinate()) == [1] and list(dp.get_coordinate()) == [1] and tp._rank == 3
        assert meshes_of(tp) == [mesh, tp, dp]
        assert mesh["tp"] is tp   # slicing again (e.g. in every step) gives the same slice: nothing grows
        for m in meshes_of(tp):
            set_mesh_rank(m, 1)   # a spare promoted to rank 1: dp 0, tp 1
        assert [list(m.get_coordinate()) for m in (mesh, tp, dp)] == [[0, 1], [1], [0]]
    finally:
        dist.destroy_process_group()
