"""The recovery round, both sides: every agent's report and wait for a decision, the coordinator's collection and
decision, and the decision applied (``ControlPlane.recover`` calls ``recover``).

Agreement (DESIGN.md "Recovery"), one *round*: a process that leaves its generation without having heard of the
failure disseminates ``teardown``. Every live process sends its report (``ready``) unasked to the coordinator,
the lowest-ranked live process in its view, as soon as it starts to recover, and again to a new coordinator if
that one is suspected. The coordinator asks only the processes whose report is still missing ``collect_after``
seconds into its round (``collect``, with a fresh round id: the failure notice may not have reached them), and
waits for every ``ready`` (a live process that does not answer within ``ready_timeout`` seconds has a stuck
training thread: it is suspected). Once all live processes have reported and no suspicion arrived for
``settle`` seconds, it takes the newest view among the reports (the assignment of the highest applied
generation: some members may have applied a decision others never received), runs ``agreement.decide``, and
disseminates ``decision`` down a binomial tree over the live agents (each agent
passes it on before reading it: O(log N) hops, no agent sends more than log2 N copies). If the coordinator is
suspected meanwhile, the next lowest takes over with a new round. A forwarder that dies unnoticed cuts its
subtree off this decision; its death is a failure, and the next round's decision reaches them. A process
accepts a decision newer than its generation from an unsuspected coordinator; if its waiting exceeds
``recovery_timeout`` it gives up with RecoveryTimeout (a clear exit, never a hang).

The round's state lives on the ControlPlane ``cp`` each function is handed (its inbox tables, which ``pump`` fills:
``_collects``, ``_ready``, ``_auto``, ``_decisions``; its round counter; the view it applies).
"""
from __future__ import annotations

import dataclasses
import time

from ..errors import Fenced, RecoveryTimeout, RunFinished
from ..ids import NodeId, ProcId
from ..process import fence as fencing
from .agreement import decide
from .decision import Decision, RoundFailure
from .membership import apply_pending, spares_of
from .messages import Collect, Ready, Report, RoundId, Teardown


def recover(cp, report: dict[ProcId, Report], on_phase=None, wait=None, stop=None) -> Decision | None:
    """The agreement round behind ``ControlPlane.recover`` (control/plane.py): its docstring says what this takes,
    returns and raises; one copy of it, there."""
    on_phase = on_phase or (lambda _name: None)
    wait = wait or cp.pump
    stop = stop or (lambda: False)
    cp.peers.failure.set()
    if cp.peers.notice_g < cp.generation:  # nobody told us: we are the first to leave this generation
        cp.peers.disseminate(Teardown.KIND, Teardown(cp.generation).to_wire())
    end = time.monotonic() + cp.recovery_timeout
    answered: dict[NodeId, RoundId] = {}
    my_round = None
    told = False
    auto_to = None
    while True:
        cp.pump(0)
        if cp._finish is not None:
            raise RunFinished("the run finished while this process was recovering")
        decision = _take_decision(cp)
        if decision is not None:
            break
        alive = _coordinator_candidates(cp)
        if alive[0] == cp.me:
            if my_round is None:
                my_round = _start_round(cp, alive)
                if not told:
                    told = True
                    on_phase("agree")
            decision = _coordinate(cp, my_round, alive, report)
            if decision is not None:
                break
        else:
            my_round = None
            if auto_to != alive[0]:   # report at once to the coordinator-to-be: no collect round trip
                auto_to = alive[0]
                cp.peers.send(auto_to, Ready.KIND, _ready(cp, ("auto", cp.generation), report).to_wire())
                if not told:
                    told = True
                    on_phase("agree")
            for src, (rid, _g) in list(cp._collects.items()):
                if src in alive and answered.get(src) != rid:
                    cp.peers.send(src, Ready.KIND, _ready(cp, rid, report).to_wire())
                    answered[src] = rid
                    if not told:
                        told = True
                        on_phase("agree")
        if time.monotonic() > end:
            raise RecoveryTimeout(f"no decision for a generation after {cp.generation} within "
                                  f"{cp.recovery_timeout:.0f} s (coordinator: MPI rank {alive[0]})")
        # a coordinator re-checks its round at least every ``settle`` seconds; the others wait for a message
        wait(cp.settle if alive[0] == cp.me else cp.poll_s)
        if stop():   # the caller's own failure, seen while it waited: it acts on it, not this round
            return None
    if isinstance(decision, RoundFailure):
        raise decision.exception()
    if set(cp.procs()) & set(decision.fenced):
        raise Fenced(f"the decision for generation {decision.generation} (coordinator MPI rank "
                     f"{decision.coordinator}) declares this process failed")
    on_phase("decided")
    apply_decision(cp, decision)
    return decision


def _coordinator_candidates(cp) -> list[NodeId]:
    """Live agents, in order: the first coordinates. (A node whose training process failed declares itself
    failed and leaves, so a coordinator is never on a node the decision fences.)"""
    return cp.peers.alive()


def _ready(cp, rid: RoundId, report: dict[ProcId, Report]) -> Ready:
    return Ready(round=tuple(rid), report=report, applied=cp.generation, assignment=tuple(cp.assignment),
                 spare_nodes=tuple(cp.spare_nodes))   # the assignment travels as runs of ids: O(N) ids, a few runs


def _start_round(cp, alive: list[NodeId]) -> RoundId:
    """A new round with this agent as coordinator. The reports come unasked (``recover``); ``_coordinate``
    asks the agents still missing ``collect_after`` seconds from now."""
    cp._round += 1
    rid = (cp.me, cp._round)
    cp._round_t0 = time.monotonic()
    cp._collected = False
    return rid


