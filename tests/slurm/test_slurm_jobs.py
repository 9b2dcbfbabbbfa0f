"""Hot swap under a real Slurm: the batch template (train.sbatch) and the submitit job, 2 active + 1 spare nodes
(slurm_helpers.ACTIVE), one node crashed mid-run with scripts/slurm-local-cluster.sh (power-loss emulation: every
process of the node SIGKILLed).

Each test checks that the job ends COMPLETED in sacct, that the summary records the swap of the crashed host,
and that the final parameters are bit-identical to a failure-free local run. Kill-to-resume times and the
phase shares are printed and appended to $DEADPOOL_SLURM_MEASURE (default /tmp/deadpool-slurm-measure.jsonl).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from slurm_helpers import (ACTIVE, CRASH_STEP, MEASURE, ROOT, SCALING, STEPS, TRAIN, VENV, crash_when as _crash_when,
                           events as _events, final_state as _final_state, host_of as _host_of, job_output,
                           wait_gone)

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]


def _measure(label, summary, events, t_kill, extra=None):
    f = summary["failures"][0]
    t_resume = max(e["t"] for e in events if e["event"] == "resumed")
    t_suspect = min(e["t"] for e in events if e["event"] == "suspect")
    ph = dict(f["phases"], detect=t_suspect - t_kill)  # a real crash has no fault_injected event: measure from the kill
    total = t_resume - t_kill
    rec = {"test": label, "kill_to_resume_s": total, "phases_s": ph,
           "phase_share": {k: (v / total if v is not None and total > 0 else None) for k, v in ph.items()},
           "failed_hosts": f.get("failed_hosts"), "job": summary.get("slurm_job_id"), **(extra or {})}
    print(f"\n[measure] {json.dumps(rec)}")
    with open(MEASURE, "a") as fh:
        fh.write(json.dumps(rec) + "\n")
    return rec


def _sbatch_with_crash(tmp_path, fail_node, pick_node, label, spares=1, wait_s=150):
    """The template, submitted from tmp_path/submit with a relative SUMMARY (the job itself runs in tmp_path:
    --chdir), so each test also checks that the summary lands in the submitter's directory."""
    run_dir = str(tmp_path / "run")
    (tmp_path / "submit").mkdir()
    job = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", f"--nodes={ACTIVE + spares}",
                          f"--export=ALL,NODES={ACTIVE},SPARES={spares},STEPS={STEPS},RUN_DIR={run_dir},VENV={VENV},"
                          f"SUMMARY=s.json", TRAIN], cwd=tmp_path / "submit",
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip().split(";")[0]

    def gone():
        return not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, timeout=20).stdout.strip()

    node, t_kill = _crash_when(run_dir, fail_node, pick_node, CRASH_STEP, time.time() + 150, gone)
    end = time.time() + wait_s
    while time.time() < end and not gone():
        time.sleep(0.5)
    state = _final_state(job)
    out = "".join(open(p).read() for p in [str(tmp_path / f"deadpool-{job}.out")] if os.path.exists(p))
    assert os.path.exists(os.path.join(run_dir, "summary.json")), f"no summary.json; job {job} {state}\n{out}"
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert json.load(open(tmp_path / "submit" / "s.json")) == summary, "SUMMARY=s.json: not in the submit directory"
    return job, state, summary, node, t_kill, run_dir, out


def _check(state, summary, node, reference_digest, out):
    assert state == "COMPLETED", f"sacct state {state}\n{out}"
    assert summary["completed"] and summary["steps_completed"] == STEPS, summary
    assert summary["swaps"] == 1 and len(summary["failures"]) == 1, summary["failures"]
    assert summary["failures"][0]["failed_hosts"] == [node], summary["failures"]
    assert summary["param_digest"] == reference_digest, "parameters differ from the failure-free run"


def test_sbatch_survives_node_crash(tmp_path, fail_node, reference_digest):
    """(a) node2 (MPI rank 1, not the batch host) dies at step 25: the spare takes its place."""
    job, state, s, node, t_kill, run_dir, out = _sbatch_with_crash(tmp_path, fail_node, _host_of(1), "a")
    _check(state, s, node, reference_digest, out)
    assert "finished_by" not in s  # the batch script itself wrote the summary
    # why: Slurm's view of the crashed host, asked by the batch host's watcher (launch/nodestate.py NodeStates)
    (f,) = s["failures"]
    assert [x["host"] for x in f["slurm"]] == [node] and f["slurm"][0]["state"], f
    assert f["why"].startswith(f"node{f['failed_nodes'][0]} (host {node}) lost whole") and f"Slurm {node}: " in \
        f["why"], f["why"]
    _measure("sbatch-node2", s, _events(run_dir), t_kill)


