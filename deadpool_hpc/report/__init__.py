"""Pictures of a run, made after the fact (or while it runs) from its run directory: read-only.

``timeline.py`` turns a run's event log into what ``deadpool plot`` draws (pure: no matplotlib); ``plot.py`` draws it
(matplotlib, the ``plot`` extra). The runtime (agents, training processes, the control and data planes) imports
nothing of this room; only the ``deadpool`` command (launch/cli.py) and the benchmarks do
(tests/project/test_layout.py).
"""
