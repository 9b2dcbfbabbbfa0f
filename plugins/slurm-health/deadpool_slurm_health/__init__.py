"""Slurm node health for deadpool-hpc: a node that Slurm drains, marks down or failing (an admin's ``scontrol update
state=drain``, a HealthCheckProgram's verdict, slurmd's own) is swapped out at the job's next step boundary, before it
crashes: a *planned* swap, no step recomputed (deadpool_hpc/agent/health.py, agent/node.py).

Each node agent checks its own node, ``scontrol show node -o $SLURMD_NODENAME``, every
``DEADPOOL_SLURM_HEALTH_INTERVAL`` seconds (default 30): one slurmctld RPC per node and interval, so a job of N nodes
costs slurmctld N / interval RPCs per second (512 nodes: 17/s at the default). The detector applies only inside a
Slurm job step (``SLURM_JOB_ID`` and ``SLURMD_NODENAME`` set); elsewhere it is not built.

States that ask for a swap (``UNHEALTHY``): DRAIN (draining and drained), DOWN, FAIL / FAILING, NOT_RESPONDING,
MAINT, REBOOT_REQUESTED / REBOOT_ISSUED, POWER_DOWN / POWERING_DOWN. The reason Slurm records (``Reason=``) goes into
the event log and the summary.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

from deadpool_hpc.agent.health import NodeInfo, Unhealthy

__all__ = ["SlurmNodeState", "detector", "parse_node", "UNHEALTHY"]

UNHEALTHY = frozenset({"DRAIN", "DRAINING", "DRAINED", "DOWN", "FAIL", "FAILING", "NOT_RESPONDING", "MAINT",
                       "REBOOT_REQUESTED", "REBOOT_ISSUED", "POWER_DOWN", "POWERING_DOWN"})
DEFAULT_INTERVAL_S = 30.0
SCONTROL_TIMEOUT_S = 10.0


def parse_node(line: str) -> tuple[set[str], str | None]:
    """(state flags, reason) of one line of ``scontrol show node -o NAME``: ``State=MIXED+DRAIN`` gives
    {"MIXED", "DRAIN"} (a trailing ``*``, "not responding", gives NOT_RESPONDING); the reason without its
    ``[user@time]`` stamp, None if Slurm records none."""
    m = re.search(r"\bState=(\S+)", line)
    if m is None:
        raise ValueError(f"no State= in scontrol's output: {line[:200]!r}")
    state = m.group(1)
    flags = {f for f in state.rstrip("*").upper().split("+") if f}
    if state.endswith("*"):
        flags.add("NOT_RESPONDING")
    r = re.search(r"\bReason=(.*?)(?: \[[^\]]*\])?(?= \w+=|$)", line)
    return flags, (r.group(1).strip() or None) if r else None


class SlurmNodeState:
    """Detector: this node's state in Slurm. ``check()`` returns Unhealthy when a state flag is in UNHEALTHY; raises
    RuntimeError when scontrol fails (logged by the agent as ``detector_error``; the run goes on)."""

    def __init__(self, nodename: str, interval_s: float = DEFAULT_INTERVAL_S, scontrol: str = "scontrol"):
        self.nodename = nodename
        self.interval_s = interval_s
        self.scontrol = scontrol

    def check(self) -> Unhealthy | None:
        out = subprocess.run([self.scontrol, "show", "node", "-o", self.nodename], capture_output=True, text=True,
                             timeout=SCONTROL_TIMEOUT_S)
        if out.returncode != 0:
            raise RuntimeError(f"scontrol show node {self.nodename} exited {out.returncode}: {out.stderr.strip()[:200]}")
        flags, reason = parse_node(out.stdout.strip())
        bad = sorted(flags & UNHEALTHY)
        if not bad:
            return None
        return Unhealthy(f"Slurm marks {self.nodename} {'+'.join(bad)}" + (f": {reason}" if reason else ""))


def detector(node: NodeInfo) -> SlurmNodeState | None:
    """Entry point (group ``deadpool_hpc.detectors``). None outside a Slurm job step. Raises ValueError for a bad
    DEADPOOL_SLURM_HEALTH_INTERVAL and RuntimeError when scontrol is not on PATH (the run does not start)."""
    if not node.slurm_node or not node.slurm_job_id:
        return None
    raw = os.environ.get("DEADPOOL_SLURM_HEALTH_INTERVAL", str(DEFAULT_INTERVAL_S))
    try:
        interval = float(raw)
    except ValueError:
        interval = -1.0
    if not interval > 0:
        raise ValueError(f"DEADPOOL_SLURM_HEALTH_INTERVAL={raw!r}: accepted: seconds between checks, > 0")
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise RuntimeError("scontrol is not on PATH of the node agent: the Slurm health detector cannot ask Slurm")
    return SlurmNodeState(node.slurm_node, interval, scontrol)
