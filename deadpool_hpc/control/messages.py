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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from ..ipc.schema import CONTROL, Codec, Message
from .decision import IdRuns

RoundId = tuple   # (coordinator's MPI rank, its round count), or ("auto", generation)


def _round_id(raw, label: str) -> tuple:
    if not (isinstance(raw, (list, tuple)) and len(raw) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in raw[1:])
            and (raw[0] == "auto" or isinstance(raw[0], int) and not isinstance(raw[0], bool))):
        raise ValueError(f"{label} is {raw!r}; expected [coordinator, round] or ['auto', generation] (ints)")
    return tuple(raw)


RoundIdWire = Annotated[RoundId, Codec(list, _round_id)]


@dataclass(frozen=True)
class Report(Message):
    own_rank: int | None = None
    own: tuple[int, ...] = ()
    held: dict[int, tuple[int, ...]] = field(default_factory=dict)
    done_step: int = -1
    start_step: int = 0


@dataclass(frozen=True)
class Ready(Message, plane=CONTROL, kind="ready"):
    round: RoundIdWire
    report: dict[int, Report]
    applied: int
    assignment: IdRuns
    spare_nodes: tuple[int, ...]

    @property
    def unasked(self) -> bool:
        """Sent as soon as its agent began to recover, before any coordinator asked."""
        return self.round[0] == "auto"


@dataclass(frozen=True)
class Collect(Message, plane=CONTROL, kind="collect"):
    round: RoundIdWire
    g: int


@dataclass(frozen=True)
class Sync(Message, plane=CONTROL, kind="sync"):
    tag: str


@dataclass(frozen=True)
class Finished(Message, plane=CONTROL, kind="finish"):
    steps: int | None = None


@dataclass(frozen=True)
class Abort(Message, plane=CONTROL, kind="abort"):
    error: str
    mpi_rank: int
