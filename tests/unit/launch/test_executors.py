"""The launch vocabulary (deadpool_hpc/launch/executors.py): one executor per back-end, ``submit()`` returning a job
handle with ``result()``, ``status()``, ``swap(node)`` and ``cancel()``; and the ``deadpool`` command on top of it.

Unit tests refuse bad input before anything starts; the e2e tests start real local runs (MPI, real processes) in a
thread of the test process through LocalExecutor and act on them through the handle."""
from __future__ import annotations

import os
import time

import pytest

from deadpool_hpc.config import RunConfig
from deadpool_hpc.errors import ConfigError
from deadpool_hpc.events import read_events


def test_the_public_names_are_the_executors_and_their_jobs():
    import deadpool_hpc.launch as launch

    for name in launch.__all__:
        assert getattr(launch, name) is not None, name
    assert issubclass(launch.LocalJob, launch.DeadpoolJob) and issubclass(launch.SlurmJob, launch.DeadpoolJob)
    assert issubclass(launch.SubmititJob, launch.DeadpoolJob)
    with pytest.raises(AttributeError):
        launch.HotSwapJob   # the submitit task's callable is submitit_job's, not a launch name
    from deadpool_hpc.launch import submitit_job

    assert not hasattr(submitit_job, "executor"), "submitit's private _executor is no longer reached into"


def test_bad_settings_and_functions_are_refused_before_anything_starts(tmp_path):
    from deadpool_hpc.launch import LocalExecutor

    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"unknown run setting\(s\) \['spare'\]; accepted: .*spares"):
        LocalExecutor(spare=1, run_dir=str(run_dir)).submit()
    with pytest.raises(ValueError, match="cannot submit the lambda .* accepted: a module-level function"):
        LocalExecutor(run_dir=str(run_dir)).submit(lambda ctx: None)
    with pytest.raises(ConfigError, match="set them in one place"):
        LocalExecutor(nodes=2).submit(RunConfig(run_dir=str(run_dir)))
    with pytest.raises(ConfigError, match="cannot import 'no_such_pkg.mod'"):
        LocalExecutor(run_dir=str(run_dir)).submit("no_such_pkg.mod:train")
    with pytest.raises(ConfigError, match="--resume: .* has no checkpoint"):
        LocalExecutor(run_dir=str(run_dir)).submit(None, resume=True)
    assert not run_dir.exists(), "a refused submission wrote to the run directory"


def test_attach_finds_the_backend_from_the_target(tmp_path):
    from deadpool_hpc.launch import SlurmJob, attach

    local = attach(str(tmp_path))
    assert local.job_id is None and local.run_dir == str(tmp_path) and local.done()
    with pytest.raises(ConfigError, match="no run is in progress .* nothing to cancel"):
        local.cancel()
    (tmp_path / "slurm_job_id").write_text("4242\n")
    job = attach(str(tmp_path))
    assert isinstance(job, SlurmJob) and job.job_id == "4242" and job.run_dir == str(tmp_path)
    with pytest.raises(ConfigError, match="neither a run directory nor a Slurm job id"):
        attach(str(tmp_path / "nope"))


