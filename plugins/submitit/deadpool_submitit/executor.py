"""``DeadpoolExecutor``: submitit's SlurmExecutor for hot-swap runs, registered as ``cluster="deadpool"``.

The same run as deadpool-hpc's own ``SubmititExecutor`` (deadpool_hpc/launch/executors.py: one vocabulary for
every back-end, ``DeadpoolJob`` handles with ``swap(node)``), for code written against submitit's vocabulary:
here the executor is submitit's (AutoExecutor, ``deadpool_`` parameters) and so are its jobs.

    import submitit
    from deadpool_hpc.train.demo import train

    ex = submitit.AutoExecutor("submitit-logs", cluster="deadpool")
    ex.update_parameters(nodes=4, deadpool_spares=1, deadpool_steps=200, deadpool_run_dir="run",
                         deadpool_partition="debug", timeout_min=60)
    job = ex.submit(train)          # or a HotSwapJob, a "package.module:function" string, None (the demo)
    summary = job.result()          # the run summary (dict) of a completed run

Everything that makes a run survive a node crash is what ``SubmititExecutor.parameters`` sets, applied at every
submission: Slurm gets ``nodes + spares`` nodes, one task per node (the node agent) with
``cpus_per_task = ranks_per_node`` CPUs, ``#SBATCH --no-kill --requeue --exclusive`` and
``srun --no-kill --kill-on-bad-exit=0 --mpi=pmi2``. The callable submitit runs is a ``HotSwapJob`` (its
``checkpoint()`` handles preemption and the time limit), and the job objects are ``HotSwapSlurmJob``s, whose
``result()`` is task 0's: the summary.

Parameters. Through ``AutoExecutor`` the executor's own parameters take the ``deadpool_`` prefix (submitit's rule
for cluster-specific parameters); on a ``DeadpoolExecutor`` made directly they have no prefix. Besides submitit's
generic ones (``nodes`` = ACTIVE nodes, ``timeout_min``, ``cpus_per_task``, ``gpus_per_node``, ``mem_gb``,
``name``) and every SlurmExecutor parameter (``deadpool_partition``, ``deadpool_account``, ``deadpool_qos``, ...),
it takes the run's settings (``RUN_PARAMETERS``: RunConfig's settings by their flat names, derived from its sections):
``spares``, ``ranks_per_node``, ``steps``, ``train_args``, ``replicas``, ``replica_transport``, ``requeue``,
``max_requeues``, ``run_dir``, ``summary_path``, timeouts in seconds, ... and HotSwapJob's ``wait_survivors_s``
and ``checkpoint_wait_s``.
``slurm_``-prefixed parameters do not reach this executor (AutoExecutor drops other clusters' parameters).
"""
from __future__ import annotations

import math
import re
import shutil
import typing as tp

from submitit.core import utils
from submitit.slurm.slurm import SlurmExecutor

from deadpool_hpc.config import RunConfig, run_parameters
from deadpool_hpc.errors import ConfigError
from deadpool_hpc.launch import slurm as deadpool_slurm
from deadpool_hpc.launch import timelimit
from deadpool_hpc.launch.executors import train_fn_spec as _train_fn_spec
from deadpool_hpc.launch.options import check_train_fn
from deadpool_hpc.launch.submitit_job import JOB_FLAGS, HotSwapJob, hot_swap_job_class, srun_args

__all__ = ["DeadpoolExecutor", "RUN_PARAMETERS", "train_fn_spec"]

DEMO = RunConfig().train.train_fn  # "deadpool_hpc.train.demo:train"

