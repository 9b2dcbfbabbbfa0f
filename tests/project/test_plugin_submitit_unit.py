"""The submitit plugin (plugins/submitit, deadpool-submitit) without Slurm: AutoExecutor(cluster="deadpool")
resolves to DeadpoolExecutor through submitit's entry points, sizes the sbatch job as SubmititExecutor does, and refuses
bad parameters and training functions that the workers could not import, with a message naming them.

Nothing here reaches Slurm: every refusal comes before sbatch. submitit's SlurmExecutor only needs an ``srun`` on
PATH to be constructed; where none is installed, a stub that is never run is put at the end of PATH."""
from __future__ import annotations

import os
import shutil

import pytest

submitit = pytest.importorskip("submitit")

from deadpool_hpc.config import RunConfig  # noqa: E402
from deadpool_hpc.errors import ConfigError  # noqa: E402


@pytest.fixture
def ex(tmp_path, monkeypatch):
    if not shutil.which("srun"):
        stub = tmp_path / "bin"
        stub.mkdir()
        (stub / "srun").write_text("#!/bin/sh\nexit 1\n")
        (stub / "srun").chmod(0o755)
        monkeypatch.setenv("PATH", os.environ.get("PATH", "") + os.pathsep + str(stub))
    try:
        return submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="deadpool")
    except ValueError as exc:  # "AutoExecutor doesn't know any executor named deadpool"
        pytest.fail(f"{exc}: the plugin is not installed; run "
                    f".venv/bin/python -m pip install --no-deps --no-build-isolation -e plugins/submitit")


def test_entry_point_resolves_to_the_deadpool_executor(ex):
    from importlib import metadata

    from submitit.core import plugins

    from deadpool_submitit import DeadpoolExecutor

    eps = {ep.name: ep.value for ep in metadata.entry_points(group="submitit")}
    assert eps.get("executor") == "deadpool_submitit:DeadpoolExecutor", eps
    assert plugins.get_executors()["deadpool"] is DeadpoolExecutor
    assert type(ex._executor) is DeadpoolExecutor and ex.cluster == "deadpool"
    assert submitit.AutoExecutor.which() != "deadpool"  # never chosen without cluster="deadpool"


def test_the_job_is_sized_and_flagged_for_hot_swap(ex):
    from deadpool_hpc.launch.submitit_job import hot_swap_job_class

    ex.update_parameters(nodes=4, deadpool_spares=1, deadpool_ranks_per_node=2, timeout_min=10,
                         deadpool_partition="debug", deadpool_additional_parameters={"comment": "x"},
                         deadpool_srun_args=["--cpu-bind=none"])
    inner = ex._executor
    assert inner.job_class is hot_swap_job_class()
    p = inner.parameters
    assert (p["nodes"], p["ntasks_per_node"], p["cpus_per_task"], p["time"]) == (5, 1, 2, 10)
    assert p["additional_parameters"] == {"no-kill": True, "requeue": True, "exclusive": True, "comment": "x"}
    assert p["srun_args"] == ["--no-kill", "--kill-on-bad-exit=0", "--mpi=pmi2", "--cpu-bind=none"]
    text = inner._make_submission_file_text("CMD", "uid")
    assert "#SBATCH --no-kill" in text and "#SBATCH --nodes=5" in text and "#SBATCH --partition=debug" in text
    assert "--no-kill --kill-on-bad-exit=0 --mpi=pmi2 --cpu-bind=none CMD" in text
    assert inner.run_parameters["nodes"] == 4 and inner.run_parameters["spares"] == 1
    with pytest.warns(UserWarning, match="deadpool_spares"):  # submitit maps the unprefixed name, with a warning
        ex.update_parameters(spares=2)
    assert inner.parameters["nodes"] == 6


def test_every_run_setting_is_a_parameter():
    from deadpool_submitit import RUN_PARAMETERS

    # interleave_replication: a benchmark's on/off blocks (benchmarks/overhead.py), not a setting of a user's job;
    # fork_server: the local launcher's (worker/forkserver.py), never used under srun
    fields = {f.name for f in RunConfig.flat_fields()} - {"nodes", "faults", "train_fn", "interleave_replication",
                                                                "fork_server"}
    assert fields <= set(RUN_PARAMETERS), fields - set(RUN_PARAMETERS)


