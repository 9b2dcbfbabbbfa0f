"""The launch vocabulary, in submitit's shape: one executor per back-end, whose ``submit()`` returns a job handle.

    from deadpool_hpc.launch import LocalExecutor, SlurmExecutor, SubmititExecutor

    job = LocalExecutor(nodes=3, spares=1, steps=200, run_dir="runs/a").submit(train)   # or a RunConfig, a
    job.status()            # "package.module:function" name, None (the demo)
    job.swap("node1")       # planned swap: node1 leaves at its next step boundary, a spare takes its place
    summary = job.result()  # blocks until the run ends: the run summary (dict; ``completed`` says how it went)
    job.cancel()            # stop the run (every process; a Slurm job: scancel)

Back-ends:

- ``LocalExecutor``: the embedded default, N + S emulated nodes as local processes (``deadpool run``; the run
  goes in a thread of this process: launch/local.py's ``launch`` underneath).
- ``SlurmExecutor``: the batch template (templates/train.sbatch) rendered and submitted with sbatch
  (``deadpool submit``; no dependency beyond Slurm's commands).
- ``SubmititExecutor``: submitit underneath, through its public API only (``submitit.SlurmExecutor``,
  ``update_parameters``, ``submit``, ``Job.task(0)``); each Slurm task runs ``submitit_job.HotSwapJob``.

Every ``submit(what=None, **train_args)`` takes what ``deadpool run --train-fn`` takes: a module-level function
``fn(ctx)`` (the workers import it by name), its ``"package.module:function"`` name, None (the built-in demo),
or a ready ``RunConfig`` (then the executor's run settings must be empty: one place sizes the run). Keyword
arguments are added to ``train_args``. The executors' run settings are RunConfig's fields (``nodes``,
``spares``, ``steps``, ``run_dir``, ...); bad ones raise ConfigError (a ValueError) naming the value and what is
accepted, at ``submit``, before anything is written or started.

``attach(target)`` is the handle of a run started elsewhere: a Slurm job id, or a run directory (a local run or
a Slurm job's); the ``deadpool`` command's status, swap and cancel use it.

The submitit plugin (plugins/submitit: ``submitit.AutoExecutor(folder, cluster="deadpool")``) is the same run
for code written against submitit's own vocabulary; its jobs are submitit's.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import signal
import subprocess
import threading
import time
import typing as tp

from ..config import RunConfig
from ..control.mpi import check_transport
from ..errors import ConfigError
from ..rundir import RunDir, RunDirBusy, check_free
from .options import check_train_fn

__all__ = ["DeadpoolJob", "LocalExecutor", "LocalJob", "SlurmExecutor", "SlurmJob", "SubmititExecutor",
           "SubmititJob", "attach", "train_fn_spec", "JobLost"]

DEMO = RunConfig().train.train_fn   # "deadpool_hpc.train.demo:train"
_ACCEPTED_FN = ("accepted: a module-level function fn(ctx) of a module the nodes can import (as for "
                "`deadpool run --train-fn`), its 'package.module:function' name, a RunConfig, or None (the "
                "built-in demo)")
# Slurm states in which a job may still run (squeue/sacct): result() waits while the job is in one of them
SLURM_LIVE = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "COMPLETING",
              "CONFIGURING", "SUSPENDED", "STAGE_OUT", "SIGNALING")


class JobLost(RuntimeError):
    """``result()``: the job ended without a run summary (a Slurm job cancelled before its run started, its batch
    host lost; rebuild one with ``deadpool summary RUN_DIR``)."""


def train_fn_spec(fn, accepted: str = _ACCEPTED_FN) -> str:
    """The "package.module:function" name the workers import for ``fn``: a module-level function (its module must
    be importable by name, so not ``__main__``), such a name (a str, checked when the job is submitted), or None
    (the built-in demo, ``deadpool_hpc.train.demo:train``). Raises ValueError, naming ``fn`` and what is accepted,
    for anything else: a lambda, a nested function or closure, a method, a functools.partial, a callable object,
    a function its module does not hold under its name (``accepted``: what the message says is accepted)."""
    from ..worker.entry import load_train_fn

    if fn is None:
        return DEMO
    if isinstance(fn, str):
        return fn
    if not inspect.isfunction(fn):
        raise ValueError(f"deadpool executor: cannot submit {fn!r}: not a function; {accepted}")
    mod, qualname = fn.__module__, fn.__qualname__
    what = f"{mod}.{qualname}"
    if fn.__name__ == "<lambda>":
        raise ValueError(f"deadpool executor: cannot submit the lambda {what}: the workers import the training "
                         f"function by name; {accepted}")
    if "<locals>" in qualname:
        raise ValueError(f"deadpool executor: cannot submit {what}: a function defined inside another (a closure) "
                         f"cannot be imported by name; {accepted}")
    if "." in qualname:
        raise ValueError(f"deadpool executor: cannot submit {what}: a method or class attribute; {accepted}")
    if not mod or mod == "__main__":
        raise ValueError(f"deadpool executor: cannot submit {qualname!r} of __main__ (a script): the workers import "
                         f"the function by its module's name; move it to an importable module. {accepted}")
    spec = f"{mod}:{qualname}"
    try:
        found = load_train_fn(spec)
    except Exception as exc:  # ImportError, AttributeError, or the module's own error
        raise ValueError(f"deadpool executor: cannot submit {what}: {spec!r} does not import here "
                         f"({type(exc).__name__}: {exc}); {accepted}") from None
    if found is not fn:
        raise ValueError(f"deadpool executor: cannot submit {what}: {spec!r} names another object (was the function "
                         f"redefined or decorated?); {accepted}")
    return spec


def _config(settings: dict, what, train_args: dict) -> RunConfig:
    """The RunConfig of one submission (see the module): ``what`` a RunConfig (used as it is: ``settings`` and
    ``train_args`` must be empty), else a training function's spec with ``settings`` and ``train_args``."""
    if isinstance(what, RunConfig):
        if settings or train_args:
            raise ConfigError(f"deadpool executor: submit(RunConfig) on an executor with run settings "
                              f"{sorted(settings) + sorted(train_args)}; accepted: set them in one place (the "
                              f"RunConfig, or the executor and submit's keyword arguments)")
        check_transport()
        return what.validate()
    known = {f.name for f in RunConfig.flat_fields()}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(f"deadpool executor: unknown run setting(s) {unknown}; accepted: "
                          f"{', '.join(sorted(known - {'train_fn'}))}")
    spec = train_fn_spec(what)
    run = dict(settings)
    args = dict(run.pop("train_args", None) or {}, **train_args)
    cfg = RunConfig(**run, train_fn=spec, train_args=args).validate()
    check_train_fn(spec, args)   # ConfigError naming the spec or the bad train arg
    check_transport()   # ConfigError: an MPI transport on which one node's death kills every agent (control/mpi.py)
    return cfg


