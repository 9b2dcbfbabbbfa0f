"""Fixtures for the Slurm tests: a real local Slurm cluster (scripts/slurm-local-cluster.sh, 5 emulated nodes),
node crashes that are recovered after each test, and the failure-free reference digest.

The cluster needs root and apt (Debian 12); the module is skipped, with the reason, where either is missing, or
when DEADPOOL_SLURM_TESTS=0. A cluster that is already up with at least 5 nodes (`.ci/run` starts one) is used as
it is and left running; otherwise the session fixture brings one up and always tears it down.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "scripts", "slurm-local-cluster.sh")
NODES = 5
from slurm_helpers import ACTIVE  # noqa: E402  (tests/slurm is on sys.path, as for the test modules)
STEPS = 80          # a run is ~20-40 s on 2 cores; the crash comes at CRASH_STEP
CRASH_STEP = 25


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: needs a real (local) Slurm cluster; brings one up with "
                                       "scripts/slurm-local-cluster.sh (root, Debian, apt)")


def _cluster(*args, timeout=300, check=True):
    return subprocess.run(["bash", CLUSTER, *args], timeout=timeout, check=check, capture_output=True, text=True)


def _running_nodes() -> int:
    """Nodes of a local cluster that is up now (0 if none)."""
    st = _cluster("status", timeout=60, check=False)
    if st.returncode != 0:
        return 0
    n = _cluster("nodes", timeout=30, check=False)
    return len(n.stdout.split()) if n.returncode == 0 else 0


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.environ.get("DEADPOOL_SLURM_TESTS", "1") == "0":
        pytest.skip("DEADPOOL_SLURM_TESTS=0")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (scripts/slurm-local-cluster.sh up refuses otherwise)")
    if not shutil.which("sbatch") and not shutil.which("apt-get"):
        pytest.skip("no Slurm installed and no apt-get to install it (Debian 12 needed)")
    if _running_nodes() >= NODES:
        yield NODES  # someone else's cluster (.ci/run): theirs to tear down
        return
    try:
        up = _cluster("up", str(NODES), timeout=600, check=False)
    except subprocess.TimeoutExpired:
        _cluster("down", timeout=120, check=False)
        pytest.fail("slurm-local-cluster.sh up timed out")
    if up.returncode != 0:
        pytest.fail(f"slurm-local-cluster.sh up {NODES} failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}")
    try:
        yield NODES
    finally:
        _cluster("down", timeout=180, check=False)


@pytest.fixture(autouse=True)
def clean_cluster(request):
    """After each Slurm test, whatever it asserted: cancel the jobs it left in this private cluster's queue and
    resume every node left drained or down (a run drains the nodes it declares failed; a test that fails half-way
    must not leave the next tests pending on them)."""
    yield
    if "slurm_cluster" not in request.fixturenames:
        return
    q = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30)
    jobs = q.stdout.split()
    if jobs:
        subprocess.run(["scancel", *jobs], timeout=30, check=False)
        end = time.time() + 60
        while time.time() < end and subprocess.run(["squeue", "-h"], capture_output=True, text=True,
                                                    timeout=30).stdout.strip():
            time.sleep(0.5)
    bad = subprocess.run(["sinfo", "-h", "-N", "-t", "drain,drng,down", "-o", "%N"], capture_output=True, text=True,
                         timeout=30).stdout.split()
    for n in sorted(set(bad)):
        _cluster("recover", n, timeout=120, check=False)


@pytest.fixture
def fail_node(slurm_cluster):
    """fail_node("node2") crashes a node now (every process SIGKILLed, no --wait); recovered after the test."""
    failed = []

    def _fail(node, mode="crash"):
        _cluster("fail", node, mode, timeout=60)
        failed.append(node)

    yield _fail
    for n in failed:
        _cluster("recover", n, timeout=120, check=False)


@pytest.fixture(scope="session")
def reference_digest(failure_free):
    """param_digest of the same run (ACTIVE nodes, STEPS) without any failure, launched locally (no Slurm): the session's
    shared baseline (tests/conftest.py)."""
    return failure_free(nodes=ACTIVE, steps=STEPS)["param_digest"]
