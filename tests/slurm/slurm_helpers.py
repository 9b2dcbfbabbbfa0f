"""Helpers shared by the Slurm tests (tests/slurm): the event log, sacct's final state, acting at a step."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from deadpool_hpc.events import read_events

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 80        # keep equal to conftest.STEPS (the reference run)
CRASH_STEP = 25
# active nodes of the Slurm tests' jobs (+ 1 spare): what they test is the Slurm path (sbatch, srun, submitit,
# requeue, a node crashed), not the world size, which the local tests cover up to 4 x 2 ranks. Every emulated node
# shares this machine's 2 cores and each costs ~6 CPU-s to start (its agent's and its training process's torch
# import, the model build): 2 + 1 nodes start in about half the time of 4 + 1 (issue 24)
ACTIVE = 2
# the train template as `deadpool submit` finds it (the package's copy); the scaling template through the checkout's
# sbatch/ link, as docs/slurm.md submits it: both ways a template finds its home (DEADPOOL_HOME) are exercised
TRAIN = os.path.join(ROOT, "deadpool_hpc", "launch", "templates", "train.sbatch")
SCALING = os.path.join(ROOT, "sbatch", "scaling.sbatch")
VENV = sys.prefix  # the venv running the tests (has deadpool-hpc installed)
MEASURE = os.environ.get("DEADPOOL_SLURM_MEASURE", "/tmp/deadpool-slurm-measure.jsonl")


def events(run_dir, name=None):
    path = os.path.join(run_dir, "events.jsonl")
    ev = list(read_events(path)) if os.path.exists(path) else []
    return [e for e in ev if e["event"] == name] if name else ev


def final_state(job_id, timeout=30):
    """The job's final state in sacct (the allocation record; --no-kill leaves RESIZING records before it)."""
    end = time.time() + timeout
    state = None
    while time.time() < end:
        out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "JobID,State"], capture_output=True,
                             text=True, timeout=20).stdout
        rows = [l.split("|") for l in out.splitlines() if l.split("|")[0] == str(job_id)]
        state = rows[-1][1].split()[0] if rows else None
        if state not in (None, "RUNNING", "PENDING", "RESIZING", "COMPLETING", "REQUEUED"):
            return state
        time.sleep(1)
    return state


def gone(job_id) -> bool:
    """True once the job is no longer in squeue (ended, not merely requeued)."""
    return not subprocess.run(["squeue", "-h", "-j", str(job_id)], capture_output=True, text=True,
                              timeout=20).stdout.strip()


def wait_gone(job_id, seconds) -> bool:
    end = time.time() + seconds
    while time.time() < end and not gone(job_id):
        time.sleep(0.5)
    return gone(job_id)


def host_of(mpi_rank):
    """pick_node for crash_when: the host MPI rank ``mpi_rank`` runs on in this job (whatever nodes Slurm gave it)."""
    return lambda ev: next(e["host"] for e in ev if e["event"] == "hello" and e.get("role", "agent") == "agent" and e["mpi_rank"] == mpi_rank)


def crash_when(run_dir, fail_node, pick_node, at_step, deadline, done, after: float = 0.0):
    """Poll the event log; once some rank logged step >= at_step (in a step event written after ``after``, wall
    time), call fail_node(pick_node(events)). Returns (pick_node's value, the time of the call)."""
    while time.time() < deadline and not done():
        ev = events(run_dir)
        steps = [e["step"] for e in ev if e["event"] == "step" and e["t"] > after]
        if steps and max(steps) >= at_step:
            node = pick_node(ev)
            t = time.time()
            fail_node(node)
            return node, t
        time.sleep(0.2)
    raise AssertionError(f"the run never reached step {at_step} (events: {len(events(run_dir))})")


def job_output(path) -> str:
    return open(path).read() if os.path.exists(path) else f"({path} missing)"


def wait_for(cond, seconds, what, poll=0.1):
    """``cond()``'s first truthy value within ``seconds``; else AssertionError "``what`` within N s"."""
    end = time.time() + seconds
    while time.time() < end:
        got = cond()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"{what} within {seconds} s")


def crash_in_the_start_up(run_dir, task, fail_node, seconds=120):
    """Crash the node of launch 0.0's ``task`` as soon as its task runs (its beacon, launch/slurm_startup.py, names the
    host), while the node agents are still in srun's launch or MPI_Init: no agent may have said hello yet (a fixed
    delay after RUNNING raced with a fast start-up: seen, the world already existed 1 s after RUNNING). Returns
    the host."""
    beacon = os.path.join(run_dir, "starting", "0.0", str(task))
    host = wait_for(lambda: os.path.exists(beacon) and open(beacon).read().strip(), seconds,
                    f"task {task}'s start-up beacon", poll=0.02)
    fail_node(host)
    hello = [e for e in events(run_dir, "hello") if e.get("role") == "agent"]
    assert not hello, f"the agents' MPI world existed before {host} was crashed: {hello}"
    return host
