"""What the control plane's own messages say (``ControlPlane.pump`` and the recovery round, control/round.py), each a
schema message (ipc/schema.py) whose body its type hints give. The decision and the failed round are
control/decision.py's, the readmission control/membership.py's.

- ``Report``: one training process's part of a recovery report, what ``agreement.decide`` reads: the training rank
  it holds (``own_rank``, None for a spare) and the steps of its own verified snapshots (``own``), the replicas it
  holds by training rank (``held``, on the wire keyed by ``str(rank)``), the steps it completed (``done_step``, -1
  for none) and the step this attempt started from (``start_step``: 0, or a requeued attempt's checkpoint). A
  spare that holds nothing reports the defaults.
- ``Ready`` (kind ``ready``): an agent's recovery report to the coordinator: ``report`` by virtual process, the
  generation it applied last (``applied``) and its view of it (``assignment``, as runs of ids; ``spare_nodes``).
  ``round``: the round it answers, ``(coordinator, n)``, or ``("auto", generation)`` for one sent unasked.
- ``Collect`` (``collect``): the coordinator asks for the reports still missing in its round ``round`` (it is at
  generation ``g``).
- ``Sync`` (``sync``): this agent reached barrier ``tag``.
- ``Finished`` (``finish``): the run is over (``steps``: the steps trained, when known).
- ``Abort`` (``abort``): agent ``mpi_rank`` stops the job: ``error``.

Then the node agents' own exchanges (persist rounds, the rendezvous store's sets, stragglers, the start-up
pre-flight), each described where it is defined below; ``ControlPlane.on`` handlers of these kinds get them typed
(control/handlers.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from ..ids import Generation, NodeId, ProcId, Rank
from ..ipc.schema import CONTROL, Codec, Message
from .decision import ProcRuns

RoundId = tuple   # (coordinator's MPI rank: a NodeId, its round count: a Round), or ("auto", Generation)


def _round_id(raw, label: str) -> tuple:
    if not (isinstance(raw, (list, tuple)) and len(raw) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in raw[1:])
            and (raw[0] == "auto" or isinstance(raw[0], int) and not isinstance(raw[0], bool))):
        raise ValueError(f"{label} is {raw!r}; expected [coordinator, round] or ['auto', generation] (ints)")
    return tuple(raw)


RoundIdWire = Annotated[RoundId, Codec(list, _round_id)]


@dataclass(frozen=True)
class Report(Message):
    own_rank: Rank | None = None
    own: tuple[int, ...] = ()
    held: dict[Rank, tuple[int, ...]] = field(default_factory=dict)
    done_step: int = -1
    start_step: int = 0


@dataclass(frozen=True)
class Ready(Message, plane=CONTROL, kind="ready"):
    round: RoundIdWire
    report: dict[ProcId, Report]
    applied: Generation
    assignment: ProcRuns
    spare_nodes: tuple[NodeId, ...]

    @property
    def unasked(self) -> bool:
        """Sent as soon as its agent began to recover, before any coordinator asked."""
        return self.round[0] == "auto"


@dataclass(frozen=True)
class Collect(Message, plane=CONTROL, kind="collect"):
    round: RoundIdWire
    g: Generation


@dataclass(frozen=True)
class Sync(Message, plane=CONTROL, kind="sync"):
    tag: str


@dataclass(frozen=True)
class Finished(Message, plane=CONTROL, kind="finish"):
    steps: int | None = None


@dataclass(frozen=True)
class Abort(Message, plane=CONTROL, kind="abort"):
    error: str
    mpi_rank: NodeId


# ---- the node agents' own exchanges over the control plane (handlers registered with ControlPlane.on) -----------
@dataclass(frozen=True)
class Persist(Message, plane=CONTROL, kind="persist"):
    """(the persist scheduler -> every training node, agent/persister.py) Write the checkpoint of ``step`` of
    generation ``g``."""

    g: Generation
    step: int


@dataclass(frozen=True)
class Persisted(Message, plane=CONTROL, kind="persisted"):
    """(a training node -> the scheduler) Done with round ``step`` of generation ``g``: written (``ok``), or missed
    or failed."""

    g: Generation
    step: int
    ok: bool = True


@dataclass(frozen=True)
class Kv(Message, plane=CONTROL, kind="kv"):
    """(agent/rendezvous.py) A ``set`` of generation ``g``'s store: ``key`` to ``value`` (bytes, base64)."""

    g: Generation
    key: str
    value: str