class DeadpoolJob:
    """A run's handle, whatever its back-end: ``result()``, ``status()``, ``swap(node)``, ``cancel()``, ``done()``;
    ``run_dir`` (absolute) and ``job_id`` (the Slurm job id, None for a local run)."""

    run_dir: str
    job_id: str | None = None

    def result(self, timeout: float | None = None) -> dict:
        """Block until the run ends (at most ``timeout`` seconds: TimeoutError) and return its summary (dict,
        summary.build_summary's: ``completed``, ``steps_completed``, ``swaps``, ``failures``, ``param_digest``,
        ...), of a run that completed or not. Raises JobLost if the job ended without one."""
        raise NotImplementedError

    def done(self) -> bool:
        """True once the run has ended (a requeued Slurm job has not)."""
        raise NotImplementedError

    def status(self) -> dict:
        """``{"state", "run_dir", "job_id", "slurm", "run"}``: ``state`` one word (PENDING, RUNNING, COMPLETED,
        FAILED, CANCELLED, ...; Slurm's for a Slurm job), ``slurm`` Slurm's view of the job (None for a local
        run), ``run`` the run's progress from its event log (step, loss, failures, hosts; slurm.run_progress)."""
        from .slurm import run_progress, status

        if self.job_id is None:
            return {"state": self._state(), "run_dir": self.run_dir, "job_id": None, "slurm": None,
                    "run": run_progress(self.run_dir)}
        st = status(self.job_id)
        if st.get("run") is None and os.path.exists(RunDir(self.run_dir).config):
            st["run"] = run_progress(self.run_dir)
        return {"state": (st.get("slurm") or {}).get("state"), "run_dir": self.run_dir, "job_id": self.job_id,
                **st}

    def _state(self) -> str | None:
        return None

    def swap(self, node: str, reason: str = "deadpool swap") -> dict:
        """Planned swap: ``node`` (Slurm's node name, or ``node<index>`` for a local run) leaves the running job at
        its next step boundary and a spare takes its place, no step recomputed (launch/swap.py, agent/planned.py).
        Returns ``{"run_dir", "node", "index", "path"}``. Raises ConfigError, writing nothing, if the run is not
        running, keeps no replicas, ``node`` is not one of its active nodes, or no spare is left."""
        from .swap import request

        # by the run directory: it names its job (slurm_job_id), which a submitit job's id does not name back
        return request(self.run_dir, node, reason)

    def cancel(self) -> None:
        """Stop the run: every process of a local run (as SIGTERM would: ``interrupted`` in its summary), or
        ``scancel`` of a Slurm job (the ranks save a checkpoint on SIGTERM; the summary says ``stopped``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(run_dir={self.run_dir!r}, job_id={self.job_id!r})"


# ---- local -----------------------------------------------------------------------------------------------------
class LocalExecutor:
    """The embedded default: a run of emulated nodes as local processes under MPICH's hydra (launch/local.py).
    ``settings`` are RunConfig's fields (``nodes``, ``spares``, ``steps``, ``run_dir``, ...); ``on_poll(events)``
    is called with the run's new events every ``poll_s`` seconds (the live console of ``deadpool run``);
    ``timeout``: seconds before the whole run is killed (None: no limit; ``result()`` raises TimeoutError)."""

    def __init__(self, *, on_poll=None, poll_s: float = 0.25, timeout: float | None = None, **settings):
        self.settings, self.on_poll, self.poll_s, self.timeout = settings, on_poll, poll_s, timeout

    def submit(self, what=None, resume: bool = False, **train_args) -> "LocalJob":
        """Start one run in a thread of this process and return its LocalJob. Raises ConfigError before anything
        starts for a bad config, a training function that cannot be imported by name, or a run directory or
        summary path that cannot be used (``resume``: one with no checkpoint of this layout); RunDirBusy (a
        ConfigError) from ``result()`` if another run holds the run directory."""
        from ..rundir import check_output_file, check_run_dir
        from .local import check_resume

        cfg = _config(self.settings, what, train_args)
        check_run_dir(cfg.output.run_dir)
        if cfg.output.summary_path:
            check_output_file(cfg.output.summary_path, run_dir=cfg.output.run_dir)
        if resume:
            check_resume(cfg.output.run_dir, cfg.layout.world_size)
        return LocalJob(cfg, self.on_poll, self.poll_s, resume, self.timeout).start()

    def run(self, what=None, resume: bool = False, **train_args) -> dict:
        """``submit(...).result()`` in this thread, so that SIGTERM, SIGHUP and SIGINT stop the run (what
        ``deadpool run`` does). Raises local.Interrupted for such a signal before any process started."""
        from .local import launch

        cfg = _config(self.settings, what, train_args)
        return launch(cfg, on_poll=self.on_poll, poll_s=self.poll_s, resume=resume, timeout=self.timeout)


class LocalJob(DeadpoolJob):
    """A local run going on in a thread of this process (LocalExecutor.submit)."""

    def __init__(self, cfg: RunConfig, on_poll=None, poll_s: float = 0.25, resume: bool = False,
                 timeout: float | None = None):
        from .local import StopRequest

        self.cfg, self.run_dir, self.job_id = cfg, os.path.abspath(cfg.output.run_dir), None
        self._stop = StopRequest()
        self._args = (on_poll, poll_s, resume, timeout)
        self._summary: dict | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="deadpool-local-run", daemon=True)

    def start(self) -> "LocalJob":
        self._thread.start()
        return self

    def _run(self) -> None:
        from .local import launch

        on_poll, poll_s, resume, timeout = self._args
        try:
            self._summary = launch(self.cfg, on_poll=on_poll, poll_s=poll_s, resume=resume, timeout=timeout,
                                   stop=self._stop)
        except BaseException as exc:   # raised again by result()
            self._error = exc

    def result(self, timeout: float | None = None) -> dict:
        """See DeadpoolJob.result. Raises what the launch raised instead (ConfigError, RunDirBusy,
        local.Interrupted when cancelled before any process started)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the run in {self.run_dir} is still going after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._summary

    def done(self) -> bool:
        return not self._thread.is_alive()

    def _state(self) -> str:
        if not self.done():
            return "CANCELLING" if self._stop.signum else "RUNNING"
        if self._error is not None or self._summary is None:
            return "CANCELLED" if self._stop.signum else "FAILED"
        if self._summary.get("completed"):
            return "COMPLETED"
        return "CANCELLED" if self._summary.get("interrupted") else "FAILED"

    def cancel(self) -> None:
        self._stop.request(signal.SIGTERM)


