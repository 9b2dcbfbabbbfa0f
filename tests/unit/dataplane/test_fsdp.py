"""FSDP2 state under ``ctx.protect`` (dataplane/fsdp.py, worker/protect.py) in process: the snapshot round trip of
sharded state, the torch internals the uneven reshape of a promoted spare's shards uses, and FSDP2 models protect()
cannot keep refused; a step cut short inside FSDP2's backward on two real processes. The runs that recover FSDP2, HSDP
and TP loops are tests/e2e/test_fsdp2.py's.
"""
import os
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from deadpool_hpc.dataplane.collectives import Watch
from deadpool_hpc.dataplane.meshgroup import MeshGroup, device_mesh
from deadpool_hpc.train.model import GPT, GPTConfig
from deadpool_hpc.worker.protect import Protected

from snapshots import restore, snapshot, train_steps  # tests/snapshots.py


def sharded(world_size=1, rank=0, d_model=16):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=d_model, context=8))
    mesh = device_mesh(MeshGroup(rank, world_size, Watch(threading.Event(), 30.0)))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    return model, opt, sched


def protected(world_size=1):
    model, opt, sched = sharded(world_size)
    prot = Protected(world_size, model, opt, sched)
    prot.bind(0, Watch(threading.Event(), 30.0))
    return model, opt, sched, prot


def local_digest(model):
    return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]).clone()


@pytest.mark.parametrize("at", [0, 3])
def test_sharded_snapshot_round_trip_is_bitwise(local_group, at):
    """Snapshot the shards after ``at`` steps, train on, restore, train the same steps again: the same shards,
    optimizer state and schedule; protect() leaves the optimizer without state (its dry step is undone)."""
    model, opt, sched, prot = protected()
    assert not opt.state
    assert all(i in prot._layout.unique for i in range(len(prot.entries))) and prot.common_nbytes == 0
    train_steps(model, opt, sched, 0, at)
    layout, slot = snapshot(prot)
    train_steps(model, opt, sched, at, 3)
    want = local_digest(model)
    train_steps(model, opt, sched, at + 3, 2)
    restore(prot, layout, slot)
    assert bool(opt.state) == (at > 0)
    train_steps(model, opt, sched, at, 3)
    assert torch.equal(local_digest(model), want)


def test_a_spare_optimizer_gets_sharded_state(local_group):
    model, opt, sched, prot = protected()
    train_steps(model, opt, sched, 0, 4)
    layout, slot = snapshot(prot)
    train_steps(model, opt, sched, 4, 2)
    want = local_digest(model)
    model2, opt2, sched2, prot2 = protected()
    restore(prot2, layout, slot)
    train_steps(model2, opt2, sched2, 4, 2)
    assert torch.equal(local_digest(model2), want)


def test_uneven_shards_a_spare_built_as_rank_0_takes_rank_2s_shapes(local_group):
    """3 ranks, uneven shards (vocabulary 256 and d_model 16 do not divide by 3). The snapshot layout is the same
    whichever rank builds it (every shard padded to rank 0's rows), and a model built as rank 0 (a spare's) rebound to
    rank 2 has exactly the shards of a model built as rank 2, views of FSDP2's padded buffers. Pins the torch
    internals ``dataplane/fsdp._reshape_shard`` uses."""
    from deadpool_hpc.dataplane.fsdp import fsdp_params, mesh_infos, rebind

    model0, opt0, _ = sharded(world_size=3, rank=0)
    model2, opt2, _ = sharded(world_size=3, rank=2)
    prot0, prot2 = Protected(3, model0, opt0), Protected(3, model2, opt2)
    assert prot0.entries == prot2.entries, "the snapshot layout depends on the rank"
    tok0, tok2 = model0.tok.weight.to_local(), model2.tok.weight.to_local()
    assert tok0.shape == (86, 16) and tok2.shape == (84, 16)
    for fp in fsdp_params(model0):   # the internals _reshape_shard reads and writes
        assert {"padded_sharded_param_size", "_sharded_param_data", "sharded_size", "contiguous_sharded_stride",
                "_orig_size", "fsdp_placement", "sharded_param"} <= set(vars(fp)), sorted(vars(fp))
    assert rebind(model0, 2) is True
    assert rebind(model0, 2) is False   # already rank 2's shapes
    for (name, p0), p2 in zip(model0.named_parameters(), model2.parameters()):
        assert p0.to_local().shape == p2.to_local().shape, name
        assert p0.to_local().stride() == p2.to_local().stride(), name
    for fp, fp2 in zip(fsdp_params(model0), fsdp_params(model2)):
        assert fp.sharded_size == fp2.sharded_size and fp.contiguous_sharded_stride == fp2.contiguous_sharded_stride
        assert fp.sharded_param.to_local().data_ptr() == fp._sharded_param_data.data_ptr()
    assert all(i.shard_mesh_rank == 2 and list(i.mesh.get_coordinate()) == [2] for i in mesh_infos(model0))


