"""Slurm's signals, wherever they land (docs/slurm.md, "Signals"): real Slurm commands at a given step of a real run
on the local cluster, one test per delivery (sharing a job where one job honestly meets two deliveries).

- the batch shell alone (`scancel -b -s USR2`, what `--signal=B:USR2@T` delivers), then, in the requeued attempt,
  the steps alone (`scancel -s TERM`, what a preemption with GraceTime sends first when no --signal is set): each
  saves, requeues and resumes; the job ends COMPLETED with the failure-free digest;
- every process of the job, the job being ended (a plain `scancel`: SIGCONT + SIGTERM to all, SIGKILL after
  KillWait, as at the time limit and at the end of a preemption's grace time): saved, summary written, no requeue;
- every process of the job while it goes on (`scancel --full -s TERM`): srun kills its step at once (Slurm 22.05),
  so nothing can be saved; the documented exit (summary written, stopped reason, exit 143), never a hang;
- submitit, `scancel`: `job.result()` raises instead of returning a summary.

Measurements (signal to saved, signal to the job's end) are printed and appended to $DEADPOOL_SLURM_MEASURE.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from slurm_helpers import (ACTIVE, MEASURE, ROOT, STEPS, TRAIN, VENV, crash_when, events, final_state, gone, job_output,
                           wait_gone)

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]
OWN_VENV = os.path.realpath(VENV) == os.path.realpath(os.path.join(ROOT, ".venv"))


def _record(rec):
    print(f"\n[measure] {json.dumps(rec)}")
    with open(MEASURE, "a") as fh:
        fh.write(json.dumps(rec) + "\n")


def _scancel(*args):
    return lambda _node: subprocess.run(["scancel", *args], check=True, timeout=30)


def _after(run_dir, name, t, seconds):
    """The first `name` event written after wall time t, waiting for it up to `seconds`."""
    end = time.time() + seconds
    while time.time() < end:
        found = [e for e in events(run_dir, name) if e["t"] > t]
        if found:
            return found[0]
        time.sleep(0.3)
    raise AssertionError(f"no {name} event within {seconds} s; events: {[e['event'] for e in events(run_dir)][-15:]}")


def _template_job(tmp_path, steps=STEPS, nodes=2, spares=1):
    """The package's train.sbatch submitted from tmp_path/sub with relative RUN_DIR and SUMMARY (the job runs in
    tmp_path: --chdir), and, when the tests run from the checkout's .venv, without VENV (the template finds it)."""
    sub = tmp_path / "sub"
    sub.mkdir()
    env = f"ALL,NODES={nodes},SPARES={spares},STEPS={steps},RUN_DIR=run,SUMMARY=s.json" + ("" if OWN_VENV else f",VENV={VENV}")
    job = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", f"--nodes={nodes + spares}", f"--export={env}",
                          TRAIN], cwd=sub, capture_output=True, text=True, timeout=60, check=True).stdout.split(";")[0].strip()
    return job, sub, str(sub / "run")


