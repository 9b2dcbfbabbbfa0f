"""Issue 9: the user's own loop (DDP, torch.optim.AdamW, an LR scheduler) kept alive by ``ctx.protect``.

End to end: real MPI processes, real gloo groups, real signals (``launch``, as tests/e2e/test_never_hang.py), running
``examples/ddp_gpt.py``'s ``train``: a node killed and a rank frozen at step 40 end bitwise equal to the failure-free
run, with at most one step recomputed, with one and two ranks per node. In process (the snapshot round trip, bad input
refused before training starts): tests/unit/worker/test_protect.py.
"""
import os

import pytest

from deadpool_hpc.config import RunConfig

from runs import EXAMPLE_STEPS as STEPS, check_recovered, example_digest, launch_reaped, run_example  # tests/runs.py

SMALL = dict(n_layer=1, n_head=2, d_model=32, context=32, batch_size=4)
EXAMPLE = dict(train_fn="examples.ddp_gpt:train", train_args=SMALL)


def run(tmp_path, name, *specs, **kw):
    return run_example(tmp_path, name, *specs, **{"nodes": 3, **EXAMPLE, **kw})


@pytest.fixture(scope="module")
def baseline(failure_free):
    return example_digest(failure_free, nodes=3, **EXAMPLE)   # tests/conftest.py: shared by every module


@pytest.fixture(scope="module")
def baseline_p2(failure_free):
    return failure_free(nodes=2, ranks_per_node=2, steps=STEPS, **EXAMPLE)["param_digest"]


@pytest.mark.e2e
def test_ddp_example_kill_node1_at_30_and_hang_rank2_at_40(tmp_path, baseline):
    """node1 SIGKILLed at step 30; rank 2 SIGSTOPped inside its step 40: the others wait in the pollable gradient
    all-reduce (beating the progress page, so only rank 2 is fenced) until its agent's progress watch finds it
    after --hang-timeout. The first recovery is over long before the second fault."""
    s = run(tmp_path, "faults", "kill node1@30", "hang rank2@40", spares=2)
    check_recovered(s, baseline, ["node1", "rank2"], [[1], [2]])


@pytest.mark.e2e
def test_ddp_example_kill_node1_and_hang_rank2_two_ranks_per_node(tmp_path, baseline_p2):
    """The same with two ranks per node: rank 2 is node1's first rank in the original layout; after node1's loss
    it lives on the spare node2, which is fenced whole when rank 2 hangs."""
    s = run(tmp_path, "faults2", "kill node1@30", "hang rank2@40", nodes=2, ranks_per_node=2, spares=2)
    check_recovered(s, baseline_p2, ["node1", "rank2"], [[1], [2]])


@pytest.mark.e2e
def test_ddp_example_planned_swap_recomputes_nothing(tmp_path, failure_free):
    """``deadpool swap`` of node1 while the DDP example trains: its processes stop once they wrote snapshot B, and
    since a rank joins the gradient all-reduce of B only once its snapshot B is committed, nobody completes step B:
    the spare takes over at B with no step recomputed, bitwise equal."""
    import subprocess
    import sys
    import threading
    import time

    from deadpool_hpc.events import read_events

    # 120 steps (about 3 s here), not STEPS (about 1.2 s): the operator's `deadpool swap` is a new Python process,
    # and on a loaded CI machine it once arrived 0.74 s after step 15, when the 44-step run was ending (the swap was
    # refused, rightly: "the run ends at step 44 before the next step boundary")
    steps = 120
    base = failure_free(nodes=3, steps=steps, **EXAMPLE)
    cfg = RunConfig(nodes=3, spares=1, steps=steps, run_dir=str(tmp_path / "swap"), train_fn="examples.ddp_gpt:train",
                    train_args=SMALL, rendezvous_timeout=4.0, hang_timeout=3.0).validate()
    out = {}

    def operator():
        path, end = os.path.join(cfg.output.run_dir, "events.jsonl"), time.time() + 200
        while time.time() < end and not (os.path.exists(path) and any(
                e["event"] == "step" and e["step"] >= 5 for e in read_events(path))):
            time.sleep(0.05)
        out["swap"] = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "swap", cfg.output.run_dir, "node1",
                                      "--reason", "ECC errors (test)"], capture_output=True, text=True, timeout=60)

    t = threading.Thread(target=operator, daemon=True)
    t.start()
    s = launch_reaped(cfg, 240)
    t.join(30)
    assert out["swap"].returncode == 0, out["swap"].stderr
    assert s["completed"] and s["planned_swaps"] == 1 and s["swaps"] == 1, s["failures"]
    (f,) = s["failures"]
    assert f["kind"] == "planned swap" and f["failed_nodes"] == [1] and f["recomputed_steps"] == 0, f
    assert s["param_digest"] == base["param_digest"], "a planned swap changed the parameters"


@pytest.mark.e2e
def test_ddp_example_no_spare_left_requeues_from_the_checkpoint(tmp_path, baseline):
    """No spare: the cut step is saved to disk (each rank's shard of the protected state), the run restarts from
    it and ends bitwise equal to the failure-free run."""
    s = run(tmp_path, "requeue", "kill node1@40", spares=0, requeue=True)
    assert s["completed"] and s["param_digest"] == baseline, s
