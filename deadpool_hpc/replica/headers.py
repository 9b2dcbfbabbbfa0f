"""What the replica stream's messages say (``stream.Link.send_msg`` / ``recv_msg``), beyond the framing: each a
schema message (ipc/schema.py), its body derived from its type hints.

- ``Push`` (pusher -> holder, kind ``push``): a snapshot of training ``rank`` at ``step`` (``generation``) follows,
  ``nbytes`` bytes whose CRC-32C is ``crc``.
- ``RestoreOffer`` (a rank's source -> the rank's new process, ``restore``): the copy of ``rank`` at ``step`` for
  ``generation`` follows (``ok``), ``nbytes`` / ``crc`` as for a push; or, ``ok`` false, why there is none
  (``reason``). ``source``: the sender's replica address (its transport's JSON form, e.g. ``[host, port]``; null before
  it serves).
- ``Go`` (receiver -> sender, ``go``): send the bytes (``ok``), or not and why (``reason``), and whether asking again
  later may succeed (``retry``).
- ``Ack`` (receiver -> sender, ``ack``): the bytes arrived and check out (``ok``), or why not. A push's names the
  push (``rank``, ``step``, ``crc``); a restore's does not (the keys are left out).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ipc.schema import REPLICA, Message


@dataclass(frozen=True)
class Push(Message, plane=REPLICA, kind="push"):
    generation: int
    rank: int
    step: int
    nbytes: int
    crc: int


@dataclass(frozen=True)
class RestoreOffer(Message, plane=REPLICA, kind="restore"):
    generation: int
    rank: int
    step: int
    ok: bool
    source: list | None
    reason: str
    nbytes: int
    crc: int


@dataclass(frozen=True)
class Go(Message, plane=REPLICA, kind="go"):
    ok: bool
    retry: bool
    reason: str


@dataclass(frozen=True)
class Ack(Message, plane=REPLICA, kind="ack"):
    SPARSE = True
    ok: bool
    reason: str
    rank: int | None = None
    step: int | None = None
    crc: int | None = None
