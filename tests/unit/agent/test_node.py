"""A node's failure as the node agent's loop sees it (agent/node.py ``node_failed``, ``tick``, ``run``): recorded as
a pending exit, never raised through the waits under way, and acted on at the top of ``run``'s loop. NodeAgent's
own methods on a fake agent (its log, control plane, supervisor and comeback recorded): no process. The real
failures are tests/e2e/test_hotswap.py's, tests/e2e/test_lifecycle.py's and tests/e2e/test_never_hang.py's."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from deadpool_hpc.agent.node import NodeAgent
from deadpool_hpc.agent.state import NodeState, PendingExit
from deadpool_hpc.errors import Fenced

S = NodeState


class _Agent:
    """What ``node_failed``, ``tick`` and ``run`` read of their agent, recorded."""

    state, transition, exiting = NodeAgent.state, NodeAgent.transition, NodeAgent.exiting
    node_failed, tick, run = NodeAgent.node_failed, NodeAgent.tick, NodeAgent.run

    def __init__(self, returnable: bool, failures=1):
        self._state, self.pending_exit, self.exit_code, self.resume, self.reps = S.TRAINING, None, 0, None, {}
        self.last_work_failure, self.failures, self.calls = None, failures, []
        self.log = SimpleNamespace(emit=lambda name, **kw: self.calls.append(name), sync=lambda: None)
        self.cp = SimpleNamespace(generation=2, pump=lambda t: self.calls.append("pump"),
                                  declare_failed=lambda reason, returning=False, work=None:
                                  self.calls.append(("declare_failed", returning)))
        self.sup = SimpleNamespace(kill_all=lambda t: self.calls.append("kill_all"))
        self.comeback = SimpleNamespace(allowed=lambda cause: returnable, come_back=self._come_back)

    def _start(self):   # the start-up sees the failure (twice: a second process exits in the same pass)
        for _ in range(self.failures):
            self.node_failed("training process 0 exited with code 1", cause="exit")
        self.calls.append("started")

    def _come_back(self, failed):
        self.calls.append(("come_back", failed))
        self.transition(S.RETURNING, "checks")
        self.transition(S.DONE, "the run is complete (while the node was returning)")


def test_a_failure_is_declared_once_recorded_and_raised_only_at_the_top_of_the_loop():
    a = _Agent(returnable=False, failures=2)
    with pytest.raises(Fenced, match="this node failed: training process 0 exited"):
        a.run()
    # the caller went on after the call (no exception through it); the second failure was not declared again
    assert a.calls == ["node_failed", ("declare_failed", False), "kill_all", "agent_state", "started"]
    assert a.state == S.DONE and a.pending_exit is None


def test_a_node_that_may_come_back_returns_from_the_top_of_the_loop():
    a = _Agent(returnable=True)
    assert a.run() == 0
    failed = PendingExit("training process 0 exited with code 1", "exit", returning=True)
    # ended its processes first, told the others it returns, finished the start-up's pass, then came back
    assert a.calls == ["node_failed", "kill_all", ("declare_failed", True), "started", ("come_back", failed),
                       "agent_state", "agent_state"]
    assert a.state == S.DONE and a.pending_exit is None


def test_tick_does_nothing_while_an_exit_is_pending():
    a = _Agent(returnable=False)
    a.pending_exit = PendingExit("x", "exit", returning=False)
    assert a.exiting
    a.tick(0.0)
    assert a.calls == []   # not even the control messages: the agent's loop acts first


def test_the_preflight_tick_ends_the_checks_with_a_public_error_once_the_node_failed():
    """The start-up checks (agent/preflight.py) wait by ticking the agent's loop; once the node failed meanwhile the
    tick raises PreflightStopped, which ``_start`` catches."""
    from deadpool_hpc.agent.preflight import PreflightStopped

    ticks = []
    agent = SimpleNamespace(tick=ticks.append, pending_exit=None)
    NodeAgent._tick_or_stop(agent, 0.005)
    agent.pending_exit = PendingExit("training process 0 exited", "exit", returning=False)
    with pytest.raises(PreflightStopped):
        NodeAgent._tick_or_stop(agent, 0.005)
    assert ticks == [0.005, 0.005]
