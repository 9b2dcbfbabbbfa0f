"""Issues 9 and 25: an FSDP2 loop as LLM loops are written (``fully_shard(module, mesh=ctx.device_mesh)`` under a
``MixedPrecisionPolicy`` of bf16 parameters and fp32 reduction, gradient accumulation over two micro-batches,
``clip_grad_norm_`` over the sharded gradients, torch.optim.AdamW, a cosine schedule; activation checkpointing in one
run) kept alive by ``ctx.protect``.

End to end: real MPI processes, real gloo groups, real signals, running ``examples/fsdp2_gpt.py``'s ``train`` on 4
ranks (even shards), on 3 (uneven: the last rank's shards are shorter, and the spare that replaces it reshapes its
own at promotion), as HSDP on a (2, 2) mesh (replicate x shard), and ``examples/llama_tp.py`` (a Llama-style
decoder, tensor parallel x FSDP2 on a (dp 2, tp 2) mesh): a node killed at step 30 and a rank frozen at step 40 end bitwise equal to the failure-free run
with at most one step recomputed, with one and two ranks per node; each failure-free run has the losses of the plain
FSDP2 script under torchrun. In process (the snapshot round trip of sharded state, the torch internals the uneven
reshape uses, FSDP2 models protect() cannot keep refused): tests/unit/dataplane/test_fsdp.py.
"""
import os
import re
import signal
import subprocess
import sys

import pytest

from deadpool_hpc.config import RunConfig

from runs import EXAMPLE_STEPS as STEPS, check_recovered, example_digest, launch_reaped, run_example  # tests/runs.py

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = paths.ROOT
SMALL = dict(n_layer=1, n_head=2, d_model=32, context=32, batch_size=4)   # every dimension divides by 4


def run(tmp_path, name, *specs, **kw):
    return run_example(tmp_path, name, *specs, **{"nodes": 4, **EXAMPLE, **kw})


EXAMPLE = dict(train_fn="examples.fsdp2_gpt:train", train_args=SMALL)


@pytest.fixture(scope="module")
def baseline(failure_free):
    return example_digest(failure_free, nodes=4, **EXAMPLE)   # tests/conftest.py: shared by every module


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