def test_slurm_executor_renders_what_deadpool_submit_submits(tmp_path, monkeypatch, capsys):
    from deadpool_hpc.launch import SlurmExecutor, cli

    monkeypatch.chdir(tmp_path)
    text = SlurmExecutor(signal_lead=300, nodes=2, spares=1, run_dir="runs/a").render()
    assert "#SBATCH --nodes=3" in text and "#SBATCH --signal=USR2@300" in text
    assert f"RUN_DIR={tmp_path}/runs/a" in text
    capsys.readouterr()
    assert cli.main(["submit", "--dry-run", "--nodes", "2", "--spares", "1", "--run-dir", "runs/a",
                     "--signal-lead", "300"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == text.rstrip("\n")
    assert not (tmp_path / "runs").exists(), "--dry-run wrote something"


def test_one_cli_and_the_batch_commands_in_their_own_module(capsys):
    """``deadpool`` holds what people type; the templates call only ``python -m deadpool_hpc.launch.batch``'s
    sub-commands, each of which exists."""
    import re

    from deadpool_hpc.launch import batch, cli, slurm

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    helptext = capsys.readouterr().out
    for cmd in ("run", "submit", "status", "plot", "swap", "cancel", "summary", "scaling"):
        assert re.search(rf"\b{cmd}\b", helptext), cmd
    assert not hasattr(slurm, "main"), "a second command line in slurm.py"
    used = set()
    for name in slurm.TEMPLATES:
        text = open(slurm.template_path(name)).read()
        assert "deadpool_hpc.launch.slurm " not in text, name
        used |= set(re.findall(r"-m deadpool_hpc\.launch\.batch ([a-z-]+)", text))
    assert used == {"copy-config", "write-config", "prepare", "watch", "launch", "task", "relaunch", "end",
                    "cancel-companions", "join"}, used
    for cmd in used:
        with pytest.raises(SystemExit) as info:
            batch.main([cmd, "--help"])
        assert info.value.code == 0, cmd
    assert cli.main(["summary", "/nonexistent/run"]) == 2
    assert set(slurm.BATCH_COMMANDS) == used | {"requeue-if-needed"}
    assert slurm._moved(["render"]) == 2 and "use `deadpool submit --dry-run`" in capsys.readouterr().err


def _wait_step(run_dir, step, seconds=240):
    end = time.time() + seconds
    path = os.path.join(run_dir, "events.jsonl")
    while time.time() < end:
        if os.path.exists(path) and any(e["event"] == "step" and e["step"] >= step for e in read_events(path)):
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {seconds} s")


@pytest.mark.e2e
def test_local_job_status_swap_and_result(tmp_path):
    """LocalExecutor.submit: the run goes on in a thread; status() says RUNNING with its step, swap("node1") makes a
    spare take node1's place at a step boundary, result() is the summary of the completed run."""
    from deadpool_hpc.launch import LocalExecutor

    run_dir = str(tmp_path / "run")
    job = LocalExecutor(nodes=2, spares=1, steps=40, run_dir=run_dir).submit(None)
    _wait_step(run_dir, 8)
    st = job.status()
    assert st["state"] == "RUNNING" and st["job_id"] is None and st["run"]["step"] >= 8, st
    r = job.swap("node1", reason="test")
    assert r["index"] == 1 and os.path.exists(r["path"]), r
    s = job.result(timeout=300)
    assert job.done() and job.status()["state"] == "COMPLETED"
    assert s["completed"] and s["steps_completed"] == 40 and s["swaps"] == 1, s
    assert s["failures"][0]["kind"] == "planned swap", s["failures"]


@pytest.mark.e2e
def test_local_job_cancel_stops_every_process_and_writes_the_summary(tmp_path):
    from deadpool_hpc.launch import LocalExecutor

    run_dir = str(tmp_path / "run")
    job = LocalExecutor(nodes=2, spares=1, steps=100000, run_dir=run_dir).submit("deadpool_hpc.train.demo:train")
    _wait_step(run_dir, 3)
    job.cancel()
    s = job.result(timeout=120)
    assert not s["completed"] and s["interrupted"] == "SIGTERM" and not s["processes_left"], s
    assert job.status()["state"] == "CANCELLED"
    assert any(e["event"] == "interrupted" for e in read_events(os.path.join(run_dir, "events.jsonl")))


@pytest.mark.e2e
def test_deadpool_cancel_stops_a_deadpool_run_of_another_process(tmp_path):
    """`deadpool cancel RUN_DIR` (attach: a local run) sends SIGTERM to the launcher that holds run.lock: it stops
    every process, writes the summary (`interrupted`: SIGTERM) and exits 128 + 15, as Ctrl-C's sibling would."""
    import json
    import subprocess
    import sys

    run_dir = str(tmp_path / "run")
    deadpool = [sys.executable, "-m", "deadpool_hpc.launch.cli"]
    proc = subprocess.Popen(deadpool + ["run", "--nodes", "2", "--spares", "1", "--steps", "100000", "--run-dir",
                                        run_dir], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_step(run_dir, 3)
        c = subprocess.run(deadpool + ["cancel", run_dir], capture_output=True, text=True, timeout=60)
        assert c.returncode == 0, c.stderr
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 128 + 15, (rc, proc.stderr.read())
    s = json.load(open(os.path.join(run_dir, "summary.json")))
    assert s["interrupted"] == "SIGTERM" and not s["completed"] and not s["processes_left"], s
    again = subprocess.run(deadpool + ["cancel", run_dir], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "nothing to cancel" in again.stderr, again.stderr


def test_launch_checks_paths_too(tmp_path):
    from deadpool_hpc.errors import ConfigError
    from deadpool_hpc.launch import LocalExecutor

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        LocalExecutor().run(RunConfig(nodes=2, spares=1, steps=2, run_dir=str(tmp_path / "file")))
    with pytest.raises(ConfigError, match="is a directory"):
        LocalExecutor().run(RunConfig(nodes=2, spares=1, steps=2, run_dir=str(tmp_path / "r"),
                                      summary_path=str(tmp_path)))
    assert not (tmp_path / "r").exists()
