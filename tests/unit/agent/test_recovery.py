"""A node agent's recovery rounds (agent/recovery.py) through their narrow interface (``RecoveryHost``): a fake node
agent whose attributes cannot be written once the round starts (the round returns its result, it writes nothing of
the agent), a fake control plane whose ``recover`` and ``barrier`` return what the test says. Pure logic, no
process: the real rounds are tests/e2e/test_hotswap.py's, tests/e2e/test_never_hang.py's and tests/e2e/test_lifecycle.py's."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from deadpool_hpc.agent.recovery import MAX_FAILED_ROUNDS, Recovery, RecoveryEnd
from deadpool_hpc.agent.state import NodeState
from deadpool_hpc.config import RunConfig
from deadpool_hpc.control.decision import Decision
from deadpool_hpc.control.messages import Report
from deadpool_hpc.errors import PeerFailure, RecoveryTimeout, RunFinished
from deadpool_hpc.ipc.messages import Exit, Failure, Left, RoundFailed, Spare, Train, View
from deadpool_hpc.replica import restore


class Slot:
    def __init__(self, step, from_replica=False):
        self.step, self.crc, self.from_replica = step, 1234, from_replica


class Rep:
    """One local rank's Replicator: its report, its own slots, the restore it expects."""

    def __init__(self, rank, steps):
        self.rank, self.steps = rank, steps
        self.slots = [Slot(s) for s in steps]
        self.own = SimpleNamespace(get=lambda step: next(s for s in self.slots if s.step == step), slots=self.slots)
        self.calls = []

    def quiesce(self):
        self.calls.append("quiesce")

    def report(self):
        return {"own_rank": self.rank, "own": list(self.steps), "held": {}}

    def expect_restore(self, r, step, g):
        self.calls.append(("expect_restore", r, step, g))
        self.slots.append(Slot(step, from_replica=True))

    def poll_restore(self, flag, since, timeout, for_s):
        self.calls.append("poll_restore")
        return self.slots[-1]


class CP:
    """The control plane as a round sees it: ``recover`` and ``barrier`` give what the test queued."""

    def __init__(self, decisions, barriers=(True,), ranks=None):
        self.generation, self.failure, self.member_nodes = 0, threading.Event(), [0, 1, 2]
        self.decisions, self.barriers, self.ranks = list(decisions), list(barriers), ranks or {}
        self.reports, self.barrier_calls = [], []

    def recover(self, report, on_phase=None, wait=None, stop=None):
        self.reports.append(report)
        d = self.decisions.pop(0)
        if isinstance(d, BaseException):
            raise d
        if d is not None:
            self.generation = d.generation
        return d

    def barrier(self, tag, participants, timeout, tick=None, stop=None):
        self.barrier_calls.append((tag, list(participants), stop is not None))
        return self.barriers.pop(0)

    def train_rank(self, local):
        return self.ranks.get(local)

    def wait_sends(self):
        pass


class Host:
    """The node agent as a round sees it (``RecoveryHost``). ``seal()``: from then on no attribute may be set."""

    def __init__(self, cp, node=0, P=1, reps=None, alive=(0,), fail_in_tick=False):
        # world size 3; waits of 5 s (a collective's), 9 s (the ready wait: plus the heartbeat ceiling)
        self.cfg = RunConfig(collective_timeout=5.0, hang_timeout=0, rendezvous_timeout=5.0, nodes=3, replicas=1,
                             run_dir="/nonexistent", crash_loop_limit=0)
        self.cp, self.node, self.P, self.resume = cp, node, P, None
        self.log = SimpleNamespace(events=[], emit=lambda name, **kw: self.log.events.append(name))
        self.faults = SimpleNamespace(wants_phase=lambda name, rounds: False,
                                      at_phase=lambda name, rounds: self.phases.append(name))
        self.reps = reps if reps is not None else {0: Rep(0, [40, 41])}
        self.layouts, self.checkpoint_dir = {}, "/nonexistent/checkpoint"
        self.alive = list(alive)
        self.sup = SimpleNamespace(alive=lambda: list(self.alive), wait_all=lambda t: None)
        self.sent, self.roles, self.phases, self.cuts, self.failed, self.ticks = [], [], [], [], [], []
        self.channel = SimpleNamespace(send=lambda local, kind, body: self.sent.append((local, kind, body)))
        self.desk = SimpleNamespace(drop_pending=lambda: None)
        self.rendezvous = SimpleNamespace(fail_all=lambda: None, open=lambda g: self.phases.append(f"open{g}"))
        self.swaps = SimpleNamespace(suspend=lambda: None)
        self.spare_checks = SimpleNamespace(end=lambda: None)
        self.persister = SimpleNamespace(quiesce=lambda: None)
        self.fail_in_tick = fail_in_tick
        self._sealed = False

    def seal(self):
        self._sealed = True

    def __setattr__(self, name, value):
        if getattr(self, "_sealed", False):
            raise AssertionError(f"the round wrote the agent's {name!r}")
        object.__setattr__(self, name, value)

    @property
    def exiting(self):
        return bool(self.failed)

    def tick(self, timeout=0.0):
        self.ticks.append(timeout)
        if self.fail_in_tick:
            self.node_failed("training process 0 exited with code 1", cause="exit")

    def node_failed(self, reason, cause="other", work=None):
        self.failed.append(cause)

    def cut_to(self, step):
        self.cuts.append(step)

    def configure(self, local):
        pass

    def view(self):
        return View(self.cp.generation, (0, 1, 2), ())

    def send_role(self, local, role):
        self.roles.append((local, role))

    def retarget_ring_link(self):
        pass

    def replica_address(self, proc):
        return ["127.0.0.1", 1]