def test_fully_shard_without_ctx_device_mesh_is_refused(local_group):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, context=8))
    fully_shard(model)   # the default mesh: the default group, replaced at every recovery
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"another mesh than ctx.device_mesh.*accepted: fully_shard\(module, "
                                         r"mesh=ctx.device_mesh\)"):
        Protected(1, model, opt)


def _cut_short_worker(rank: int, store_path: str, out_dir: str) -> None:
    """One of two real processes (gloo over a FileStore): see test_a_step_cut_short_inside_fsdp2_recomputes_exactly."""
    from deadpool_hpc.errors import PeerFailure

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    model, opt, sched = sharded(world_size=2, rank=rank)
    prot = Protected(2, model, opt, sched)
    prot.bind(rank, Watch(threading.Event(), 30.0))
    train_steps(model, opt, sched, 0, 2)
    layout, slot = snapshot(prot)
    train_steps(model, opt, sched, 2, 2)
    want = local_digest(model)
    restore(prot, layout, slot)
    real, calls = MeshGroup.all_gather_single, []

    def failing(group, out, inp, opts=None):
        calls.append(1)
        if len(calls) == 3:   # root and block gathered in forward; the block's re-gather in backward fails
            raise PeerFailure("a peer failed during a collective (test)")
        return real(group, out, inp, opts)

    MeshGroup.all_gather_single = failing
    try:
        train_steps(model, opt, sched, 2, 1)
        raised = False
    except PeerFailure:
        raised = True
    restore(prot, layout, slot)
    before = len(calls)
    train_steps(model, opt, sched, 2, 2)
    torch.save({"raised": raised, "gathers": len(calls) - before, "equal": torch.equal(local_digest(model), want)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.e2e
def test_a_step_cut_short_inside_fsdp2_recomputes_exactly(tmp_path):
    """A PeerFailure raised inside FSDP2's backward (its re-gather of a resharded block, on both of two real ranks)
    leaves FSDP2's per-iteration state mid-step; the restore puts it back (dataplane/fsdp.reset_after_failure), so
    the steps recomputed from the snapshot gather again and give the same shards as steps never interrupted.
    (Without the reset the survivors of a Slurm test trained on alone, with unsharded parameters.)"""
    import torch.multiprocessing as mp

    mp.start_processes(_cut_short_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["raised"], "the injected failure did not interrupt the step"
        assert got["gathers"] == 6, f"rank {rank}: FSDP2 gathered {got['gathers']} times in 2 steps (3 per step)"
        assert got["equal"], f"rank {rank}: the recomputed steps differ from uninterrupted ones"


def test_an_hsdp_mesh_whose_replicate_group_lives_on_one_node_is_refused(local_group):
    """HSDP (2, 2) on one node of four ranks: each replicate group, (0, 2) and (1, 3), lives on that node, whose loss
    would take every copy of its shards (kept only in the group's own snapshots). Refused before the first step. (A
    row-major (replicate, shard) mesh over two nodes or more always spans nodes.)"""
    from deadpool_hpc.dataplane.meshgroup import device_mesh as nd_mesh

    torch.manual_seed(0)
    layout = torch.arange(4).view(2, 2)
    watch = Watch(threading.Event(), 30.0)
    groups = [MeshGroup(0, 2, watch, name=f"refuse_{n}", layout=layout, dim=d) for d, n in enumerate(("r", "s"))]
    mesh = nd_mesh(groups, "cpu", mesh_dim_names=("replicate", "shard"))
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, context=8))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"replicate group of ranks \[0, 2\] lives on one node \(node 0, 4 ranks per "
                                         r"node\).*accepted: a mesh whose replicate dimension spans nodes"):
        Protected(4, model, opt, ring=(4, 1, 1))
    Protected(4, model, opt, ring=(2, 2, 1))   # two ranks per node: (0, 2) on nodes 0 and 1
