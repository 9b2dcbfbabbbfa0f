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

import dataclasses
import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ..ipc.schema import CONTROL, Message
from ..ids import Generation, NodeId, ProcId
from .decision import NodeRuns, ProcRuns


@dataclass(frozen=True)
class Membership:
    """One agent's view of its generation (``ControlPlane.membership``): replaced whole, never changed in place (a
    decision applied, a readmission, a rejoin, a resume), so a reader on another thread (the control thread:
    ``Peers.generation``) sees one view or the next, never a mix.

    generation: the generation applied (0 at the start); assignment: the virtual process holding each training rank
    (assignment[r]); spare_nodes: the spare nodes' MPI ranks, in promotion order; members: the generation's virtual
    processes (training and spare); coordinator: the MPI rank that decided it (None before the first decision).
    Raises ValueError for a generation that is not an integer >= 0."""

    generation: Generation
    assignment: tuple[ProcId, ...]
    spare_nodes: tuple[NodeId, ...]
    members: tuple[ProcId, ...]
    coordinator: NodeId | None = None

    def __post_init__(self):
        g = self.generation
        try:
            n = operator.index(g)
        except TypeError:
            n = -1
        if isinstance(g, bool) or n < 0:
            raise ValueError(f"generation {g!r}: must be an integer >= 0")
        for key in ("assignment", "spare_nodes", "members"):
            object.__setattr__(self, key, tuple(getattr(self, key)))

    @classmethod
    def initial(cls, ranks_per_node: int, active_nodes: int, size: int) -> "Membership":
        """Generation 0: nodes 0 .. active_nodes - 1 train (node n holds virtual processes n*P .. n*P+P-1), the
        other ``size - active_nodes`` agents are spares, every virtual process is a member."""
        return cls(0, tuple(range(active_nodes * ranks_per_node)), tuple(range(active_nodes, size)),
                   tuple(range(size * ranks_per_node)))

    def replace(self, **changes) -> "Membership":
        """A new view with ``changes`` (field=value) applied."""
        return dataclasses.replace(self, **changes)

    def with_spare(self, node: NodeId, ranks_per_node: int) -> "Membership":
        """The view with ``node`` a spare of this generation: appended to ``spare_nodes`` (last in promotion order)
        unless listed, its virtual processes among the members."""
        P = ranks_per_node
        spares = self.spare_nodes if node in self.spare_nodes else self.spare_nodes + (node,)
        return self.replace(spare_nodes=spares,
                            members=tuple(sorted(set(self.members) | set(range(node * P, (node + 1) * P)))))


def spares_of(view_spares: Iterable[NodeId], alive: Iterable[NodeId], assignment: Iterable[ProcId],
              P: int) -> list[NodeId]:
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
    it; t: when (Unix seconds); joined: the joined nodes' slots and how to reach them, {str(node): {"sponsor",
    "identity"}} (control/joining.py), which an agent that was out meanwhile has not heard of."""

    node: NodeId
    generation: Generation
    assignment: ProcRuns
    spare_nodes: tuple[NodeId, ...]
    members: ProcRuns
    suspected: tuple[NodeId, ...]
    coordinator: NodeId
    t: float
    joined: dict = dataclasses.field(default_factory=dict)


def admitter(cp) -> NodeId | None:
    """The agent that readmits returning nodes and admits replacement nodes: the lowest live agent of the MPI world
    (a joined node, control/joining.py, has no MPI: it does neither), as ``cp`` sees it; None when it sees none."""
    with cp.peers.lock:
        joined = set(cp.peers.relays.routes)
    return next((n for n in cp.peers.alive() if n not in joined and not (n == cp.me and cp.world is None)), None)


def joined_nodes(cp) -> dict:
    """{node: its sponsor} of the joined nodes ``cp``'s agent trusts (control/joining.py)."""
    with cp.peers.lock:
        return {n: s for n, s in cp.peers.relays.routes.items() if n not in cp.peers.suspected and n != cp.me}


def may_readmit(cp, node: NodeId) -> str | None:
    """Why the agent of ``cp`` cannot readmit ``node`` now (it asks again), or None. Only the lowest live agent of
    the MPI world does (``admitter``); never during a recovery, nor before the decision that took the node out is
    applied here."""
    if cp.me != admitter(cp):
        return "not the lowest live agent"
    if node not in cp.peers.returning:
        return "not a returning node"
    if cp.failure.is_set():
        return "a recovery is under way"
    if any(m // cp.P == node for m in cp.members) or any(m // cp.P == node for m in cp.assignment):
        return "the decision that took it out is not applied yet"
    return None


def readmit(cp, node: NodeId) -> Readmit:
    """(the coordinator) Put ``node`` back in the spare pool of the current generation and tell every live agent."""
    cp.peers.readmit(node)
    _add(cp, node)
    with cp.peers.lock:
        suspected = tuple(sorted(cp.peers.suspected))
    msg = Readmit(node=node, generation=cp.generation, assignment=tuple(cp.assignment),
                  spare_nodes=tuple(cp.spare_nodes), members=tuple(cp.members), suspected=suspected,
                  coordinator=cp.me, t=time.time(),
                  joined={str(n): {"sponsor": s, "identity": cp.idents[n]} for n, s in joined_nodes(cp).items()})
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
    cp.adopt(Membership(msg.generation, msg.assignment, msg.spare_nodes, msg.members, msg.coordinator))
    for n, j in msg.joined.items():   # joined meanwhile: how to reach them (control/joining.py)
        cp.take_identity(int(n), dict(j["identity"]))
        cp.peers.relays.route(int(n), int(j["sponsor"]))
    cp.forget_rounds()
    cp.peers.notice_g = msg.generation
    cp.peers.rejoined(msg.suspected)


def _add(cp, node: NodeId) -> None:
    cp.adopt(cp.membership.with_spare(node, cp.P))