@dataclass(frozen=True)
class StragglerSummary(Message, plane=CONTROL, kind="straggler_summary"):
    """(every training node -> the lowest live agent, agent/stragglers.py) ``node``'s seconds per step in
    ``generation``: its own work (``own_s``) and the wall step (``step_s``), for its training ``ranks``; ``site``:
    its health plugin's slowest site ``[factor, name]``, or None."""

    node: NodeId
    generation: Generation
    own_s: float
    step_s: float
    ranks: tuple[Rank, ...]
    site: list | None = None

    def __post_init__(self):
        s = self.site
        if s is not None and not (len(s) == 2 and isinstance(s[0], (int, float)) and not isinstance(s[0], bool)
                                  and isinstance(s[1], str)):
            raise ValueError(f"straggler_summary message: key 'site' is {s!r}; expected [factor, name] or null")


@dataclass(frozen=True)
class Straggler(Message, plane=CONTROL, kind="straggler"):
    """(the lowest live agent -> a straggler) Hand your work to a spare: ``reason``."""

    reason: str = "straggler"


@dataclass(frozen=True)
class PeerPreflight(Message, plane=CONTROL, kind="preflight", tag="phase"):
    """(agent/preflight.py, every agent -> every agent at start-up) ``built``: this agent's training processes
    are built; ``figure``: its pre-flight matmul took ``seconds``, and its links to peers (``links``: peer ->
    ok)."""


@dataclass(frozen=True)
class PreflightBuilt(PeerPreflight, variant="built"):
    pass


@dataclass(frozen=True)
class PreflightFigure(PeerPreflight, variant="figure"):
    seconds: float
    links: dict[NodeId, bool] = field(default_factory=dict)


# ---- a planned swap (agent/planned.py), a spare's link re-check (agent/sparecheck.py), a return (agent/comeback.py)
@dataclass(frozen=True)
class SwapAsk(Message, plane=CONTROL, kind="swap_ask"):
    """(a node that wants to leave -> the lowest live agent) May ``node``, at ``generation``, hand its work to a
    spare now?"""

    node: NodeId
    generation: Generation


@dataclass(frozen=True)
class SwapAnswer(Message, plane=CONTROL, kind="swap_answer"):
    """(the lowest live agent -> the asker) ``ok``: the lease is the asker's. Else ``busy``: node ``busy`` holds it
    (ask again later), or ``why`` not at all. ``busy`` and ``why`` are left out of the body when None."""

    SPARSE = True
    ok: bool
    busy: NodeId | None = None
    why: str | None = None


@dataclass(frozen=True)
class SpareLinkAsk(Message, plane=CONTROL, kind="link_ask"):
    """(an idle spare -> a training node) Let your training processes run the all-reduce of link re-check ``tag``
    over nodes ``a`` < ``b`` (the spare and the training node)."""

    tag: str
    a: NodeId
    b: NodeId


@dataclass(frozen=True)
class Rejoin(Message, plane=CONTROL, kind="rejoin"):
    """(a returning node's agent -> every agent) Readmit this node to the spare pool; it would be its ``returns``-th
    return."""

    returns: int


@dataclass(frozen=True)
class Over(Message, plane=CONTROL, kind="over"):
    """(the members -> every returning agent) The members left for a requeue with exit ``code``: leave too."""

    code: int = 75


# ---- the notices the control thread reads itself (control/peers.py): failures, fencing, preemption ---------------
@dataclass(frozen=True)
class Suspect(Message, plane=CONTROL, kind="suspect"):
    """(along a dissemination tree, control/topology.py) MPI ranks ``ranks`` failed: ``reason``; ``last_heard``: when
    the one that noticed it last heard of them (Unix seconds, or null). Sent by a node about itself
    (ControlPlane.declare_failed) it also says whether it lives on to return to the spare pool (``returning``) and
    how its training process ended (``work``: a control/crashloop.py WorkFailure's wire form, read apart so that a
    malformed one loses only itself). ``origin``: the MPI rank that started the notice, added by
    ``Peers.disseminate``. ``returning``, ``work`` and ``origin`` are left out of the body when None."""

    SPARSE = True
    ranks: tuple[NodeId, ...]
    reason: str
    last_heard: float | None
    returning: bool | None = None
    work: dict | None = None
    origin: NodeId | None = None


@dataclass(frozen=True)
class Teardown(Message, plane=CONTROL, kind="teardown"):
    """(along a dissemination tree) A member left generation ``g``: recover. ``origin``: as for ``Suspect``."""

    SPARSE = True
    g: Generation
    origin: NodeId | None = None


@dataclass(frozen=True)
class Fenced(Message, plane=CONTROL, kind="fenced"):
    """(a suspecting agent -> the suspect itself) You were declared failed (``reason``): stop."""

    reason: str = ""


@dataclass(frozen=True)
class Preempt(Message, plane=CONTROL, kind="preempt"):
    """(the agents that got the preemption signal -> every live agent) Save a checkpoint and leave. No fields."""
