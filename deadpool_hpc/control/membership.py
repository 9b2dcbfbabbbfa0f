"""Membership between recoveries: a failed node that checked itself and comes back to the spare pool.

A node whose training processes failed while its agent lived on declared itself failed (``returning``), was
recovered around like any lost node, checked itself and asks to come back (``rejoin``, agent/comeback.py). Only the
lowest live agent, the coordinator of any next round, *readmits* it, and only between recoveries: its own failure
flag is down and the decision that took the node out is applied (the node is in no member list), so a node
returning while a recovery runs joins the next generation, never the current round. The readmission changes no
generation and stops no training: the node is appended to ``spare_nodes`` (last in promotion order), its processes to
``members``, and every agent trusts it again (``Peers.readmit``). The coordinator sends ``Readmit`` to every live
agent, the node included, which takes the view in it as its own.

A recovery that starts while a ``Readmit`` is on its way is safe: the coordinator of its round counts any live,
reporting node that trains nothing as a spare (``spares_of``), whichever view it took; an agent that gets the
``Readmit`` of a generation it has not applied yet keeps it until it does (control/round.py ``apply_decision`` calls
``apply_pending``). Not covered: the coordinator dying after readmitting a node and before every agent got the
message; the next coordinator may still suspect the node, whose recovery then times out (RecoveryTimeout: it
leaves, and the job goes on without it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..ipc.schema import CONTROL, Message
from .decision import IdRuns


def spares_of(view_spares, alive, assignment, P: int) -> list[int]:
    """The spare nodes of a round, in promotion order: the view's (``view_spares``), then every live agent in
    ``alive`` that holds no training rank of ``assignment`` and is not listed (a node readmitted meanwhile)."""
    training = {m // P for m in assignment}
    listed = list(view_spares)
    return listed + sorted(n for n in alive if n not in training and n not in listed)


@dataclass(frozen=True)
class Readmit(Message, plane=CONTROL, kind="readmit"):
    """A node back in the spare pool. node: its MPI rank; generation: the generation it joins (no new one);
    assignment / spare_nodes / members: that generation's view after the readmission (what the node takes as its
    own); suspected: the MPI ranks the coordinator suspects (the node's heartbeat view); coordinator: who readmitted
    it; t: when (Unix seconds)."""

    node: int
    generation: int
    assignment: IdRuns
    spare_nodes: tuple[int, ...]
    members: IdRuns
    suspected: tuple[int, ...]
    coordinator: int
    t: float


def may_readmit(cp, node: int) -> str | None:
    """Why the agent of ``cp`` cannot readmit ``node`` now (it asks again), or None. Only the lowest live agent does;
    never during a recovery, nor before the decision that took the node out is applied here."""
    alive = cp.peers.alive()
    if cp.me != alive[0]:
        return "not the lowest live agent"
    if node not in cp.peers.returning:
        return "not a returning node"
    if cp.failure.is_set():
        return "a recovery is under way"
    if any(m // cp.P == node for m in cp.members) or any(m // cp.P == node for m in cp.assignment):
        return "the decision that took it out is not applied yet"
    return None


def readmit(cp, node: int) -> Readmit:
    """(the coordinator) Put ``node`` back in the spare pool of the current generation and tell every live agent."""
    cp.peers.readmit(node)
    _add(cp, node)
    with cp.peers.lock:
        suspected = tuple(sorted(cp.peers.suspected))
    msg = Readmit(node=node, generation=cp.generation, assignment=tuple(cp.assignment),
                  spare_nodes=tuple(cp.spare_nodes), members=tuple(cp.members), suspected=suspected,
                  coordinator=cp.me, t=time.time())
    cp.peers.broadcast(Readmit.KIND, msg.to_wire())
    return msg


def on_readmit(cp, msg: Readmit) -> None:
    """(every other agent) Trust the node again and count it as a spare of its generation (kept until that
    generation is applied here, if it is newer than ours)."""
    if msg.node == cp.me:
        return
    if msg.generation > cp.generation:
        cp.pending_readmits.append(msg)
        return
    if msg.generation < cp.generation and not any(m // cp.P == msg.node for m in cp.members):
        return   # a decision since left it out (its coordinator did not know it yet): it is not ours to add
    cp.peers.readmit(msg.node)
    if msg.generation == cp.generation:
        _add(cp, msg.node)


def apply_pending(cp) -> None:
    """(control/round.py ``apply_decision``) The readmissions of the generation just applied."""
    pending, cp.pending_readmits = cp.pending_readmits, []
    for msg in pending:
        if msg.generation > cp.generation:
            cp.pending_readmits.append(msg)
        elif msg.generation == cp.generation:
            on_readmit(cp, msg)


def rejoin(cp, msg: Readmit) -> None:
    """(the readmitted node) Take the coordinator's view as this agent's own: the generation it joins, its layout,
    the suspected agents; what its control plane kept from before its failure (rounds, decisions, barriers) is
    dropped."""
    cp.enter_generation(msg.generation)
    cp.assignment, cp.spare_nodes, cp.members = list(msg.assignment), list(msg.spare_nodes), list(msg.members)
    cp.coordinator = msg.coordinator
    cp._collects, cp._ready, cp._auto, cp._decisions, cp._sync = {}, {}, {}, {}, {}
    cp.pending_readmits = []
    cp.first_suspicion = None
    cp.peers.notice_g = msg.generation
    cp.peers.rejoined(msg.suspected)


def _add(cp, node: int) -> None:
    if node not in cp.spare_nodes:
        cp.spare_nodes.append(node)
    cp.members = sorted(set(cp.members) | set(cp.procs(node)))
