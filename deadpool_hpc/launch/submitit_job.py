"""submitit launch: ``HotSwapJob(cfg)`` is the callable, ``executor(folder, cfg)`` the matching AutoExecutor.

    from deadpool_hpc.launch.submitit_job import HotSwapJob, executor
    ex = executor("submitit-logs", cfg, slurm_partition="debug")     # nodes = cfg.nodes + cfg.spares, --no-kill
    job = ex.submit(HotSwapJob(cfg))
    summary = job.task(0).result()                                   # the run summary (dict); see docs/slurm.md

submitit runs the callable once per Slurm task (one task per node and rank, ``tasks_per_node`` =
``cfg.ranks_per_node``), each inside submitit's own ``srun``. Every task starts the ordinary worker
(``python -m deadpool_hpc.worker.entry RUN_DIR``) as a child, handing it the PMI-2 descriptor srun gave the task,
so the MPI ranks are exactly those of ``sbatch/train.sbatch``. Task 0 then waits for the other survivors and
returns the summary built from the event log; the other tasks return their worker's exit code.

What makes the step survive a node crash is in ``executor()``: ``#SBATCH --no-kill`` (job) through
``slurm_additional_parameters`` and ``srun --no-kill --kill-on-bad-exit=0 --mpi=pmi2`` (step) through
``slurm_srun_args`` (submitit >= 1.5 appends them to its srun line; checked with 1.5.4). Without the srun
``--no-kill`` Slurm kills the whole step when any node fails.

The config is written and the job secret file (RUN_DIR/.secret, mode 600) created when the ``HotSwapJob`` is
constructed, on the submitting host (RUN_DIR must be on a filesystem the nodes share). Every task derives the same
``DEADPOOL_JOB_SECRET`` = HMAC-SHA256(secret file, Slurm job id), so the secret is never in a pickle or the
environment of the submitting process, and differs per job.

Limits: the batch host (the node of task 0) is special here as everywhere under sbatch. If it dies, the ranks
train on and finish, but task 0's result is lost: ``job.task(0).result()`` raises, and the summary must be
rebuilt with ``python -m deadpool_hpc.launch.slurm summary RUN_DIR``.
TODO(checkpoint): ``checkpoint()`` (submitit's requeue on preemption/timeout) is not implemented: a requeued job
would start from step 0. Implementing it needs the worker to write a resumable checkpoint on USR2.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time

from ..config import RunConfig
from . import slurm, slurm_job


def srun_args(mpi: str = "pmi2") -> list[str]:
    return ["--no-kill", "--kill-on-bad-exit=0", f"--mpi={mpi}"]


def executor(folder: str, cfg: RunConfig, timeout_min: int = 60, **params):
    """A submitit AutoExecutor sized and flagged for ``cfg``. Extra ``params`` go to update_parameters
    (e.g. ``slurm_partition="debug"``); ``slurm_additional_parameters`` are merged with ours."""
    import submitit

    ex = submitit.AutoExecutor(folder=folder, cluster=params.pop("cluster", "slurm"))
    add = {"no-kill": True, "no-requeue": True, "exclusive": True}  # as sbatch/train.sbatch
    add.update(params.pop("slurm_additional_parameters", {}) or {})
    ex.update_parameters(nodes=cfg.total_nodes, tasks_per_node=cfg.ranks_per_node, timeout_min=timeout_min,
                         slurm_additional_parameters=add,
                         slurm_srun_args=list(params.pop("slurm_srun_args", srun_args())), **params)
    return ex


class HotSwapJob:
    """The submitit callable for one run. Construct it on the submitting host: it validates ``cfg``, writes
    RUN_DIR/config.json, clears the previous run's logs, and creates the secret file."""

    def __init__(self, cfg: RunConfig, wait_survivors_s: float = 60.0):
        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.run_dir)
        self.wait_survivors_s = wait_survivors_s
        slurm.write_config(cfg, self.run_dir)
        for name in ("events.jsonl", "summary.json", "finisher.lock", "slurm_job_id"):
            try:
                os.remove(os.path.join(self.run_dir, name))
            except FileNotFoundError:
                pass
        exited = os.path.join(self.run_dir, "exited")
        if os.path.isdir(exited):
            for n in os.listdir(exited):
                os.remove(os.path.join(exited, n))
        path = os.path.join(self.run_dir, ".secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)

    def job_secret(self, job_id: str) -> str:
        with open(os.path.join(self.run_dir, ".secret"), "rb") as fh:
            key = fh.read().strip()
        return hmac.new(key, str(job_id).encode(), hashlib.sha256).hexdigest()

    def __call__(self):
        import submitit

        env_info = submitit.JobEnvironment()
        job_id = os.environ.get("SLURM_JOB_ID") or str(env_info.job_id).split("_")[0]
        rank = env_info.global_rank
        if rank == 0:
            with open(os.path.join(self.run_dir, "slurm_job_id"), "w") as fh:
                fh.write(f"{job_id}\n")
        env = dict(os.environ, DEADPOOL_JOB_SECRET=self.job_secret(job_id), OMP_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        rc = slurm_job.run_worker(self.run_dir, env)
        slurm_job.mark_exited(self.run_dir, rc)
        if rank != 0:
            return rc
        end = time.monotonic() + self.wait_survivors_s
        while time.monotonic() < end and not slurm_job.expected_survivors(self.run_dir) <= slurm_job.exited_tasks(self.run_dir):
            time.sleep(0.5)
        summary = slurm.write_summary(self.run_dir, extra={"launcher": "submitit", "worker_rc": rc})
        return summary

    # TODO(checkpoint): no checkpoint() on purpose. submitit would requeue on USR2 (timeout/preemption) and rerun
    # the callable from step 0; add checkpoint() returning submitit.helpers.DelayedSubmission(self) once the worker
    # can write and resume from a checkpoint.
