"""Your own DDP or FSDP2 loop under a real Slurm (issue 9): ``examples/ddp_gpt.py``'s and ``examples/fsdp2_gpt.py``'s
``train`` (DDP or fully_shard, torch.optim.AdamW, a cosine schedule, ``ctx.protect``), 2 active + 1 spare nodes,
submitted with ``deadpool submit --train-fn examples.<example>:train`` from the repository root and through the
submitit plugin (``AutoExecutor(cluster="deadpool").submit(examples.<example>.train)``); the node of MPI rank 1 is crashed
(scripts/slurm-local-cluster.sh: every process SIGKILLed) at step 25. Each job ends COMPLETED with parameters
bit-identical to a failure-free local run of the same example.

One job per example, each through one of the two paths (DDP through ``deadpool submit``, FSDP2 through the submitit
plugin): the paths themselves are each crashed with the demo too (test_slurm_jobs.py, test_plugin_submitit.py), and
both examples survive the same crash locally with one and two ranks per node (tests/e2e/test_your_loop.py,
tests/e2e/test_fsdp2.py); the four combinations cost four Slurm jobs where two cover every cell (issue 24)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from slurm_helpers import ACTIVE, CRASH_STEP, ROOT, STEPS, crash_when, final_state, gone, host_of, wait_gone

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]
SMALL = dict(n_layer=1, n_head=2, d_model=32, context=32, batch_size=4)  # as tests/e2e/test_your_loop.py


@pytest.fixture()
def ddp_reference(failure_free, example):
    """param_digest of the example's failure-free run (ACTIVE nodes, STEPS), launched locally: the session's shared
    baseline (tests/conftest.py, which puts the checkout on PYTHONPATH for ``examples``)."""
    return failure_free(nodes=ACTIVE, steps=STEPS, train_fn=f"examples.{example}:train", train_args=SMALL)["param_digest"]


def _check(s, node, ref):
    assert s["completed"] and s["steps_completed"] == STEPS, s
    assert s["swaps"] == 1 and s["failures"][0]["failed_hosts"] == [node], s["failures"]
    assert s["param_digest"] == ref, "the example's parameters differ from its failure-free run"


@pytest.mark.parametrize("example", ["ddp_gpt"])
def test_example_through_deadpool_submit_survives_a_node_crash(tmp_path, fail_node, example, ddp_reference):
    run_dir = str(tmp_path / "run")
    args = [a for k, v in SMALL.items() for a in ("--train-arg", f"{k}={v}")]
    out = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "submit", "--train-fn",
                          f"examples.{example}:train", *args,
                          "--nodes", str(ACTIVE), "--spares", "1", "--steps", str(STEPS), "--run-dir", run_dir],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1]
    node, _ = crash_when(run_dir, fail_node, host_of(1), CRASH_STEP, time.time() + 180, lambda: gone(job))
    assert wait_gone(job, 180), f"job {job} still running"
    assert final_state(job) == "COMPLETED"
    _check(json.load(open(os.path.join(run_dir, "summary.json"))), node, ddp_reference)


@pytest.mark.parametrize("example", ["fsdp2_gpt"])
def test_example_through_the_submitit_plugin_survives_a_node_crash(tmp_path, fail_node, example, ddp_reference,
                                                                   monkeypatch):
    submitit = pytest.importorskip("submitit")
    monkeypatch.chdir(ROOT)  # submitit's job starts where it was submitted from: examples/ is importable there
    monkeypatch.syspath_prepend(ROOT)
    import importlib

    train = importlib.import_module(f"examples.{example}").train

    run_dir = tmp_path / "run"
    ex = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="deadpool")
    ex.update_parameters(nodes=ACTIVE, deadpool_spares=1, deadpool_steps=STEPS, deadpool_run_dir=str(run_dir),
                         timeout_min=10)
    job = ex.submit(train, **SMALL)  # keyword arguments become train_args
    try:
        node, _ = crash_when(str(run_dir), fail_node, host_of(1), CRASH_STEP, time.time() + 180, job.done)
        end = time.time() + 180
        while not job.done() and time.time() < end:
            time.sleep(1)
        assert job.done(), f"job {job.job_id} still running 180 s after the crash"
    except AssertionError:
        job.cancel(check=False)
        raise
    assert final_state(job.job_id) == "COMPLETED"
    _check(job.result(), node, ddp_reference)