def test_sbatch_survives_crash_of_rank0_and_batch_host(tmp_path, fail_node, reference_digest):
    """(b) the node of MPI rank 0, which is also the batch host (srun puts task 0 on the first node): the batch
    script and srun die with it; the survivors train on, and the last task writes the summary (RUN_DIR/summary.json
    and the relative SUMMARY, in the submit directory) and completes the job (slurm_job.finish_headless)."""
    def rank0_host(ev):
        return next(e["host"] for e in ev if e["event"] == "hello" and e.get("role", "agent") == "agent" and e["mpi_rank"] == 0)

    job, state, s, node, t_kill, run_dir, out = _sbatch_with_crash(tmp_path, fail_node, rank0_host, "b")
    assert node == "node1"  # rank 0 ran on the first node of the allocation, which is the batch host
    _check(state, s, node, reference_digest, out)
    assert "batch host dead" in s.get("finished_by", ""), s.get("finished_by")
    _measure("sbatch-rank0-batchhost", s, _events(run_dir), t_kill)


def test_sbatch_without_spare_checkpoints_requeues_and_resumes(tmp_path, fail_node, reference_digest):
    """(d) ACTIVE nodes, no spare: node2 dies; the ranks save a checkpoint of the cut step, the batch script
    requeues the job, and the requeued job (on nodes left) resumes from it and completes."""
    job, state, s, node, t_kill, run_dir, out = _sbatch_with_crash(tmp_path, fail_node, _host_of(1), "d",
                                                                   spares=0, wait_s=300)
    assert state == "COMPLETED", f"sacct state {state}\n{out}"
    assert s["completed"] and s["steps_completed"] == STEPS, s
    assert s["requeues"] == 1 and s["swaps"] == 0, s
    f = s["failures"][0]
    assert f["requeued"] and f["failed_hosts"] == [node], f
    ev = _events(run_dir)
    saved = [e for e in ev if e["event"] == "checkpoint_saved"]
    resumed = [e for e in ev if e["event"] == "resumed_from_checkpoint"]
    assert len(saved) == 1 and len(resumed) == ACTIVE and {e["step"] for e in resumed} == {saved[0]["step"]}
    assert node not in {e["host"] for e in ev if e["event"] == "hello" and e["t"] > saved[0]["t"]}
    assert s["param_digest"] == reference_digest, "parameters differ from the failure-free run"
    t_first = min(e["t"] for e in ev if e["event"] == "step" and e["t"] > saved[0]["t"])
    print(f"\n[measure] requeue: kill -> first step of the requeued job {t_first - t_kill:.1f} s")


def test_sbatch_sigusr2_checkpoints_requeues_and_resumes(tmp_path, slurm_cluster, reference_digest):
    """(f) the template's --signal=USR2 path: SIGUSR2 to every task (`scancel --signal=USR2`, as Slurm does before
    the time limit); the ranks save at an agreed step and exit, the batch script requeues the job, it resumes."""
    run_dir = str(tmp_path / "run")
    job = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", f"--nodes={ACTIVE + 1}",
                          f"--export=ALL,NODES={ACTIVE},SPARES=1,STEPS={STEPS},RUN_DIR={run_dir},VENV={VENV}", TRAIN],
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip().split(";")[0]

    def gone():
        return not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, timeout=20).stdout.strip()

    _crash_when(run_dir, lambda _n: subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30),
                lambda ev: None, CRASH_STEP, time.time() + 150, gone)
    end = time.time() + 240
    while time.time() < end and not gone():
        time.sleep(0.5)
    state = _final_state(job)
    out = "".join(open(p).read() for p in [str(tmp_path / f"deadpool-{job}.out")] if os.path.exists(p))
    assert state == "COMPLETED", f"sacct state {state}\n{out}"
    s = json.load(open(os.path.join(run_dir, "summary.json")))
    assert s["completed"] and s["failures"] == [] and s["requeues"] == 1, s
    (p,) = s["preemptions"]
    assert p["resumed"] and p["cut_step"] >= CRASH_STEP, p
    assert s["param_digest"] == reference_digest, "parameters differ from the failure-free run"
    # a new job in the same run directory starts from step 0: the old checkpoint is not resumed
    job2 = subprocess.run(["sbatch", "--parsable", "--wait", f"--chdir={tmp_path}", "--nodes=1",
                           f"--export=ALL,NODES=1,SPARES=0,STEPS=5,RUN_DIR={run_dir},VENV={VENV}", TRAIN],
                          capture_output=True, text=True, timeout=180)
    s2 = json.load(open(os.path.join(run_dir, "summary.json")))
    assert job2.returncode == 0 and s2["completed"] and s2["steps_completed"] == 5, (job2.stderr, s2)
    assert s2["requeues"] == 0 and s2["preemptions"] == [], s2
    assert not [e for e in _events(run_dir) if e["event"] == "resumed_from_checkpoint"]


