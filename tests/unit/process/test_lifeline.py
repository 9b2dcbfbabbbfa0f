"""process/lifeline.py in process: where a lifeline starts and what it refuses. Its real processes (a launcher that
dies, its peers, a recycled pid) are tests/e2e/test_lifecycle.py's."""
import pytest


def test_lifeline_only_under_the_local_launcher(tmp_path):
    from deadpool_hpc.process import lifeline

    assert lifeline.start(str(tmp_path / "e.jsonl"), environ={}) is None  # Slurm: nothing starts
    with pytest.raises(ValueError, match="DEADPOOL_LAUNCHER='12x'"):
        lifeline.start(str(tmp_path / "e.jsonl"), environ={"DEADPOOL_LAUNCHER": "12x"})