class _AttachedLocalJob(DeadpoolJob):
    """A local run started by another process (``deadpool run``), found by its run directory."""

    def __init__(self, run_dir: str):
        self.run_dir, self.job_id = os.path.abspath(run_dir), None

    def done(self) -> bool:
        try:
            check_free(self.run_dir)
        except RunDirBusy:
            return False
        return True

    def _state(self) -> str:
        if not self.done():
            return "RUNNING"
        try:
            with open(RunDir(self.run_dir).summary) as fh:
                s = json.load(fh)
        except (OSError, ValueError):
            return "ENDED"
        return "COMPLETED" if s.get("completed") else ("CANCELLED" if s.get("interrupted") else "FAILED")

    def result(self, timeout: float | None = None) -> dict:
        end = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"the run in {self.run_dir} is still going after {timeout} s")
            time.sleep(1)
        try:
            with open(RunDir(self.run_dir).summary) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            raise JobLost(f"the run in {self.run_dir} ended without a summary; rebuild one from its event log: "
                          f"deadpool summary {self.run_dir}") from None

    def cancel(self) -> None:
        """SIGTERM to the launcher that holds the run directory's lock (its pid, start time and host are in
        run.lock), as Ctrl-C would. Raises ConfigError when no run holds it, or one on another host does."""
        import socket

        from ..process.fence import is_alive

        try:
            check_free(self.run_dir)
        except RunDirBusy as busy:
            holder = busy.holder
        else:
            raise ConfigError(f"no run is in progress in {self.run_dir} (nobody holds its run.lock): nothing to "
                              f"cancel")
        if holder.get("host") != socket.gethostname() or not holder.get("pid") or not is_alive(holder):
            raise ConfigError(f"the run in {self.run_dir} is held by {holder or 'an unknown process'}, not a "
                              f"process of this host that can be signalled; stop it where it runs")
        os.kill(int(holder["pid"]), signal.SIGTERM)


