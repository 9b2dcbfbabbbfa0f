"""Issues 9 and 25: an FSDP2 loop as LLM loops are written (``fully_shard(module, mesh=ctx.device_mesh)`` under a
``MixedPrecisionPolicy`` of bf16 parameters and fp32 reduction, gradient accumulation over two micro-batches,
``clip_grad_norm_`` over the sharded gradients, torch.optim.AdamW, a cosine schedule; activation checkpointing in one
run) kept alive by ``ctx.protect``.

End to end: real MPI processes, real gloo groups, real signals, running ``examples/fsdp2_gpt.py``'s ``train`` on 4
ranks (even shards), on 3 (uneven: the last rank's shards are shorter, and the spare that replaces it reshapes its
own at promotion), as HSDP on a (2, 2) mesh (replicate x shard), and ``examples/llama_tp.py`` (a Llama-style
decoder, tensor parallel x FSDP2 on a (dp 2, tp 2) mesh): a node killed at step 30 and a rank frozen at step 40 end bitwise equal to the failure-free run
with at most one step recomputed, with one and two ranks per node; each failure-free run has the losses of the plain
FSDP2 script under torchrun. In process: the snapshot round trip of sharded state, the torch internals the uneven
reshape uses, and FSDP2 models protect() cannot keep refused.
"""
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from deadpool_hpc.config import RunConfig
from deadpool_hpc.dataplane.collectives import Watch
from deadpool_hpc.dataplane.meshgroup import MeshGroup, device_mesh
from deadpool_hpc.train.model import GPT, GPTConfig
from deadpool_hpc.worker.protect import Protected

from runs import faults, launch_reaped  # tests/runs.py
from e2e.test_your_loop import STEPS, check_recovered, restore, snapshot, train_steps  # noqa: F401

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = paths.ROOT
SMALL = dict(n_layer=1, n_head=2, d_model=32, context=32, batch_size=4)   # every dimension divides by 4


def run(tmp_path, name, *specs, **kw):
    cfg = RunConfig(**{**dict(nodes=4, spares=1, steps=STEPS, run_dir=str(tmp_path / name), faults=faults(*specs),
                              train_fn="examples.fsdp2_gpt:train", train_args=SMALL, rendezvous_timeout=4.0,
                              hang_timeout=3.0), **kw}).validate()
    return launch_reaped(cfg, 240)


EXAMPLE = dict(train_fn="examples.fsdp2_gpt:train", train_args=SMALL)


@pytest.fixture(scope="module")
def baseline(failure_free):
    s = failure_free(nodes=4, steps=STEPS, **EXAMPLE)   # tests/conftest.py: shared by every module
    assert s["final_loss"] < 0.8 * s["first_loss"], "the example does not train"
    return s["param_digest"]


@pytest.fixture(scope="module")
def baseline_p2(failure_free):
    return failure_free(nodes=2, ranks_per_node=2, steps=STEPS, **AC)["param_digest"]


AC = dict(train_fn="examples.fsdp2_gpt:train", train_args=dict(SMALL, ac=1))   # activation checkpointing


HSDP = dict(train_fn="examples.fsdp2_gpt:train", train_args=dict(SMALL, replicate=2))   # a (2, 2) mesh


@pytest.fixture(scope="module")
def baseline_hsdp(failure_free):
    return failure_free(nodes=4, steps=STEPS, **HSDP)["param_digest"]


TP = dict(train_fn="examples.llama_tp:train", train_args={"n_layers": 1})   # Llama-style, (dp 2, tp 2)


@pytest.fixture(scope="module")
def baseline_tp(failure_free):
    return failure_free(nodes=4, steps=STEPS, **TP)["param_digest"]


@pytest.fixture(scope="module")
def baseline3(failure_free):
    return failure_free(nodes=3, steps=STEPS, **EXAMPLE)


@pytest.mark.e2e
def test_fsdp2_example_kill_node1_at_30_and_hang_rank2_at_40(tmp_path, baseline):
    """node1 SIGKILLed at step 30: the spare node4, which built its model as rank 0, becomes rank 1 at its
    promotion. Rank 2 SIGSTOPped inside its step 40: the others wait in one of the mesh's collectives (FSDP2's
    all-gather or reduce-scatter, clip_grad_norm_'s all-reduce), which run pollably (dataplane/meshgroup.py), until
    its agent finds it after --hang-timeout."""
    s = run(tmp_path, "faults", "kill node1@30", "hang rank2@40", spares=2)
    check_recovered(s, baseline, ["node1", "rank2"], [[1], [2]])


@pytest.mark.e2e
def test_fsdp2_example_kill_node1_and_hang_rank2_two_ranks_per_node(tmp_path, baseline_p2):
    """The same with two ranks per node and every block activation-checkpointed (its forward, with FSDP2's
    all-gather, run again in backward)."""
    s = run(tmp_path, "faults2", "kill node1@30", "hang rank2@40", nodes=2, ranks_per_node=2, spares=2,
            train_args=dict(SMALL, ac=1))
    check_recovered(s, baseline_p2, ["node1", "rank2"], [[1], [2]])


@pytest.mark.e2e
def test_fsdp2_example_uneven_shards_on_3_ranks(tmp_path, baseline3):
    """3 ranks: no dimension of the model divides by 3 (vocabulary 256 -> shards of 86, 86, 84 rows; d_model 32 ->
    11, 11, 10). The spare builds its model as rank 0 (the largest shards); rank 2's replacement points its shards at
    rank 2's rows at promotion (dataplane/fsdp.rebind) and its optimizer state is made again with those shapes."""
    s = run(tmp_path, "uneven", "kill node1@30", "hang rank2@40", nodes=3, spares=2)
    check_recovered(s, baseline3["param_digest"], ["node1", "rank2"], [[1], [2]])