@pytest.mark.parametrize("params, message", [
    ({"deadpool_spares": -1}, "spares=-1 is refused; accepted: 0 or more"),
    ({"deadpool_steps": "80"}, "steps='80' is refused; accepted: 1 or more"),
    ({"deadpool_ranks_per_node": 0}, "ranks_per_node=0 is refused; accepted: 1 or more"),
    ({"deadpool_hang_timeout": -1.0}, "hang_timeout=-1.0 is refused; accepted: seconds > 0 (0"),
    ({"deadpool_requeue": "yes"}, "requeue='yes' is refused; accepted: True or False"),
    ({"nodes": 0}, "nodes=0 is refused; accepted: an integer >= 1 (ACTIVE nodes"),
    ({"tasks_per_node": 2}, "tasks_per_node=2 is refused; accepted: 1 (one node agent per node"),
    ({"deadpool_use_srun": False}, "use_srun=False is refused; accepted: True"),
    ({"deadpool_srun_args": "--no-kill"}, "srun_args='--no-kill' is refused; accepted: a list of str"),
])
def test_bad_parameters_are_refused_with_what_is_accepted(ex, params, message):
    before = dict(ex._executor.parameters)
    with pytest.raises(ValueError) as info:
        ex.update_parameters(**params)
    assert message in str(info.value)
    assert ex._executor.parameters == before  # nothing half-applied


def test_an_unknown_parameter_is_refused_with_the_valid_ones(ex):
    with pytest.raises(NameError, match=r"Unknown argument 'spare' for executor 'deadpool'.*spares"):
        ex.update_parameters(deadpool_spare=1)


def test_a_layout_that_cannot_work_is_refused_at_submit(ex, tmp_path):
    ex.update_parameters(nodes=1, deadpool_spares=1, deadpool_run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"nodes=1 with spares=1: .* hot-swap needs at least 2 active nodes"):
        ex.submit(None)
    ex.update_parameters(nodes=2, deadpool_ranks_per_node=2, cpus_per_task=1)
    with pytest.raises(ValueError, match=r"cpus_per_task=1 is refused; accepted: at least ranks_per_node \(2\)"):
        ex.submit(None)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def _script_function(module: str):
    ns = {"__name__": module}
    exec("def train(ctx):\n    pass\n", ns)
    return ns["train"]


def _closure():
    def inner(ctx):
        pass
    return inner


@pytest.mark.parametrize("fn, message", [
    (lambda ctx: None, "cannot submit the lambda"),
    (_closure(), "a function defined inside another (a closure)"),
    (_script_function("__main__"), "'train' of __main__ (a script)"),
    (_script_function("no_such_module_here"), "'no_such_module_here:train' does not import here"),
    (RunConfig(), "not a function"),
    (print, "not a function"),
])
def test_training_functions_the_workers_cannot_import_are_refused(ex, tmp_path, fn, message):
    ex.update_parameters(nodes=2, deadpool_spares=1, deadpool_run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError) as info:
        ex.submit(fn)
    assert message in str(info.value) and "accepted: a module-level function fn(ctx)" in str(info.value)


def test_a_bad_name_positional_arguments_and_arrays_are_refused(ex, tmp_path):
    ex.update_parameters(nodes=2, deadpool_spares=1, deadpool_run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="cannot import 'no_such_pkg.mod'"):
        ex.submit("no_such_pkg.mod:train")
    with pytest.raises(ValueError, match=r"positional arguments \(3,\)"):
        ex.submit("deadpool_hpc.train.demo:train", 3)
    with pytest.raises(ValueError, match="2 submissions at once .* one run per job"):
        ex.submit_array([None, None])


def test_function_names(ex):
    from deadpool_hpc.train.demo import train
    from deadpool_submitit import train_fn_spec

    assert train_fn_spec(train) == train_fn_spec(None) == RunConfig().train.train_fn == "deadpool_hpc.train.demo:train"


def test_a_hot_swap_job_that_contradicts_the_executor_is_refused(ex, tmp_path):
    from deadpool_hpc.launch.submitit_job import HotSwapJob

    job = HotSwapJob(RunConfig(nodes=2, spares=1, steps=5, run_dir=str(tmp_path / "run")))
    ex.update_parameters(nodes=3, deadpool_steps=5)
    with pytest.raises(ValueError, match=r"nodes=3 here but 2 in the job; accepted: set them in one place"):
        ex.submit(job)


