"""What each Slurm task of a submitit job runs: ``HotSwapJob(cfg)``, the callable that ``SubmititExecutor``
(launch/executors.py) and the submitit plugin (plugins/submitit) submit.

    from deadpool_hpc.launch import SubmititExecutor
    job = SubmititExecutor("submitit-logs", slurm={"partition": "debug"}, nodes=4, spares=1).submit(train)
    summary = job.result()      # the run summary (dict)

submitit runs the callable once per Slurm task (one task per node, ``ntasks_per_node=1``, with
``cpus_per_task = cfg.ranks_per_node``), each inside submitit's own ``srun``. Every task starts the node agent
(``python -m deadpool_hpc.agent RUN_DIR``) as a child, handing it the PMI-2 descriptor srun gave the task, so the
MPI processes (one agent per node) are exactly those of ``templates/train.sbatch``; each agent starts the node's
training processes. Task 0 then waits for the other survivors and
returns the summary built from the event log; the other tasks return their worker's exit code.

Results: task 0's result is the summary, returned only for a run that completed: a job that Slurm ended
(``scancel``; the end of a preemption's grace time) leaves no result (submitit's ``UncompletedJobError``, state
CANCELLED, ...), after task 0 wrote RUN_DIR/summary.json (``stopped``, and the checkpoint the ranks saved when they
got SIGTERM); a run that failed raises ``RunIncomplete`` (as submitit's ``FailedJobError``) naming the step
reached, the errors and the summary's path. (``SubmititJob.result()`` returns that summary in both cases.)
``cfg.summary_path`` (relative: to the directory ``HotSwapJob`` is constructed in) gets a copy of the summary.
``hot_swap_job_class()`` is the submitit Job class whose ``result()`` is task 0's (the plugin's jobs).

What makes the step survive a node crash is in the job's parameters (``SubmititExecutor.parameters``):
``#SBATCH --no-kill`` (job) through ``additional_parameters`` and ``srun --no-kill --kill-on-bad-exit=0
--mpi=pmi2`` (step) through ``srun_args`` (submitit >= 1.5 appends them to its srun line; checked with 1.5.4).
Without the srun ``--no-kill`` Slurm kills the whole step when any node fails.

The config is written and the job secret file (RUN_DIR/.secret, mode 600) created when the ``HotSwapJob`` is
constructed, on the submitting host (RUN_DIR must be on a filesystem the nodes share). Every task derives the same
``DEADPOOL_JOB_SECRET`` = HMAC-SHA256(secret file, Slurm job id), so the secret is never in a pickle or the
environment of the submitting process, and differs per job.

Preemption and time limit: ``HotSwapJob.checkpoint()`` is submitit's hook. Slurm sends SIGUSR2 to every task
(submitit asks ``--signal=USR2@90``); the workers catch it, agree on a cut step and save a persistent checkpoint
with torch.distributed.checkpoint (RUN_DIR/checkpoint, the same path as a job that ran out of spares), then exit 75.
On task 0, submitit calls ``checkpoint()``, which forwards the signal to its worker, waits until the run logged
``checkpoint_saved``, logs ``requeued`` and returns ``DelayedSubmission(self)``; submitit then requeues the job.
The requeued job (same id, same RUN_DIR) resumes at the cut step, and ``job.result()`` is the final summary.
If no checkpoint appears within ``checkpoint_wait_s``, ``checkpoint()`` returns None and submitit ends the job
without requeueing it (``UncompletedJobError``). SIGTERM (``scancel -s TERM``, a preemption's notice without
``--signal``, ``scancel``, the time limit) reaches every task; submitit ignores it, the workers save a checkpoint
and exit 75, and task 0 decides as the batch template does (``slurm_job.settle``): requeue if the job goes on,
stop (no result) if Slurm is ending it.

A node lost before the agents' MPI world exists (srun's launch, MPI_Init: MPICH cannot survive it): each
task touches a beacon (launch/slurm_startup.py) and task 0 watches them, as the batch host does under sbatch. On a
loss it records it (RUN_DIR/relaunch/ATTEMPT.0.json), every surviving task ends its own agent (they all wait in
MPI_Init) and returns, and task 0 starts the agents again as a step of their own on the live nodes of the same
allocation (``srun --overlap``, the task wrapper of the sbatch path), one spare fewer; it then waits for that step
and ends the job as below. With no spare left the run ends with the reason (RunIncomplete).

Limits: the batch host (the node of task 0) is special here as everywhere under sbatch. If it dies, the ranks
train on and finish, but task 0's result is lost: ``job.task(0).result()`` raises, and the summary must be
rebuilt with ``deadpool summary RUN_DIR``. A run that loses a node with no spare
left saves a checkpoint, and task 0 requeues the job (``scontrol requeue``, at most ``max_requeues`` times) as the
sbatch template does; the requeued job resumes from it.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from ..config import RunConfig, only_under_slurm_batch
from ..events import EventLog, read_events
from ..logs import setup as setup_logging
from ..errors import ConfigError
from ..rundir import RunDir, emit_requeued, latest_checkpoint
from .options import check_extensions
from . import slurm, slurm_job, slurm_startup

_log = logging.getLogger(__name__)

JOB_FLAGS = {"no-kill": True, "requeue": True, "exclusive": True}   # sbatch options of a job, as templates/train.sbatch


def srun_args(mpi: str = "pmi2") -> list[str]:
    """The srun flags every hot-swap step needs: a node's death must not end the step (docs/slurm.md)."""
    return ["--no-kill", "--kill-on-bad-exit=0", f"--mpi={mpi}"]


