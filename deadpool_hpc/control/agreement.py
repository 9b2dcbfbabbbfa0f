"""The recovery decision: a pure function from (layout, failed set, survivors' reports) to a plan.

The coordinator (the lowest-ranked live process) runs ``decide`` once every live process has
reported; everybody else applies the result it receives. Being pure, it is unit-tested directly.
Steps follow DESIGN.md "Recovery, in order": agree on the failed set, map every failed node to a
spare node rank for rank, and cut at the newest step ``T`` whose state exists for every rank (a
survivor's own snapshots, or a failed rank's replica at its holder).
"""
from __future__ import annotations

from ..errors import ReplicaError


def holder_of(train_rank: int, ranks_per_node: int, active_nodes: int) -> int:
    """Training rank that holds ``train_rank``'s replica: same local index on the next node (a ring).

    Raises ValueError for a single active node (no other node to hold a replica).
    """
    if active_nodes < 2:
        raise ValueError("replicas need at least 2 active nodes (a ring over nodes)")
    node, local = divmod(train_rank, ranks_per_node)
    return ((node + 1) % active_nodes) * ranks_per_node + local


def held_by(train_rank: int, ranks_per_node: int, active_nodes: int) -> int:
    """Training rank whose replica ``train_rank`` holds (the ring's predecessor)."""
    node, local = divmod(train_rank, ranks_per_node)
    return ((node - 1) % active_nodes) * ranks_per_node + local


def decide(*, generation: int, ranks_per_node: int, assignment: list[int], spare_nodes: list[int],
           failed: set[int], reports: dict[int, dict], preempt: bool = False) -> dict:
    """Plan the next generation.

    assignment[r] = MPI rank holding training rank r; spare_nodes = ids of live spare nodes, in
    promotion order; failed = suspected MPI ranks; reports[m] = {"own": [steps], "held": {"r": [steps]},
    "done_step": int} from each live process (spares report {}).

    Returns the decision dict (see keys below). When a lost active node finds no spare, the decision
    has ``exhausted`` True, no promotion, and still the cut step and the holder of every lost rank's
    replica (the job saves a persistent checkpoint at the cut and is requeued). ``preempt`` (Slurm
    announced preemption or the time limit with SIGUSR2) makes the decision ``exhausted`` too, with
    no promotion: save at the cut and requeue. ``reason`` says which: "hot swap", "no spare node
    left" or "preempted". Raises ReplicaError when some rank's state at a common step exists nowhere.
    """
    P = ranks_per_node
    W = len(assignment)
    N = W // P
    failed_nodes = sorted({m // P for m in failed})
    active_nodes = [assignment[n * P] // P for n in range(N)]  # physical node of each logical node
    spares = [s for s in spare_nodes if s not in failed_nodes]
    new_assign = list(assignment)
    promoted: dict[int, int] = {}
    lost = [n for n in failed_nodes if n in active_nodes]
    exhausted = preempt or len(lost) > len(spares)
    reason = "preempted" if preempt else ("no spare node left" if exhausted else "hot swap")
    for node in ([] if exhausted else lost):
        spare = spares.pop(0)
        slot = active_nodes.index(node)
        for i in range(P):
            r = slot * P + i
            new_assign[r] = spare * P + i
            promoted[r] = spare * P + i
    fenced = sorted(m for node in failed_nodes for m in range(node * P, node * P + P))
    members = sorted(m for m in reports if m // P not in failed_nodes)

    sources: dict[int, int] = {}
    common: set[int] | None = None
    for r in range(W):
        m = assignment[r]
        if m // P not in failed_nodes:
            avail = set(reports.get(m, {}).get("own", []))
        else:
            h = holder_of(r, P, N) if N >= 2 else None
            hm = assignment[h] if h is not None else None
            if hm is None or hm // P in failed_nodes:
                raise ReplicaError(f"rank {r} and the holder of its replica were lost together; no state survives")
            avail = set(reports.get(hm, {}).get("held", {}).get(str(r), []))
            sources[r] = hm
        common = avail if common is None else common & avail
    if not common:
        raise ReplicaError(f"no step whose state exists for every rank (reports: {reports})")
    cut = max(common)
    done = max((rep.get("done_step", -1) for rep in reports.values() if rep), default=cut)
    return {
        "generation": generation,
        "failed_nodes": failed_nodes,
        "fenced": fenced,
        "assignment": new_assign,
        "promoted": {str(k): v for k, v in promoted.items()},
        "sources": {str(k): v for k, v in sources.items()},
        "exhausted": exhausted,
        "reason": reason,
        "spare_nodes": spares,
        "members": members,
        "cut_step": cut,
        "recomputed_steps": max(0, done - cut),
        "high_water": done,
    }
