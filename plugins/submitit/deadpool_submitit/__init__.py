"""submitit plugin for deadpool-hpc: ``submitit.AutoExecutor(folder, cluster="deadpool")`` submits hot-swap runs.

See ``deadpool_submitit.executor`` (and plugins/submitit/README.md) for the parameters and what is refused.
"""
from .executor import RUN_PARAMETERS, DeadpoolExecutor, train_fn_spec

__all__ = ["DeadpoolExecutor", "RUN_PARAMETERS", "train_fn_spec"]
