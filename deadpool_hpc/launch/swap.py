"""``deadpool swap JOBID|RUN_DIR NODE``: an operator's planned swap (maintenance, a node that logs ECC errors).

The node named leaves the running job at its next step boundary and a spare takes its place, with no step
recomputed (agent/planned.py); the request travels as the file RUN_DIR/swap/NODE.json, read by the
node's agent through the built-in ``swap-request`` detector (agent/health.py). NODE is Slurm's node name for a
Slurm job, ``node<index>`` for a local run (``deadpool run``).

Everything is checked before the request is written, so a refused request leaves the run alone: the job must be
running with replication on, NODE one of its active nodes (not a spare, not already failed), and a spare must be
left. Requests for several nodes are taken one at a time by the job (agent/planned.py: the swap lease).
"""
from __future__ import annotations

import os

from ..agent.health import request_path, write_request
from ..errors import ConfigError
from ..events import read_events
from ..rundir import RunDir, RunDirBusy, check_free
from .slurm import status
from .slurm_common import load_config


def _view(events: list[dict], total_nodes: int, active_nodes: int) -> tuple[set[int], list[int]]:
    """(failed nodes, spare nodes left) of the current attempt of the run (events after its last requeue: a requeued
    attempt starts again from the start-up layout), from its decisions (``failed_nodes``; ``replaced``: failed node
    -> the spare that took its place)."""
    last = max((i for i, e in enumerate(events) if e["event"] == "requeued"), default=-1)
    events = events[last + 1:]
    failed = {int(n) for e in events if e["event"] == "decision" for n in e.get("failed_nodes") or []}
    failed |= {e["node"] for e in events if e["event"] == "node_failed" and "node" in e}
    promoted = {int(v) for e in events if e["event"] == "decision" for v in (e.get("replaced") or {}).values()}
    spares = [n for n in range(active_nodes, total_nodes) if n not in promoted and n not in failed]
    return failed, spares


def request(target: str, node: str, reason: str = "deadpool swap") -> dict:
    """Ask the run ``target`` (a Slurm job id or a run directory) to swap ``node`` out at its next step boundary.
    Returns ``{"run_dir", "node", "index", "path"}``. Raises ConfigError (exit 2), writing nothing, if the run is
    not running, ``node`` is not one of its active nodes, or no spare is left."""
    st = status(target)
    run = st.get("run")
    if not run or not os.path.exists(RunDir(run["run_dir"]).config):
        raise ConfigError(f"no run directory found for {target!r}; accepted: a running job's id (a job submitted "
                          f"with deadpool submit) or its run directory")
    run_dir = run["run_dir"]
    job = st.get("slurm")
    if job is not None:
        if job.get("state") != "RUNNING":
            raise ConfigError(f"job {job['job_id']} is {job.get('state') or 'unknown to Slurm'}, not RUNNING: "
                              f"there is no run to swap a node of")
    else:
        try:
            check_free(run_dir)
        except RunDirBusy:
            pass  # a live launcher holds it: the run is in progress
        else:
            raise ConfigError(f"no run is in progress in {run_dir} (nobody holds its run.lock): nothing to swap")
    if run.get("finished"):
        raise ConfigError(f"the run in {run_dir} has finished: nothing to swap")
    cfg = load_config(run_dir)
    if not cfg.replication.replicate:
        raise ConfigError(f"the run in {run_dir} keeps no replicas (--no-replicate): a node's state cannot be handed "
                          f"to a spare; accepted: a run with replication on")
    events = list(read_events(RunDir(run_dir).events))
    failed, spares = _view(events, cfg.layout.total_nodes, cfg.layout.nodes)
    if job is not None:  # Slurm's node names, from each agent's newest hello
        names = {e["mpi_rank"]: e.get("slurm_node") for e in events
                 if e["event"] == "hello" and e.get("role") == "agent"}
    else:
        names = {i: f"node{i}" for i in range(cfg.layout.total_nodes)}
    index = next((i for i, n in names.items() if n == node), None)
    if index is None:
        known = ", ".join(str(n) for _, n in sorted(names.items())) or "none known yet (no node agent has started)"
        raise ConfigError(f"node {node!r} is not in the run in {run_dir}; its nodes: {known}")
    if index in failed:
        raise ConfigError(f"node {node!r} (node{index}) already failed and left the run")
    if index in spares:
        raise ConfigError(f"node {node!r} (node{index}) is a spare: nothing to hand over; accepted: an active node "
                          f"({', '.join(str(names[i]) for i in sorted(names) if i not in spares and i not in failed)})")
    if not spares:
        raise ConfigError(f"no spare node left in the run in {run_dir}: {node!r} cannot be swapped out")
    if os.path.exists(request_path(run_dir, node)):
        raise ConfigError(f"a swap of {node!r} is already requested ({request_path(run_dir, node)})")
    path = write_request(run_dir, node, reason)
    return {"run_dir": run_dir, "node": node, "index": index, "path": path}
