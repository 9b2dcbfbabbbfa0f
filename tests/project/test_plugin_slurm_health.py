"""plugins/slurm-health: parsing scontrol's node line and when the detector applies (pure logic). The plugin's proof
is tests/slurm/test_slurm_planned_swap.py: a node drained on the real local Slurm cluster is swapped out."""
from __future__ import annotations

import pytest

from deadpool_hpc.agent.health import NodeInfo, installed

slurm_health = pytest.importorskip("deadpool_slurm_health", reason="plugins/slurm-health is not installed "
                                                                   "(scripts/bootstrap.sh installs it)")


def node(**kw):
    return NodeInfo(**{**dict(node=1, hostname="h", slurm_node="node2", slurm_job_id="7", run_dir="/r"), **kw})


@pytest.mark.parametrize("line, flags, reason", [
    ("NodeName=node2 Arch=x86_64 State=MIXED+DRAIN ThreadsPerCore=1 Reason=ECC errors on GPU 3 [root@2026-12-01T14:15:00] "
     "Comment=(null)", {"MIXED", "DRAIN"}, "ECC errors on GPU 3"),
    ("NodeName=node2 State=DOWN* Reason=Not responding [slurm@2026-12-01T14:15:00]", {"DOWN", "NOT_RESPONDING"},
     "Not responding"),
    ("NodeName=node2 State=ALLOCATED ThreadsPerCore=1", {"ALLOCATED"}, None),
    ("NodeName=node2 State=IDLE+DRAIN Reason=hc", {"IDLE", "DRAIN"}, "hc"),
])
def test_parse_node(line, flags, reason):
    assert slurm_health.parse_node(line) == (flags, reason)


def test_no_state_is_an_error_naming_the_output():
    with pytest.raises(ValueError, match="no State="):
        slurm_health.parse_node("slurm_load_node error: Invalid node name specified")


def test_registered_and_built_only_inside_a_slurm_job_step(monkeypatch):
    assert "slurm-health" in installed() and "swap-request" in installed()
    assert slurm_health.detector(node(slurm_node=None, slurm_job_id=None)) is None
    monkeypatch.setenv("DEADPOOL_SLURM_HEALTH_INTERVAL", "0")
    with pytest.raises(ValueError, match=r"DEADPOOL_SLURM_HEALTH_INTERVAL='0': accepted: seconds between checks, > 0"):
        slurm_health.detector(node())
    monkeypatch.setenv("DEADPOOL_SLURM_HEALTH_INTERVAL", "2.5")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="scontrol is not on PATH"):
        slurm_health.detector(node())