@pytest.mark.e2e
def test_fsdp2_example_no_spare_left_requeues_from_the_checkpoint(tmp_path, baseline):
    """No spare: the cut step is saved to disk (each rank's shards, the optimizer's 0-dim step counters included),
    the run restarts from it and ends bitwise equal to the failure-free run."""
    s = run(tmp_path, "requeue", "kill node1@40", spares=0, requeue=True)
    assert s["completed"] and s["param_digest"] == baseline, s


@pytest.mark.e2e
def test_hsdp_no_spare_left_requeues_and_the_lost_rank_gets_its_shards_from_its_replicate_group(tmp_path,
                                                                                               baseline_hsdp):
    """HSDP keeps the shards in each rank's own snapshot and never sends them (its replicate group holds the same).
    No spare: rank 1's checkpoint is written by its replica's holder, which has no copy of rank 1's shards and says so
    (``kept``: False); after the requeue rank 1 takes them from rank 3, the other rank of its replicate group, and the
    run ends bitwise equal to the failure-free one."""
    s = run(tmp_path, "requeue-hsdp", "kill node1@40", spares=0, requeue=True, train_args=HSDP["train_args"])
    assert s["completed"] and s["param_digest"] == baseline_hsdp, s


@pytest.mark.e2e
def test_hsdp_2x2_kill_node1_at_30_and_hang_rank2_at_40(tmp_path, baseline_hsdp):
    """HSDP on ctx.init_device_mesh((2, 2), ("replicate", "shard")): FSDP2's reduce-scatter runs on the shard
    dimension's group and its all-reduce on the replicate dimension's, each a sub-group of the generation built at
    its join (dataplane/groups.build_subgroups); the promoted spares take rank 1's and rank 2's coordinates on both
    dimensions and their shards from the other rank of their replicate group (never replicated)."""
    s = run(tmp_path, "hsdp", "kill node1@30", "hang rank2@40", spares=2, train_args=HSDP["train_args"])
    check_recovered(s, baseline_hsdp, ["node1", "rank2"], [[1], [2]])
    # the shards (131,968 bytes per rank here) stay in each rank's own snapshot: only the JSON region and the RNG
    # (70,592 bytes) are sent; the promoted spares took their shards from their replicate groups
    assert s["bytes_replicated_per_rank_per_step"] < 100_000, s["bytes_replicated_per_rank_per_step"]


@pytest.mark.e2e
def test_tp2_x_fsdp2_kill_node1_at_30_and_hang_rank2_at_40(tmp_path, baseline_tp):
    """examples/llama_tp.py: a Llama-style decoder with attention and feed-forward split by parallelize_module inside
    each tp group of a (dp 2, tp 2) mesh and fully_shard across dp; TP's all-reduces and FSDP2's collectives run on
    the generation's sub-groups. The spare built as rank 0 takes rank 1's tp coordinate, then rank 2's dp one."""
    s = run(tmp_path, "tp", "kill node1@30", "hang rank2@40", spares=2, **TP)
    check_recovered(s, baseline_tp, ["node1", "rank2"], [[1], [2]])


@pytest.mark.e2e
@pytest.mark.parametrize("ranks,extra", [(4, {}), (3, {}), (4, {"replicate": 2}), (4, None)],
                         ids=["fsdp4", "fsdp3", "hsdp2x2", "tp2xfsdp2"])
def test_fsdp2_example_trains_like_the_plain_script_under_torchrun(ranks, extra, failure_free):
    """The same losses as ``torchrun examples/fsdp2_gpt.py`` (plain FSDP2 on its own default mesh and collectives,
    the same settings) at the first and the last step of the failure-free runs above: the mesh group and the
    pollable collectives change nothing in the arithmetic."""
    example = TP if extra is None else dict(EXAMPLE, train_args=dict(SMALL, **extra))
    want = failure_free(nodes=ranks, steps=STEPS, **example)   # the baselines of the rows above, shared
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [a for k, v in example["train_args"].items() for a in ("--train-arg", f"{k}={v}")]
    script = example["train_fn"].split(":")[0].split(".")[1] + ".py"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(ranks), os.path.join(ROOT, "examples", script), "--steps", str(STEPS),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # torchrun and its workers: its own process group
        except ProcessLookupError:
            pass
        proc.wait()
    lines = [ln for ln in err.splitlines() if "Warning" not in ln and "warnings.warn" not in ln]
    assert proc.returncode == 0, "\n".join(lines[:30] + ["..."] + lines[-20:])   # the workers' own lines first
    losses = dict(re.findall(r"^step (\d+) loss (\S+)$", out, re.M))
    assert f"{want['first_loss']:.4f}" == losses["0"], (want["first_loss"], losses)
    assert f"{want['final_loss']:.4f}" == losses[str(STEPS - 1)], (want["final_loss"], losses)


# ---- in process ---------------------------------------------------------------------------------------------------
@pytest.fixture()
def local_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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


@pytest.mark.e2e
def test_a_bad_setting_met_while_building_the_model_is_named_in_the_run_s_error(tmp_path):
    """The training function raises before ctx.run on every node (HSDP's replicate=3 does not divide 2 ranks): the
    run ends before training, and its error says what the function raised, not only that a process died."""
    cfg = RunConfig(nodes=2, spares=0, steps=5, run_dir=str(tmp_path / "bad"), train_fn=EXAMPLE["train_fn"],
                    train_args=dict(SMALL, replicate=3)).validate()
    s = launch_reaped(cfg, 120)
    assert not s["completed"]
    assert any("failed at start-up on node(s) [0, 1]: ValueError: --train-arg replicate=3: accepted: a divisor of "
               "the world size 2" in e for e in s["errors"]), s["errors"]
