"""The submitit plugin (plugins/submitit, distribution deadpool-submitit) under a real Slurm: a run submitted
through ``submitit.AutoExecutor(folder, cluster="deadpool")``, 2 active + 1 spare nodes, survives the crash of a
node (scripts/slurm-local-cluster.sh: every process of the node SIGKILLed) at step 25, ends COMPLETED in sacct,
and its final parameters are bit-identical to a failure-free local run."""
from __future__ import annotations

import time

import pytest

from slurm_helpers import ACTIVE, CRASH_STEP, STEPS, crash_when, events, final_state, host_of

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]


def _diagnostics(job, folder) -> str:
    import subprocess

    q = subprocess.run(["squeue", "-h", "-j", str(job.job_id), "-o", "%T %R"], capture_output=True, text=True,
                       timeout=20)
    logs = "".join(open(p).read()[-600:] for p in sorted(folder.glob("*_0_log.err")))
    return f"squeue: {q.stdout.strip()!r}\n{logs}"


def test_autoexecutor_deadpool_survives_node_crash(tmp_path, fail_node, reference_digest):
    submitit = pytest.importorskip("submitit")
    from deadpool_hpc.launch.submitit_job import hot_swap_job_class
    from deadpool_hpc.train.demo import train

    run_dir, folder = tmp_path / "run", tmp_path / "submitit"
    ex = submitit.AutoExecutor(folder=folder, cluster="deadpool")
    ex.update_parameters(nodes=ACTIVE, deadpool_spares=1, deadpool_steps=STEPS, deadpool_run_dir=str(run_dir),
                         deadpool_partition="debug", timeout_min=10)
    job = ex.submit(train)  # a module-level function: the workers import deadpool_hpc.train.demo:train
    assert isinstance(job, hot_swap_job_class())
    try:
        node, _ = crash_when(str(run_dir), fail_node, host_of(1), CRASH_STEP, time.time() + 150, job.done)
        end = time.time() + 180
        while not job.done() and time.time() < end:  # submitit's result() has no timeout
            time.sleep(1)
        assert job.done(), f"job {job.job_id} still running 180 s after the crash\n{_diagnostics(job, folder)}"
    except AssertionError as exc:
        diag = _diagnostics(job, folder)
        job.cancel(check=False)
        raise AssertionError(f"{exc}\n{diag}") from None
    s = job.result()  # HotSwapSlurmJob: task 0's result, the run summary
    assert final_state(job.job_id) == "COMPLETED"
    assert s["completed"] and s["steps_completed"] == STEPS, s
    assert s["swaps"] == 1 and len(s["failures"]) == 1 and s["failures"][0]["failed_hosts"] == [node], s["failures"]
    assert s["param_digest"] == reference_digest, "parameters differ from the failure-free run"
    hello = [e for e in events(str(run_dir), "hello") if e.get("role", "agent") == "agent"]
    assert len({e["host"] for e in hello}) == ACTIVE + 1  # nodes + spares: one agent on each node of the job
