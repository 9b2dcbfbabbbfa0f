"""Slurm's side of a lost node: drain it, and record what Slurm says of it (its State and Reason).

Run by the batch host's keeper (launch/keeper.py; or the task standing in for it) and by the task
that ends a job whose batch host died (slurm_job.finish_headless). Both need SlurmUser/admin rights to drain; a
refusal is logged, never raised.
"""
from __future__ import annotations

import logging
import re
import subprocess
import time

_log = logging.getLogger(__name__)


def drain(node: str, reason: str) -> bool:
    """``scontrol update nodename=NODE state=drain``: needs SlurmUser/admin (or root). False if refused."""
    try:
        out = subprocess.run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _log.warning("drain %s: %s", node, exc)
        return False
    if out.returncode != 0:
        _log.warning("drain %s refused (needs SlurmUser/admin): %s", node, out.stderr.strip())
    return out.returncode == 0


# Slurm's view of a lost node (``scontrol show node``), asked by the watcher off the agents' path: at once, then
# every NODE_STATE_EVERY_S until Slurm's State says the node is down or not responding, at most NODE_STATE_WAIT_S
# (Slurm marks a silent node after SlurmdTimeout: 300 s by default, 5 s on scripts/slurm-local-cluster.sh)
NODE_STATE_WAIT_S = 120.0
NODE_STATE_EVERY_S = 2.0
NODE_STATE_TIMEOUT_S = 5.0   # one scontrol call
DOWN_FLAGS = frozenset({"DOWN", "NOT_RESPONDING", "FAIL", "FAILING", "POWER_DOWN", "POWERED_DOWN", "REBOOT_ISSUED"})
_REASON = re.compile(r"(?:^|\s)Reason=(.*?)(?:\s+\[[^\]]*\])?\s*(?=$|\s[A-Za-z]+=)")


def parse_node_state(text: str) -> tuple[str | None, str | None]:
    """(State, Reason) of one node in ``scontrol show node -o NAME``'s output; Reason without its ``[user@time]``;
    None for a field that is not there."""
    state = re.search(r"(?:^|\s)State=(\S+)", text)
    reason = _REASON.search(text.strip())
    return (state.group(1) if state else None), (reason.group(1).strip() or None if reason else None)


def node_state(host: str) -> tuple[str | None, str | None]:
    """Slurm's (State, Reason) of ``host`` now; (None, None) when scontrol cannot say (within
    NODE_STATE_TIMEOUT_S)."""
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", host], capture_output=True, text=True,
                             timeout=NODE_STATE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    return parse_node_state(out.stdout) if out.returncode == 0 else (None, None)


def is_down(state: str | None) -> bool:
    """Whether a State (``IDLE+DRAIN``, ``DOWN+NOT_RESPONDING``, ``MIXED*``...) says Slurm sees the node as gone."""
    return bool(state) and (state.endswith("*") or bool(DOWN_FLAGS & set(state.rstrip("*").split("+"))))


class NodeStates:
    """What Slurm says of each host the run lost, as ``node_state`` events (``host``, ``lost_node``: the run's node
    index, ``generation``: the decision's, ``state``, ``reason``, ``after_s``: seconds since the watcher saw the
    decision, ``settled``: Slurm sees it down): the first answer, then each change until settled or
    NODE_STATE_WAIT_S. ``query(host) -> (state, reason)`` (``node_state``); ``log``: an events.EventLog."""

    def __init__(self, log, query=node_state, wait_s: float = NODE_STATE_WAIT_S, every_s: float = NODE_STATE_EVERY_S):
        self.log, self.query, self.wait_s, self.every_s = log, query, wait_s, every_s
        self.asked: set[str] = set()
        self._pending: dict[str, dict] = {}

    def lost(self, host: str, lost_node: int, generation: int) -> None:
        self.asked.add(host)
        self._pending[host] = {"lost_node": lost_node, "generation": generation, "t0": time.monotonic(),
                               "next": 0.0, "last": None}
        self.poll()

    def poll(self) -> None:
        now = time.monotonic()
        for host, p in list(self._pending.items()):
            if now < p["next"]:
                continue
            state, reason = self.query(host)
            after = time.monotonic() - p["t0"]
            settled, late = is_down(state), after >= self.wait_s
            if (state, reason) != p["last"] or settled or late:
                self.log.emit("node_state", host=host, lost_node=p["lost_node"], generation=p["generation"],
                              state=state, reason=reason, after_s=round(after, 3), settled=settled)
                p["last"] = (state, reason)
            if settled or late:
                del self._pending[host]
            else:
                p["next"] = now + self.every_s