def test_usr2_to_the_batch_shell_then_term_to_the_steps_requeue_and_complete(tmp_path, slurm_cluster, reference_digest):
    """The issue's repro: `deadpool submit --sbatch-arg=--signal=B:USR2@120`, then `scancel -b -s USR2` at step 20:
    the batch shell traps it and passes it on; the ranks save and the job is requeued. In the requeued attempt,
    `scancel -s TERM` at step 50 (SIGTERM to the steps, as a preemption's notice): saved and requeued again. The job
    ends COMPLETED, bit-identical to a failure-free run; the relative --summary is in the submitter's directory."""
    sub = tmp_path / "sub"
    sub.mkdir()
    cli = [sys.executable, "-m", "deadpool_hpc.launch.cli", "submit", "--nodes", str(ACTIVE), "--spares", "1", "--steps",
           str(STEPS), "--run-dir", "run", "--summary", "s.json", "--sbatch-arg=--signal=B:USR2@120"]
    r = subprocess.run(cli, cwd=sub, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.split()[-1]
    run_dir = str(sub / "run")
    try:
        _, t_usr2 = crash_when(run_dir, _scancel("-b", "-s", "USR2", job), lambda ev: None, 20, time.time() + 150,
                               lambda: gone(job))
        requeued = _after(run_dir, "requeued", t_usr2, 60)
        _, t_term = crash_when(run_dir, _scancel("-s", "TERM", job), lambda ev: None, 50, time.time() + 150,
                               lambda: gone(job), after=requeued["t"])
        assert wait_gone(job, 240), f"job {job} still queued"
    finally:
        subprocess.run(["scancel", job], timeout=30)
    out = job_output(os.path.join(run_dir, f"slurm-{job}.out"))
    assert final_state(job) == "COMPLETED", out
    s = json.load(open(sub / "s.json"))
    assert s == json.load(open(os.path.join(run_dir, "summary.json"))) and not os.path.exists(os.path.join(run_dir, "s.json"))
    assert s["completed"] and s["steps_completed"] == STEPS and s["failures"] == [] and s["requeues"] == 2, s
    assert [x["signal"] for x in s["signals"]] == ["USR2"], s["signals"]  # the TERM went to the steps only
    saved = events(run_dir, "checkpoint_saved")
    assert [e["reason"] for e in saved] == ["preempted", "preempted"], saved
    assert t_usr2 < saved[0]["t"] < requeued["t"] < t_term < saved[1]["t"], (t_usr2, saved, t_term)
    p1, p2 = s["preemptions"]
    assert p1["resumed"] and p2["resumed"] and p1["cut_step"] >= 20 and p2["cut_step"] >= 50, s["preemptions"]
    assert s["stopped"] is None
    assert s["param_digest"] == reference_digest, "parameters differ from the failure-free run"
    _record({"test": "batch-usr2-then-steps-term", "job": job, "usr2_to_saved_s": saved[0]["t"] - t_usr2,
             "term_to_saved_s": saved[1]["t"] - t_term, "cut_steps": [p1["cut_step"], p2["cut_step"]]})


def test_scancel_of_a_running_job_saves_writes_the_summary_and_is_not_requeued(tmp_path, slurm_cluster):
    """A plain `scancel` of a running job: Slurm sends SIGCONT + SIGTERM to every process of the job (batch shell,
    srun, the tasks) and SIGKILL after KillWait (5 s on this cluster). The ranks save at the next step; the batch
    script, seeing Slurm end the job, does not requeue it, logs `stopped` and writes the summary (RUN_DIR and the
    relative SUMMARY in the submit directory) within KillWait. The template is submitted from a directory that
    is not the checkout, without VENV: it finds its package through the job's Command."""
    job, sub, run_dir = _template_job(tmp_path)
    try:
        _, t_cancel = crash_when(run_dir, _scancel(job), lambda ev: None, 15, time.time() + 150, lambda: gone(job))
        assert wait_gone(job, 60), f"cancelled job {job} still queued after 60 s"
    finally:
        subprocess.run(["scancel", job], timeout=30)
    out = job_output(tmp_path / f"deadpool-{job}.out")
    assert final_state(job) == "CANCELLED", out
    assert os.path.exists(sub / "s.json"), f"no summary in the submit directory\n{out}"
    s = json.load(open(sub / "s.json"))
    assert s == json.load(open(os.path.join(run_dir, "summary.json")))
    assert not s["completed"] and s["requeues"] == 0 and not events(run_dir, "requeued"), s
    assert [x["signal"] for x in s["signals"]] == ["TERM"], s["signals"]
    (saved,) = events(run_dir, "checkpoint_saved")
    (stopped,) = events(run_dir, "stopped")
    assert saved["reason"] == "preempted" and t_cancel < saved["t"] < stopped["t"], (saved, stopped)
    assert "CANCELLED" in stopped["reason"] and s["stopped"]["reason"] == stopped["reason"], stopped
    assert s["stopped"]["checkpoint_step"] == saved["step"] == s["checkpoint"]["step"] >= 15, s
    step_dir = os.path.join(run_dir, "checkpoint", f"step{saved['step']}")
    assert sorted(os.listdir(step_dir)) == ["rank0", "rank0.json", "rank1", "rank1.json"]
    assert "not requeued: Slurm is ending the job" in out, out
    _record({"test": "scancel-running", "job": job, "term_to_saved_s": saved["t"] - t_cancel,
             "term_to_stopped_s": stopped["t"] - t_cancel, "checkpoint_step": saved["step"]})


def test_term_to_every_process_of_a_running_job_ends_it_with_the_summary(tmp_path, slurm_cluster):
    """`scancel --full -s TERM` reaches srun too while the job goes on, and srun (Slurm 22.05) answers a SIGTERM by
    killing its step with SIGKILL ("srun: forcing job termination") before any rank can act. Nothing can be saved;
    the documented exit: the batch shell survives, writes the summary with the reason and exits 143 (FAILED),
    at once, without a requeue."""
    job, sub, run_dir = _template_job(tmp_path)
    try:
        _, t_term = crash_when(run_dir, _scancel("--full", "-s", "TERM", job), lambda ev: None, 10, time.time() + 150,
                               lambda: gone(job))
        assert wait_gone(job, 60), f"job {job} still queued 60 s after SIGTERM"
    finally:
        subprocess.run(["scancel", job], timeout=30)
    t_end = time.time()
    out = job_output(tmp_path / f"deadpool-{job}.out")
    assert "srun: forcing job termination" in out, out
    assert final_state(job) == "FAILED", out
    s = json.load(open(sub / "s.json"))
    assert not s["completed"] and s["requeues"] == 0 and [x["signal"] for x in s["signals"]] == ["TERM"], s
    assert "srun answers a SIGTERM of its own by killing its step" in s["stopped"]["reason"], s["stopped"]
    assert not events(run_dir, "checkpoint_saved") and not events(run_dir, "requeued")
    _record({"test": "scancel-full-term", "job": job, "term_to_gone_s_upper_bound": t_end - t_term})


def test_submitit_scancel_raises_instead_of_returning_a_summary(tmp_path, slurm_cluster, monkeypatch):
    """submitit, a running job cancelled with `scancel` (SubmititJob.cancel()): the workers save on SIGTERM, task 0
    writes the summary (RUN_DIR, and cfg.summary_path, relative to where it was submitted) and leaves no result, so
    submitit's job.result() and job.task(0).result() raise UncompletedJobError naming the state, and the
    handle's result() returns the summary task 0 wrote (not completed, stopped: CANCELLED)."""
    from submitit.core.utils import UncompletedJobError

    from deadpool_hpc.launch import SubmititExecutor

    monkeypatch.chdir(tmp_path)
    handle = SubmititExecutor(str(tmp_path / "submitit"), timeout_min=10, slurm={"partition": "debug"}, nodes=2,
                              spares=1, steps=STEPS, run_dir="run", summary_path="s.json").submit(None)
    job = handle.submitit_job
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # relative paths were resolved when the job was submitted
    run_dir = str(tmp_path / "run")
    assert handle.run_dir == run_dir
    try:
        _, t_cancel = crash_when(run_dir, lambda _n: handle.cancel(), lambda ev: None, 15, time.time() + 150,
                                 job.done)
        end = time.time() + 120
        while not job.done() and time.time() < end:
            time.sleep(1)
        assert job.done(), f"cancelled submitit job {job.job_id} not done after 120 s"
    finally:
        job.cancel(check=False)
    job.task(0)._results_timeout_s = 2  # submitit waits this long for a result file that will never come
    with pytest.raises(UncompletedJobError, match="CANCELLED"):
        job.result()
    with pytest.raises(UncompletedJobError):
        job.task(0).result()
    assert handle.result() == json.load(open(os.path.join(run_dir, "summary.json")))
    s = json.load(open(tmp_path / "s.json"))
    assert s == json.load(open(os.path.join(run_dir, "summary.json")))
    assert not s["completed"] and s["launcher"] == "submitit" and "CANCELLED" in s["stopped"]["reason"], s
    (saved,) = events(run_dir, "checkpoint_saved")
    assert s["checkpoint"]["step"] == saved["step"] and not events(run_dir, "requeued")
    _record({"test": "submitit-scancel", "job": job.job_id, "term_to_saved_s": saved["t"] - t_cancel})
