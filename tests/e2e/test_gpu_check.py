"""benchmarks/gpu_check.py is the one script run where a GPU is lent: keep it working here. Without CUDA it runs
its snapshot code path on the CPU (shared buffer, copy, the host copy checked against the state) and skips NCCL."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.e2e   # runs benchmarks/gpu_check.py in its own interpreter

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = paths.ROOT


def test_gpu_check_script_runs_its_cpu_self_test():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--rounds", "1",
                        "--steps", "3"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "host copy equals device state: True" in p.stdout and "GPU CHECK PASSED" in p.stdout, p.stdout
    if not torch.cuda.is_available():
        assert "[nccl] skipped: no CUDA device" in p.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the device check runs for real")
def test_the_device_check_says_it_skips_without_cuda_and_exits_0():
    """benchmarks/gpu_check.sh runs `deadpool run` on the GPUs; without CUDA it runs nothing and says so."""
    p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "gpu_check: skipped: no CUDA device here" in p.stdout and "nothing was run" in p.stdout, p.stdout