def test_a_deadpool_executor_made_directly_takes_unprefixed_names(ex, tmp_path):
    from deadpool_submitit import DeadpoolExecutor

    direct = DeadpoolExecutor(tmp_path / "direct")
    direct.update_parameters(nodes=2, spares=1, ranks_per_node=2, partition="debug", time=5)
    p = direct.parameters
    assert (p["nodes"], p["cpus_per_task"], p["partition"], p["time"]) == (3, 2, "debug", 5)
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['spare'\]; accepted: .*spares"):
        direct.update_parameters(spare=1)


@pytest.mark.e2e
def test_a_time_limit_that_leaves_no_time_before_the_signal_is_refused_at_submit(ex, tmp_path):
    """Issue 46 under submitit: its signal comes signal_delay_s (default 90) before the time limit; timeout_min=2 would
    stop every attempt as soon as it starts. Refused with the parameters to change, before anything is written."""
    ex.update_parameters(nodes=2, deadpool_spares=1, timeout_min=2, deadpool_run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError) as info:
        ex.submit(None)
    assert str(info.value).startswith("deadpool executor: timeout_min=2 (120 s) leaves no time to train before the "
                                      "signal: signal_delay_s=90 asks Slurm for SIGUSR2 90 s before the time limit")
    assert "accepted: signal_delay_s=30 or less (at least 10) with timeout_min=2, or timeout_min=3 or more with " \
           "signal_delay_s=90" in str(info.value)
    ex.update_parameters(deadpool_signal_delay_s=5)
    with pytest.raises(ConfigError, match=r"signal_delay_s=5: accepted: whole seconds from 10"):
        ex.submit(None)
    assert not (tmp_path / "run").exists()


def test_submitit_executor_refuses_a_time_limit_shorter_than_its_signal():
    from deadpool_hpc.launch import SubmititExecutor

    with pytest.raises(ConfigError, match=r"^timeout_min=2 \(120 s\) leaves no time .* signal_delay_s=90 asks"):
        SubmititExecutor("s", timeout_min=2, nodes=2, spares=1)
    with pytest.raises(ConfigError, match=r"signal_delay_s=91 asks .* accepted: signal_delay_s=90 or less"):
        SubmititExecutor("s", timeout_min=3, slurm={"slurm_signal_delay_s": 91})


def test_submitit_executor_sizes_the_job_as_the_plugin_does(ex, tmp_path):
    """deadpool-hpc's own SubmititExecutor (submitit's public SlurmExecutor underneath) and the plugin give Slurm the
    same job: nodes + spares nodes, one task each, ranks_per_node CPUs, the hot-swap sbatch and srun flags."""
    from deadpool_hpc.launch import SubmititExecutor

    ours = SubmititExecutor(tmp_path / "s", timeout_min=10, slurm={"partition": "debug", "srun_args": ["--cpu-bind=none"],
                                                        "additional_parameters": {"comment": "x"}})
    p = ours.parameters(RunConfig(nodes=4, spares=1, ranks_per_node=2))
    ex.update_parameters(nodes=4, deadpool_spares=1, deadpool_ranks_per_node=2, timeout_min=10,
                         deadpool_partition="debug", deadpool_additional_parameters={"comment": "x"},
                         deadpool_srun_args=["--cpu-bind=none"])
    theirs = ex._executor.parameters
    for k in ("nodes", "ntasks_per_node", "cpus_per_task", "time", "partition", "additional_parameters", "srun_args"):
        assert p[k] == theirs[k], (k, p[k], theirs[k])
    sub = submitit.SlurmExecutor(folder=tmp_path / "s")
    sub.update_parameters(**p)   # submitit's public API takes them as they are
    text = sub._make_submission_file_text("CMD", "uid")
    assert "#SBATCH --no-kill" in text and "#SBATCH --nodes=5" in text and "#SBATCH --partition=debug" in text
    assert "--no-kill --kill-on-bad-exit=0 --mpi=pmi2 --cpu-bind=none CMD" in text
