"""The Slurm launch's path rules and rendering, without a cluster (tests/slurm runs the real jobs).

A relative --run-dir or --summary means the submitter's current directory on every launch path; the rendered
batch script pins absolute paths and the checkout it came from (DEADPOOL_HOME).
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from deadpool_hpc.config import RunConfig
from deadpool_hpc.launch import slurm

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = paths.ROOT


def test_write_config_and_render_make_relative_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tf").mkdir()
    cfg = RunConfig(nodes=2, spares=1, steps=5, run_dir="runs/a", summary_path="s.json", metrics_textfile="tf")
    path = slurm.write_config(cfg)
    written = json.load(open(path))["output"]
    assert written["run_dir"] == str(tmp_path / "runs" / "a") and written["summary_path"] == str(tmp_path / "s.json")
    assert written["metrics_textfile"] == str(tmp_path / "tf")   # the job runs in RUN_DIR (--chdir)
    text = slurm.render(cfg)
    assert re.search(r"(?m)^#SBATCH --nodes=3$", text)
    assert f"SUMMARY=${{SUMMARY:-{tmp_path / 's.json'}}}" in text
    assert f"RUN_DIR={tmp_path / 'runs' / 'a'}" in text
    assert f"DEADPOOL_HOME=${{DEADPOOL_HOME:-{ROOT}}}" in text  # the checkout whose template was rendered
    monkeypatch.delenv("DEADPOOL_SUMMARY", raising=False)
    assert slurm.summary_out(str(tmp_path / "runs" / "a")) == str(tmp_path / "s.json")
    monkeypatch.setenv("DEADPOOL_SUMMARY", "/elsewhere/x.json")  # what the batch script exports to the tasks
    assert slurm.summary_out(str(tmp_path / "runs" / "a")) == "/elsewhere/x.json"


def test_partition_named_in_extra_sbatch_arguments():
    assert slurm._partition_of(["--partition=gpu"]) == "gpu"
    assert slurm._partition_of(["--time", "1:00", "--partition", "gpu"]) == "gpu"
    assert slurm._partition_of(["-pgpu"]) == "gpu" and slurm._partition_of(["-p", "gpu"]) == "gpu"
    assert slurm._partition_of(["--signal=B:USR2@120"]) is None and slurm._partition_of(None) is None


@pytest.mark.e2e
def test_templates_are_valid_bash():
    for name in slurm.TEMPLATES:
        r = subprocess.run(["bash", "-n", slurm.template_path(name)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def _fake_running_job(monkeypatch, slurm_job) -> list:
    """Slurm faked for settle(): job 42 RUNNING, every command recorded in the returned list and answered rc 0."""
    ran = []
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(slurm_job, "job_state", lambda job: ("RUNNING", "None"))
    monkeypatch.setattr(slurm_job.subprocess, "run",
                        lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    return ran


def test_settle_never_requeues_a_run_that_a_crash_loop_stopped(tmp_path, monkeypatch):
    """A crash loop (control/crashloop.py) saved a checkpoint too, but a requeue would resume into the same crash:
    ``stopped`` with the loop's line, no ``scontrol requeue``, with --requeue and the job still running. Slurm is
    faked, as in the test below."""
    from deadpool_hpc.events import EventLog, read_events
    from deadpool_hpc.launch import slurm_job

    slurm.write_config(RunConfig(nodes=2, spares=1, steps=50, run_dir=str(tmp_path), requeue=True))
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "LATEST").write_text('{"step": 30}')
    line = "rank 1 ended by SIGABRT at step 30 on node1, node2: a crash that follows the work, not the node; ..."
    log = EventLog(str(tmp_path / "events.jsonl"))
    log.emit("checkpoint_saved", t=2.0, step=30, reason="crash loop")
    log.emit("crash_loop", t=2.0, rank=1, end="SIGABRT", step=30, error=line)
    log.close()
    ran = _fake_running_job(monkeypatch, slurm_job)
    assert slurm_job.settle(str(tmp_path), since=1.5) == {"action": "stopped", "reason": f"a crash loop: {line}",
                                                          "checkpoint_step": 30}
    assert ran == []
    (e,) = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] in ("stopped", "requeued")]
    assert e["event"] == "stopped" and e["reason"] == f"a crash loop: {line}"


def test_settle_logs_requeued_with_its_fields_and_requeues(tmp_path, monkeypatch):
    """The in-job side's requeue (no spare left, the job still running): ``requeued`` numbered after the earlier
    ones, with the Slurm job id, the reason and the checkpoint, then ``scontrol requeue``. Slurm is faked."""
    from deadpool_hpc.events import EventLog, read_events
    from deadpool_hpc.launch import slurm_job

    slurm.write_config(RunConfig(nodes=2, spares=0, steps=50, run_dir=str(tmp_path)))
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "LATEST").write_text('{"step": 20}')
    log = EventLog(str(tmp_path / "events.jsonl"))
    log.emit("requeued", t=1.0, attempt=1, reason="preempted")
    log.emit("checkpoint_saved", t=2.0, step=20, reason="no spare node left")
    log.close()
    ran = _fake_running_job(monkeypatch, slurm_job)
    assert slurm_job.settle(str(tmp_path), since=1.5) == {"action": "requeued", "reason": "no spare node left"}
    assert ran == [["scontrol", "requeue", "42"]]
    e = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "requeued"][-1]
    assert {k: e[k] for k in ("attempt", "slurm_job_id", "reason", "time_limit", "checkpoint")} == \
        {"attempt": 2, "slurm_job_id": "42", "reason": "no spare node left", "time_limit": None,
         "checkpoint": {"step": 20}}