_ACCEPTED_FN = ("accepted: a module-level function fn(ctx) of a module the nodes can import (as for "
                "`deadpool run --train-fn`), its 'package.module:function' name, a HotSwapJob, or None (the "
                "built-in demo)")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_seconds(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# name -> (check, what is accepted): the run's settings, derived from RunConfig's sections (config.run_parameters:
# every public setting but nodes, submitit's generic parameter); then HotSwapJob's two waits.
RUN_PARAMETERS: tp.Dict[str, tp.Tuple[tp.Callable[[tp.Any], bool], str]] = {
    **run_parameters(),
    "wait_survivors_s": (lambda v: _is_seconds(v) and v > 0, "seconds > 0 (task 0's wait for the other tasks)"),
    "checkpoint_wait_s": (lambda v: _is_seconds(v) and v > 0, "seconds > 0 (checkpoint()'s wait for the "
                                                              "checkpoint on SIGUSR2)"),
}
_JOB_PARAMETERS = ("wait_survivors_s", "checkpoint_wait_s")


def _refused(name: str, value, accepted: str) -> ValueError:
    return ValueError(f"deadpool executor: {name}={value!r} is refused; accepted: {accepted}")


def _run_config_error(exc: ConfigError) -> ConfigError:
    """RunConfig.validate() names CLI options (``--spares 1``); name the executor's parameters (``spares=1``)."""
    msg = re.sub(r"--([a-z][a-z-]*) (?=[-\w.])", lambda m: m.group(1).replace("-", "_") + "=", str(exc))
    msg = re.sub(r"--([a-z][a-z-]*)", lambda m: m.group(1).replace("-", "_"), msg)
    return ConfigError(f"deadpool executor: {msg}")


def train_fn_spec(fn) -> str:
    """The "package.module:function" name the workers import for ``fn``: deadpool_hpc.launch.executors.train_fn_spec,
    whose message names what this executor's ``submit`` accepts. Raises ValueError for a function the workers
    could not import by name."""
    return _train_fn_spec(fn, _ACCEPTED_FN)


class DeadpoolExecutor(SlurmExecutor):
    """submitit executor for hot-swap runs (``cluster="deadpool"``); a SlurmExecutor otherwise.

    ``submit(fn, **train_args)`` accepts a module-level training function ``fn(ctx)``, its
    "package.module:function" name, None (the built-in demo), or a ready ``HotSwapJob``; keyword arguments are
    added to ``train_args``. One run per job: ``map_array``, ``submit_array`` and ``batch()`` are refused.

    ``nodes`` is the number of ACTIVE nodes (default 3, as RunConfig); the job asks Slurm for ``nodes + spares``
    nodes, one task each, ``cpus_per_task`` (default: ``ranks_per_node``) CPUs per task. ``timeout_min`` (minutes,
    default 60) is the job's time limit; ``time`` likewise. ``additional_parameters`` are merged over
    ``{"no-kill": True, "requeue": True, "exclusive": True}``; ``srun_args`` are appended to
    ``--no-kill --kill-on-bad-exit=0 --mpi=pmi2``.

    Raises ValueError (ConfigError, a ValueError, for a layout RunConfig refuses), naming the parameter, its value
    and what would be accepted: at ``update_parameters`` for a value of the wrong type or range, ``tasks_per_node``
    other than 1 or ``use_srun=False``; at ``submit`` for a combination that cannot work (e.g. ``spares`` with one
    active node, ``replicas`` >= ``nodes``, ``cpus_per_task`` < ``ranks_per_node``, more nodes than the partition
    has, ``timeout_min`` that leaves no time to train before submitit's signal ``signal_delay_s`` seconds before the
    time limit, default 90: ``timeout_min`` must exceed it by 90 s, see deadpool_hpc/launch/timelimit.py), a
    training function that cannot be imported by name, a ``HotSwapJob`` whose config contradicts parameters set
    here, or a run directory a job still uses. RuntimeError at construction when ``srun`` is not on PATH.
    """

    def __init__(self, folder, max_num_timeout: int = 3, max_pickle_size_gb: float = 1.0,
                 python: tp.Optional[str] = None) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout, max_pickle_size_gb=max_pickle_size_gb,
                         python=python)
        self.job_class = hot_swap_job_class()  # result() = task 0's: the summary
        self._run: tp.Dict[str, tp.Any] = {}   # run settings set here (RunConfig's defaults otherwise)
        self._cpus: tp.Optional[int] = None    # cpus_per_task set here (else ranks_per_node)
        self._additional: tp.Dict[str, tp.Any] = {}
        self._srun_extra: tp.List[str] = []
        super()._internal_update_parameters(time=60, **self._sizing(self._layout()))

    @classmethod
    def name(cls) -> str:
        return "deadpool"

    @classmethod
    def affinity(cls) -> int:
        # below SlurmExecutor's 2: AutoExecutor() without cluster= keeps choosing "slurm"; > 0 where srun exists
        return 1 if shutil.which("srun") else -1

    @classmethod
    def _valid_parameters(cls) -> tp.Set[str]:
        return super()._valid_parameters() | set(RUN_PARAMETERS)

    # -- parameters ------------------------------------------------------------------------------------------
    def _layout(self) -> RunConfig:
        return RunConfig(**{k: v for k, v in self._run.items() if k not in _JOB_PARAMETERS})

    def _sizing(self, cfg: RunConfig) -> tp.Dict[str, tp.Any]:
        return {"nodes": cfg.layout.total_nodes, "ntasks_per_node": 1,  # one node agent per node
                "cpus_per_task": self._cpus or cfg.layout.ranks_per_node,
                "additional_parameters": dict(JOB_FLAGS, **self._additional),
                "srun_args": srun_args() + self._srun_extra}

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        """Set parameters (unprefixed names; AutoExecutor strips ``deadpool_``). Raises ValueError naming a bad
        value and what is accepted, or listing the valid parameters for an unknown one."""
        kwargs = dict(kwargs)
        unknown = sorted(set(kwargs) - self._valid_parameters())
        if unknown:
            raise ValueError(f"deadpool executor: unknown parameter(s) {unknown}; accepted: "
                             f"{', '.join(sorted(self._valid_parameters()))}")
        run = {k: kwargs.pop(k) for k in list(kwargs) if k in RUN_PARAMETERS}
        for k, v in run.items():
            check, accepted = RUN_PARAMETERS[k]
            if k in ("run_dir", "summary_path") and hasattr(v, "__fspath__"):
                v = run[k] = str(v.__fspath__())
            if not check(v):
                raise _refused(k, v, accepted)
        if "nodes" in kwargs:
            n = kwargs.pop("nodes")
            if not (_is_int(n) and n >= 1):
                raise _refused("nodes", n, "an integer >= 1 (ACTIVE nodes; the job gets nodes + spares)")
            run["nodes"] = n
        if "ntasks_per_node" in kwargs:
            t = kwargs.pop("ntasks_per_node")
            if t not in (None, 1):
                raise _refused("tasks_per_node", t, "1 (one node agent per node; it starts ranks_per_node "
                                                    "training processes: set ranks_per_node instead)")
        if "use_srun" in kwargs and kwargs["use_srun"] is not True:
            raise _refused("use_srun", kwargs["use_srun"], "True (the node agents are the tasks of submitit's srun)")
        cpus = kwargs.pop("cpus_per_task", self._cpus)
        if cpus is not None and not (_is_int(cpus) and cpus >= 1):
            raise _refused("cpus_per_task", cpus, "an integer >= 1, at least ranks_per_node")
        additional = kwargs.pop("additional_parameters", self._additional)
        if not isinstance(additional, dict):
            raise _refused("additional_parameters", additional, "a dict of sbatch options")
        extra = kwargs.pop("srun_args", self._srun_extra)
        if isinstance(extra, str) or not all(isinstance(a, str) for a in (extra or [])):
            raise _refused("srun_args", extra, "a list of str (srun options added after ours)")
        new_run = dict(self._run, **run)
        sizing_of = RunConfig(**{k: v for k, v in new_run.items() if k not in _JOB_PARAMETERS})
        old = (self._run, self._cpus, self._additional, self._srun_extra)
        self._run, self._cpus, self._additional, self._srun_extra = new_run, cpus, dict(additional), list(extra or [])
        try:
            super()._internal_update_parameters(**kwargs, **self._sizing(sizing_of))
        except Exception:
            self._run, self._cpus, self._additional, self._srun_extra = old
            raise

    @property
    def run_parameters(self) -> tp.Dict[str, tp.Any]:
        """The run settings set so far (``nodes`` = active nodes), RunConfig's defaults for the others."""
        cfg = self._layout()
        out = {f.name: getattr(cfg, f.name) for f in cfg.flat_fields() if f.name not in ("faults", "train_fn")}
        out.update((k, self._run[k]) for k in _JOB_PARAMETERS if k in self._run)
        return out

    # -- submission ------------------------------------------------------------------------------------------
    def submit(self, fn: tp.Any = None, *args: tp.Any, **kwargs: tp.Any):  # type: ignore[override]
        """Submit one hot-swap run; returns its HotSwapSlurmJob (``result()``: the summary dict, hours later).
        ``fn``: a module-level function ``fn(ctx)``, a "package.module:function" str, None (the demo) or a
        HotSwapJob; ``kwargs`` are added to ``train_args``. Raises ValueError (see the class)."""
        return super().submit(fn, *args, **kwargs)

    def _hot_swap_job(self, delayed: utils.DelayedSubmission) -> HotSwapJob:
        fn, args, kwargs = delayed.function, delayed.args, delayed.kwargs
        if args:
            raise ValueError(f"deadpool executor: submit() got positional arguments {args!r} for {fn!r}; the "
                             f"training function is called as fn(ctx); pass its settings as keyword arguments "
                             f"(they become train_args) or as the train_args parameter")
        if isinstance(fn, HotSwapJob):
            if kwargs:
                raise ValueError(f"deadpool executor: submit(HotSwapJob, **{kwargs!r}): a HotSwapJob takes no "
                                 f"arguments; its config's train_args are the training function's settings")
            have = dict(fn.cfg.flat(), wait_survivors_s=fn.wait_survivors_s,
                        checkpoint_wait_s=fn.checkpoint_wait_s)
            clash = {k: (v, have[k]) for k, v in self._run.items() if have[k] != v}
            if clash:
                raise ValueError("deadpool executor: the HotSwapJob's config contradicts parameters set on the "
                                 "executor: " + ", ".join(f"{k}={mine!r} here but {theirs!r} in the job"
                                                         for k, (mine, theirs) in sorted(clash.items()))
                                 + "; accepted: set them in one place (a HotSwapJob's config sizes the job)")
            self._check_fit(fn.cfg)
            return fn
        spec = train_fn_spec(fn)
        run = {k: v for k, v in self._run.items() if k not in _JOB_PARAMETERS}
        train_args = dict(run.pop("train_args", {}), **kwargs)
        try:
            cfg = RunConfig(**run, train_args=train_args, train_fn=spec).validate()
        except ConfigError as exc:
            raise _run_config_error(exc) from None
        check_train_fn(spec, train_args)  # ConfigError naming the spec or the bad train arg
        self._check_fit(cfg)
        return HotSwapJob(cfg, **{k: self._run[k] for k in _JOB_PARAMETERS if k in self._run})

    def _check_fit(self, cfg: RunConfig) -> None:
        if self._cpus is not None and self._cpus < cfg.layout.ranks_per_node:
            raise _refused("cpus_per_task", self._cpus, f"at least ranks_per_node ({cfg.layout.ranks_per_node}): each "
                                                        f"training process needs a CPU")
        try:
            deadpool_slurm.check_partition(cfg, self.parameters.get("partition"))
        except ConfigError as exc:
            raise _run_config_error(exc) from None
        try:   # the time limit must leave time to train before submitit's USR2 (launch/timelimit.py)
            timelimit.check_submitit(self.parameters.get("time"), self.parameters.get("signal_delay_s", 90))
        except ConfigError as exc:
            raise ConfigError(f"deadpool executor: {exc}") from None

    def _internal_process_submissions(self, delayed_submissions: tp.List[utils.DelayedSubmission]) -> tp.List[tp.Any]:
        if len(delayed_submissions) != 1:
            raise ValueError(f"deadpool executor: {len(delayed_submissions)} submissions at once (map_array, "
                             f"submit_array or batch()); accepted: one run per job, submit() them one by one, each "
                             f"with its own run_dir")
        job = self._hot_swap_job(delayed_submissions[0])
        params = self.parameters
        self.parameters = dict(params, **self._sizing(job.cfg))  # sized by the job's own config
        try:
            return super()._internal_process_submissions([utils.DelayedSubmission(job)])
        finally:
            self.parameters = params