def test_deadpool_submit_refuses_a_busy_run_dir_a_bad_time_and_an_impossible_size(tmp_path, slurm_cluster):
    """`deadpool submit` bad input: more nodes (or ranks per node) than the partition has, sbatch's refusal, and a
    run directory whose job is still queued give exit 2 and a message naming the problem, and the queued job's
    config is not touched."""
    cli = [sys.executable, "-m", "deadpool_hpc.launch.cli", "submit", "--nodes", "2", "--spares", "1", "--steps", "5"]
    # a job the partition can never run (Slurm would accept it and leave it pending, PartitionNodeLimit)
    too_big = subprocess.run(cli[:4] + ["--nodes", "8", "--spares", "1", "--run-dir", str(tmp_path / "big")],
                             capture_output=True, text=True, timeout=60)
    assert too_big.returncode == 2 and "needs 9 nodes (8 active + 1 spare) but partition 'debug' has 5" in too_big.stderr, \
        too_big.stderr
    assert not (tmp_path / "big").exists()  # refused before anything was written
    cpus = subprocess.run(cli + ["--ranks-per-node", "3", "--run-dir", str(tmp_path / "big")], capture_output=True,
                          text=True, timeout=60)
    assert cpus.returncode == 2 and "--ranks-per-node 3 needs 3 CPUs on each of 3 nodes" in cpus.stderr, cpus.stderr
    run_dir = str(tmp_path / "busy")
    bad = subprocess.run(cli + ["--run-dir", run_dir, "--time", "bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--time 'bogus' is not a Slurm time limit; accepted" in bad.stderr \
        and "Traceback" not in bad.stderr, bad.stderr   # checked before sbatch (issue 46), naming the value
    bad = subprocess.run(cli + ["--run-dir", run_dir, "--sbatch-arg=--no-such-option"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "sbatch refused the job" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    first = subprocess.run(cli + ["--run-dir", run_dir, "--sbatch-arg=--begin=now+1hour"], capture_output=True,
                           text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    job = first.stdout.strip().splitlines()[-1]
    try:
        config = open(os.path.join(run_dir, "config.json")).read()
        again = subprocess.run(cli + ["--run-dir", run_dir, "--steps", "7"], capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and f"belongs to job {job}, which is still PENDING" in again.stderr, again.stderr
        assert open(os.path.join(run_dir, "config.json")).read() == config
    finally:
        subprocess.run(["scancel", job], timeout=30)


def _job_diagnostics(job_id, folder):
    q = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T %R"], capture_output=True, text=True, timeout=20)
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=20)
    logs = "".join(open(p).read()[-600:] for p in sorted(folder.glob("*_0_log.err")))
    return f"squeue: {q.stdout.strip()!r}; nodes: {' '.join(nodes.stdout.split())}\n{logs}"


def _submitit_job(tmp_path, spares=1):
    """A run through SubmititExecutor; returns (submitit's Job, the run directory, our SubmititJob handle)."""
    from deadpool_hpc.launch import SubmititExecutor

    run_dir = str(tmp_path / "run")
    ex = SubmititExecutor(str(tmp_path / "submitit"), timeout_min=10, slurm={"partition": "debug"},
                          nodes=ACTIVE, spares=spares, steps=STEPS, run_dir=run_dir)
    handle = ex.submit(None)
    return handle.submitit_job, run_dir, handle


def _submitit_at_step(tmp_path, job, run_dir, action, pick_node):
    """_crash_when for a submitit job: on failure, cancel it and show why it never got there."""
    try:
        return _crash_when(run_dir, action, pick_node, CRASH_STEP, time.time() + 150, job.done)
    except AssertionError as exc:
        diag = _job_diagnostics(job.job_id, tmp_path / "submitit")
        job.cancel(check=False)
        raise AssertionError(f"{exc}\n{diag}") from None


def _wait_done(job, seconds):
    end = time.time() + seconds
    while not job.done() and time.time() < end:  # submitit's result() has no timeout
        time.sleep(1)
    assert job.done(), f"submitit job {job.job_id} still running after {seconds} s"


def test_submitit_without_spare_checkpoints_requeues_and_resumes(tmp_path, fail_node, reference_digest):
    """(h) submitit, ACTIVE nodes and no spare: node2 dies; the ranks save a checkpoint, task 0 requeues the job
    (as the template does), and the requeued job resumes from it; job.result() is the final summary."""
    job, run_dir, handle = _submitit_job(tmp_path, spares=0)
    _submitit_at_step(tmp_path, job, run_dir, fail_node, _host_of(1))
    _wait_done(job, 300)
    s = handle.result()  # task 0's result, the summary
    assert s == job.task(0).result()
    assert _final_state(job.job_id) == "COMPLETED"
    assert s["completed"] and s["steps_completed"] == STEPS, s
    assert s["requeues"] == 1 and s["swaps"] == 0 and s["failures"][0]["requeued"], s
    assert s["param_digest"] == reference_digest, "parameters differ from the failure-free run"


def test_submitit_survives_a_node_crashed_before_the_agents_mpi_world_exists(tmp_path, fail_node, reference_digest):
    """(c) the same run through submitit (SubmititExecutor), task 1's node crashed as soon as its task runs,
    while the agents are in srun's launch or MPI_Init (issue 28, scope 0). Task 0 watches the tasks'
    beacons as the batch host does under sbatch, every surviving task ends its agent, and task 0 starts the agents
    again on the live nodes (a step of their own, srun --overlap) with the spare in the lost node's place. The
    job ends COMPLETED and bitwise equal. (A crash at step 25 under submitit: test_plugin_submitit, the same
    HotSwapJob through the plugin.)"""
    from slurm_helpers import crash_in_the_start_up

    job, run_dir, handle = _submitit_job(tmp_path)
    t_submit = time.time()
    lost = crash_in_the_start_up(run_dir, 1, fail_node)   # task 1's node (task 0's holds the result)
    _wait_done(job, 240)
    s = handle.result()
    assert _final_state(job.job_id) == "COMPLETED"
    assert s["completed"] and s["steps_completed"] == STEPS, s
    assert [r["lost_hosts"] for r in s["relaunches"]] == [[lost]] and s["spares_left"] == 0, s["relaunches"]
    assert s["failures"] == [] and s["swaps"] == 0, s["failures"]
    assert s["param_digest"] == reference_digest, "parameters differ from the failure-free run"
    (found,) = _events(run_dir, "startup_node_lost")
    assert found["startup_s"] < 15, found   # within seconds, not at the 300 s start-up deadline
    print(f"\n[measure] submitit: start-up loss found after {found['startup_s']:.1f} s; first step "
          f"{min(e['t'] for e in _events(run_dir, 'step')) - t_submit:.1f} s after the submission")


def test_submitit_preemption_checkpoints_requeues_and_resumes(tmp_path, slurm_cluster, reference_digest):
    """(e) submitit's checkpoint(): Slurm delivers SIGUSR2 to every task (as before preemption or the time limit;
    here `scancel --signal=USR2`); the ranks save a persistent checkpoint at an agreed step, checkpoint() returns
    the job to requeue, submitit requeues it, and the requeued job resumes there and completes identically."""
    job, run_dir, handle = _submitit_job(tmp_path)
    _submitit_at_step(tmp_path, job, run_dir,
                      lambda _n: subprocess.run(["scancel", "--signal=USR2", str(job.job_id)], check=True, timeout=30),
                      lambda ev: None)
    t_signal = time.time()
    _wait_done(job, 240)
    s = handle.result()
    assert _final_state(job.job_id) == "COMPLETED"
    assert s["completed"] and s["steps_completed"] == STEPS, s
    assert s["failures"] == [] and s["swaps"] == 0 and s["requeues"] == 1, s
    (p,) = s["preemptions"]
    assert p["resumed"] and p["cut_step"] >= CRASH_STEP, p
    ev = _events(run_dir)
    saved = [e for e in ev if e["event"] == "checkpoint_saved"]
    assert len(saved) == 1 and saved[0]["reason"] == "preempted", saved
    resumed = [e for e in ev if e["event"] == "resumed_from_checkpoint"]
    assert len(resumed) == ACTIVE and {e["step"] for e in resumed} == {p["cut_step"]}, resumed
    assert s["param_digest"] == reference_digest, "parameters differ from the failure-free run"
    t_first = min(e["t"] for e in ev if e["event"] == "step" and e["t"] > saved[0]["t"])
    rec = {"test": "submitit-preempt", "signal_to_saved_s": saved[0]["t"] - t_signal,
           "signal_to_first_step_after_requeue_s": t_first - t_signal, "cut_step": p["cut_step"], "job": job.job_id}
    print(f"\n[measure] {json.dumps(rec)}")
    with open(MEASURE, "a") as fh:
        fh.write(json.dumps(rec) + "\n")


def test_scaling_template_from_another_directory_writes_one_summary_per_size(tmp_path, slurm_cluster):
    """(g) sbatch/scaling.sbatch as a job array over active-node counts 2 and 3 (+1 spare), submitted as in the
    issue from a directory that is not the checkout, with a relative OUT_DIR and neither TRAIN_SBATCH nor VENV:
    the template finds train.sbatch next to itself and the checkout's .venv (through the job's Command). One
    completed run and one summary per size, and `deadpool scaling` tabulates them."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    own_venv = os.path.realpath(VENV) == os.path.realpath(os.path.join(ROOT, ".venv"))
    env = "ALL,SIZES=2 3,SPARES=1,STEPS=20,OUT_DIR=scaling" + ("" if own_venv else f",VENV={VENV}")
    job = subprocess.run(["sbatch", "--parsable", "--array=0-1", "--nodes=4", f"--export={env}", SCALING],
                         cwd=elsewhere, capture_output=True, text=True, timeout=60, check=True).stdout.strip().split(";")[0]
    assert wait_gone(job, 240), f"job array {job} still queued after 240 s"
    states = {_final_state(f"{job}_{i}") for i in (0, 1)}
    out = "".join(job_output(elsewhere / f"deadpool-scaling-{job}_{i}.out") for i in (0, 1))
    assert states == {"COMPLETED"}, f"{states}\n{out}"
    out_dir = elsewhere / "scaling"
    table = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "scaling", str(out_dir)],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stdout + table.stderr
    rows = json.loads(table.stdout)
    assert [(r["nodes"], r["world_size"], r["completed"]) for r in rows] == [(2, 2, True), (3, 3, True)]
    assert all(r["median_tokens_per_s"] > 0 for r in rows) and rows[0]["speedup"] == 1.0


def test_templates_say_which_variable_to_set(tmp_path, slurm_cluster):
    """A template that cannot find the package or its neighbour stops at once (exit 2) and names the variable to
    set: a copy of train.sbatch whose PYTHON cannot import deadpool_hpc, and a copy of scaling.sbatch alone."""
    import shutil

    copies = tmp_path / "copies"
    copies.mkdir()
    shutil.copy(TRAIN, copies / "train.sbatch")
    shutil.copy(SCALING, copies / "lonely-scaling.sbatch")
    no_pkg = subprocess.run(["sbatch", "--wait", "--nodes=2", "--export=ALL,NODES=1,SPARES=1,STEPS=5,PYTHON=/usr/bin/python3",
                             "copies/train.sbatch"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    job = no_pkg.stdout.split()[-1]
    out = job_output(tmp_path / f"deadpool-{job}.out")
    assert no_pkg.returncode == 2 and "'/usr/bin/python3' cannot import deadpool_hpc" in out and "Set VENV=" in out, out
    (tmp_path / "lonely").mkdir()
    shutil.move(copies / "lonely-scaling.sbatch", tmp_path / "lonely" / "scaling.sbatch")
    lonely = subprocess.run(["sbatch", "--wait", "--nodes=2", "--export=ALL,SIZES=1", "lonely/scaling.sbatch"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    job = lonely.stdout.split()[-1]
    out = "".join(job_output(p) for p in tmp_path.glob(f"deadpool-scaling-{job}_*.out"))
    assert lonely.returncode == 2 and "Set TRAIN_SBATCH=" in out and "DEADPOOL_HOME=" in out, out
