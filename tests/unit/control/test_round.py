"""The agreement round and the barriers (control/round.py, control/barrier.py) against a fake control thread: a
ControlPlane made without MPI (no ``__init__``: its tables set here), whose ``peers`` records what is sent and
whose inbox the test fills. Pure logic, no process, no socket: the real round among real agents is
tests/e2e/test_hotswap.py's and tests/e2e/test_never_hang.py's."""
from __future__ import annotations

import queue
import threading

import pytest

from deadpool_hpc.control import round as rounds
from deadpool_hpc.control.barrier import barrier
from deadpool_hpc.control.decision import Decision
from deadpool_hpc.control.messages import Ready, Report
from deadpool_hpc.control.handlers import HandlerTable
from deadpool_hpc.control.membership import Membership
from deadpool_hpc.control.plane import OWN_KINDS, ControlPlane
from deadpool_hpc.errors import Fenced, PeerFailure, RecoveryTimeout, RunFinished


class Peers:
    """The control thread as the round sees it: who is alive, what was sent, the inbox."""

    def __init__(self, alive, suspected=()):
        self._alive, self.suspected = list(alive), set(suspected)
        self.inbox: queue.Queue = queue.Queue()
        self.failure, self.preempted = threading.Event(), threading.Event()
        self.notice_g, self.last_suspicion, self.last_resort, self.fenced = -1, 0.0, False, None
        self.returning: dict = {}
        self.sent: list = []
        self.disseminated: list = []

    def alive(self):
        return [n for n in self._alive if n not in self.suspected]

    def is_suspected(self, n):
        return n in self.suspected

    def suspect(self, n, reason, notify=True):
        self.suspected.add(n)

    def send(self, dest, kind, body):
        self.sent.append((dest, kind, body))

    def send_many(self, dests, kind, body):
        for d in dests:
            self.send(d, kind, body)

    def disseminate(self, kind, body):
        self.disseminated.append((kind, body))


class Log:
    def __init__(self):
        self.events = []

    def emit(self, name, **fields):
        self.events.append((name, fields))


def plane(me: int, size: int, active: int, peers: Peers, P: int = 1) -> ControlPlane:
    """A ControlPlane of ``size`` agents (``active`` of them train, P ranks each) as ``__init__`` leaves it, less
    MPI and the control thread."""
    cp = ControlPlane.__new__(ControlPlane)
    cp.me, cp.size, cp.P, cp.log, cp.peers = me, size, P, Log(), peers
    cp.settle, cp.poll_s, cp.collect_after, cp.ready_timeout, cp.recovery_timeout = 0.0, 0.001, 2.0, 60.0, 120.0
    cp.replicas, cp.crash_loop_limit, cp.work_failures = 1, 0, []
    cp._membership = Membership.initial(P, active, size)
    cp.handlers = HandlerTable(reserved=OWN_KINDS)
    cp.idents = [{"node": n} for n in range(size)]
    cp._round, cp._finish, cp._abort, cp.first_suspicion = 0, None, None, None
    cp._collects, cp._ready, cp._auto, cp._decisions, cp._sync = {}, {}, {}, {}, {}
    cp.on_member_lost, cp.pending_readmits, cp.readmitted = None, [], None
    return cp


@pytest.fixture
def fenced(monkeypatch):
    """The nodes a decision applied would SIGKILL by pid (process/fence.py): recorded, nobody is killed."""
    out = []
    monkeypatch.setattr(rounds.fencing, "fence", lambda ident: out.append(ident["node"]))
    return out


def _report(rank: int, own, held=None) -> dict:
    """Node ``rank``'s report (P = 1): its one process's Report (control/messages.py), by virtual process."""
    return {rank: Report(own_rank=rank, own=tuple(own), held={int(r): tuple(s) for r, s in (held or {}).items()},
                         done_step=max(own))}


def _ready(cp: ControlPlane, report: dict, applied: int = 0) -> dict:
    """A report sent unasked (``recover``'s first message), as another agent of ``cp``'s view sends it (its wire
    form, as it reaches the inbox)."""
    return Ready(round=("auto", applied), report=report, applied=applied, assignment=tuple(cp.assignment),
                 spare_nodes=tuple(cp.spare_nodes)).to_wire()