# ---- Slurm (the batch template) --------------------------------------------------------------------------------
class SlurmExecutor:
    """The batch template (templates/train.sbatch, shipped in the package) rendered into RUN_DIR/job.sbatch and
    submitted with ``sbatch`` (slurm.submit): what ``deadpool submit`` does. ``partition``, ``time`` (Slurm's
    format, e.g. ``2:00:00``), ``account``, ``signal_lead`` (seconds: SIGUSR2 this long before the time limit; the
    template's 120 by default) and ``sbatch_args`` (extra sbatch arguments) go to sbatch; ``settings`` are
    RunConfig's fields."""

    def __init__(self, *, partition: str | None = None, time: str | None = None, account: str | None = None,
                 signal_lead: int | None = None, sbatch_args: list[str] | None = None,
                 template: str | None = None, **settings):
        self.settings = settings
        self.sbatch = dict(partition=partition, time=time, account=account, extra=list(sbatch_args or []),
                           template=template, signal_lead=signal_lead)

    def submit(self, what=None, **train_args) -> "SlurmJob":
        """Submit one run; returns its SlurmJob. Raises ConfigError, before anything is written or queued, as
        slurm.submit says (a partition that can never run it, a time limit that leaves no time to train before the
        signal, a run directory a job still uses, sbatch's refusal)."""
        from .slurm import submit

        cfg = _config(self.settings, what, train_args)
        return SlurmJob(submit(cfg, **self.sbatch), cfg.output.run_dir)

    def render(self, what=None, **train_args) -> str:
        """The batch script ``submit`` would submit (nothing is written or submitted)."""
        from .slurm import render

        cfg = _config(self.settings, what, train_args)
        return render(cfg, self.sbatch["template"], signal_lead=self.sbatch["signal_lead"])


