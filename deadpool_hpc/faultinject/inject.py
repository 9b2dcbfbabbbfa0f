"""Fault injection for tests and demos: real signals to real processes, at a step or a recovery phase.

``--kill node1@60`` SIGKILLs every process of node 1 (its agent and its training processes: what a node crash
looks like) when training first reaches step 60; ``--kill rank2@60`` SIGKILLs the training process holding
rank 2 (its agent sees the exit at once); ``--hang ...`` sends SIGSTOP instead (frozen, sockets open).
``--kill node2@rebuild`` fires when node 2 reaches that phase of its ``nth`` recovery round (spec.Fault lists
the phases). A fault fires once: step faults only on the first pass through their step (the caller fires them
above the job's high-water step), phase faults the first time their phase comes.

Two halves. ``RankFaults`` runs in a training process: step faults, and the phases a training process goes
through (build and first at the start, rebuild, restore, resume); a node target there is fired by the node's agent
(``FireNode``), a spare node by training rank 0's agent (``InjectSpare``, passed on over the control plane as
``Inject``): faultinject/messages.py.
``NodeFaults`` runs in the node agent: the phases it goes through (startup, once its training processes are
spawned; detect, agree, decided, and restore while it sends a replica), and node faults asked for by its training
processes or by another agent.

``--nic-down node1`` gives node 1's training processes a gloo interface that does not exist, from their start
(``nic_down_env``): a data-plane interface that is down.

``--slow node1@startup:8`` makes node 1's training processes 8 times slower from their start (``@build``: once their
model is built; ``@40``: from step 40 on) (``Slowdown``: its agent stops and continues them), until the node is
fenced or the run ends.

``fault_injected`` is written (and fsynced) before the signal, so recovery times are measured from it. Signals go
to this node's own processes only, known by pid (children of the agent, or the agent itself).
"""
from __future__ import annotations

import os
import signal
import threading
import time

from .messages import FireNode, Inject, InjectSpare, NicDown

AGENT_PHASES = ("startup", "detect", "agree", "decided")
RANK_PHASES = ("build", "first", "rebuild", "restore", "resume")


def _signal(kind: str) -> signal.Signals:
    return signal.SIGKILL if kind == "kill" else signal.SIGSTOP


class RankFaults:
    """A training process's share. node/local: where it sits; log: EventLog; send(kind, body): to its agent (a
    ``FireNode`` or an ``InjectSpare``'s kind and wire form)."""

    def __init__(self, faults, *, node: int, local: int, ranks_per_node: int, log, send):
        self.steps = sorted((f for f in faults if f.phase is None), key=lambda f: (f.step, f.target_kind, f.index))
        self.phases = [f for f in faults if f.phase in RANK_PHASES]
        self.node, self.local, self.P = node, local, ranks_per_node
        self.log, self.send = log, send
        self.fired: set = set()

    def at_step(self, step: int, train_rank: int, active_nodes: set, spare_nodes: list) -> None:
        """Fire what is due at ``step`` (called on the first pass only)."""
        for f in self.steps:
            if f.step != step:
                continue
            if f.target_kind == "rank":
                if f.index == train_rank:
                    self._fire_self(f.kind, f.target, step=step)
                continue
            if f.index in active_nodes:
                if f.index == self.node and self.local == 0:  # the node's first process asks for the whole node
                    self.send(FireNode.KIND, FireNode(f.kind, f.target, f.factor, step=step).to_wire())
            elif train_rank == 0:
                if f.index in spare_nodes:
                    ask = InjectSpare(f.index, FireNode(f.kind, f.target, f.factor, step=step))
                    self.send(InjectSpare.KIND, ask.to_wire())
                else:
                    self.log.emit("fault_skipped", kind=f.kind, target=f.target, step=step,
                                  reason=f"node{f.index} is neither training nor a live spare at step {step} (lost)")

    def at_phase(self, phase: str, nth: int, train_rank: int | None) -> None:
        for f in self.phases:
            if f.phase != phase or f.nth != nth or f in self.fired:
                continue
            if f.target_kind == "rank" and f.index == train_rank:
                self.fired.add(f)
                self._fire_self(f.kind, f.target, phase=f.when)
            elif f.target_kind == "node" and f.index == self.node and (self.local == 0 or phase == "build"):
                # (build: whichever of the node's processes gets there first; the agent fires the node once)
                self.fired.add(f)
                self.send(FireNode.KIND, FireNode(f.kind, f.target, f.factor, phase=f.when).to_wire())

    def _fire_self(self, kind: str, target: str, step=None, phase=None) -> None:
        sig = _signal(kind)
        self.log.emit("fault_injected", kind=kind, target=target, step=step, phase=phase, node=self.node,
                      pids=[os.getpid()], signal=sig.name)
        self.log.sync()
        os.kill(os.getpid(), sig)


