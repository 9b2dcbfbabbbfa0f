"""The recovery decision: a pure function from (layout, failed set, live processes' reports) to a plan.

The coordinator of a recovery round (the lowest-ranked live process, plane.py) runs ``decide`` once every
live process has reported; every member applies the result it receives. Being pure, it is unit-tested
directly. Steps follow DESIGN.md "Recovery, in order": agree on the failed set, map every failed node to a
spare node rank for rank, and cut at the newest step ``T`` whose state exists for every rank, then say
where each rank's state at ``T`` comes from. Where replicas are is placement.py's rule (``holders_of``).
"""
from __future__ import annotations

from ..errors import ReplicaError
from ..ids import Generation, NodeId, ProcId, Rank
from ..placement import holders_of, promotion
from .crashloop import find_loop
from .decision import Decision
from .messages import Report


def decide(*, generation: Generation, ranks_per_node: int, assignment: list[ProcId], spare_nodes: list[NodeId],
           failed: set[ProcId], reports: dict[ProcId, Report], preempt: bool = False, replicas: int = 1,
           work_failures=(), crash_loop_limit: int = 0) -> Decision:
    """Plan the next generation.

    assignment[r] = MPI rank holding training rank r; spare_nodes = ids of live spare nodes, in promotion
    order; failed = suspected MPI ranks; reports[m]: the Report of each live process m (control/messages.py: its
    ``own_rank``, ``own`` steps, ``held`` steps by rank, ``done_step``, ``start_step``; a spare that holds nothing
    reports the defaults). Only verified snapshots are reported; ``own`` counts for rank r only when the
    process still holds r (a promoted spare whose restore failed reports no own steps).

    Returns the Decision (decision.py; its coordinator and times are left for the coordinator to fill
    in). ``sources[r]`` names the MPI rank that sends rank r's state at the
    cut, for every rank whose process (new or old) lacks it locally: promoted spares, and ranks whose
    process lost its state in a failed round. When a lost active node finds no spare, the decision has
    ``exhausted`` True, no promotion, and still the cut and a source for every lost rank (the job saves a
    persistent checkpoint there and is requeued). A rank whose state exists nowhere before any rank has trained a
    step (a node lost during start-up or step 0) starts fresh: the cut is the attempt's start step and ``fresh``
    lists the ranks that rebuild their initial state themselves (no source). ``preempt`` (Slurm's warning) makes it
    ``exhausted`` too. ``reason``: "hot swap", "no spare node left", "preempted", "crash loop", or "rebuild" (nobody
    failed: a
    collective timed out or a round failed; same members, new process group). ``work_failures`` (crashloop.py
    WorkFailure, oldest first: how training processes ended) and ``crash_loop_limit``: when the newest failure
    completes a crash loop (``find_loop``: the same rank, end and step on more than ``crash_loop_limit`` nodes), the
    decision promotes nobody, is ``exhausted`` with reason "crash loop" and names the loop (``crash_loop``): the
    members save the checkpoint of the cut and the run stops, spares left or not. Raises ReplicaError, naming the
    rank, when some rank's state at a common step exists nowhere.
    """
    P = ranks_per_node
    W = len(assignment)
    N = W // P
    failed_nodes = sorted({m // P for m in failed})
    active_nodes = [assignment[n * P] // P for n in range(N)]  # physical node of each logical node
    spares = [s for s in spare_nodes if s not in failed_nodes]
    new_assign = list(assignment)
    promoted: dict[Rank, ProcId] = {}
    replaced: dict[NodeId, NodeId] = {}  # lost node -> the spare node that takes its place
    lost = [n for n in failed_nodes if n in active_nodes]
    loop = None if preempt else find_loop(list(work_failures), crash_loop_limit)
    exhausted = preempt or loop is not None or len(lost) > len(spares)
    if preempt:
        reason = "preempted"
    elif loop is not None:
        reason = "crash loop"
    elif exhausted:
        reason = "no spare node left"
    else:
        reason = "hot swap" if lost else ("spare lost" if failed_nodes else "rebuild")
    replacing = {} if exhausted else promotion(lost, spares)
    spares = spares[len(replacing):]   # the spares left for the next generation
    for node, spare in replacing.items():
        replaced[node] = spare
        slot = active_nodes.index(node)
        for i in range(P):
            r = slot * P + i
            new_assign[r] = spare * P + i
            promoted[r] = spare * P + i
    fenced = sorted(m for node in failed_nodes for m in range(node * P, node * P + P))
    members = sorted(m for m in reports if m // P not in failed_nodes)

    def own_steps(m: ProcId, r: Rank) -> set[int]:
        rep = reports.get(m)
        if m // P in failed_nodes or rep is None or rep.own_rank != r:
            return set()
        return set(rep.own)

    held = {r: {} for r in range(W)}  # rank -> {step: [live MPI ranks holding a verified copy]}
    for m in members:
        for r, steps in reports[m].held.items():
            for s in steps:
                held.setdefault(r, {}).setdefault(s, []).append(m)
    avail = {r: own_steps(assignment[r], r) | set(held[r]) for r in range(W)}
    gone = [r for r in range(W) if not avail[r]]
    done = max((rep.done_step for rep in reports.values()), default=-1)
    start = max((rep.start_step for rep in reports.values()), default=0)
    fresh: list[Rank] = []
    if gone and done <= start and all(s <= start for a in avail.values() for s in a):
        # a fresh start: lost before every rank's first snapshot was committed, so no rank has trained a
        # step (none can pass step 0's first collective before every rank's snapshot 0 is committed), and every
        # rank's state is still its initial one, which each rank without a copy of it rebuilds itself: its process
        # built the model as the user's function builds it (a spare too), and binds to its rank
        fresh = gone
        for r in fresh:
            avail[r] = {start}
        gone = []
    if gone:
        r = gone[0]
        raise ReplicaError(f"rank {r}: its node and every holder of its replica were lost together (failed nodes "
                           f"{failed_nodes}); no copy of its state survives"
                           + (f" (nor of ranks {gone[1:]})" if gone[1:] else ""))
    common = set.intersection(*avail.values())
    if not common:
        raise ReplicaError(f"no step whose state exists for every rank: {({r: sorted(a) for r, a in avail.items()})}")
    cut = max(common)
    sources: dict[Rank, ProcId] = {}
    for r in range(W):
        if cut in own_steps(new_assign[r], r) or r in fresh:
            continue
        ring = [assignment[h] for h in holders_of(r, P, N, min(replicas, N - 1))] if N > 1 and replicas else []
        have = held[r].get(cut, [])
        pick = next((m for m in ring if m in have), None)  # holder 0 is a valid pick: compare with None
        sources[r] = have[0] if pick is None else pick
    done = max(done, cut)
    return Decision(
        generation=generation,
        failed_nodes=tuple(failed_nodes),
        fenced=tuple(fenced),
        assignment=tuple(new_assign),
        promoted=promoted,
        replaced=replaced,
        sources=sources,
        fresh=tuple(fresh),
        exhausted=exhausted,
        reason=reason,
        spare_nodes=tuple(spares),
        members=tuple(members),
        cut_step=cut,
        recomputed_steps=max(0, done - cut),
        high_water=done,
        crash_loop=loop,
    )
