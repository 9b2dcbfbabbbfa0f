"""Replacement nodes on the real local cluster (launch/companion.py, docs/replacement-nodes.md "Operations"): a job
with ``--spare-floor`` asks Slurm for a companion job when its pool falls below the floor, and everything it asked
of Slurm is gone when it ends.

The companion jobs are submitted held (``DEADPOOL_COMPANION_SBATCH_ARGS=--hold``): a cluster with no free node,
whatever else runs on this shared cluster. The cluster is shared with other work: this module never brings it up
or down (it is skipped when it is not up: ``bash scripts/slurm-local-cluster.sh up 5``), and cancels only the jobs
it submitted, by job id (the conftest's clean-up of every queued job is replaced here by a no-op).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest
from slurm_helpers import (ACTIVE, crash_when, events, final_state, host_of, job_output, wait_for, wait_gone)

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "scripts", "slurm-local-cluster.sh")
MEASURE = os.environ.get("DEADPOOL_SLURM_MEASURE", "/tmp/deadpool-slurm-measure.jsonl")


@pytest.fixture(scope="module")
def cluster_up():
    if os.environ.get("DEADPOOL_SLURM_TESTS", "1") == "0":
        pytest.skip("DEADPOOL_SLURM_TESTS=0")
    st = subprocess.run(["bash", CLUSTER, "status"], capture_output=True, text=True, timeout=60)
    if st.returncode != 0:
        pytest.skip("the local Slurm cluster is not up (bash scripts/slurm-local-cluster.sh up 5)")


@pytest.fixture(autouse=True)
def clean_cluster():
    """(replaces the conftest's) the cluster is shared: each test cancels its own jobs by id, nothing else."""
    yield


def _squeue_name(name: str) -> list[list[str]]:
    out = subprocess.run(["squeue", "-h", f"--name={name}", "-o", "%i %T %r"], capture_output=True, text=True,
                         timeout=30).stdout
    return [l.split() for l in out.splitlines() if l.strip()]


def _submit(tmp_path, *args, nodes: int = ACTIVE, hold: bool = True) -> tuple[str, str]:
    cli = [sys.executable, "-m", "deadpool_hpc.launch.cli", "submit", "--nodes", str(nodes), "--spares", "1",
           "--run-dir", "run", *args]
    env = dict(os.environ, DEADPOOL_COMPANION_SBATCH_ARGS="--hold" if hold else "")
    r = subprocess.run(cli, cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[-1], str(tmp_path / "run")


@contextlib.contextmanager
def _running(tmp_path, *args, **kw):
    """Submit (``_submit``); yield (job, run_dir, fail): ``fail(host)`` crashes a host with the cluster script, and
    ``fail.hosts`` lists the hosts to bring back. Then, whatever happened, the job and its companions are cancelled
    by id and every host in ``fail.hosts`` recovered."""
    job, run_dir = _submit(tmp_path, *args, **kw)
    hosts: list[str] = []

    def fail(node: str) -> None:
        subprocess.run(["bash", CLUSTER, "fail", node, "crash"], check=True, timeout=60)
        hosts.append(node)

    fail.hosts = hosts
    try:
        yield job, run_dir, fail
    finally:
        subprocess.run(["scancel", job, *_companion_ids(run_dir)], timeout=30)
        for n in hosts:
            subprocess.run(["bash", CLUSTER, "recover", n], timeout=120, check=False)


def _completed(job, run_dir, steps: int) -> dict:
    """The job ended COMPLETED with ``steps`` steps trained: its summary."""
    assert final_state(job) == "COMPLETED", job_output(os.path.join(run_dir, f"slurm-{job}.out"))
    s = json.load(open(os.path.join(run_dir, "summary.json")))
    assert s["completed"] and s["steps_completed"] == steps, s
    return s


def _record(rec: dict) -> None:
    print(f"\n[measure] {json.dumps(rec)}")
    with open(MEASURE, "a") as fh:
        fh.write(json.dumps(rec) + "\n")


def _companion_ids(run_dir) -> list[str]:
    return [e["job_id"] for e in events(run_dir, "companion_submitted")]


def _no_job_left(job, run_dir):
    """squeue shows neither the main job nor any companion of it; each companion ended CANCELLED."""
    assert wait_gone(job, 60), f"job {job} still queued"
    assert wait_for(lambda: not _squeue_name(f"deadpool-spare-{job}"), 30, "no companion job queued"), \
        _squeue_name(f"deadpool-spare-{job}")
    for c in _companion_ids(run_dir):
        assert final_state(c) == "CANCELLED", c


def test_a_lost_spare_asks_for_a_companion_cancelled_after_spare_wait_when_no_node_is_free(tmp_path, cluster_up):
    """2 + 1 with --spare-floor 1 --spare-wait 5: node1 (MPI rank 1) crashed at step 20, the spare takes its place,
    the pool is empty (below the floor): one companion job is submitted, stays pending (held: no free node), and
    is cancelled 5 s later; the job goes on and ends COMPLETED; nothing of the run is left in squeue."""
    with _running(tmp_path, "--steps", "200", "--spare-floor", "1", "--spare-wait", "5") as (job, run_dir, fail):
        _, t_kill = crash_when(run_dir, fail, host_of(1), 20, time.time() + 150, lambda: wait_gone(job, 0))
        sub = wait_for(lambda: events(run_dir, "companion_submitted"), 30, "a companion job submitted")[0]
        cid = sub["job_id"]
        queued = _squeue_name(f"deadpool-spare-{job}")
        assert queued and queued[0][0] == cid and queued[0][1] == "PENDING", queued   # held: no node for it
        canc = wait_for(lambda: [e for e in events(run_dir, "companion_cancelled") if e["job_id"] == cid], 30,
                        "the companion cancelled after --spare-wait")[0]
        assert canc["reason"] == "not started within 5 s" and canc["accepted"], canc
        assert wait_gone(job, 180), f"job {job} still queued"
    _completed(job, run_dir, 200)
    _no_job_left(job, run_dir)
    assert len(_companion_ids(run_dir)) == 1   # not asked again: the pool did not shrink further
    pool = events(run_dir, "spare_pool")
    assert pool[0]["spares"] == 1 and pool[-1]["spares"] == 0, pool
    _record({"test": "companion-cancelled-after-wait", "job": job, "companion": cid,
             "kill_to_submitted_s": round(sub["t"] - t_kill, 2),
             "submitted_to_cancelled_s": round(canc["t"] - sub["t"], 2)})


def test_a_companion_still_pending_when_the_job_ends_is_cancelled_by_the_job(tmp_path, cluster_up):
    """2 + 1 with --spare-floor 2 (one spare below it from the start) and --spare-wait 600: the companion job is
    submitted at once and stays pending (held); the job trains on, is not held back by it, ends COMPLETED, and its
    batch script's exit trap cancels the companion: nothing of the run is left in squeue."""
    with _running(tmp_path, "--steps", "40", "--spare-floor", "2", "--spare-wait", "600") as (job, run_dir, _):
        sub = wait_for(lambda: events(run_dir, "companion_submitted"), 90, "a companion job submitted")[0]
        assert wait_gone(job, 180), f"job {job} still queued"
    _completed(job, run_dir, 40)
    out = job_output(os.path.join(run_dir, f"slurm-{job}.out"))
    _no_job_left(job, run_dir)
    assert _companion_ids(run_dir) == [sub["job_id"]]   # floor 2, pool 1: one missing, asked once
    canc = [e for e in events(run_dir, "companion_cancelled") if e["job_id"] == sub["job_id"]]
    assert [e["reason"] for e in canc] == ["the job ends"], canc
    assert f"companion jobs of {job} cancelled: {sub['job_id']}" in out, out[-2000:]


JOIN_STEPS = 400


@pytest.mark.parametrize("first,second", [(0, 2), (1, 0)], ids=["batch-host-first-then-node2",
                                                                 "then-its-sponsor-node0"])
def test_a_replacement_node_joins_the_running_job_and_takes_the_next_loss(tmp_path, cluster_up, failure_free, first,
                                                                          second):
    """3 + 1 with --spare-floor 1 on the 5-node cluster: the host of node ``first`` crashed whole at step 30 (the
    cluster script's crash); the spare takes over; the pool is empty, so a companion job is submitted, starts on the
    fifth node, and its agent joins the running job as a spare (the lost node's slot, control/joining.py); then the
    host of node ``second`` is crashed, and the joined node is the one promoted; the pool is empty again and a second
    request (no node left for it) stays pending until the job's end cancels it. The job ends COMPLETED with the
    failure-free digest, the joined node's companion job COMPLETED with it, and nothing of the run is left in
    squeue. Node 0 is the batch host, the coordinator and the lowest agent at once. Lost first: its keeper dies
    with it, and the lowest live task stands in for it (launch/keeper.py, ``keeper_stand_in``) and asks for the
    replacement. Lost second: it is also the joined node's sponsor: the joined node re-attaches to another agent
    and takes rank 0, and the stand-in asks for the next node. Prints (and records) the time from the first crash
    to the replacement being a ready spare."""
    ref = failure_free(nodes=3, steps=JOIN_STEPS)["param_digest"]
    with _running(tmp_path, "--steps", str(JOIN_STEPS), "--spare-floor", "1", "--spare-wait", "300", nodes=3,
                  hold=False) as (job, run_dir, fail):
        host1, t_kill = crash_when(run_dir, fail, host_of(first), 30, time.time() + 150, lambda: wait_gone(job, 0))
        joined = wait_for(lambda: events(run_dir, "node_joined"), 90, "the replacement node joined")[0]
        admitted = events(run_dir, "node_admitted")[0]
        assert joined["node"] == first == admitted["node"], (joined, admitted)   # the lost node's slot
        assert joined["job_id"] == events(run_dir, "companion_submitted")[0]["job_id"], joined
        host2, t_kill2 = crash_when(run_dir, fail, host_of(second), 0, time.time() + 60, lambda: wait_gone(job, 0),
                                    after=joined["t"])
        assert wait_gone(job, 180), f"job {job} still queued"
    s = _completed(job, run_dir, JOIN_STEPS)
    assert s["param_digest"] == ref, "parameters differ from the failure-free run"
    assert wait_gone(job, 60) and wait_for(lambda: not _squeue_name(f"deadpool-spare-{job}"), 30,
                                           "no companion job queued"), _squeue_name(f"deadpool-spare-{job}")
    decisions = events(run_dir, "decision")
    assert [d["failed_nodes"] for d in decisions] == [[first], [second]], decisions
    assert decisions[1]["promoted"] == {str(second): first} and decisions[1]["reason"] == "hot swap", decisions[1]
    ids = _companion_ids(run_dir)
    assert len(ids) == 2 and final_state(ids[0]) == "COMPLETED" and final_state(ids[1]) == "CANCELLED", ids
    subs = events(run_dir, "companion_submitted")
    stand_in = events(run_dir, "keeper_stand_in")
    lost0 = decisions[0] if first == 0 else decisions[1]
    assert len(stand_in) == 1 and stand_in[0]["t"] > lost0["t"], stand_in       # one stand-in, once node 0 is lost
    assert stand_in[0]["task"] == min({1, 2, 3} - {first, second}), stand_in  # the lowest live task
    asked_by_stand_in = [e for e in subs if e["pid"] == stand_in[0]["pid"]]
    assert asked_by_stand_in == (subs if first == 0 else subs[1:]), (subs, stand_in)
    if second == 0:
        took = events(run_dir, "node_reattached")
        assert took and took[0]["node"] == first and took[0]["sponsor"] != 0, took
    _record({"test": f"replacement-joins-node{first}-first-then-node{second}", "job": job, "companion": ids[0],
             "crashed": [host1, host2],
             "crash_to_stand_in_s": round(stand_in[0]["t"] - (t_kill if first == 0 else t_kill2), 2),
             "crash_to_submitted_s": round(subs[0]["t"] - t_kill, 2),
             "crash_to_admitted_s": round(admitted["t"] - t_kill, 2),
             "crash_to_ready_spare_s": round(joined["t"] - t_kill, 2),
             "second_crash_to_recovered_s": round(max(e["t"] for e in events(run_dir, "recovered")
                                                      if e["generation"] == 2) - t_kill2, 2),
             "reattached_s": [e["seconds"] for e in events(run_dir, "node_reattached")]})


def test_a_replacement_node_that_dies_during_its_admission_costs_the_members_nothing(tmp_path, cluster_up,
                                                                                      failure_free):
    """2 + 1 with --spare-floor 1: the host of node 1 crashed at step 30, a companion job starts and its agent asks
    to join; the moment the job admits it, the newcomer's agent is SIGKILLed (its training processes still
    starting). Its sponsor sees its link close: it is a lost spare like any other, the members train on, and the job
    ends COMPLETED with the failure-free digest; every companion job of the run is gone from squeue at the end."""
    ref = failure_free(nodes=ACTIVE, steps=JOIN_STEPS)["param_digest"]
    with _running(tmp_path, "--steps", str(JOIN_STEPS), "--spare-floor", "1", "--spare-wait", "300",
                  hold=False) as (job, run_dir, fail):
        crash_when(run_dir, fail, host_of(1), 30, time.time() + 150, lambda: wait_gone(job, 0))
        admitted = wait_for(lambda: events(run_dir, "node_admitted"), 90, "a replacement node admitted")[0]
        newcomer = next(e["pid"] for e in events(run_dir, "join_requested") if e["job_id"] == admitted["job_id"])
        os.kill(newcomer, 9)
        fail.hosts.append(admitted["host"])   # (declared dead, so drained by the job: resumed at the end)
        t_killed = time.time()
        assert wait_gone(job, 180), f"job {job} still queued"
    s = _completed(job, run_dir, JOIN_STEPS)
    assert s["param_digest"] == ref, "parameters differ from the failure-free run"
    assert wait_for(lambda: not _squeue_name(f"deadpool-spare-{job}"), 30, "no companion job queued")
    lost = [d for d in events(run_dir, "decision") if d["t"] > t_killed - 1 and 1 in d["failed_nodes"]]
    assert lost and not lost[0]["promoted"], events(run_dir, "decision")   # a spare lost: nobody to replace