class RunIncomplete(RuntimeError):
    """Raised by task 0 (so ``job.result()`` raises submitit's FailedJobError with this message) when the run
    ended without completing and Slurm was not ending the job: an error, or no spare and no requeue left."""


_job_class = None


def hot_swap_job_class():
    """``HotSwapSlurmJob``: submitit's SlurmJob whose ``result()`` is task 0's (the run summary) instead of
    submitit's "use results()" assertion for a job of several tasks. (Built on first use: submitit is imported
    only by those who use it.)"""
    global _job_class
    if _job_class is None:
        import submitit

        class HotSwapSlurmJob(submitit.SlurmJob):
            def result(self):
                """The run summary (dict), returned by task 0 of a run that completed. Raises submitit's
                UncompletedJobError if the job ended without a result (cancelled, preempted, its batch host
                lost), FailedJobError if the run failed (RunIncomplete)."""
                if self._sub_jobs:
                    return self._sub_jobs[0].result()
                return super().result()

        _job_class = HotSwapSlurmJob
    return _job_class


class HotSwapJob:
    """The submitit callable for one run. Construct it on the submitting host: it validates ``cfg``, writes
    RUN_DIR/config.json, clears the previous run's logs, and creates the secret file."""

    def __init__(self, cfg: RunConfig, wait_survivors_s: float = 60.0, checkpoint_wait_s: float = 60.0):
        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.output.run_dir)
        self.wait_survivors_s = wait_survivors_s
        self.checkpoint_wait_s = checkpoint_wait_s
        self._worker = None  # this task's worker process (not pickled: see __getstate__)
        self._saved_before = 0
        self._skipped_before = 0
        self._lock = None
        only_under_slurm_batch(cfg, "submitit (no batch script to cancel companion jobs)")
        check_extensions(cfg.replication.replica_transport)   # a missing or broken plugin named before anything starts
        # a job still running there must keep its files (RunDirBusy: a ConfigError); held while the directory is
        # prepared, as every launcher does (the task 0 of the job takes it again when it starts)
        with RunDir(self.run_dir).locked("submitit: preparing") as rd:
            slurm.write_config(cfg, self.run_dir)
            rd.prepare()  # a new run starts at step 0
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
        setup_logging(f"submitit-task{rank}")
        if rank == 0:
            self._lock = RunDir(self.run_dir)
            self._lock.acquire(f"slurm job {job_id}")  # held by task 0 while the run lives (one run per directory)
            with open(os.path.join(self.run_dir, "slurm_job_id"), "w") as fh:
                fh.write(f"{job_id}\n")
        env = dict(os.environ, DEADPOOL_JOB_SECRET=self.job_secret(job_id), OMP_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        t0 = time.time()
        self._saved_before = len(self._events("checkpoint_saved"))
        self._skipped_before = len(self._events("checkpoint_skipped"))
        # a node lost before the agents' MPI world exists: task 0 watches every task's beacon, as the batch
        # host does under sbatch (launch/slurm_startup.py), and starts the agents again on the live nodes
        lid = slurm_startup.launch_id()
        checker = None
        if rank == 0:
            slurm_startup.write_launch(self.run_dir, lid, slurm_startup.step_nodes(self.cfg.layout.total_nodes))
            checker = _BeaconChecker(self.run_dir).start()
        slurm_startup.Beacon(self.run_dir, rank).start()
        # SIGUSR2 stays with submitit (its handler calls checkpoint() on task 0); the worker gets it from Slurm too
        forward = tuple(s for s in slurm_job.FORWARDED if s != signal.SIGUSR2)
        rc = self._unless_finished(lambda: slurm_job.run_worker(
            self.run_dir, env, forward_signals=forward, on_start=lambda proc: self._started(proc, lid)))
        slurm_job.mark_exited(self.run_dir, rc)
        if rank != 0:
            return rc
        try:
            while os.path.exists(_relaunch_file(self.run_dir, lid)):
                rc, lid = self._relaunch(env, lid)
        finally:
            checker.stop()
        self._unless_finished(self._wait_survivors)
        # the ranks saved a checkpoint (no spare left, SIGTERM): requeue as the sbatch template does if the job goes
        # on, and leave without a result (SystemExit: submitit records none), so the requeued job's is the one read
        how = slurm_job.settle(self.run_dir, since=t0)
        if how["action"] == "requeued":
            raise SystemExit(75)
        s = slurm.write_summary(self.run_dir, out=slurm.summary_out(self.run_dir),
                                extra={"launcher": "submitit", "worker_rc": rc})
        if s["completed"]:
            return s
        where = f"summary in {os.path.join(self.run_dir, 'summary.json')}"
        if s["checkpoint"]:
            where += f"; checkpoint of step {s['checkpoint']['step']} in {os.path.join(self.run_dir, 'checkpoint')}"
        if how["action"] == "stopped" and not how.get("killed") and slurm_job.job_state(job_id)[0] != "RUNNING":
            # Slurm is ending the job (scancel): no result, so result() raises UncompletedJobError with its state
            _log.warning("job %s stopped at step %s of %s: %s; %s", job_id,
                         s["steps_completed"], self.cfg.train.steps, how["reason"], where)
            raise SystemExit(1)
        raise RunIncomplete(f"the run did not complete: step {s['steps_completed']} of {self.cfg.train.steps}"
                            f"{'; stopped: ' + s['stopped']['reason'] if s['stopped'] else ''}"
                            f"{'; errors: ' + '; '.join(map(str, s['errors'])) if s['errors'] else ''}; {where}")

    def _started(self, proc, lid: str) -> None:
        """This task's node agent runs: the one a checkpoint() signals, and one to end if the watcher finds a node
        lost before the agents' MPI world exists (they all wait in MPI_Init for it)."""
        self._worker = proc
        path = _relaunch_file(self.run_dir, lid)

        def end_on_relaunch() -> None:
            while proc.poll() is None:
                if os.path.exists(path):
                    proc.kill()
                    return
                time.sleep(0.25)

        threading.Thread(target=end_on_relaunch, name="deadpool-relaunch-watch", daemon=True).start()

    def _relaunch(self, env: dict, lid: str) -> tuple[int, str]:
        """(task 0) A node was lost before the agents' MPI world existed: one spare fewer (slurm_startup.relaunch),
        and the agents again, on the live nodes of this allocation, as a step of their own (``srun --overlap``,
        the task wrapper ``deadpool_hpc.launch.batch task``; submitit's own step cannot be started again: ending it
        would end this task). The other submitit tasks have returned by then. Returns (the step's exit code, its
        launch id). Raises RunIncomplete when no spare is left."""
        try:
            total, _spares, excluded = slurm_startup.relaunch(self.run_dir, lid)
        except ConfigError as exc:
            raise RunIncomplete(str(exc)) from None
        attempt, _, n = lid.partition(".")
        launch = str(int(n) + 1)
        os.environ["DEADPOOL_LAUNCH"] = env["DEADPOOL_LAUNCH"] = launch   # markers: RUN_DIR/exited/ATTEMPT.LAUNCH
        new = f"{attempt}.{launch}"
        slurm_startup.write_launch(self.run_dir, new, slurm_startup.step_nodes(total, ",".join(excluded)))
        cmd = ["srun", *srun_args(), "--overlap", f"--nodes={total}", f"--ntasks={total}", "--ntasks-per-node=1",
               f"--cpus-per-task={self.cfg.layout.ranks_per_node}", "--distribution=block",
               f"--exclude={','.join(excluded)}",
               f"--output={os.path.join(self.run_dir, 'task-%t.log')}",
               sys.executable, "-m", "deadpool_hpc.launch.batch", "task", self.run_dir, "--no-finisher"]
        _log.warning("%s lost before the agents' MPI world existed: the agents again on %d nodes", excluded, total)
        proc = subprocess.Popen(cmd, env=env)   # checkpoint() signals it; srun passes SIGUSR2 on to the tasks
        self._worker = proc
        return proc.wait(), new

    def _wait_survivors(self) -> None:
        end = time.monotonic() + self.wait_survivors_s
        while (time.monotonic() < end
               and not slurm_job.expected_survivors(self.run_dir) <= slurm_job.exited_tasks(self.run_dir)):
            time.sleep(0.5)

    def _unless_finished(self, fn):
        """Run fn(). A SIGUSR2 that comes when the run has already finished makes checkpoint() return None, and
        submitit then raises UncompletedJobError from its handler, i.e. from inside fn: that is not a failure,
        so finish the wait (the worker's exit code, or the survivors) and go on."""
        from submitit.core.utils import UncompletedJobError

        try:
            return fn()
        except UncompletedJobError:
            if not self._events("finished"):
                raise
            if self._worker is not None and self._worker.returncode is None:
                return self._worker.wait()
            return fn()

    def _events(self, name: str) -> list[dict]:
        path = RunDir(self.run_dir).events
        return [e for e in read_events(path) if e["event"] == name] if os.path.exists(path) else []

    def checkpoint(self, *args, **kwargs):
        """submitit's hook on preemption or time-out (SIGUSR2, task 0 only): make sure the worker got the signal,
        wait up to ``checkpoint_wait_s`` seconds for the run's persistent checkpoint, and return the job to
        requeue (it resumes from the checkpoint). The signal before any rank trained a step (``checkpoint_skipped``:
        nothing new to save) requeues too, from the checkpoint this attempt resumed from (``requeued`` with
        ``idle``), at most slurm_job.MAX_IDLE_REQUEUES times in a row (then ``stopped`` with the reason). Returns
        None, so that submitit does not requeue, when the run already finished, no checkpoint was saved in time, or
        that bound was reached."""
        from submitit.helpers import DelayedSubmission

        if self._worker is not None and self._worker.returncode is None:
            try:
                os.kill(self._worker.pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass
        end = time.monotonic() + self.checkpoint_wait_s
        while time.monotonic() < end:
            if self._events("finished"):
                return None
            saved = self._events("checkpoint_saved")
            skipped = self._events("checkpoint_skipped")
            idle = len(saved) <= self._saved_before and len(skipped) > self._skipped_before
            if idle:   # stopped before its first step: the checkpoint it resumed from (or step 0) is untouched
                log = EventLog(RunDir(self.run_dir).events)
                streak = slurm_job.idle_streak(self._events("requeued"))
                if streak >= slurm_job.MAX_IDLE_REQUEUES:
                    why = slurm_job.idle_stop_reason(streak, skipped[-1]["step"],
                                                     slurm_job.time_limit_of(os.environ.get("SLURM_JOB_ID")),
                                                     checkpoint=latest_checkpoint(self.run_dir) is not None)
                    log.emit("stopped", reason=why, slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                             checkpoint_step=skipped[-1]["step"], checkpoint=latest_checkpoint(self.run_dir))
                    _log.warning("not requeued: %s", why)
                    return None
                saved = [dict(skipped[-1], idle=True)]
            if len(saved) > self._saved_before or idle:
                emit_requeued(EventLog(RunDir(self.run_dir).events), launcher="submitit",
                              slurm_job_id=os.environ.get("SLURM_JOB_ID"), checkpoint_step=saved[-1]["step"],
                              reason=saved[-1].get("reason"), idle=idle or None)
                # submitit runs `scontrol requeue` next, in this process; the requeue makes slurmd SIGTERM every
                # process of the step, that scontrol included, which then raised CalledProcessError (-15) and
                # ended the job as failed although Slurm had requeued it (seen in CI). SIGTERM is ignored from here
                # on, by this process and (SIG_IGN is inherited across fork and exec) by scontrol; submitit exits
                # right after the requeue, and Slurm's SIGKILL after KillWait still bounds it.
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                return DelayedSubmission(self)
            time.sleep(0.2)
        return None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_worker"] = None  # a Popen is neither picklable nor meaningful in the requeued job
        state["_lock"] = None    # nor is a held lock (the requeued task 0 takes it again)
        return state


def _relaunch_file(run_dir: str, lid: str) -> str:
    return os.path.join(run_dir, "relaunch", lid + ".json")


class _BeaconChecker:
    """(task 0) ``slurm_startup.BeaconCheck`` every second, in a thread, until ``stop()``. It ends no step (that
    would end submitit's, task 0 with it): its record (RUN_DIR/relaunch/LAUNCH.json) makes every task end its own
    node agent (``HotSwapJob._started``), and task 0 relaunch."""

    def __init__(self, run_dir: str, period: float = 1.0):
        self.run_dir, self.period = run_dir, period
        self.beacons = slurm_startup.BeaconCheck(run_dir, None)
        self._stop = threading.Event()

    def start(self) -> "_BeaconChecker":
        threading.Thread(target=self._run, name="deadpool-startup-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        path = RunDir(self.run_dir).events
        while not self._stop.wait(self.period):
            try:
                for h in self.beacons.poll(list(read_events(path)) if os.path.exists(path) else []):
                    _log.warning("%s lost during the start-up: the agents are started again without it", h)
            except (OSError, ValueError, KeyError) as exc:
                _log.warning("start-up watch: %s", exc)
