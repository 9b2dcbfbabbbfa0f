"""The recovery decision as a typed value, and its wire form.

Owns the shape of what a recovery round's coordinator sends to every member (``Decision``, or ``RoundFailure``
when ``agreement.decide`` raised) and the conversion to and from the JSON-safe dict that travels in a control
message (``to_wire`` / ``from_wire``; no pickle on the wire). Does not own how a decision is made
(agreement.py) nor how it is applied (plane.py, agent/recovery.py).

Ids, as in agreement.py: a *training rank* r in 0..world_size-1; a *virtual process* m = node * P + local
(the id the control plane works in); a *node* n = m // P, which is also the node agent's MPI rank. JSON has
only string object keys, so the maps keyed by an int are keyed by ``str(int)`` on the wire; ``from_wire``
turns them back, so nothing past this module sees a string key. The lists of ids travel as runs of consecutive
ids (``int_runs``): an assignment or a member list is O(N) ids but a few runs, and a decision for 8,192 ranks
written out id by id (80 KB) exceeded the control plane's 64 KiB message limit (ipc/wire.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from ..ids import Generation, NodeId, ProcId, Rank
from ..ipc.schema import CONTROL, Codec, Message, OneOf
from .crashloop import CrashLoop


# ids in one list on the wire: far above any job, low enough that a bad message cannot exhaust memory
MAX_IDS = 1 << 24


def int_runs(ids) -> list[list[int]]:
    """``ids`` (ints) as runs ``[[first, count], ...]`` of consecutive increasing ids, in order: [0, 1, 2, 7, 3]
    -> [[0, 3], [7, 1], [3, 1]]. ``from_int_runs`` is the inverse."""
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return out


def from_int_runs(runs, what: str = "a list of ids") -> tuple[int, ...]:
    """The ids of ``int_runs`` output. Raises ValueError naming ``what`` when ``runs`` is not a list of
    ``[first, count]`` pairs of ints with count >= 1 and at most MAX_IDS ids in all."""
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(runs, (list, tuple)) or not all(
            isinstance(r, (list, tuple)) and len(r) == 2 and is_int(r[0]) and is_int(r[1]) and r[1] >= 1
            for r in runs):
        raise ValueError(f"{what} on the wire is {str(runs)[:80]!r}; expected runs [[first, count >= 1], ...]")
    if sum(r[1] for r in runs) > MAX_IDS:
        raise ValueError(f"{what} on the wire has more than {MAX_IDS} ids")
    return tuple(i for first, count in runs for i in range(first, first + count))


IdRuns = Annotated[tuple[int, ...], Codec(int_runs, from_int_runs)]   # a list of ids, on the wire as runs
NodeRuns = Annotated[tuple[NodeId, ...], Codec(int_runs, from_int_runs)]   # the same, of nodes
ProcRuns = Annotated[tuple[ProcId, ...], Codec(int_runs, from_int_runs)]   # of virtual processes
RankRuns = Annotated[tuple[Rank, ...], Codec(int_runs, from_int_runs)]     # of training ranks


@dataclass(frozen=True)
class Decision(Message):
    """The plan for the next generation, made by one recovery round's coordinator and applied by every member.

    - generation: the generation this plan starts (one more than the newest applied one among the reports).
    - failed_nodes: nodes found failed this round (sorted).
    - fenced: virtual processes of the failed nodes (sorted); a process named here must stop (Fenced).
    - assignment: assignment[r] = the virtual process that holds training rank r in the new generation.
    - promoted: {training rank: virtual process of the spare node that takes it over}; empty unless a hot swap.
    - replaced: {lost node: spare node that takes its place}.
    - sources: {training rank: virtual process that sends that rank's state at ``cut_step``}, for every rank
      whose (new or old) process lacks it locally; the other ranks restore from their own snapshot.
    - fresh: training ranks (sorted) whose state exists nowhere, at a fresh start (nobody has trained a step yet:
      a node lost during start-up or step 0): ``cut_step`` is 0, and each of their processes takes its own initial
      state, the model as the user's function built it, bound to its rank; no source, no snapshot.
    - exhausted: True when the job cannot go on here (no spare left for a lost node, preempted, or a crash loop):
      the members save a persistent checkpoint at ``cut_step`` and leave, to be requeued (not after a crash loop).
    - reason: "hot swap", "spare lost", "rebuild" (nobody failed: a collective timed out or a round failed),
      "no spare node left", "preempted" or "crash loop".
    - crash_loop: the crash loop (crashloop.py CrashLoop) that stops the run, with reason "crash loop"; else None.
    - spare_nodes: live spare nodes left after this plan, in promotion order.
    - members: virtual processes of the new generation (trainers and spares; sorted).
    - cut_step: the step every rank restores (the newest step whose state exists for every rank).
    - recomputed_steps: steps already done by some rank that will be trained again (high_water - cut_step, >= 0).
    - high_water: the highest step any reporting process had completed.
    - coordinator: MPI rank (= node) of the agent that made the decision; None until it is sent.
    - t_decided: wall-clock time (Unix seconds) the coordinator sent it; None until then.
    - first_suspicion: wall-clock time (Unix seconds) of the coordinator's first suspicion that started this
      recovery, or None (a rebuild with nobody suspected).
    """

    generation: Generation
    failed_nodes: NodeRuns
    fenced: ProcRuns
    assignment: ProcRuns
    promoted: dict[Rank, ProcId]
    replaced: dict[NodeId, NodeId]
    sources: dict[Rank, ProcId]
    exhausted: bool
    reason: str
    spare_nodes: NodeRuns
    members: ProcRuns
    cut_step: int
    recomputed_steps: int
    high_water: int
    fresh: RankRuns = ()
    crash_loop: CrashLoop | None = None
    coordinator: NodeId | None = None
    t_decided: float | None = None
    first_suspicion: float | None = None

    @classmethod
    def from_wire(cls, d) -> "Decision":
        """The inverse of ``to_wire`` (ipc/schema.py). Raises ValueError naming the first missing or malformed key,
        or for a failed round's body (read one with ``decision_from_wire``)."""
        if isinstance(d, dict) and "error" in d:
            raise ValueError(f"a recovery decision on the wire is a failed round ({d['error']!r}); use "
                             f"decision_from_wire")
        return super().from_wire(d)


@dataclass(frozen=True)
class RoundFailure(Message):
    """A round whose ``agreement.decide`` raised: the coordinator sends this instead of a plan, and every member
    raises the same error (``exception()``).

    - generation: the generation the round was deciding.
    - error: the exception's class name (one of deadpool_hpc.errors, else RuntimeError is raised).
    - message: its message.
    - members: virtual processes the failure is sent to (every live process; sorted).
    - failed_nodes: nodes found failed this round (sorted).
    - fenced: always empty (nobody is fenced by a failed round); kept so a member reads it as it reads a plan.
    - coordinator, t_decided, first_suspicion: as in ``Decision``.
    """

    generation: Generation
    error: str
    message: str
    members: ProcRuns
    failed_nodes: NodeRuns
    fenced: ProcRuns = field(default=())
    coordinator: NodeId | None = None
    t_decided: float | None = None
    first_suspicion: float | None = None

    def exception(self) -> Exception:
        from .. import errors

        cls = getattr(errors, self.error, None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = RuntimeError
        return cls(self.message)


DECISION = OneOf(CONTROL, "decision", (Decision, RoundFailure), lambda d: RoundFailure if "error" in d else Decision)


def decision_from_wire(d: dict) -> Decision | RoundFailure:
    """A ``decision`` control message's body: a RoundFailure if it carries "error", else a Decision.
    Raises ValueError naming the first missing or malformed key."""
    return DECISION.from_wire(d)