def decision(**kw):
    base = dict(generation=1, failed_nodes=(1,), fenced=(1,), assignment=(0, 3, 2), promoted={1: 3},
                replaced={1: 3}, sources={1: 2}, exhausted=False, reason="hot swap", spare_nodes=(),
                members=(0, 2, 3), cut_step=40, recomputed_steps=1, high_water=41, coordinator=0)
    return Decision(**{**base, **kw})


def _left(rec, local=0, done=41):
    rec.on_left(local, Left(generation=0, done_step=done, why="failure"))


def test_a_round_that_keeps_the_node_a_spare_returns_that_and_writes_nothing_of_the_agent():
    cp = CP([decision(assignment=(0, 3, 2), spare_nodes=(4,))], ranks={})
    host = Host(cp, node=4, reps={0: Rep(None, [])})
    rec = Recovery(host)
    _left(rec)
    assert rec.wanted() and rec.processes_left()
    host.seal()
    end = rec.run()
    assert end == RecoveryEnd(NodeState.SPARE, "recovery round 1: a spare of generation 1")
    assert host.sent == [(0, Failure.KIND, Failure(0).to_wire())]
    assert [type(r) for _, r in host.roles] == [Spare] and host.cuts == [40] and cp.barrier_calls == []
    assert cp.reports == [{4: Report(own_rank=None, own=(), held={}, done_step=41, start_step=0)}]
    assert not rec.wanted() and not rec.in_round and host.phases == ["detect"]


def test_a_promoted_spare_restores_meets_the_trainers_and_is_told_its_rank():
    rep = Rep(None, [])
    cp = CP([decision()], ranks={0: 1})   # node 3's process takes over rank 1, sent by node 2
    host = Host(cp, node=3, reps={0: rep})
    rec = Recovery(host)
    _left(rec)
    host.seal()
    end = rec.run()
    assert end.state == NodeState.TRAINING and end.exit_code is None
    assert ("expect_restore", 1, 40, 1) in rep.calls and "poll_restore" in rep.calls
    assert cp.barrier_calls == [("rebuild1.0", [0, 2, 3], True)]   # the new trainers' nodes; it can stop early
    (local, role), = host.roles
    assert isinstance(role, Train) and role.rank == 1 and role.restore.promoted and role.restore.from_replica
    assert role.restore.cut_step == 40 and role.restore.round == 1 and host.phases == ["detect", "rebuild", "open1"]


def test_this_nodes_failure_while_its_processes_leave_stops_the_round_before_the_agreement():
    cp = CP([decision()])
    host = Host(cp, fail_in_tick=True)   # local 0 never says Left: the agent's tick sees it exit
    rec = Recovery(host)
    rec.on_round_failed(0, RoundFailed(generation=0, error="join failed"))
    host.seal()
    assert rec.run() is None
    assert host.failed == ["exit"] and len(host.ticks) == 1 and cp.reports == [] and host.roles == []
    assert not rec.in_round


def test_a_stopped_agreement_or_barrier_ends_the_round_with_nothing_sent():
    cp = CP([None])   # recover returned None: this node failed while it waited
    host = Host(cp)
    rec = Recovery(host)
    _left(rec)
    assert rec.run() is None and host.roles == [] and host.cuts == []
    cp = CP([decision(assignment=(0, 1, 2), promoted={}, sources={}, replaced={})], barriers=[False],
            ranks={0: 0})
    host = Host(cp)
    rec = Recovery(host)
    _left(rec)
    assert rec.run() is None and host.roles == [] and host.cuts == [40]