# 3 nodes x 1 rank + spare 3; node 1 died; its rank's replica lives on node 2 (held up to step 40)
def _lost_node_1(me: int):
    peers = Peers([0, 1, 2, 3], suspected=[1])
    cp = plane(me, 4, 3, peers)
    reports = {0: _report(0, [40, 41], {"2": [40, 41]}), 2: _report(2, [40, 41], {"1": [40]}), 3: {}}
    return cp, peers, reports


def test_the_coordinator_decides_once_every_live_agent_reported_and_applies_its_decision(fenced):
    cp, peers, reports = _lost_node_1(me=0)
    for n in (2, 3):
        peers.inbox.put(("ready", n, _ready(cp, reports[n])))
    before = cp.membership
    phases = []
    d = cp.recover(reports[0], on_phase=phases.append)
    assert (d.generation, d.promoted, d.sources, d.cut_step, d.coordinator) == (1, {1: 3}, {1: 2}, 40, 0)
    assert phases == ["agree", "decided"]
    assert [k for k, _ in peers.disseminated] == ["teardown", "decision"]   # nobody had told it: it tore down
    assert Decision.from_wire(peers.disseminated[-1][1]) == d
    assert [e for e, _ in cp.log.events] == ["decision"]
    # the view is replaced, not changed: whoever held the old one still sees generation 0
    assert before == Membership.initial(1, 3, 4) and cp.membership is not before
    assert (cp.generation, cp.assignment, cp.spare_nodes, cp.members, cp.coordinator) == (1, (0, 3, 2), (),
                                                                                           d.members, 0)
    assert fenced == [1] and not peers.failure.is_set()


def test_an_agent_reports_unasked_to_the_lowest_live_agent_and_takes_its_decision(fenced):
    coord, cpeers, reports = _lost_node_1(me=0)
    for n in (2, 3):
        cpeers.inbox.put(("ready", n, _ready(coord, reports[n])))
    decision = coord.recover(reports[0])
    wire = cpeers.disseminated[-1][1]
    cp, peers, _ = _lost_node_1(me=2)
    peers.notice_g = 0   # the teardown reached it: it does not tear down again
    sent_unasked = _ready(cp, reports[2])

    def wait(_s):   # the decision comes down the tree while it waits
        peers.inbox.put(("decision", 0, wire))

    d = cp.recover(reports[2], wait=wait)
    assert d == decision and cp.generation == 1 and cp.assignment == (0, 3, 2)
    assert peers.sent == [(0, "ready", sent_unasked)] and peers.disseminated == []


def test_a_stop_seen_while_waiting_leaves_the_round_and_applies_nothing():
    cp, peers, reports = _lost_node_1(me=2)
    seen = []
    d = cp.recover(reports[2], wait=seen.append, stop=lambda: bool(seen))
    assert d is None and len(seen) == 1 and cp.generation == 0 and cp.membership == Membership.initial(1, 3, 4)
    assert [(dest, kind) for dest, kind, _ in peers.sent] == [(0, "ready")]


def test_a_round_ends_with_an_error_not_a_hang():
    cp, peers, reports = _lost_node_1(me=2)
    cp.recovery_timeout = 0.0
    with pytest.raises(RecoveryTimeout, match="coordinator: MPI rank 0"):
        cp.recover(reports[2], wait=lambda _s: None)
    cp, peers, reports = _lost_node_1(me=2)
    cp._finish = {"steps": 10}
    with pytest.raises(RunFinished):
        cp.recover(reports[2])


def test_a_decision_that_fences_this_agent_raises_fenced(fenced):
    coord, cpeers, reports = _lost_node_1(me=0)
    for n in (2, 3):
        cpeers.inbox.put(("ready", n, _ready(coord, reports[n])))
    coord.recover(reports[0])
    cp, peers, _ = _lost_node_1(me=1)   # node 1 still runs (a false suspicion): the decision fences it
    peers.suspected.clear()
    peers.inbox.put(("decision", 0, cpeers.disseminated[-1][1]))
    with pytest.raises(Fenced, match="generation 1"):
        cp.recover(reports[0], wait=lambda _s: None)
    assert cp.generation == 0


