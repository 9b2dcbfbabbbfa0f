"""The time limit and the signal lead on the local cluster (issue 46, scope 5; docs/slurm.md, "Signals").

As a new user tried it: `deadpool submit ... --time 2` with more steps than fit. The template's USR2@120 came at
once, the job checkpointed and requeued, the requeued attempt got USR2 again before its first step, skipped its
checkpoint (nothing new to save) and the job ended FAILED. Now:

- the submission is refused (exit 2) with the reason, naming --time, the lead and what would be accepted; nothing is
  written or queued (fast: no job runs);
- Slurm's --time formats mean to launch/timelimit.py what they mean to sbatch (held jobs, scontrol's TimeLimit);
- a requeued attempt that gets the signal before its first step is requeued again from the same checkpoint (not
  FAILED), and the job completes with the failure-free digest (the signal is sent by hand, `scancel -s USR2`, at
  the moment a 2-minute limit would send it: as soon as the attempt's tasks run; a real 2-minute job is too long for
  the suite and was run by hand, docs/slurm.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from slurm_helpers import ACTIVE, MEASURE, ROOT, STEPS, crash_when, events, final_state, gone, job_output, wait_for, wait_gone

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]
sys.path.insert(0, os.path.join(ROOT, "tests"))
from unit.launch.test_timelimit import BAD_TIMES, SLURM_TIMES  # noqa: E402  (the pure-logic table, checked here against sbatch)


def _queue() -> list[str]:
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout.split()


def test_deadpool_submit_time_2_is_refused_with_the_reason(tmp_path, slurm_cluster):
    """`deadpool submit --time 2` with the template's 120 s lead: exit 2, the reason, nothing written nor queued;
    `--time 2 --signal-lead 30` (what the refusal offers) is accepted and the job carries USR2@30."""
    before = _queue()
    sub = tmp_path / "sub"
    sub.mkdir()
    cli = [sys.executable, "-m", "deadpool_hpc.launch.cli", "submit", "--nodes", str(ACTIVE), "--spares", "1",
           "--steps", "100000", "--run-dir", "run"]
    r = subprocess.run(cli + ["--time", "2"], cwd=sub, capture_output=True, text=True, timeout=60)
    print(r.stderr)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("deadpool: error: --time 2 (120 s) leaves no time to train before the signal: "
                               "--signal-lead 120 asks Slurm for SIGUSR2 120 s before the time limit"), r.stderr
    assert "accepted: --signal-lead 30 or less (at least 10) with --time 2, or --time 4 or more with " \
           "--signal-lead 120" in r.stderr
    assert not (sub / "run").exists() and _queue() == before
    ok = subprocess.run(cli + ["--time", "2", "--signal-lead", "30", "--sbatch-arg=--hold"], cwd=sub,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    job = ok.stdout.split()[-1]
    try:
        show = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30).stdout
        assert "TimeLimit=00:02:00" in show, show
        assert "#SBATCH --signal=USR2@30\n" in open(sub / "run" / "job.sbatch").read()
    finally:
        subprocess.run(["scancel", job], timeout=30)


def test_time_formats_mean_what_sbatch_makes_of_them(tmp_path, slurm_cluster):
    """Each --time of tests/unit/launch/test_timelimit.py, given to sbatch (a held job, cancelled at once): the time limit Slurm
    sets is the one parse_time_limit computes; the refused ones are refused by sbatch too ("-2" excepted: sbatch takes
    it as 2982614 days, the check refuses it)."""
    from deadpool_hpc.launch.timelimit import parse_time_limit

    def slurm_seconds(text):
        r = subprocess.run(["sbatch", "--parsable", "--hold", f"--time={text}", f"--chdir={tmp_path}",
                            f"--output={tmp_path}/o", "--wrap", "true"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return "refused"
        job = r.stdout.strip().split(";")[0]
        try:
            show = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                                  timeout=30).stdout
        finally:
            subprocess.run(["scancel", job], timeout=30)
        limit = show.split("TimeLimit=")[1].split()[0]
        return None if limit == "UNLIMITED" else parse_time_limit(limit)  # D-HH:MM:SS: unambiguous

    for text, seconds in SLURM_TIMES.items():
        assert slurm_seconds(text) == seconds == parse_time_limit(text), text
    for text in BAD_TIMES:
        if text != "-2":
            assert slurm_seconds(text) == "refused", text


def test_a_signal_before_the_first_step_requeues_from_the_same_checkpoint(tmp_path, slurm_cluster, reference_digest):
    """USR2 at step 25 (saved, requeued); in the requeued attempt USR2 again as soon as its tasks run, before its
    first step, as a time limit shorter than the lead sends it: nothing new to save (`checkpoint_skipped`), the job
    is requeued again (`requeued`, idle) and resumes from the same checkpoint; it ends COMPLETED, bit-identical to a
    failure-free run. Before issue 46 settle answered `none` for the second attempt (no checkpoint_saved, no batch
    signal): the summary was written and the job ended FAILED."""
    sub = tmp_path / "sub"
    sub.mkdir()
    cli = [sys.executable, "-m", "deadpool_hpc.launch.cli", "submit", "--nodes", str(ACTIVE), "--spares", "1",
           "--steps", str(STEPS), "--run-dir", "run"]
    r = subprocess.run(cli, cwd=sub, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.split()[-1]
    run_dir = str(sub / "run")
    usr2 = lambda _node: subprocess.run(["scancel", "-s", "USR2", job], check=True, timeout=30)  # noqa: E731
    try:
        _, t1 = crash_when(run_dir, usr2, lambda ev: None, 25, time.time() + 150, lambda: gone(job))
        req1 = wait_for(lambda: [e for e in events(run_dir, "requeued") if e["t"] > t1], 60, "the first requeue")[0]
        ready = os.path.join(run_dir, "ready", "1")   # the requeued attempt's tasks (SLURM_RESTART_COUNT=1) run
        wait_for(lambda: os.path.isdir(ready) and len(os.listdir(ready)) == ACTIVE + 1, 120,
                 "the requeued attempt's tasks")
        t2 = time.time()
        usr2(None)
        early = [e for e in events(run_dir, "step") if e["t"] > req1["t"] and e["t"] < t2]
        assert not early, f"the requeued attempt trained before the signal (step {early[0]['step']}): inconclusive"
        skipped = wait_for(lambda: [e for e in events(run_dir, "checkpoint_skipped") if e["t"] > t2], 90,
                           "checkpoint_skipped after the second USR2")[0]
        req2 = wait_for(lambda: [e for e in events(run_dir, "requeued") if e["t"] > t2], 60, "the second requeue")[0]
        assert wait_gone(job, 240), f"job {job} still queued"
    finally:
        subprocess.run(["scancel", job], timeout=30)
    out = job_output(os.path.join(run_dir, f"slurm-{job}.out"))
    assert final_state(job) == "COMPLETED", out
    saved = events(run_dir, "checkpoint_saved")
    assert len(saved) == 1 and saved[0]["step"] >= 25 and skipped["step"] == saved[0]["step"], (saved, skipped)
    assert req2["idle"] is True and req2["checkpoint"]["step"] == saved[0]["step"], req2
    assert not req1.get("idle")
    resumed = [e["step"] for e in events(run_dir, "resumed_from_checkpoint") if e.get("rank") == 0]
    assert resumed[-1] == saved[0]["step"], resumed  # the third attempt resumed from the first save
    assert "stopped before the first step" in out and "requeued" in out
    s = json.load(open(os.path.join(run_dir, "summary.json")))
    assert s["completed"] and s["steps_completed"] == STEPS and s["requeues"] == 2 and s["stopped"] is None, s
    assert s["param_digest"] == reference_digest, "parameters differ from the failure-free run"
    first_step = min(e["t"] for e in events(run_dir, "step") if e["t"] > req2["t"])
    rec = {"test": "usr2-before-the-first-step", "job": job, "usr2_to_saved_s": round(saved[0]["t"] - t1, 2),
           "usr2_to_requeued_s": round(req1["t"] - t1, 2), "idle_usr2_to_requeued_s": round(req2["t"] - t2, 2),
           "requeued_to_first_step_s": round(first_step - req2["t"], 2), "cut_step": saved[0]["step"]}
    print(f"\n[measure] {json.dumps(rec)}")
    with open(MEASURE, "a") as fh:
        fh.write(json.dumps(rec) + "\n")
