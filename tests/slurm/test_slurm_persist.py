"""A job killed outright still resumes from recent state (issue 28): the node agents persist every rank's newest
committed snapshot in the background (``--persist-every``, agent/persister.py), so a requeue that nobody saved for
resumes from it.

One job (``deadpool submit``, 2 active + 1 spare, the demo, ``--persist-every 2``) is hit twice:

- ``scancel --full -s TERM`` once it passed step 30: every process of the job gets SIGTERM, and srun (Slurm 22.05)
  SIGKILLs its step at once, so nothing is saved at that moment. The batch script finds the agents' persisted
  checkpoint of this attempt and requeues the job (it used to end FAILED, nothing saved, no requeue);
- ``scontrol requeue`` once the requeued attempt passed step 60: an admin's requeue, counted in the summary
  (``requeues``) though this run did not ask for it.

The job ends COMPLETED after two requeues, each resumed from a persisted (or, for the admin's requeue, saved)
step no more than a few seconds back, bitwise equal to the failure-free local run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from slurm_helpers import ACTIVE, ROOT, STEPS, events, final_state, wait_for, wait_gone

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]


def _wait_step(run_dir, step, after, seconds=240):
    end = time.time() + seconds
    while time.time() < end:
        if any(e["step"] >= step for e in events(run_dir, "step") if e["t"] > after):
            return time.time()
        time.sleep(0.2)
    raise AssertionError(f"no step {step} after {after} within {seconds} s")


def test_killed_outright_and_requeued_by_an_admin_the_job_resumes_from_persisted_state(tmp_path, slurm_cluster,
                                                                                     reference_digest):
    run_dir = str(tmp_path / "run")
    out = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "submit", "--nodes", str(ACTIVE), "--spares", "1",
                          "--steps", str(STEPS), "--persist-every", "2", "--run-dir", run_dir], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1]
    _wait_step(run_dir, 30, 0)
    # and the agents' first background write (every 2 s from the first step): 2 nodes pass step 30 within 2 s, and a
    # job killed outright before any write has nothing to resume from (it stops, as docs/slurm.md says; CI once)
    wait_for(lambda: events(run_dir, "checkpoint_persisted"), 60, "no checkpoint persisted by the first attempt")
    subprocess.run(["scancel", "--full", "-s", "TERM", job], check=True, timeout=30)
    (req1,) = wait_for(lambda: events(run_dir, "requeued"), 120, "no requeue after scancel --full -s TERM")
    resumed = wait_for(lambda: events(run_dir, "resumed_from_checkpoint"), 180, "the requeued attempt never resumed")
    t2 = _wait_step(run_dir, 60, resumed[0]["t"])
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
    assert wait_gone(job, 400), f"job {job} still running"
    assert final_state(job) == "COMPLETED"
    s = json.load(open(os.path.join(run_dir, "summary.json")))
    assert s["completed"] and s["steps_completed"] == STEPS, s
    assert s["param_digest"] == reference_digest, "parameters differ from the failure-free run"
    assert s["requeues"] == 2, [e for e in events(run_dir, "requeued")]
    starts = sorted({e["step"] for e in events(run_dir, "resumed_from_checkpoint")})
    # the last step each attempt logged before it was requeued: an attempt may still save the step after the one
    # seen when it was stopped (scontrol requeue's SIGTERM, KillWait allowing: docs/slurm.md), as seen in CI once
    ends = sorted(e["t"] for e in events(run_dir, "requeued"))
    killed_at = [max(e["step"] for e in events(run_dir, "step") if e["t"] < t) for t in ends]
    assert len(starts) == 2 and all(0 < a <= k for a, k in zip(starts, killed_at)), (starts, killed_at)
    print(f"\n[measure] killed at steps {killed_at}, resumed from steps {starts} "
          f"({[k - a for a, k in zip(starts, killed_at)]} steps back)")
