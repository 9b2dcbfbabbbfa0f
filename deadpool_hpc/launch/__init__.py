"""Launching a run: one vocabulary for every back-end (executors.py), the ``deadpool`` command (cli.py).

    from deadpool_hpc.launch import LocalExecutor, SlurmExecutor, SubmititExecutor, attach

The names are imported on first use, so that ``import deadpool_hpc.launch.X`` stays light.
"""
from __future__ import annotations

__all__ = ["DeadpoolJob", "JobLost", "LocalExecutor", "LocalJob", "SlurmExecutor", "SlurmJob", "SubmititExecutor",
           "SubmititJob", "attach", "train_fn_spec"]


def __getattr__(name: str):
    if name in __all__:
        from . import executors

        return getattr(executors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
