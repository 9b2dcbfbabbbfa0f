"""What fault injection says across processes (inject.py), each a schema message (ipc/schema.py) whose body its type
hints give, key for key the dicts they replace.

- ``FireNode`` (a training process -> its agent, channel kind ``fault``): fire fault ``kind`` (kill, hang, slow,
  nic_down) on this whole node, at ``step`` or at recovery phase ``phase`` (``Fault.when``: ``rebuild``,
  ``restore#2``); ``factor``: a slow fault's (None otherwise). ``step`` and ``phase`` are left out of the body when
  None; ``factor`` is always there (null for none).
- ``InjectSpare`` (training rank 0 -> its agent, channel kind ``inject_spare``): spare node ``node`` is to fire
  ``fault`` on itself; its agent passes it on as
- ``Inject`` (agent -> agent, control-plane kind ``inject``): the same, to the spare's agent
  (``NodeFaults.on_message``).
  Both carry the fault's keys beside ``node``, in one object.
- ``NicDown`` (an agent -> its training processes, channel kind ``nic_down``): from now on every gloo group they
  build uses interface ``ifname`` (one that does not exist: a spare's data plane down from a step on).

The receivers read them typed; a malformed one is dropped and said (``bad_message``), never fired.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from ..ipc.schema import CONTROL, FLAT, TO_AGENT, TO_WORKER, Message


@dataclass(frozen=True)
class FireNode(Message, plane=TO_AGENT, kind="fault"):
    """Fire fault ``kind`` on the whole node of the sender (the module docstring)."""

    SPARSE = True
    kind: str
    target: str
    factor: float | None
    step: int | None = None
    phase: str | None = None


@dataclass(frozen=True)
class SpareFault(Message):
    """Spare node ``node`` is to fire ``fault`` on itself (``InjectSpare``, then ``Inject``)."""

    node: int
    fault: Annotated[FireNode, FLAT]


@dataclass(frozen=True)
class InjectSpare(SpareFault, plane=TO_AGENT, kind="inject_spare"):
    """(training rank 0 -> its agent) Have spare node ``node``'s agent fire ``fault``."""


@dataclass(frozen=True)
class Inject(SpareFault, plane=CONTROL, kind="inject"):
    """(an agent -> spare node ``node``'s agent) Fire ``fault`` on your node."""


@dataclass(frozen=True)
class NicDown(Message, plane=TO_WORKER, kind="nic_down"):
    """From now on, every gloo group this process builds uses interface ``ifname``."""

    ifname: str