def _take_decision(cp) -> Decision | RoundFailure | None:
    """The newest decision for a generation after ours, from an unsuspected coordinator, naming us."""
    best = None
    for g, (src, d) in cp._decisions.items():
        mine = set(cp.procs())
        named = mine & set(d.members) or mine & set(d.fenced)
        if g > cp.generation and not cp.peers.is_suspected(src) and named:
            if best is None or g > best.generation:
                best = d
    return best


def _coordinate(cp, rid: RoundId, alive: list[NodeId],
                report: dict[ProcId, Report]) -> Decision | RoundFailure | None:
    ready = cp._ready.setdefault(rid, {})
    if cp.me not in ready:
        ready[cp.me] = _ready(cp, rid, report)
    if cp._auto:
        for src, body in cp._auto.items():
            old = ready.get(src)
            if old is None or body.applied > old.applied:   # a newer report replaces an older one
                ready[src] = body
        cp._auto.clear()
    now = time.monotonic()
    if not cp._collected and len(ready) < len(alive) and now - cp._round_t0 >= cp.collect_after:
        cp._collected = True
        cp.peers.send_many([p for p in alive if p not in ready], Collect.KIND,
                           Collect(round=rid, g=cp.generation).to_wire())
    if len(ready) < len(alive) and now - cp._round_t0 <= cp.ready_timeout:
        return None  # someone is missing for sure: the O(N) look below waits for the last report
    missing = [p for p in alive if p not in ready]
    if missing:
        if now - cp._round_t0 > cp.ready_timeout:
            for p in missing:
                cp.peers.suspect(p, f"no recovery report within {cp.ready_timeout:.1f} s while its heartbeats "
                                    f"go on: its training thread is stuck")
        return None
    if now - cp.peers.last_suspicion < cp.settle:
        return None
    view = max((ready[n] for n in alive), key=lambda b: b.applied)
    g = view.applied + 1
    P = cp.P
    assignment = list(view.assignment)
    # a spare readmitted (control/membership.py) after some reports' view was taken is a spare all the same
    spare_nodes = spares_of(view.spare_nodes, alive, assignment, P)
    in_job = set(assignment) | {n * P + i for n in spare_nodes for i in range(P)}
    failed = {m for n in range(cp.size) if cp.peers.is_suspected(n) for m in cp.procs(n) if m in in_job}
    reports = {m: rep for n in alive for m, rep in ready[n].report.items()}
    try:
        decision = decide(generation=g, ranks_per_node=P, assignment=assignment,
                          spare_nodes=spare_nodes, failed=failed, reports=reports,
                          preempt=cp.peers.preempted.is_set(), replicas=cp.replicas,
                          work_failures=tuple(cp.work_failures), crash_loop_limit=cp.crash_loop_limit)
    except Exception as exc:  # tell everybody, then raise the same error everywhere
        decision = RoundFailure(generation=g, error=type(exc).__name__, message=str(exc),
                                members=tuple(sorted(m for n in alive for m in cp.procs(n))),
                                failed_nodes=tuple(sorted({m // P for m in failed})))
    decision = dataclasses.replace(decision, coordinator=cp.me, t_decided=time.time(),
                                   first_suspicion=cp.first_suspicion)
    wire = decision.to_wire()
    cp.peers.disseminate("decision", wire)   # down a tree over the live agents: O(log N) hops
    cp._ready.pop(rid, None)
    cp.log.emit("decision", **{k: wire.get(k) if k not in ("failed_nodes", "fresh") else list(getattr(decision, k, ()))
                               for k in ("generation", "failed_nodes", "promoted", "replaced", "sources", "fresh",
                                         "cut_step", "exhausted", "reason", "recomputed_steps",
                                         "t_decided", "first_suspicion", "error", "message", "crash_loop")})
    return decision


def apply_decision(cp, decision: Decision) -> None:
    """Make ``decision`` this agent's generation: its layout, the fenced nodes suspected (and killed by pid unless
    returning), its coordinator, the readmissions kept for it, the failure flag cleared (raised again if a member
    is suspected already), and the round tables emptied of what belongs to rounds now over."""
    g = decision.generation
    # first: fencing the failed below is no loss of a member
    cp.adopt(cp.membership.replace(assignment=decision.assignment, spare_nodes=decision.spare_nodes,
                                   members=decision.members))
    if decision.exhausted:   # no spare left: the checkpoint round must not lose a slow member's copies
        cp.peers.last_resort = True
    for n in sorted({m // cp.P for m in decision.fenced}):
        cp.peers.suspect(n, "fenced by decision", notify=False)
        if n not in cp.peers.returning:   # a returning agent ended its processes itself, and lives on
            fencing.fence(cp.idents[n])
    cp.adopt(cp.membership.replace(generation=g, coordinator=decision.coordinator))
    cp.first_suspicion = None
    apply_pending(cp)   # nodes readmitted to this generation before its decision reached us
    cp.peers.failure.clear()
    # a suspicion raised after the decision belongs to the next round (a preemption waits for the next
    # step boundary: Context._one_step)
    if any(cp.peers.is_suspected(n) for n in cp.member_nodes):
        cp.peers.failure.set()
    cp._decisions = {k: v for k, v in cp._decisions.items() if k > g}
    # a report sent unasked before this decision belongs to a round now over
    cp._auto = {src: b for src, b in cp._auto.items() if b.applied >= g}
    # a collect sent from generation g already asks for the next round: keep it
    cp._collects = {src: c for src, c in cp._collects.items() if c[1] >= g}
