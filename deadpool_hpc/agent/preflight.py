"""The site's health check of a node before it is trusted (``--health-check CMD``; issue 28, scope 6).

Each node agent runs ``CMD`` (``sh -c``) once at start-up, while its training processes import torch and build the
model, in a session of its own, with the agent's environment (``DEADPOOL_NODE`` is the node's index; under Slurm
``SLURMD_NODENAME`` its name) and its output in ``RUN_DIR/health-check-node<N>.log``. Exit 0 means healthy. Any other
exit, or a command still running at ``--startup-timeout``, is a failure of the node like a training process that
never comes up: the node is fenced and a spare takes its place (``node_failed`` with cause ``health_check``), before
it trains a step. What a site puts there: ``nvidia-smi -q`` checks, a DCGM diagnostic (``dcgmi diag -r 1``), an
NCCL all-reduce test of the node, a file-system probe.

Not checked here: a spare again at its promotion (it ran the check at start-up, as every node), and a node's speed
against the job's (issue 26's straggler detection).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time


class HealthCheck:
    """One run of the site's command; ``poll()`` -> None while it runs, else (exit code, seconds, output tail)."""

    def __init__(self, cmd: str, env: dict, log_path: str):
        self.cmd, self.log_path = cmd, log_path
        self.t0 = time.monotonic()
        self._out = open(log_path, "wb")
        self.proc = subprocess.Popen(["sh", "-c", cmd], env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.result: tuple[int, float, str] | None = None

    def poll(self) -> tuple[int, float, str] | None:
        if self.result is None and self.proc.poll() is not None:
            self._out.close()
            self.result = (self.proc.returncode, time.monotonic() - self.t0, self._tail())
        return self.result

    def kill(self) -> None:
        """End the command and everything it started (its session)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._out.close()

    def _tail(self, n: int = 400) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(max(0, os.path.getsize(self.log_path) - n))
                return fh.read().decode(errors="replace").strip()
        except OSError:
            return ""
