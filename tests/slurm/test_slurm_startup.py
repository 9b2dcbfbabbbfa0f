"""A node lost during the job's start-up, under a real Slurm (issue 28): nodes crashed with
scripts/slurm-local-cluster.sh (``fail NODE crash``: every process of the node SIGKILLed), not ``--kill``.

One job (``deadpool submit --nodes 3 --spares 2``, the demo) takes two losses, one on each side of the moment the
node agents' MPI world exists:

- as soon as task 1 runs, before any agent said hello (srun's launch, MPI_Init: MPICH cannot survive a process lost
  there). The batch
  host's start-up watch finds it within seconds (its task's beacon stands still, or never appears), ends the step,
  and srun starts again on the live nodes with one spare fewer (``relaunched``); it used to wait 300 s in MPI_Init
  and end FAILED;
- 1 s after the relaunched agents said hello, while the training processes import torch and build the model: the
  control plane swaps in the spare left and the ranks without a committed snapshot start fresh.

The job ends COMPLETED, bitwise equal to the failure-free local run of the same 3 nodes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from slurm_helpers import ROOT, STEPS, crash_in_the_start_up, events, final_state, wait_for, wait_gone

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]


def test_nodes_crashed_before_and_after_the_agents_mpi_world_exists(tmp_path, fail_node, failure_free):
    ref = failure_free(nodes=3, steps=STEPS)["param_digest"]
    run_dir = str(tmp_path / "run")
    out = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "submit", "--nodes", "3", "--spares", "2",
                          "--steps", str(STEPS), "--run-dir", run_dir], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1]
    wait_for(lambda: subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                                 timeout=20).stdout.strip() == "RUNNING", 120, f"job {job} RUNNING")
    first = crash_in_the_start_up(run_dir, 1, fail_node)   # task 1's node (task 0's is the batch host)
    (rel,) = wait_for(lambda: events(run_dir, "relaunched"), 120, "no relaunch")
    assert rel["lost_hosts"] == [first] and rel["spares_left"] == 1, rel
    (lost,) = events(run_dir, "startup_node_lost")
    assert lost["startup_s"] < 15, lost   # found within seconds, not at the 300 s start-up deadline
    hello = wait_for(lambda: {e["mpi_rank"]: e["host"] for e in events(run_dir, "hello")
                           if e.get("role") == "agent" and e["t"] > rel["t"]}.get(1), 120, "no agents after the relaunch")
    time.sleep(1.0)
    second = hello   # MPI rank 1's node of the relaunched step (an active node, not the batch host)
    fail_node(second)
    assert wait_gone(job, 300), f"job {job} still running"
    assert final_state(job) == "COMPLETED"
    s = json.load(open(os.path.join(run_dir, "summary.json")))
    assert s["completed"] and s["steps_completed"] == STEPS, s
    assert s["param_digest"] == ref, "parameters differ from the failure-free run"
    assert [r["lost_hosts"] for r in s["relaunches"]] == [[first]], s["relaunches"]
    (f,) = s["failures"]
    assert f["failed_hosts"] == [second] and f["outcome"] == "hot swap" and s["spares_left"] == 0, s["failures"]
    print(f"\n[measure] start-up loss found after {lost['startup_s']:.1f} s; second loss during start-up: "
          f"{f['during_start_up']}, recovery {f['recovery_s']:.1f} s; start-up {s['start_up_s']:.1f} s")