class NodeFaults:
    """A node agent's share. node: this node; pids(): this node's training processes' pids by local rank;
    rank_local(rank) -> local rank on this node holding training ``rank`` now, or None; log: EventLog;
    tell_local(kind, body): send every training process of this node a message (``NicDown``'s kind and wire form)."""

    def __init__(self, faults, *, node: int, log, pids, rank_local, tell_local=None):
        self.phases = [f for f in faults if f.phase in AGENT_PHASES + ("restore",) and f.kind != "nic_down"]
        self.node = node
        self.log = log
        self.pids = pids
        self.rank_local = rank_local
        self.fired: set = set()
        self._lock = threading.Lock()   # at_phase's check-and-mark: a restore's send threads reach "restore" at once
        self.slowdown = None   # Slowdown, once --slow fired
        self.tell_local = tell_local   # tell_local(kind, body): a message to every training process of this node

    def wants_phase(self, phase: str, nth: int) -> bool:
        return any(f.phase == phase and f.nth == nth and f not in self.fired and self._mine(f) for f in self.phases)

    def at_phase(self, phase: str, nth: int) -> None:
        """This agent reached ``phase`` of its ``nth`` round (``restore``: half-way through sending a replica, on a
        send thread: several may reach it at once, and each fault fires once)."""
        for f in self.phases:
            with self._lock:
                if f.phase != phase or f.nth != nth or f in self.fired or not self._mine(f):
                    continue
                self.fired.add(f)
            if f.target_kind == "node":
                self.fire_node(FireNode(f.kind, f.target, f.factor, phase=f.when))
            else:
                pid = self.pids()[self.rank_local(f.index)]
                sig = _signal(f.kind)
                self.log.emit("fault_injected", kind=f.kind, target=f.target, step=None, phase=f.when, node=self.node,
                              pids=[pid], signal=sig.name)
                self.log.sync()
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass   # gone already (another fault of this phase, or its own exit)

    def _mine(self, f) -> bool:
        if f.target_kind == "node":
            return f.index == self.node
        return self.rank_local(f.index) is not None

    def on_message(self, msg: Inject) -> None:
        """Another agent (training rank 0's) asks this spare node to fire on itself (once per target and step)."""
        key = (msg.fault.target, msg.fault.step)
        if key not in self.fired:
            self.fired.add(key)
            self.fire_node(msg.fault)

    def slow_node(self, fault: FireNode) -> None:
        """``--slow``: this node's training processes run 1/factor of the time from now on (once per node: at
        ``build`` each of them asks)."""
        if self.slowdown is not None:
            return
        pids = list(self.pids().values())
        self.log.emit("fault_injected", kind="slow", target=fault.target, step=fault.step, phase=fault.phase,
                      node=self.node, pids=pids, factor=fault.factor, signal="SIGSTOP/SIGCONT")
        self.log.sync()
        self.slowdown = Slowdown(pids, float(fault.factor)).start()

    def fire_node(self, fault: FireNode) -> None:
        """The whole node: its training processes, then this agent (a node crash / freeze); or, for ``slow``, its
        training processes made ``factor`` times slower; for ``nic_down`` (a spare's, at a step), its training
        processes' gloo given an interface that does not exist (``tell_local``)."""
        if fault.kind == "slow":
            return self.slow_node(fault)
        if fault.kind == "nic_down":
            ifname = _nic_down_injected(self.log, fault.target, self.node, fault.step, list(self.pids().values()))
            return self.tell_local(NicDown.KIND, NicDown(ifname).to_wire())
        sig = _signal(fault.kind)
        pids = list(self.pids().values())
        self.log.emit("fault_injected", kind=fault.kind, target=fault.target, step=fault.step,
                      phase=fault.phase, node=self.node, pids=pids + [os.getpid()], signal=sig.name)
        self.log.sync()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), sig)


def nic_down_env(faults, node: int, env: dict, log) -> None:
    """``--nic-down nodeN``: before node N's agent spawns its training processes, their gloo is given an interface
    that no machine has (``GLOO_SOCKET_IFNAME``, read by every gloo process group they build): a data-plane interface
    that is down, while the agent's control plane works."""
    for f in faults:
        if f.kind == "nic_down" and f.index == node and f.step is None:   # (at a step: fire_node)
            env["GLOO_SOCKET_IFNAME"] = _nic_down_injected(log, f.target, node, None, [])


def _nic_down_injected(log, target: str, node: int, step, pids: list) -> str:
    """Log (and fsync) a ``--nic-down`` fault; returns the interface gloo is to be given."""
    from .spec import NIC_DOWN_IFNAME

    log.emit("fault_injected", kind="nic_down", target=target, step=step, phase="startup" if step is None else None,
             node=node, pids=pids, signal=None, ifname=NIC_DOWN_IFNAME)
    log.sync()
    return NIC_DOWN_IFNAME


class Slowdown:
    """Run ``pids`` 1/``factor`` of the time: SIGCONT, ``period``/factor seconds, SIGSTOP, factor - 1 times as long,
    in a daemon thread, until every pid is gone (the node is fenced, or the run ends). A real slowdown of real
    processes: their wall time per unit of work grows by ``factor``, as on a throttled device or a node whose CPU share
    shrank."""

    def __init__(self, pids: list[int], factor: float, period: float = 0.05):
        self.pids, self.factor, self.period = list(pids), float(factor), period
        self._thread = threading.Thread(target=self._run, name="deadpool-slowdown", daemon=True)

    def start(self) -> "Slowdown":
        self._thread.start()
        return self

    def _signal(self, sig) -> None:
        for pid in list(self.pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                self.pids.remove(pid)

    def _run(self) -> None:
        on = self.period / self.factor
        try:
            while self.pids:
                t0 = time.monotonic()
                self._signal(signal.SIGCONT)
                time.sleep(on)
                self._signal(signal.SIGSTOP)
                # the stop lasts (factor - 1) x how long they really ran: on a busy machine this thread wakes late, and
                # a fixed pause would let them run more than 1/factor of the time
                time.sleep((time.monotonic() - t0) * (self.factor - 1))
        finally:
            self._signal(signal.SIGCONT)
