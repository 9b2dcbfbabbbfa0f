"""The replica plane's state in one process, shared by its roles: slots and who may write them.

Owns, under one lock: this process's own snapshot slots (``own``: shared with its training process) and who is
writing one of them (``own_write``: a training process's claim, its checksum under way, or a restore arriving; one
at a time); the restore this process expects (``expected``: replica/restore.py); the slots of the replicas it holds
for other training ranks (``held``) and which of them a push is being received into (``writing``); the
configuration (generation, this process's rank, its holders) and its *epoch* (raised by every ``configure``,
``quiesce`` and ``close``: a transfer begun in an older epoch never stamps a slot nor commits a step); the open
links, so that a quiesce or a close can cut them.

Does not own: the transfers themselves (replica/pusher.py pushes and commits, replica/holder.py receives,
replica/restore.py sends and receives restores), the payload's layout and checksum (replica/snapshot.py), the
assembly and the public interface (replica/replicator.py ``Replicator``).
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from ..errors import ReplicaError
from .snapshot import Slot, SlotPair, StateLayout
from .stream import Link


class Writer(enum.Enum):
    """Who is writing an own slot."""
    CLAIM = "a training process's claim"       # granted: the training process writes the slot
    STAMP = "the checksum of a written slot"   # written: this process checksums and stamps it
    RESTORE = "a restore"                      # a replica sent by a rank's source lands in it


@dataclass
class OwnWrite:
    """The one write of an own slot under way: by whom, into which slot, in which epoch."""
    who: Writer
    slot: Slot
    epoch: int


class ReplicaState:
    """One process's replica state (the module docstring). Every attribute is read and written under ``lock``;
    ``cv`` (on ``lock``) is notified when a claim ends, a step commits or a slot is freed.

    secret: the job's HMAC key; layout: the StateLayout; log: has ``emit(name, **fields)``; timeout: seconds without
    progress after which a transfer is abandoned; transport: replica/transports.py's; own: the own SlotPair.
    Hooks (tests and the agent): ``on_commit(generation, step)`` under the lock, must not block (replica/pusher.py);
    ``restore_send_hook(rank, step, sent, total)``, ``receive_hook(rank, step, received, total)`` after each piece."""

    def __init__(self, secret: bytes, layout: StateLayout, log, timeout: float, transport, own: SlotPair):
        self.secret, self.layout, self.log, self.timeout, self.transport = secret, layout, log, timeout, transport
        self.own = own
        self.on_commit = self.restore_send_hook = self.receive_hook = None
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.held: dict[int, SlotPair] = {}
        self.writing: dict[int, object] = {}      # held rank -> token of the push being received into it
        self.own_write: OwnWrite | None = None
        self.epoch = 0
        self.paused = True
        self.closed = False
        self.generation = 0
        self.my_rank: int | None = None
        self.holders: list[tuple[str, int]] = []
        self.links: set[Link] = set()             # pushes in either direction (a quiesce cuts them)
        self.other_links: set[Link] = set()       # restores sent and received (only a close cuts them)
        self.expected = None                      # the restore this process waits for (replica/restore.py Expected)
        self.address = None                       # this process's replica address (a restore it sends names it)

    def stop_for(self, epoch: int):
        """A link's ``stop``: why a transfer of ``epoch`` must end ("quiesced", "closed"), or None."""
        return lambda: ("quiesced" if self.epoch != epoch else None) or ("closed" if self.closed else None)

    def track(self, link: Link, links: set) -> None:
        with self.lock:
            links.add(link)

    def untrack(self, link: Link, links: set) -> None:
        with self.lock:
            links.discard(link)

    # ---- configuration ------------------------------------------------------------------------------
    def configure(self, generation: int, my_rank: int | None, holders: list[tuple], held_ranks: list[int]) -> None:
        """(under lock) A new epoch with this configuration: a claim of the previous one is released, own slots of
        another rank invalidated, held ranks no longer listed freed (once no transfer reads them), new ones
        allocated. Resumes pushes."""
        self.epoch += 1
        if self.own_write is not None and self.own_write.who is not Writer.RESTORE:
            self.own_write = None    # a training process's claim of the previous configuration
        self.generation = generation
        self.my_rank = my_rank
        for slot in self.own.slots:  # a snapshot of another rank's state is not this rank's
            if my_rank is not None and slot.rank != my_rank and not slot.readers:
                slot.invalidate()
        self.holders = holders
        for r in list(self.held):
            if r not in held_ranks:
                del self.held[r]
        for r in held_ranks:
            if r not in self.held:
                self.held[r] = SlotPair(self.layout.nbytes)
        self.paused = False
        self.cv.notify_all()

    def quiesce(self) -> list[Link]:
        """Pause pushes in a new epoch: a claim is released (its slot stays invalid), an expected restore dropped (a
        new round expects its own). Returns the links to cut."""
        with self.lock:
            self.paused = True
            self.expected = None
            self.epoch += 1
            if self.own_write is not None and self.own_write.who is not Writer.RESTORE:
                self.own_write = None
            self.cv.notify_all()
            return list(self.links)

    def close(self) -> list[Link]:
        """Closed, in a new epoch. Returns every link to cut."""
        with self.lock:
            self.closed = True
            self.epoch += 1
            self.cv.notify_all()
            return list(self.links | self.other_links)

    # ---- what is held ---------------------------------------------------------------------------------
    def held_pair(self, rank: int) -> SlotPair:
        """The slots holding replicas of training rank ``rank``. Raises ReplicaError if not held."""
        with self.lock:
            pair = self.held.get(rank)
            if pair is None:
                raise ReplicaError(f"this process holds no replica of rank {rank}; held ranks: {sorted(self.held)}")
            return pair

    def report(self) -> dict:
        """Verified copies only: {"own_rank": int|None, "own": [steps], "held": {"<rank>": [steps]}}."""
        with self.lock:
            return {"own_rank": self.my_rank, "own": self.own.steps(),
                    "held": {str(r): p.steps() for r, p in sorted(self.held.items())}}

    def copy_own(self, step: int) -> Slot | None:
        """A private copy (a new Slot, same step, CRC, rank and ``from_replica``) of this rank's own verified snapshot
        of ``step``, or None when the own slots no longer hold it. The slot is pinned (``readers``) while it is copied,
        so the training process's next snapshot cannot rewrite it meanwhile (agent/persister.py)."""
        with self.lock:
            slot = self.own.find(step)
            if slot is None or slot.rank != self.my_rank:
                return None
            slot.readers += 1
        try:
            out = Slot(self.layout.nbytes)
            out.buf[:] = slot.buf
            out.step, out.crc, out.rank, out.from_replica = slot.step, slot.crc, slot.rank, slot.from_replica
            return out
        finally:
            with self.lock:
                slot.readers -= 1
                self.cv.notify_all()

    # ---- who writes an own slot -------------------------------------------------------------------------
    def claim(self, step: int, generation: int | None = None) -> int | None:
        """A training process's claim of the own slot for ``step`` (invalidated); its index in ``own.slots``, or
        None if an own slot is busy right now (ask again) or ``generation`` is not the configured one (a stale
        claim: never granted)."""
        with self.lock:
            if generation is not None and generation != self.generation:
                return None
            if self.paused or self.own_write is not None or self.own.target(step).readers:
                return None
            slot = self.own.begin(step)
            slot.rank = self.my_rank
            self.own_write = OwnWrite(Writer.CLAIM, slot, self.epoch)
            return self.own.slots.index(slot)

    def take_claim(self, index: int) -> OwnWrite | None:
        """The training process says it wrote the claimed slot ``index``: the claim, now being checksummed
        (``Writer.STAMP``), or None (and any claim is released) when no claim of this epoch has that index."""
        with self.lock:
            w = self.own_write
            if w is None or w.who is not Writer.CLAIM:
                return None
            if self.own.slots.index(w.slot) != index or w.epoch != self.epoch:
                self.own_write = None
                return None
            w.who = Writer.STAMP
            return w

    def end_write(self, w: OwnWrite) -> bool:
        """(under lock) End the own write ``w`` (unless a quiesce or configure ended it already: a new one may hold
        the slots); whether its epoch is still the current one."""
        if self.own_write is w:
            self.own_write = None
            self.cv.notify_all()
        return w.epoch == self.epoch

    def claim_for_restore(self, step: int, give_up) -> OwnWrite | None:
        """Wait until no one writes an own slot and the one to write ``step`` into has no readers, then begin it
        for an arriving restore; None once ``give_up()`` is true."""
        with self.lock:
            while self.own_write is not None or self.own.target(step).readers:
                if give_up():
                    return None
                self.cv.wait(0.01)
            self.own_write = OwnWrite(Writer.RESTORE, self.own.begin(step), self.epoch)
            return self.own_write
