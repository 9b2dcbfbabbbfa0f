"""Fault injection for tests, demos and benchmarks: not part of the public API.

``spec.py``: the fault grammar (``--kill node1@60``, ``--hang``, ``--slow``, ``--nic-down``: ``Fault``,
``parse_fault``); ``plan.py``: the pre-start check that a layout survives the requested faults (a pure simulation);
``inject.py``: the real signals to real processes, in the node agent (``NodeFaults``) and the training process
(``RankFaults``); ``messages.py``: what they say across processes (typed messages, ipc/schema.py). The run's faults
travel in ``RunConfig.internal.faults``. Depends on ``errors``, ``placement`` and ``ipc`` (the message schema) only;
the configuration and the processes import it, never the other way.
"""
from __future__ import annotations

from .spec import Fault as Fault
from .spec import parse_fault as parse_fault