def test_a_failed_round_starts_the_next_and_too_many_in_a_row_end_the_run():
    cp = CP([PeerFailure("barrier: a peer failed"), decision(spare_nodes=(4,))])
    host = Host(cp, node=4, reps={0: Rep(None, [])})
    rec = Recovery(host)
    _left(rec)
    assert rec.run().state == NodeState.SPARE and rec.rounds == 2
    assert host.log.events == ["recovery_round_failed"]
    cp = CP([PeerFailure("x")] * (MAX_FAILED_ROUNDS + 1))
    rec = Recovery(Host(cp))
    _left(rec)
    with pytest.raises(RecoveryTimeout, match=f"{MAX_FAILED_ROUNDS} recovery rounds"):
        rec.run()
    assert len(cp.reports) == MAX_FAILED_ROUNDS
    rec = Recovery(Host(CP([RunFinished("over")])))
    _left(rec)
    assert rec.run() is None


def test_no_spare_left_before_any_step_leaves_for_a_requeue_without_a_checkpoint():
    cp = CP([decision(exhausted=True, reason="no spare node left", fresh=(1,), cut_step=0, sources={},
                      promoted={}, replaced={})], ranks={0: 0})
    host = Host(cp)
    rec = Recovery(host)
    _left(rec)
    host.seal()
    end = rec.run()
    assert end.state == NodeState.SAVED and end.exit_code == 75
    assert host.roles == [(0, Exit(75))] and "checkpoint_skipped" in host.log.events


def test_a_left_of_an_older_generation_starts_no_round_and_a_round_failed_of_a_replaced_one_neither():
    cp = CP([])
    cp.generation = 2
    rec = Recovery(Host(cp))
    rec.on_left(0, Left(generation=1, done_step=5, why="failure"))
    assert not rec.wanted()
    rec.on_round_failed(0, RoundFailed(generation=1, error="join failed"))
    assert not rec.wanted()
    rec.on_round_failed(0, RoundFailed(generation=2, error="join failed"))
    assert rec.wanted() and not rec.processes_left()


class Arriving:
    """A Replicator whose restore is waited for by the real replica/restore.py ``poll`` on a bare state: the copy
    arrives when ``arrive()`` is called (as a replica server's handler thread stamps it)."""

    def __init__(self):
        self.st = SimpleNamespace(lock=threading.RLock(), closed=False, expected=restore.Expected(1, 1, 40))
        self.st.cv = threading.Condition(self.st.lock)
        self.polls = []

    def poll_restore(self, flag, since, timeout, for_s):
        self.polls.append(for_s)
        return restore.poll(self.st, flag, since, timeout, for_s)

    def arrive(self):
        with self.st.lock:
            self.st.expected.slot = Slot(40, from_replica=True)
            self.st.cv.notify_all()


def test_the_restore_wait_ticks_the_agents_loop_until_the_copy_arrives():
    rep, host = Arriving(), Host(CP([]))
    host.tick = lambda timeout=0.0: (host.ticks.append(timeout), len(host.ticks) == 5 and rep.arrive())
    slot = Recovery(host)._await_restore(rep, 30.0)
    assert slot.step == 40 and slot.from_replica
    assert len(host.ticks) == 5 and len(rep.polls) == 6   # a tick between two polls; the sixth poll takes the copy
    assert rep.st.expected is None   # taken: the wait is over


def test_the_restore_wait_keeps_its_deadline_and_stops_at_this_nodes_failure():
    rep, host = Arriving(), Host(CP([]))
    t0 = time.monotonic()
    with pytest.raises(PeerFailure, match=r"replica of rank 1 step 40 .*: it did not arrive within 0\.3 s"):
        Recovery(host)._await_restore(rep, 0.3)
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 1.5, waited
    assert len(host.ticks) >= 10 and rep.st.expected is None   # ticked all along (every ~5 ms), then given up
    # the failure flag ends it at once
    rep, host = Arriving(), Host(CP([]))
    host.cp.failure.set()
    with pytest.raises(PeerFailure, match="failure flag set"):
        Recovery(host)._await_restore(rep, 30.0)
    # this node failed while it waited: None, with the loop ticked once
    rep, host = Arriving(), Host(CP([]), fail_in_tick=True)
    assert Recovery(host)._await_restore(rep, 30.0) is None and len(host.ticks) == 1 and host.failed == ["exit"]