def test_only_a_newer_decision_from_an_unsuspected_coordinator_naming_this_agent_is_taken():
    cp, peers, _ = _lost_node_1(me=2)

    def dec(g, members, coordinator=0):
        return Decision(generation=g, failed_nodes=(), fenced=(), assignment=(0, 1, 2), promoted={}, replaced={},
                        sources={}, exhausted=False, reason="rebuild", spare_nodes=(3,), members=members, cut_step=0,
                        recomputed_steps=0, high_water=0, coordinator=coordinator)

    cp._decisions = {0: (0, dec(0, (0, 1, 2, 3)))}
    assert rounds._take_decision(cp) is None                       # not newer than generation 0
    cp._decisions[1] = (1, dec(1, (0, 1, 2, 3), coordinator=1))
    assert rounds._take_decision(cp) is None                       # its coordinator (node 1) is suspected
    cp._decisions[2] = (0, dec(2, (0, 1, 3)))
    assert rounds._take_decision(cp) is None                       # does not name node 2
    cp._decisions[3] = (0, dec(3, (0, 2, 3)))
    cp._decisions[4] = (0, dec(4, (0, 1, 2, 3)))
    assert rounds._take_decision(cp).generation == 4               # the newest of those that qualify


def test_the_coordinator_asks_only_the_missing_after_collect_after_and_suspects_the_silent(monkeypatch):
    cp, peers, reports = _lost_node_1(me=0)
    clock = {"t": 100.0}
    monkeypatch.setattr(rounds.time, "monotonic", lambda: clock["t"])
    alive = peers.alive()
    rid = rounds._start_round(cp, alive)
    cp._auto[2] = Ready.from_wire(_ready(cp, reports[2]))
    assert rounds._coordinate(cp, rid, alive, reports[0]) is None and peers.sent == []
    clock["t"] += cp.collect_after
    assert rounds._coordinate(cp, rid, alive, reports[0]) is None
    assert peers.sent == [(3, "collect", {"round": list(rid), "g": 0})]
    assert rounds._coordinate(cp, rid, alive, reports[0]) is None and len(peers.sent) == 1   # asked once
    clock["t"] += cp.ready_timeout
    assert rounds._coordinate(cp, rid, alive, reports[0]) is None and peers.suspected == {1, 3}


def test_apply_keeps_a_returning_agent_alive_and_raises_the_flag_for_a_member_suspected_since(fenced):
    cp, peers, _ = _lost_node_1(me=0)
    peers.returning = {1: 0.0}
    peers.failure.set()
    cp._auto = {2: Ready.from_wire(_ready(cp, {}, 0)), 3: Ready.from_wire(_ready(cp, {}, 1))}
    cp._collects = {2: (["x"], 0), 3: (["y"], 1)}
    d = Decision(generation=1, failed_nodes=(1,), fenced=(1,), assignment=(0, 3, 2), promoted={1: 3},
                 replaced={1: 3}, sources={1: 2}, exhausted=False, reason="hot swap", spare_nodes=(),
                 members=(0, 2, 3), cut_step=40, recomputed_steps=1, high_water=41, coordinator=0)
    rounds.apply_decision(cp, d)
    assert fenced == [] and 1 in peers.suspected            # suspected, not killed: it ended its processes itself
    assert not peers.failure.is_set()
    assert list(cp._auto) == [3] and cp._auto[3].applied == 1 and cp._collects == {3: (["y"], 1)}
    peers.suspected.add(3)   # a member lost after the decision: the next round's
    rounds.apply_decision(cp, Decision(**{**d.__dict__, "generation": 2}))
    assert peers.failure.is_set() and cp.generation == 2


def test_a_barrier_returns_once_all_arrived_stops_on_request_and_fails_on_a_suspect():
    peers = Peers([0, 1, 2])
    cp = plane(0, 3, 3, peers)
    for n in (1, 2):
        peers.inbox.put(("sync", n, {"tag": "saved1.0"}))
    ticks = []
    assert barrier(cp, "saved1.0", [0, 1, 2], 5.0, tick=lambda: ticks.append(1)) is True
    assert [(d, k) for d, k, _ in peers.sent] == [(1, "sync"), (2, "sync")] and ticks == [1]
    assert "saved1.0" not in cp._sync
    assert barrier(cp, "rebuild2.0", [0, 1], 5.0, tick=lambda: None, stop=lambda: True) is False
    peers.suspected.add(2)
    with pytest.raises(PeerFailure, match=r"\[2\] failed"):
        barrier(cp, "rebuild3.0", [0, 2], 5.0)
    peers.suspected.clear()
    with pytest.raises(PeerFailure, match="did not arrive"):
        barrier(cp, "rebuild4.0", [0, 1], 0.0)
