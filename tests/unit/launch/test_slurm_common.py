"""launch/slurm_common.py: the Slurm path's summary writer, in process."""
import json
import os


def test_slurm_summary_that_cannot_be_written_is_printed_not_raised(tmp_path, capsys):
    """The Slurm path's summary writer (batch script, headless finisher, submitit): an output that refuses the write
    (/dev/full: ENOSPC) leaves summary_written False with the reason, and the whole summary on stdout."""
    from deadpool_hpc.config import RunConfig
    from deadpool_hpc.launch.slurm_common import write_summary
    from deadpool_hpc.rundir import write_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(str(run_dir), RunConfig(nodes=2, steps=3, run_dir=str(run_dir)))
    s = write_summary(str(run_dir), out="/dev/full")
    assert s["summary_written"] is False and "/dev/full: ENOSPC" in s["summary_error"], s.get("summary_error")
    printed = capsys.readouterr().out
    body = printed.split("--- deadpool summary", 1)[1].split("\n", 1)[1].split("--- end of deadpool summary", 1)[0]
    assert json.loads(body)["summary_error"] == s["summary_error"]
    assert os.path.exists(run_dir / "summary.json")   # the one that could be written was
