"""Planned swaps through their narrow interface (agent/planned.py ``SwapHost``): a fake node agent and control plane,
no processes. The lease goes to one node at a time; an armed swap stops each training process once it wrote the
boundary's snapshot, leaves once all of them are committed there, and lets them go again if a failure interrupts.
The end-to-end runs are tests/e2e/test_planned_swap.py.
Run: DEADPOOL_SLURM_TESTS=0 .venv/bin/python -m pytest -q tests/unit/agent/test_planned.py
"""
from __future__ import annotations

import signal
import threading
from types import SimpleNamespace

from deadpool_hpc.agent.health import Unhealthy
from deadpool_hpc.agent.planned import PlannedSwaps
from deadpool_hpc.config import RunConfig
from deadpool_hpc.control.messages import SwapAnswer, SwapAsk


class Peers:
    def __init__(self):
        self.sent, self.suspected = [], set()

    def send(self, dest, kind, body):
        self.sent.append((dest, kind, body))

    def alive(self):
        return [0, 1, 2, 3]

    def is_suspected(self, n):
        return n in self.suspected


class ControlPlane:
    def __init__(self, me=1):
        self.me, self.generation, self.spare_nodes = me, 0, [3]
        self.handlers, self.peers, self.failure = {}, Peers(), threading.Event()

    def on(self, kind, fn):
        self.handlers[kind] = fn

    def finished(self):
        return None


class Host:
    """The node agent as a planned swap sees it: nothing else of NodeAgent is reachable."""

    def __init__(self, P=2):
        self.cfg = RunConfig(replicate=True, steps=100, ranks_per_node=P, collective_timeout=30.0)
        self.log = SimpleNamespace(events=[], emit=lambda name, **kw: self.log.events.append(name))
        self.state = "training"
        self.written = {lo: 4 for lo in range(P)}
        self.reps = {lo: SimpleNamespace(committed_step=4, report=lambda: {"held": {}}) for lo in range(P)}
        self.health = SimpleNamespace(consumed=lambda detector: None)
        self.signals, self.left_with = [], None

    def in_recovery(self):
        return False

    def signal_local(self, local, sig):
        self.signals.append((local, sig))
        return True

    def node_failed(self, reason, cause):
        self.left_with = cause   # NodeAgent.node_failed records the exit; its loop acts on it, the caller stops


def test_the_lease_goes_to_one_node_at_a_time():
    cp = ControlPlane(me=0)
    coordinator = PlannedSwaps(cp, Host())
    coordinator.on_ask(1, SwapAsk(1, 0))
    coordinator.on_ask(2, SwapAsk(2, 0))
    assert [(d, b) for d, _, b in cp.peers.sent] == [(1, {"ok": True}), (2, {"ok": False, "busy": 1})]
    cp.peers.suspected.add(1)   # the holder left: the lease is free again
    coordinator.on_ask(2, SwapAsk(2, 0))
    assert cp.peers.sent[-1][2] == {"ok": True}


def test_an_armed_swap_stops_each_process_at_the_boundary_and_leaves_once_committed():
    cp, host = ControlPlane(), Host()
    swaps = PlannedSwaps(cp, host)
    swaps.want("test", Unhealthy("drained"), 0.0)
    swaps.tick()
    assert cp.peers.sent[-1][:2] == (0, "swap_ask")
    swaps.on_answer(0, SwapAnswer(True))
    assert swaps.current["target"] == 5 and host.signals == []
    for lo in range(2):
        host.written[lo] = 5
        swaps.on_written(lo)
    assert host.signals == [(0, signal.SIGSTOP), (1, signal.SIGSTOP)] and swaps.frozen() == {0, 1}
    swaps.tick()   # stopped, but not committed at the boundary yet
    assert host.left_with is None
    for rep in host.reps.values():
        rep.committed_step = 5
    swaps.tick()
    assert host.left_with == "planned" and "swap_boundary" in host.log.events


def test_a_spare_leaves_at_once_and_arms_nothing():
    cp, host = ControlPlane(), Host()
    host.state = "spare"
    swaps = PlannedSwaps(cp, host)
    swaps.want("test", Unhealthy("drained"), 0.0)
    swaps.tick()
    swaps.on_answer(0, SwapAnswer(True))
    assert host.left_with == "planned" and host.log.events == ["swap_requested"] and host.signals == []


def test_a_failure_lets_the_stopped_processes_go_and_asks_again():
    cp, host = ControlPlane(), Host()
    swaps = PlannedSwaps(cp, host)
    swaps.want("test", Unhealthy("drained"), 0.0)
    swaps.tick()
    swaps.on_answer(0, SwapAnswer(True))
    host.written[0] = 5
    swaps.on_written(0)
    swaps.suspend()
    assert host.signals == [(0, signal.SIGSTOP), (0, signal.SIGCONT)] and swaps.current is None
    assert [w[0] for w in swaps.wanted] == ["test"]
