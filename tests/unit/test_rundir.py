"""rundir: one way to prepare a run directory (fresh or resumed), atomic config.json, the ``requeued`` event.
Files only: nothing is launched."""
import json
import os

import pytest

from deadpool_hpc.config import RunConfig
from deadpool_hpc.errors import ConfigError
from deadpool_hpc.events import EventLog, read_events
from deadpool_hpc.rundir import RunDir, emit_requeued, prepare_run_dir, write_config

KEPT = ["config.json", "run.lock", "job.sbatch", ".secret", "batch.alive"]
ATTEMPT = ["summary.json", "finisher.lock", "task-0.log", "task-12.log", "exited/0/1", "ready/0/1"]
HISTORY = ["events.jsonl", "launcher.log", "slurm_job_id", "checkpoint/LATEST", "checkpoint/step-10/shard-0"]


def _previous_run(d):
    for name in KEPT + ATTEMPT + HISTORY:
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text('{"step": 10}' if name == "checkpoint/LATEST" else "x")


def _left(d):
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)


def test_a_fresh_run_removes_the_previous_runs_outputs(tmp_path):
    _previous_run(tmp_path)
    assert prepare_run_dir(str(tmp_path)) is None
    assert _left(tmp_path) == sorted(KEPT)


def test_a_resumed_run_keeps_the_event_log_and_the_checkpoint(tmp_path):
    _previous_run(tmp_path)
    assert prepare_run_dir(str(tmp_path), resume=True) == {"step": 10}
    assert _left(tmp_path) == sorted(KEPT + HISTORY)


def test_resume_without_a_checkpoint_is_a_fresh_run(tmp_path):
    _previous_run(tmp_path)
    (tmp_path / "checkpoint" / "LATEST").unlink()
    assert prepare_run_dir(str(tmp_path), resume=True) is None
    assert _left(tmp_path) == sorted(KEPT)


def test_rundir_prepare_needs_the_lock(tmp_path):
    rd = RunDir(str(tmp_path / "r"))
    with pytest.raises(AssertionError):
        rd.prepare()
    with rd.locked("t"):
        (tmp_path / "r" / "events.jsonl").write_text("x")
        rd.prepare()
    assert _left(tmp_path / "r") == ["run.lock"]


def test_write_config_is_atomic_and_round_trips(tmp_path, monkeypatch):
    cfg = RunConfig(nodes=2, spares=1, steps=7, run_dir=str(tmp_path))
    path = write_config(str(tmp_path), cfg)
    assert path == str(tmp_path / "config.json") and RunConfig.from_json(open(path).read()).train.steps == 7
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        write_config(str(tmp_path), RunConfig(nodes=3, spares=1, steps=9, run_dir=str(tmp_path)))
    assert synced, "the temp file is fsynced before the rename"
    assert RunConfig.from_json(open(path).read()).train.steps == 7, "a failed write leaves the old config whole"
    assert _left(tmp_path) == ["config.json"], "no temp file is left behind"


def test_emit_requeued_numbers_the_attempts(tmp_path):
    log = EventLog(str(tmp_path / "events.jsonl"), run="r1")
    e1 = emit_requeued(log, checkpoint={"step": 3})
    e2 = emit_requeued(log, slurm_job_id="7", reason="no spare node left", time_limit=None)
    e5 = emit_requeued(log, 5, launcher="submitit")
    log.close()
    ev = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "requeued"]
    assert [e["attempt"] for e in ev] == [1, 2, 5] and [e1["attempt"], e2["attempt"], e5["attempt"]] == [1, 2, 5]
    assert ev[0]["checkpoint"] == {"step": 3} and ev[0]["run"] == "r1"
    assert ev[1]["slurm_job_id"] == "7" and "time_limit" in ev[1] and ev[2]["launcher"] == "submitit"


def test_copy_config_checks_and_copies(tmp_path):
    from deadpool_hpc.launch.slurm import copy_config

    run = tmp_path / "run"
    run.mkdir()
    src = tmp_path / "my.json"
    src.write_text(RunConfig(nodes=2, spares=1, steps=5).to_json())
    assert copy_config(str(src), str(run)) == str(run / "config.json")
    assert (run / "config.json").read_text() == src.read_text()
    assert copy_config(str(run / "config.json"), str(run)) == str(run / "config.json")  # the same file: as is
    (tmp_path / "bad.json").write_text(json.dumps({"lr": 1, "nosuch": 2}))
    with pytest.raises(ConfigError, match="not a RunConfig"):
        copy_config(str(tmp_path / "bad.json"), str(run))
    with pytest.raises(ConfigError, match="cannot be read"):
        copy_config(str(tmp_path / "missing.json"), str(run))


def test_submitit_job_prepares_the_run_dir_as_every_launcher(tmp_path):
    """HotSwapJob (constructed on the submitting host) clears a previous run the same way, under the lock."""
    from deadpool_hpc.launch.submitit_job import HotSwapJob
    from deadpool_hpc.rundir import RunDirBusy

    _previous_run(tmp_path)
    job = HotSwapJob(RunConfig(nodes=2, spares=1, steps=5, run_dir=str(tmp_path)))
    assert _left(tmp_path) == sorted(KEPT)
    assert RunConfig.from_json((tmp_path / "config.json").read_text()).train.steps == 5
    assert job.job_secret("1") != job.job_secret("2")
    with RunDir(str(tmp_path)).locked("another run"):
        with pytest.raises(RunDirBusy):
            HotSwapJob(RunConfig(nodes=2, spares=1, steps=5, run_dir=str(tmp_path)))


def test_summary_paths_that_would_wreck_the_run_are_refused(tmp_path):
    """--summary naming the run directory (which the run creates), or one of the run's own files there."""
    from deadpool_hpc.errors import ConfigError
    from deadpool_hpc.rundir import check_output_file

    new = tmp_path / "new"
    with pytest.raises(ConfigError, match="is the run directory"):
        check_output_file(str(new), run_dir=str(new))
    assert check_output_file(str(new / "s.json"), run_dir=str(new)) == str(new / "s.json")  # created by the run
    for name in ("events.jsonl", "config.json", "run.lock"):
        with pytest.raises(ConfigError, match=f"would overwrite the run's own {name}"):
            check_output_file(str(new / name), run_dir=str(new))