class SlurmJob(DeadpoolJob):
    """A Slurm job running a run (the batch template's, or any whose run directory is known)."""

    def __init__(self, job_id: str, run_dir: str):
        self.job_id, self.run_dir = str(job_id), os.path.abspath(run_dir)

    def _slurm_state(self) -> str | None:
        from .slurm import slurm_state

        return slurm_state(self.job_id).get("state")

    def done(self) -> bool:
        state = self._slurm_state()
        return state is not None and state not in SLURM_LIVE

    def result(self, timeout: float | None = None, poll_s: float = 2.0) -> dict:
        """See DeadpoolJob.result: waits until Slurm says the job ended, then reads RUN_DIR/summary.json (the
        batch script's ``end`` wrote it). Raises JobLost naming the job's state when it ended without one."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"job {self.job_id} is still {self._slurm_state()} after {timeout} s")
            time.sleep(poll_s)
        return _summary_of(self)

    def cancel(self) -> None:
        out = subprocess.run(["scancel", self.job_id], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise ConfigError(f"scancel {self.job_id} failed (exit {out.returncode}): {out.stderr.strip()}")


def _summary_of(job: DeadpoolJob) -> dict:
    """RUN_DIR/summary.json of this job (its ``slurm_job_id``), else JobLost naming the state."""
    try:
        with open(RunDir(job.run_dir).summary) as fh:
            s = json.load(fh)
    except (OSError, ValueError):
        s = None
    if s is not None and str(s.get("slurm_job_id")) == str(job.job_id):
        return s
    state = job.status().get("state")
    raise JobLost(f"job {job.job_id} ended {state or '(state unknown)'} without a summary in {job.run_dir}; "
                  f"rebuild one from its event log: deadpool summary {job.run_dir}")


# ---- submitit ----------------------------------------------------------------------------------------------------
class SubmititExecutor:
    """submitit underneath (``submitit.SlurmExecutor``, public API only): each of the job's ``nodes + spares``
    Slurm tasks runs ``HotSwapJob`` (submitit_job.py), which starts the node's agent. ``folder``: submitit's log
    and pickle folder. ``timeout_min`` (minutes): the job's time limit. ``slurm`` are submitit SlurmExecutor
    parameters (``partition="debug"``, ``signal_delay_s``, ``additional_parameters`` merged over
    ``--no-kill --requeue --exclusive``, ``srun_args`` appended to ``--no-kill --kill-on-bad-exit=0 --mpi=pmi2``;
    a ``slurm_`` prefix is accepted and dropped). ``settings`` are RunConfig's fields; ``wait_survivors_s`` and
    ``checkpoint_wait_s`` HotSwapJob's waits. Raises ConfigError when ``timeout_min`` leaves no time
    to train before submitit's signal (``signal_delay_s`` before the time limit, default 90: timelimit.py), when it is
    constructed."""

    RUN_SETTINGS = {f.name for f in RunConfig.flat_fields()} | {"wait_survivors_s", "checkpoint_wait_s"}

    def __init__(self, folder: str, *, timeout_min: int = 60, slurm: dict | None = None, **settings):
        from . import timelimit

        self.folder, self.timeout_min = str(folder), timeout_min
        self.slurm = {k.removeprefix("slurm_"): v for k, v in (slurm or {}).items()}
        timelimit.check_submitit(timeout_min, self.slurm.get("signal_delay_s", 90))
        self.settings = {k: v for k, v in settings.items() if k not in ("wait_survivors_s", "checkpoint_wait_s")}
        self.waits = {k: v for k, v in settings.items() if k in ("wait_survivors_s", "checkpoint_wait_s")}

    def parameters(self, cfg: RunConfig) -> dict:
        """The submitit SlurmExecutor parameters of a job for ``cfg``: one task (node agent) per node, nodes +
        spares nodes, ranks_per_node CPUs per task, the hot-swap flags."""
        from .submitit_job import JOB_FLAGS, srun_args

        if cfg.layout.ranks_per_node == 0:
            raise ConfigError("--ranks-per-node 0 (one per GPU of the node) is resolved by the batch template "
                              "(deadpool submit, SlurmExecutor); accepted with the submitit executor: 1 or more")
        slurm = dict(self.slurm)
        add = dict(JOB_FLAGS, **(slurm.pop("additional_parameters", None) or {}))
        return dict(nodes=cfg.layout.total_nodes, ntasks_per_node=1, cpus_per_task=cfg.layout.ranks_per_node,
                    time=self.timeout_min, additional_parameters=add,
                    srun_args=srun_args() + list(slurm.pop("srun_args", None) or []), **slurm)

    def submit(self, what=None, **train_args) -> "SubmititJob":
        """Submit one run; returns its SubmititJob. The config is written and RUN_DIR prepared here, on the
        submitting host (HotSwapJob). Raises ConfigError (see the class) before anything is written."""
        import submitit

        from .submitit_job import HotSwapJob

        cfg = _config(self.settings, what, train_args)
        ex = submitit.SlurmExecutor(folder=self.folder)
        ex.update_parameters(**self.parameters(cfg))
        job = ex.submit(HotSwapJob(cfg, **self.waits))
        return SubmititJob(job, cfg.output.run_dir)


class SubmititJob(DeadpoolJob):
    """A submitit job running a run; ``submitit_job`` is submitit's own Job (its ``task(0).result()`` raises
    submitit's UncompletedJobError or FailedJobError where ``result()`` here returns the summary)."""

    def __init__(self, job, run_dir: str):
        self.submitit_job, self.run_dir = job, os.path.abspath(run_dir)
        self.job_id = str(job.job_id)

    def done(self) -> bool:
        return self.submitit_job.done()

    def result(self, timeout: float | None = None) -> dict:
        """See DeadpoolJob.result: task 0's result (the summary) for a run that completed; for one that did not
        (failed, no spare and no requeue left, cancelled), the summary task 0 wrote to RUN_DIR/summary.json."""
        from submitit.core.utils import FailedJobError, UncompletedJobError

        end = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"job {self.job_id} is still {self.submitit_job.state} after {timeout} s")
            time.sleep(1)
        try:
            return self.submitit_job.task(0).result()
        except (FailedJobError, UncompletedJobError):
            return _summary_of(self)

    def cancel(self) -> None:
        self.submitit_job.cancel(check=True)


# ---- attach ------------------------------------------------------------------------------------------------------
def attach(target: str) -> DeadpoolJob:
    """The handle of a run started elsewhere: ``target`` a Slurm job id (its run directory found as slurm.status
    does) or a run directory (a Slurm job's, named in its ``slurm_job_id`` file, else a local run's). Raises
    ConfigError naming ``target`` for anything else, or a job whose run directory cannot be found."""
    from .slurm import status

    target = str(target)
    if os.path.isdir(target):
        try:
            with open(os.path.join(target, "slurm_job_id")) as fh:
                job_id = fh.read().strip()
        except OSError:
            job_id = ""
        return SlurmJob(job_id, target) if job_id else _AttachedLocalJob(target)
    st = status(target)   # ConfigError: neither a directory nor a job id
    run = st.get("run")
    if not run:
        raise ConfigError(f"no run directory found for job {target!r}: pass the run directory instead (a template "
                          f"job whose RUN_DIR was set by hand)")
    return SlurmJob(target, run["run_dir"])
