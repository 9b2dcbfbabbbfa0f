"""Placement: which ranks hold a rank's replica, whose replicas a rank holds, and which spare node takes a lost
node's place. Pure functions.

Rank r's snapshot is held by the same local index on the next K active (logical) nodes, a ring, so any K
simultaneous node losses leave a copy of every rank. One rule for everyone who needs it: the recovery's decision
(control/agreement.py), the pre-start check of a fault spec (faultinject/plan.py, node by node), the node agent that
pushes and holds replicas (agent/node.py) and ``ctx.protect``, whose kept shares follow the same ring
(worker/protect.py).
"""
from __future__ import annotations

from .ids import LogicalNode, NodeId, Rank


def holder_nodes(node: LogicalNode, active_nodes: int, k: int = 1) -> list[LogicalNode]:
    """The logical nodes that hold the replicas of ``node``'s ranks: the next ``k`` on the ring of active nodes."""
    return [(node + j) % active_nodes for j in range(1, k + 1)]


def holders_of(train_rank: Rank, ranks_per_node: int, active_nodes: int, k: int = 1) -> list[Rank]:
    """Training ranks that hold ``train_rank``'s replica: same local index on the next ``k`` nodes (a ring).

    Raises ValueError when the ring is too small (fewer than k + 1 active nodes).
    """
    if k >= active_nodes:
        raise ValueError(f"{k} replica(s) need at least {k + 1} active nodes (a ring over nodes); have {active_nodes}")
    node, local = divmod(train_rank, ranks_per_node)
    return [h * ranks_per_node + local for h in holder_nodes(node, active_nodes, k)]


def held_by(train_rank: Rank, ranks_per_node: int, active_nodes: int, k: int = 1) -> list[Rank]:
    """Training ranks whose replica ``train_rank`` holds (its ``k`` predecessors on the ring)."""
    node, local = divmod(train_rank, ranks_per_node)
    return [((node - j) % active_nodes) * ranks_per_node + local for j in range(1, k + 1)]


def promotion(lost: list[NodeId], spares: list[NodeId]) -> dict[NodeId, NodeId]:
    """Which spare node takes each lost node's place: the lost (physical) nodes in node-id order, each given the
    first spare left, ``spares`` being in promotion order. One rule for the recovery's decision
    (control/agreement.py ``decide``) and the pre-start check of a fault spec (faultinject/plan.py), so the two cannot
    drift.

    Raises ValueError when there are fewer spares than lost nodes (the caller decides what that means: a requeue,
    or a refused fault spec)."""
    if len(lost) > len(spares):
        raise ValueError(f"{len(lost)} lost node(s) {sorted(lost)} but {len(spares)} spare node(s) {list(spares)}")
    return dict(zip(sorted(lost), spares))
