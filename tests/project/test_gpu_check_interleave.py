"""benchmarks/gpu_check_interleave.py (case c of gpu_check.sh): the split of one run's step times into the
replication phases, as StepSequence alternates them. Pure logic; the run itself is gpu_check.sh's (GPU_CHECK_TINY=1
runs it on the CPU)."""
import threading

import pytest

from benchmarks.gpu_check_interleave import medians, phases
from deadpool_hpc.worker.steps import StepSequence


def step(n, s):
    return {"event": "step", "step": n, "step_s": s}


def test_phases_follow_the_step_sequence_blocks():
    seq = StepSequence(world_size=1, replicate=True, interleave=3, wait_timeout=1.0, generation=lambda: 0,
                       failure=threading.Event(), watch=None, beat=lambda: None)
    events = [step(n, float(n)) for n in range(1, 13)] + [{"event": "hello"}]
    split = phases(events, block=3, warmup=0)
    # the step with 1-based index n runs the state of step n - 1: on where StepSequence replicates it
    assert split["on"] == [float(n) for n in range(1, 13) if seq.replicating(n - 1)] == [1, 2, 3, 7, 8, 9]
    assert split["off"] == [4, 5, 6, 10, 11, 12]
    assert phases(events, block=3, warmup=6) == {"on": [7, 8, 9], "off": [10, 11, 12]}


def test_medians_and_ratio_and_an_empty_phase_is_named():
    m = medians({"on": [1.0, 3.0, 2.0], "off": [2.0, 2.0]})
    assert m == {"on_s": 2.0, "off_s": 2.0, "ratio": 1.0, "on_steps": 3, "off_steps": 2}
    with pytest.raises(ValueError, match=r"on: 2, off: 0"):
        medians({"on": [1.0, 2.0], "off": []})
