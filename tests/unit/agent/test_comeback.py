"""Spares that come back (agent/comeback.py, control/membership.py): the pure parts, without processes. The real
return (real processes, real signals) is tests/e2e/test_hotswap.py's and the chaos benchmark's."""
import threading
from types import SimpleNamespace

import pytest

from deadpool_hpc.config import RunConfig
from deadpool_hpc.faultinject.spec import Fault
from deadpool_hpc.control.membership import Membership, Readmit, may_readmit, on_readmit, spares_of
from deadpool_hpc.errors import ConfigError
from deadpool_hpc.faultinject.plan import check, rounds


def test_spares_of_a_round_include_a_readmitted_node_the_view_missed():
    # P = 1; nodes 0, 1 train, 3 is the view's spare, 2 came back after that view was taken, 4 is not alive
    assert spares_of([3], [0, 1, 2, 3], [0, 1], 1) == [3, 2]
    assert spares_of([3, 2], [0, 1, 2, 3], [0, 1], 1) == [3, 2]   # listed once, in the view's order
    assert spares_of([], [0, 1], [0, 1], 1) == []
    assert spares_of([], [0, 1, 5], [0, 1, 2, 3], 2) == [5]        # P = 2: node 1 trains (procs 2, 3)


def test_readmit_round_trips_and_bad_messages_name_the_key():
    m = Readmit(node=2, generation=3, assignment=(0, 1, 4), spare_nodes=(5, 2), members=(0, 1, 2, 4, 5),
                suspected=(3,), coordinator=0, t=12.5)
    assert Readmit.from_wire(m.to_wire()) == m
    bad = dict(m.to_wire(), node="2")
    with pytest.raises(ValueError, match="'node'"):
        Readmit.from_wire(bad)
    with pytest.raises(ValueError, match="'spare_nodes'"):
        Readmit.from_wire(dict(m.to_wire(), spare_nodes=[1.5]))
    with pytest.raises(ValueError, match="assignment"):
        Readmit.from_wire(dict(m.to_wire(), assignment=[[0]]))


class _Peers:
    def __init__(self, alive, returning=(), suspected=()):
        self._alive, self.returning = list(alive), dict.fromkeys(returning, 0.0)
        self.suspected = dict.fromkeys(suspected, 0.0)
        self.lock = threading.RLock()
        self.relays = SimpleNamespace(routes={})   # no joined node (control/relay.py)

    def alive(self):
        return [n for n in self._alive if n not in self.suspected]

    def readmit(self, n):
        self.suspected.pop(n, None)
        self.returning.pop(n, None)


class _CP:
    """The few fields of a ControlPlane that membership.py reads (P = 1); its view is replaced, as the plane's."""

    generation = property(lambda self: self.membership.generation)
    assignment = property(lambda self: self.membership.assignment)
    spare_nodes = property(lambda self: self.membership.spare_nodes)
    members = property(lambda self: self.membership.members)

    def __init__(self, me, generation, assignment, spare_nodes, members, peers, failure=False):
        self.me, self.P, self.world, self.idents = me, 1, object(), {}
        self.membership = Membership(generation, assignment, spare_nodes, members)
        self.peers, self.pending_readmits = peers, []
        self.failure = threading.Event()
        if failure:
            self.failure.set()

    def adopt(self, view):
        self.membership = view

    def procs(self, n):
        return [n]


def test_only_the_lowest_live_agent_readmits_and_never_during_a_recovery():
    # node 1 failed and returns; node 0 is the lowest live agent, the decision that took node 1 out is applied
    peers = _Peers([0, 2, 3], returning=[1], suspected=[1])
    ok = _CP(0, 1, [0, 3], [], [0, 2, 3], peers)
    assert may_readmit(ok, 1) is None
    assert may_readmit(_CP(2, 1, [0, 3], [], [0, 2, 3], peers), 1) == "not the lowest live agent"
    assert may_readmit(_CP(0, 1, [0, 3], [], [0, 2, 3], peers, failure=True), 1) == "a recovery is under way"
    # the decision is not applied here yet: node 1 still trains in this agent's view
    assert may_readmit(_CP(0, 0, [0, 1], [3], [0, 1, 2, 3], peers), 1).startswith("the decision")
    assert may_readmit(ok, 2) == "not a returning node"


def test_a_readmission_of_a_generation_not_applied_yet_waits_for_it():
    cp = _CP(2, 1, [0, 3], [], [0, 2, 3], _Peers([0, 2, 3], returning=[1], suspected=[1]))
    later = Readmit(node=1, generation=2, assignment=(0, 3), spare_nodes=(1,), members=(0, 1, 2, 3), suspected=(),
                    coordinator=0, t=0.0)
    on_readmit(cp, later)
    assert cp.pending_readmits == [later] and cp.spare_nodes == () and 1 in cp.peers.suspected
    now = Readmit(node=1, generation=1, assignment=(0, 3), spare_nodes=(1,), members=(0, 1, 2, 3), suspected=(),
                  coordinator=0, t=0.0)
    on_readmit(cp, now)
    assert cp.spare_nodes == (1,) and 1 in cp.members and 1 not in cp.peers.suspected


def _cfg(**kw):
    return RunConfig(**{**dict(nodes=2, spares=1, steps=60), **kw}).validate()


def test_the_fault_plan_counts_a_node_whose_process_died_as_a_spare_again():
    two = [Fault("kill", "rank", 0, 10), Fault("kill", "rank", 1, 30)]
    check(_cfg(faults=two))   # node0 comes back and takes node1's place
    assert [r["promoted"] for r in rounds(_cfg(faults=two))] == [{0: 2}, {1: 0}]
    with pytest.raises(ConfigError, match="no spare node is left"):
        check(_cfg(faults=two, spare_return=False))
    with pytest.raises(ConfigError, match="no spare node is left"):   # a whole node lost never comes back
        check(_cfg(faults=[Fault("kill", "node", 0, 10), Fault("kill", "rank", 1, 30)]))
    # a node that came back and fails again stays out (--quarantine), unless the quarantine is off
    three = two + [Fault("kill", "rank", 0, 50)]   # rank 0 is on node2 by then: node2 comes back, node1 is next
    check(_cfg(faults=three))
    again = [Fault("kill", "rank", 0, 10), Fault("kill", "rank", 1, 30), Fault("kill", "rank", 1, 50),
             Fault("kill", "rank", 0, 55)]
    with pytest.raises(ConfigError, match="no spare node is left"):
        check(_cfg(faults=again))
    check(_cfg(faults=again, quarantine=0))
