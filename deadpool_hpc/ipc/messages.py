"""What the agent channel's messages say, at both ends (``agent/`` answers, ``worker/`` asks), beyond the frames
(``ipc/frames.py``).

The channel's messages are typed values, each a frozen dataclass whose ``to_wire`` / ``from_wire`` (the JSON-safe
body of a channel frame; no pickle) ``ipc/schema.py`` derives from its type hints, registered by the way it goes
(``schema.TO_AGENT`` / ``schema.TO_WORKER``). The recovery path's:

- ``Failure`` (agent -> worker, kind ``failure``): a recovery round starts; leave the generation.
- ``Left`` (worker -> agent, ``left``): this process left ``generation`` having completed ``done_step``.
- ``RoundFailed`` (worker -> agent, ``round_failed``): joining or restoring the new generation failed.
- ``Role`` (agent -> worker, ``role``): what the process does next, one of ``Train`` (with ``Restore`` after a
  recovery: where the cut step's state is), ``Spare``, ``Exit`` (leave with ``code``: 75, requeue) or ``Finish``.
  ``Train`` and ``Spare`` carry the generation's ``View`` (its number, the active and spare nodes).

The agent sends them (agent/node.py at start-up, agent/recovery.py each round); the worker reads them
(worker/context.py ``run``; worker/recovery.py ``_recover``, ``_follow``, ``_rejoin``). A body that lacks a key or has
one of the wrong type raises ValueError naming it. The wire form is the one the dicts read with ``.get`` had, key for
key,
but for a spare's first role, which no longer carries a trainer's keys that nobody read (rank null, world_size,
high_water, resume).

The generation store: a training process's ``AgentStore`` (worker/client.py) sends ``STORE_REQUESTS`` with a
``generation``; its agent's ``GenerationStore`` of that generation (agent/store.py) answers ``StoreReply``. The
others: the admission (``Hello``, ``Welcome``, ``Refused``: agent/channel.py), the snapshot slots (``Layout``,
``Slots``), the start-up pre-flight (``MatmulAsk`` / ``MatmulFigure``, ``LinkAsk`` / ``LinkAnswer``:
agent/preflight.py, worker/preflight.py) and the end of a run (``Trained``: rank 0 finished; ``AbortAsk``: the user's
code failed), each described where it is defined. Fault injection's (``fault``, ``inject_spare``, ``nic_down``) are
faultinject/messages.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from ..ids import Generation, LocalRank, NodeId, Rank, Round
from .schema import FLAT, TO_AGENT, TO_WORKER, Message

STORE_KINDS = frozenset({"store_set", "store_get", "store_wait", "store_check"})   # STORE_REQUESTS' kinds
# the store the start-up's link check meets through (agent/preflight.py): served by every agent, spares included,
# under this generation number, which no generation of the job has (they count from 0)
LINK_GENERATION = -1


@dataclass(frozen=True)
class Failure(Message, plane=TO_WORKER, kind="failure"):
    """The agent starts a recovery round (its generation was ``generation``): leave it and say how far you got."""

    generation: Generation


@dataclass(frozen=True)
class Left(Message, plane=TO_AGENT, kind="left"):
    """A training process left ``generation`` (or, a spare, answers a round: ``done_step`` -1); ``done_step``: the
    steps it completed there, whose snapshot it settled (the cut may be there); ``why``: what ended it (<= 200)."""

    generation: Generation
    done_step: int
    why: str

    def to_wire(self) -> dict:
        return dict(super().to_wire(), why=self.why[:200])


@dataclass(frozen=True)
class RoundFailed(Message, plane=TO_AGENT, kind="round_failed"):
    """Joining or restoring generation ``generation`` failed in this process (``error``, <= 300 characters)."""

    generation: Generation
    error: str

    def to_wire(self) -> dict:
        return dict(super().to_wire(), error=self.error[:300])


@dataclass(frozen=True)
class View(Message):
    """The generation a role belongs to and its layout (fault targets, the summary): ``active_nodes`` (sorted),
    ``spare_nodes`` (live spares, in promotion order). On the wire with ``spares_left`` too (read by nobody)."""

    generation: Generation
    active_nodes: tuple[NodeId, ...]
    spare_nodes: tuple[NodeId, ...]

    @property
    def spares_left(self) -> int:
        return len(self.spare_nodes)

    def to_wire(self) -> dict:
        return dict(super().to_wire(), spares_left=self.spares_left)


@dataclass(frozen=True)
class Restore(Message):
    """Where a recovery's trainer finds the cut step's state, and what the round was (its ``recovered`` event).

    - cut_step: the step every rank restores; slot: the index of this process's own snapshot slot that holds it
      (its source pushed it there, or it is the process's own snapshot), -1 when ``fresh``; crc: its CRC-32C
      (0 when fresh), checked as it is read.
    - fresh: the state exists nowhere and nobody trained a step: the process takes its own initial state.
    - from_replica: the slot holds a replica the rank's source sent (no kept shares in it).
    - promoted: a spare takes the rank over.
    - is_source: this node sends some rank's restore in this round (the "restore" fault phase fires there).
    - recomputed_steps, failed_nodes (sorted), round (the agent's round count): from the decision, for the events.
    - t_fail, t_agreed: wall-clock times the agent's recovery began and its round agreed.
    """

    cut_step: int
    slot: int
    crc: int
    fresh: bool
    from_replica: bool
    promoted: bool
    is_source: bool
    recomputed_steps: int
    failed_nodes: tuple[NodeId, ...]
    round: Round
    t_fail: float
    t_agreed: float


@dataclass(frozen=True)
class Role(Message, plane=TO_WORKER, kind="role", tag="what"):
    """What a training process does next (kind ``role``): a ``Train``, ``Spare``, ``Exit`` or ``Finish``.
    ``Role.from_wire(body)`` gives the one ``body["what"]`` names."""


@dataclass(frozen=True)
class Train(Role, variant="train"):
    """Train as ``rank`` of ``world_size`` in ``view.generation``. ``restore`` None: the attempt's first generation
    (load ``resume``, a requeued attempt's checkpoint record, if any); else a recovery's plan. ``high_water``: the
    highest step any process completed (faults fire only past it). The view's and the plan's keys sit in the body
    itself."""

    view: Annotated[View, FLAT]
    rank: Rank
    world_size: int
    high_water: int
    resume: dict | None
    restore: Annotated[Restore | None, FLAT] = None


@dataclass(frozen=True)
class Spare(Role, variant="spare"):
    """Wait as a spare (in ``view.generation``) until a recovery promotes this process."""

    view: Annotated[View, FLAT]


@dataclass(frozen=True)
class Exit(Role, variant="exit"):
    """Leave with ``code`` (75: the checkpoint is saved, requeue me)."""

    code: int


@dataclass(frozen=True)
class Finish(Role, variant="finish"):
    """The run is complete: leave."""


# ---- the channel's admission (agent/channel.py, worker/client.py) ---------------------------------------------
@dataclass(frozen=True)
class Hello(Message, plane=TO_AGENT, kind="hello"):
    """A training process's first frame: it is ``local_rank`` of its node, process ``pid``."""

    local_rank: LocalRank
    pid: int


@dataclass(frozen=True)
class Welcome(Message, plane=TO_WORKER, kind="welcome"):
    """The agent admitted ``local_rank``; it is process ``agent_pid``. Sent with the progress page's fd (of
    ``page_bytes`` bytes)."""

    local_rank: LocalRank
    agent_pid: int
    page_bytes: int


@dataclass(frozen=True)
class Refused(Message, plane=TO_WORKER, kind="refused"):
    """The agent refused the connection: ``why``."""

    why: str


# ---- the generation store (worker/client.py AgentStore -> agent/store.py GenerationStore) -----------------------
@dataclass(frozen=True, kw_only=True)
class StoreRequest(Message):
    """A store request: ``id`` (its reply names it), the ``generation`` whose store it asks, ``timeout`` (seconds,
    > 0: a ``get`` / ``wait`` is answered ``timeout`` by then)."""

    id: int
    generation: Generation
    timeout: float = 60.0


@dataclass(frozen=True, kw_only=True)
class StoreSet(StoreRequest, plane=TO_AGENT, kind="store_set"):
    """Set ``key`` to ``value`` (bytes, base64)."""

    key: str
    value: str


@dataclass(frozen=True, kw_only=True)
class StoreGet(StoreRequest, plane=TO_AGENT, kind="store_get"):
    """The value of ``key``, once it is there."""

    key: str


@dataclass(frozen=True, kw_only=True)
class StoreWait(StoreRequest, plane=TO_AGENT, kind="store_wait"):
    """Answer once every one of ``keys`` is there."""

    keys: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class StoreCheck(StoreRequest, plane=TO_AGENT, kind="store_check"):
    """Whether every one of ``keys`` is there now."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class StoreReply(Message, plane=TO_WORKER, kind="store_reply"):
    """The answer to request ``id`` (None: a request without one): ``ok``, with ``value`` (a get's, base64; a
    check's, a boolean), or not, with ``code`` ("failed": the generation failed or was left; "timeout"; "bad": a
    malformed request or another generation's) and ``error``."""

    SPARSE = True
    id: int | None
    ok: bool
    code: str | None = None
    error: str | None = None
    value: str | bool | None = None


STORE_REQUESTS = {c.KIND: c for c in (StoreSet, StoreGet, StoreWait, StoreCheck)}


# ---- the snapshot slots (worker/client.py attach_slots -> agent/node.py) ----------------------------------------
@dataclass(frozen=True)
class Layout(Message, plane=TO_AGENT, kind="layout"):
    """A training process asks for ``count`` snapshot slots of ``nbytes`` bytes; what they hold: ``tensors``
    (``[dtype name, shape]`` each, in order), ``rng_nbytes`` of RNG state after them, and ``local_nbytes`` kept in
    the process only (replica/snapshot.py StateLayout)."""

    nbytes: int
    count: int = 2
    tensors: list = field(default_factory=list)
    rng_nbytes: int = 0
    local_nbytes: int = 0


@dataclass(frozen=True)
class Slots(Message, plane=TO_WORKER, kind="slots"):
    """The agent's answer to ``layout``: ``count`` shared buffers of ``nbytes`` bytes, and its doorbell when
    ``bell``, as fds sent with the frame (in that order)."""

    nbytes: int
    count: int
    bell: bool = False


# ---- the start-up pre-flight (agent/preflight.py <-> worker/preflight.py) ----------------------------------------
@dataclass(frozen=True)
class MatmulAsk(Message, plane=TO_WORKER, kind="preflight"):
    """Time the pre-flight matmul on your device; answer with ``id``."""

    id: int


@dataclass(frozen=True)
class MatmulFigure(Message, plane=TO_AGENT, kind="preflight"):
    """The answer to ask ``id``: the matmul took ``seconds`` on ``device``, or failed (``error``)."""

    id: int | None
    seconds: float | None
    error: str | None
    device: str = ""


@dataclass(frozen=True)
class LinkPair(Message):
    """One link to check: meet the process of ``peer`` (a node) under store ``key``, as ``rank`` 0 or 1 of the
    pair's group."""

    peer: NodeId
    rank: int
    key: str


@dataclass(frozen=True)
class LinkAsk(Message, plane=TO_WORKER, kind="link"):
    """Check ``pairs`` (each on a thread of its own), waiting ``wait_s`` seconds for a partner and ``timeout_s``
    for each later step; answer with ``id`` (an int, or a re-check's tag)."""

    id: int | str
    pairs: tuple[LinkPair, ...]
    wait_s: float = 5.0
    timeout_s: float = 5.0


@dataclass(frozen=True)
class LinkResult(Message):
    """One link's outcome: the partner came (``seen``; if not, nothing is judged by it); its all-reduces were right
    (``ok``), the median took ``seconds``, or ``error``; ``partner``: the failure is the partner's own device."""

    seen: bool
    ok: bool = False
    seconds: float | None = None
    error: str | None = None
    partner: bool = False


@dataclass(frozen=True)
class LinkAnswer(Message, plane=TO_AGENT, kind="link"):
    """The answer to link ask ``id``: each pair's result by peer node."""

    id: int | str | None
    pairs: dict[NodeId, LinkResult]


# ---- the end of a run, as training rank 0 / a training process says it ----------------------------------------------
@dataclass(frozen=True)
class Trained(Message, plane=TO_AGENT, kind="finished"):
    """(training rank 0 -> its agent) The run is complete after ``steps`` steps (None: not said); its agent ends
    the job (control/messages.py ``Finished``)."""

    steps: int | None = None


@dataclass(frozen=True)
class AbortAsk(Message, plane=TO_AGENT, kind="abort"):
    """(a training process -> its agent) The user's code raised ``error`` (its type and message, <= 2000
    characters): the whole job stops (control/messages.py ``Abort``, to every agent)."""

    error: str

    def to_wire(self) -> dict:
        return dict(super().to_wire(), error=self.error[:2000])
