"""Fault injection for tests and demos: real signals to real processes, at a step or a recovery phase.

``--kill node1@60`` SIGKILLs every process of node 1 when training first reaches step 60 (an active node:
its first process fires for the node; a spare node: training rank 0 asks it, over the control plane, to
fire on itself); ``--kill rank2@60`` SIGKILLs the process holding training rank 2; ``--hang ...`` sends
SIGSTOP instead (the process stays, frozen, with its sockets open: what a hung node looks like).
``--kill node2@rebuild`` fires when node 2 reaches that phase of its first recovery (config.Fault lists
the phases; ``#N`` names the N-th recovery round). A fault fires once: step faults only on the first pass
through their step (the caller fires them above the job's high-water step), phase faults on the first
time their phase comes.

The event ``fault_injected`` is written (and fsynced) before the signal, so recovery times can be
measured from it. Every signal goes to a process identified by pid *and* start time (control/fence.py),
so a recycled pid is never hit.
"""
from __future__ import annotations

import os
import signal

from ..control.fence import identity, same_process


class Injector:
    """Fires this process's share of ``faults``.

    mpi_rank / ranks_per_node: where this process sits; idents: every process's identity (fence.identity
    records, by MPI rank); log: EventLog; send(dest, kind, body): a control-plane send (asks a spare to fire).
    """

    def __init__(self, faults, *, mpi_rank: int, ranks_per_node: int, idents: list[dict], log, send):
        self.steps = sorted((f for f in faults if f.phase is None), key=lambda f: (f.step, f.target_kind, f.index))
        self.phases = [f for f in faults if f.phase is not None]
        self.me = mpi_rank
        self.P = ranks_per_node
        self.node, self.local = divmod(mpi_rank, ranks_per_node)
        self.idents = idents
        self.log = log
        self.send = send
        self.fired: set = set()

    # ---- step faults ------------------------------------------------------------------------------------
    def at_step(self, step: int, train_rank: int, assignment: list[int], spare_nodes: list[int]) -> None:
        """Fire the faults due at ``step`` that this process must fire (called on the first pass only)."""
        active = {m // self.P for m in assignment}
        for f in self.steps:
            if f.step != step:
                continue
            if f.target_kind == "node" and f.index not in active:
                if train_rank != 0:
                    continue
                if f.index in spare_nodes:  # a spare node: it fires on itself when asked
                    self.send(f.index * self.P, "inject", {"kind": f.kind, "target": f.target, "step": step})
                else:
                    self.log.emit("fault_skipped", kind=f.kind, target=f.target, step=step,
                                  reason=f"node{f.index} is neither training nor a live spare at step {step} (lost)")
                continue
            if f.target_kind == "rank" and f.index != train_rank:
                continue
            if f.target_kind == "node" and (f.index != self.node or self.local != 0):
                continue  # the node's first process fires for the whole node
            self._fire(f.kind, f.target, self._victims(f), step=step)

    def on_message(self, body: dict) -> None:
        """A training rank asked this (spare) node to fire on itself (called in the agent thread)."""
        key = ("msg", body.get("target"), body.get("step"))
        if key not in self.fired:
            self.fired.add(key)
            self._fire(body["kind"], body["target"], self._node_victims(), step=body.get("step"))

    # ---- phase faults -----------------------------------------------------------------------------------
    def at_phase(self, phase: str, nth: int, train_rank: int | None) -> None:
        """This process reached ``phase`` of its ``nth`` recovery round: fire what targets it there."""
        for f in self.phases:
            if f.phase != phase or f.nth != nth or f in self.fired or not self._targets_me(f, train_rank):
                continue
            self.fired.add(f)
            self._fire(f.kind, f.target, self._victims(f), phase=f.when)

    def wants_phase(self, phase: str, nth: int, train_rank: int | None) -> bool:
        return any(f.phase == phase and f.nth == nth and f not in self.fired and self._targets_me(f, train_rank)
                   for f in self.phases)

    def _targets_me(self, f, train_rank) -> bool:
        if f.target_kind == "rank":
            return f.index == train_rank
        return f.index == self.node and self.local == 0

    # ---- firing -----------------------------------------------------------------------------------------
    def _victims(self, f) -> list[int]:
        return [self.me] if f.target_kind == "rank" else self._node_victims()

    def _node_victims(self) -> list[int]:
        return list(range(self.node * self.P, (self.node + 1) * self.P))

    def _fire(self, kind: str, target: str, victims: list[int], step=None, phase=None) -> None:
        sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
        pids = [int(self.idents[m]["pid"]) for m in victims]
        self.log.emit("fault_injected", kind=kind, target=target, step=step, phase=phase, node=self.node, pids=pids,
                      signal=sig.name)
        self.log.sync()
        me = identity()
        for m in victims:
            ident = self.idents[m]
            if ident["pid"] != me["pid"] and same_process(ident):
                try:
                    os.kill(int(ident["pid"]), sig)
                except ProcessLookupError:
                    pass
        os.kill(os.getpid(), sig)
