"""The control plane's scale study (docs/scaling.md): not part of the installed package, nothing of ``deadpool_hpc``
imports it. ``probe.py`` is a node agent's control plane with no training processes, started N times by
benchmarks/control_plane_scale.py (mpiexec, one machine) or sbatch/scaling.sbatch (``MODE=control-plane``, srun);
``scale_study.py`` turns what the probes wrote into a table, fits, a projection and plots. Run from the checkout's
root (``python -m study.probe``, ``python -m study.scale_study``), or with it on PYTHONPATH."""
