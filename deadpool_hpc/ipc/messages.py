"""What the agent channel's messages say, at both ends (``agent/`` answers, ``worker/`` asks), beyond the frames
(``ipc/frames.py``).

The recovery path's messages are typed values, each a frozen dataclass with ``to_wire`` / ``from_wire`` (the
JSON-safe body of a channel frame; no pickle), as ``control/decision.py`` is for the control plane's decision:

- ``Failure`` (agent -> worker, kind ``failure``): a recovery round starts; leave the generation.
- ``Left`` (worker -> agent, ``left``): this process left ``generation`` having completed ``done_step``.
- ``RoundFailed`` (worker -> agent, ``round_failed``): joining or restoring the new generation failed.
- ``Role`` (agent -> worker, ``role``): what the process does next, one of ``Train`` (with ``Restore`` after a
  recovery: where the cut step's state is), ``Spare``, ``Exit`` (leave with ``code``: 75, requeue) or ``Finish``.
  ``Train`` and ``Spare`` carry the generation's ``View`` (its number, the active and spare nodes).

The agent sends them (agent/node.py at start-up, agent/recovery.py each round); the worker reads them
(worker/context.py ``run``; worker/recovery.py ``_recover``, ``_follow``, ``_rejoin``). A body that lacks a key or has one of the
wrong type raises ValueError naming it. The wire form is the one the dicts read with ``.get`` had, key for key,
but for a spare's first role, which no longer carries a trainer's keys that nobody read (rank null, world_size,
high_water, resume).

The generation store: a training process's ``AgentStore`` (worker/client.py) sends ``STORE_KINDS`` requests with
a ``generation``; its agent's ``GenerationStore`` of that generation (agent/store.py) answers ``store_reply``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

STORE_KINDS = frozenset({"store_set", "store_get", "store_wait", "store_check"})
# the store the start-up's link check meets through (agent/preflight.py): served by every agent, spares included,
# under this generation number, which no generation of the job has (they count from 0)
LINK_GENERATION = -1


def _get(body: dict, key: str, what: str, types: tuple, kind: str):
    if not isinstance(body, dict) or key not in body:
        raise ValueError(f"{what} message lacks key {key!r}")
    v = body[key]
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise ValueError(f"{what} message: key {key!r} is {v!r}; expected {kind}")
    return v


def _int(body, key, what) -> int:
    return _get(body, key, what, (int,), "an int")


def _ints(body, key, what) -> tuple[int, ...]:
    v = _get(body, key, what, (list, tuple), "a list of ints")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise ValueError(f"{what} message: key {key!r} is {v!r}; expected a list of ints")
    return tuple(v)


def _number(body, key, what) -> float:
    return float(_get(body, key, what, (int, float), "a number"))


def _flag(body, key, what) -> bool:
    return _get(body, key, what, (bool,), "a boolean")


@dataclass(frozen=True)
class Failure:
    """The agent starts a recovery round (its generation was ``generation``): leave it and say how far you got."""

    KIND: ClassVar[str] = "failure"
    generation: int

    def to_wire(self) -> dict:
        return {"generation": self.generation}

    @classmethod
    def from_wire(cls, body: dict) -> "Failure":
        return cls(_int(body, "generation", cls.KIND))


@dataclass(frozen=True)
class Left:
    """A training process left ``generation`` (or, a spare, answers a round: ``done_step`` -1); ``done_step``: the
    steps it completed there, whose snapshot it settled (the cut may be there); ``why``: what ended it (<= 200)."""

    KIND: ClassVar[str] = "left"
    generation: int
    done_step: int
    why: str

    def to_wire(self) -> dict:
        return {"generation": self.generation, "done_step": self.done_step, "why": self.why[:200]}

    @classmethod
    def from_wire(cls, body: dict) -> "Left":
        return cls(_int(body, "generation", cls.KIND), _int(body, "done_step", cls.KIND),
                   _get(body, "why", cls.KIND, (str,), "a string"))


@dataclass(frozen=True)
class RoundFailed:
    """Joining or restoring generation ``generation`` failed in this process (``error``, <= 300 characters)."""

    KIND: ClassVar[str] = "round_failed"
    generation: int
    error: str

    def to_wire(self) -> dict:
        return {"generation": self.generation, "error": self.error[:300]}

    @classmethod
    def from_wire(cls, body: dict) -> "RoundFailed":
        return cls(_int(body, "generation", cls.KIND), _get(body, "error", cls.KIND, (str,), "a string"))


@dataclass(frozen=True)
class View:
    """The generation a role belongs to and its layout (fault targets, the summary): ``active_nodes`` (sorted),
    ``spare_nodes`` (live spares, in promotion order)."""

    generation: int
    active_nodes: tuple[int, ...]
    spare_nodes: tuple[int, ...]

    @property
    def spares_left(self) -> int:
        return len(self.spare_nodes)

    def to_wire(self) -> dict:
        return {"active_nodes": list(self.active_nodes), "spare_nodes": list(self.spare_nodes),
                "spares_left": self.spares_left, "generation": self.generation}

    @classmethod
    def from_wire(cls, body: dict) -> "View":
        return cls(_int(body, "generation", "role"), _ints(body, "active_nodes", "role"),
                   _ints(body, "spare_nodes", "role"))


@dataclass(frozen=True)
class Restore:
    """Where a recovery's trainer finds the cut step's state, and what the round was (its ``recovered`` event).

    - cut_step: the step every rank restores; slot: the index of this process's own snapshot slot that holds it
      (the agent pulled it there, or it is the process's own snapshot), -1 when ``fresh``; crc: its CRC-32C
      (0 when fresh), checked as it is read.
    - fresh: the state exists nowhere and nobody trained a step: the process takes its own initial state.
    - pulled: the slot was sent by the rank's source (no kept shares in it); promoted: a spare takes the rank over.
    - serving: this node serves a replica to a puller in this round (the "restore" fault phase fires there).
    - recomputed_steps, failed_nodes (sorted), round (the agent's round count): from the decision, for the events.
    - t_fail, t_agreed: wall-clock times the agent's recovery began and its round agreed.
    """

    cut_step: int
    slot: int
    crc: int
    fresh: bool
    pulled: bool
    promoted: bool
    serving: bool
    recomputed_steps: int
    failed_nodes: tuple[int, ...]
    round: int
    t_fail: float
    t_agreed: float

    def to_wire(self) -> dict:
        return {"cut_step": self.cut_step, "slot": self.slot, "crc": self.crc, "fresh": self.fresh,
                "pulled": self.pulled, "promoted": self.promoted, "serving": self.serving,
                "recomputed_steps": self.recomputed_steps, "failed_nodes": list(self.failed_nodes),
                "round": self.round, "t_fail": self.t_fail, "t_agreed": self.t_agreed}

    @classmethod
    def from_wire(cls, body: dict) -> "Restore":
        w = "role"
        return cls(_int(body, "cut_step", w), _int(body, "slot", w), _int(body, "crc", w), _flag(body, "fresh", w),
                   _flag(body, "pulled", w), _flag(body, "promoted", w), _flag(body, "serving", w),
                   _int(body, "recomputed_steps", w), _ints(body, "failed_nodes", w), _int(body, "round", w),
                   _number(body, "t_fail", w), _number(body, "t_agreed", w))


class Role:
    """What a training process does next (kind ``role``): a ``Train``, ``Spare``, ``Exit`` or ``Finish``.
    ``Role.from_wire(body)`` gives the one ``body["what"]`` names."""

    KIND: ClassVar[str] = "role"
    WHAT: ClassVar[str] = ""

    def to_wire(self) -> dict:
        raise NotImplementedError

    @staticmethod
    def from_wire(body: dict) -> "Role":
        what = _get(body, "what", "role", (str,), "a string")
        kinds = {k.WHAT: k for k in (Train, Spare, Exit, Finish)}
        if what not in kinds:
            raise ValueError(f"role message: 'what' is {what!r}; expected one of {sorted(kinds)}")
        return kinds[what]._from_wire(body)


@dataclass(frozen=True)
class Train(Role):
    """Train as ``rank`` of ``world_size`` in ``view.generation``. ``restore`` None: the attempt's first generation
    (load ``resume``, a requeued attempt's checkpoint record, if any); else a recovery's plan. ``high_water``: the
    highest step any process completed (faults fire only past it)."""

    WHAT: ClassVar[str] = "train"
    view: View
    rank: int
    world_size: int
    high_water: int
    resume: dict | None
    restore: Restore | None = None

    def to_wire(self) -> dict:
        return {**self.view.to_wire(), "what": self.WHAT, "rank": self.rank, "world_size": self.world_size,
                "high_water": self.high_water, "resume": self.resume,
                **(self.restore.to_wire() if self.restore is not None else {})}

    @classmethod
    def _from_wire(cls, body: dict) -> "Train":
        resume = _get(body, "resume", "role", (dict, type(None)), "an object or null")
        return cls(View.from_wire(body), _int(body, "rank", "role"), _int(body, "world_size", "role"),
                   _int(body, "high_water", "role"), resume, Restore.from_wire(body) if "cut_step" in body else None)


@dataclass(frozen=True)
class Spare(Role):
    """Wait as a spare (in ``view.generation``) until a recovery promotes this process."""

    WHAT: ClassVar[str] = "spare"
    view: View

    def to_wire(self) -> dict:
        return {**self.view.to_wire(), "what": self.WHAT}

    @classmethod
    def _from_wire(cls, body: dict) -> "Spare":
        return cls(View.from_wire(body))


@dataclass(frozen=True)
class Exit(Role):
    """Leave with ``code`` (75: the checkpoint is saved, requeue me)."""

    WHAT: ClassVar[str] = "exit"
    code: int

    def to_wire(self) -> dict:
        return {"what": self.WHAT, "code": self.code}

    @classmethod
    def _from_wire(cls, body: dict) -> "Exit":
        return cls(_int(body, "code", "role"))


@dataclass(frozen=True)
class Finish(Role):
    """The run is complete: leave."""

    WHAT: ClassVar[str] = "finish"

    def to_wire(self) -> dict:
        return {"what": self.WHAT}

    @classmethod
    def _from_wire(cls, body: dict) -> "Finish":
        return cls()
