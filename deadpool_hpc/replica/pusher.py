"""The sending side of the replica plane: a written own slot is checksummed, pushed to every holder, and committed.

Owns: checksumming and stamping the slot a training process wrote (``written``; a payload of more than
``INLINE_STAMP_BYTES`` on the wire by this object's *stamp* thread, so that the agent's desk, which serves every
local rank, is not held up by one rank's checksum); handing the stamped slot to one *push* thread per holder; the
push exchange on the sender's side; counting acks (a step is committed once every holder acked a verified copy of
it: ``committed``, ``ReplicaState.on_commit``). Does not own: the slots and who writes them (replica/slots.py), the
holder's side of a push (replica/holder.py), the socket mechanics (replica/stream.py).

A push thread keeps its connection between steps (a new connection and two new threads per step and holder cost
about as much CPU as moving 1.8 MB) and opens a new one when that one fails. A holder that refuses a
push says whether to retry (busy, not configured yet: every ``POLL_S`` until the transfer timeout); a refusal for
good (a wrong size, a bad checksum) is logged (``replica_rejected``) and the step is never committed: the training
process's wait before its update ends the step, as a failed peer would.
"""
from __future__ import annotations

import threading
import time
from collections import deque

from ..errors import WireError
from .headers import Ack, Go, Push
from .slots import OwnWrite, ReplicaState
from .snapshot import Slot
from .stream import KEEP_S, POLL_S, Link, LinkError, PeerGone, Stopped, fmt

INLINE_STAMP_BYTES = 1 << 20  # a written payload up to this many bytes on the wire is checksummed by the caller of
#                               ``written`` (the agent's desk), a larger one by the stamp thread


class Sender:
    """The sending side for one ReplicaState ``st``. Starts its stamp thread; ``close`` after ``st.close()``."""

    def __init__(self, st: ReplicaState):
        self.st = st
        self.committed = -1       # the newest step every holder acked (-1: none since the last ``reconfigure``)
        self.bytes_sent = 0       # payload bytes acked by holders
        self._pending: dict[int, set[str]] = {}   # step -> holders that have not acked it
        self._pushers: dict[tuple, _Pusher] = {}  # holder -> its push thread
        self._stamps: deque = deque()             # (OwnWrite, step) for the stamp thread
        self._stamp_cv = threading.Condition(st.lock)   # its own condition: a change wakes only whom it concerns
        self._thread = threading.Thread(target=self._stamp_loop, name="deadpool-replica-stamp", daemon=True)
        self._thread.start()

    def reconfigure(self) -> None:
        """(under the lock, after ``st.configure``) Retire the push threads of holders no longer listed; nothing is
        committed in the new configuration yet."""
        st = self.st
        for h in [h for h in self._pushers if h not in st.holders]:
            pusher = self._pushers.pop(h)
            pusher.retired = True
            pusher.cv.notify()
        self.committed = -1
        self._pending.clear()
        self._stamp_cv.notify_all()

    def quiesce(self) -> None:
        with self.st.lock:
            self._stamps.clear()

    def close(self) -> None:
        with self.st.lock:
            self._stamp_cv.notify_all()
            for pusher in self._pushers.values():
                pusher.cv.notify()
        self._thread.join(1.0)

    # ---- written -> stamped -> shipped ----------------------------------------------------------------
    def written(self, step: int, index: int) -> bool:
        """The training process finished writing ``step`` into the claimed own slot ``index``: checksum and stamp it
        (here, or on the stamp thread for a large payload) and push it to the holders. False for a claim a
        ``quiesce``/``configure`` dropped (its slot stays invalid)."""
        w = self.st.take_claim(index)
        if w is None:
            return False
        if self.st.layout.wire_nbytes > INLINE_STAMP_BYTES:
            with self.st.lock:
                self._stamps.append((w, step))
                self._stamp_cv.notify()
            return True
        self._stamp(w, step)
        return True

    def _stamp_loop(self) -> None:
        st = self.st
        while True:
            with st.lock:
                while not st.closed and (st.paused or not self._stamps):
                    self._stamp_cv.wait(1.0)
                if st.closed:
                    return
                w, step = self._stamps.popleft()
                if w.epoch != st.epoch:
                    continue   # quiesced meanwhile: the quiesce released the claim
            self._stamp(w, step)

    def _stamp(self, w: OwnWrite, step: int) -> None:
        st, done = self.st, False
        try:
            done = st.layout.stamp_written(w.slot, step, should_stop=lambda: st.epoch != w.epoch or st.closed)
        except Exception:  # noqa: BLE001 - (a slot unmapped under us) never committed: the rank's wait says so
            pass
        finally:
            with st.lock:
                if st.end_write(w) and done:
                    self._ship(w.slot, step, w.epoch)

    def _ship(self, slot: Slot, step: int, epoch: int) -> None:
        """(under the lock) ``slot`` holds ``step``, stamped: commit it (no holders) or queue it to every holder's
        push thread."""
        st = self.st
        if not st.holders:
            self._commit(step)
            return
        self._pending[step] = {fmt(h) for h in st.holders}
        slot.readers += len(st.holders)
        for h in st.holders:
            pusher = self._pushers.get(h)
            if pusher is None:
                pusher = self._pushers[h] = _Pusher(self, h)
            pusher.jobs.append((slot, step, epoch))
            pusher.cv.notify()

    def _commit(self, step: int) -> None:
        """(under the lock)"""
        self.committed = max(self.committed, step)
        if self.st.on_commit is not None:
            self.st.on_commit(self.st.generation, self.committed)
        self.st.cv.notify_all()

    # ---- one push ---------------------------------------------------------------------------------------
    def push(self, slot: Slot, step: int, holder, epoch: int, link: Link | None) -> Link | None:
        """Push ``step`` from ``slot`` to ``holder`` over ``link`` (kept from the previous push; None: connect).
        Returns the link to keep for the next push, or None (closed). Wire: ``push {generation, rank, step,
        nbytes, crc}`` -> ``go {ok, reason, retry}`` -> payload -> ``ack {rank, step, crc, ok, reason}``; an ack
        commits only the step, rank and CRC it names."""
        st = self.st
        peer = fmt(holder)
        rank = st.my_rank
        stop = st.stop_for(epoch)
        start = time.monotonic()
        ok = stop() is not None  # a job of an old epoch (quiesced before its turn) ends here; the link is kept
        try:
            if ok:
                return link
            while True:
                kept = link is not None
                if link is None:
                    link = Link.connect(holder, stop, idle=st.timeout, transport=st.transport)
                    st.track(link, st.links)
                link.stop, link.idle, link.last = stop, st.timeout, time.monotonic()
                try:
                    link.send_msg(Push(generation=st.generation, rank=rank, step=step,
                                       nbytes=st.layout.wire_nbytes, crc=slot.crc), st.secret)
                    go = link.recv_msg(st.secret)
                except PeerGone:
                    if not kept or stop():
                        raise
                    # the kept connection was closed while idle (a quiesce on either side, the holder's KEEP_S):
                    # nothing of this push has moved yet, so start again on a new one
                    self._drop(link)
                    link = None
                    continue
                if not isinstance(go, Go):
                    raise WireError(f"expected 'go', got {go.KIND!r}")
                if go.ok:
                    break
                reason = go.reason
                if not go.retry:
                    ok = True  # the exchange completed: the connection is still good
                    self._refused(step, peer, reason)
                    return link
                if time.monotonic() - start > st.timeout:  # busy or not configured for too long: transient
                    ok = True
                    self._refused(step, peer, f"still refused after {st.timeout:g} s: {reason}")
                    return link
                with st.lock:
                    st.cv.wait(POLL_S)
                    if stop():
                        raise Stopped(stop())
            link.send(st.layout.wire(slot))
            ack = link.recv_msg(st.secret)
            if not isinstance(ack, Ack) or (ack.rank, ack.step, ack.crc) != (rank, step, slot.crc):
                raise WireError(f"expected the ack of rank {rank} step {step} crc {slot.crc}, got {ack}")
            ok = True
            if not ack.ok:
                self._refused(step, peer, ack.reason)
                return link
            with st.lock:
                if st.epoch == epoch:
                    pending = self._pending.get(step, set())
                    pending.discard(peer)
                    self.bytes_sent += st.layout.wire_nbytes
                    if not pending:
                        self._commit(step)
                    st.cv.notify_all()
        except (LinkError, WireError, OSError) as exc:
            st.log.emit("replica_transfer_abandoned", kind="push", peer=peer, rank=rank, step=step,
                        done_bytes=getattr(exc, "done", None), nbytes=st.layout.wire_nbytes,
                        reason=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            if link is not None and not ok:
                self._drop(link)
                link = None
            with st.lock:
                slot.readers -= 1
                st.cv.notify_all()
        return link

    def _drop(self, link: Link) -> None:
        self.st.untrack(link, self.st.links)
        link.close()

    def _refused(self, step: int, peer: str, reason: str) -> None:
        self.st.log.emit("replica_rejected", role="sender", peer=peer, rank=self.st.my_rank, step=step,
                         reason=reason[:300])


class _Pusher:
    """The push thread of one holder: pushes the (slot, step, epoch) jobs handed to it in order, keeping its
    connection between pushes; ends once ``retired`` (the holder left the configuration) or closed, when no
    job is left (a job of an old epoch ends at once: its stop says "quiesced")."""

    def __init__(self, sender: Sender, holder: tuple):
        self.sender, self.holder = sender, holder
        self.jobs: deque = deque()
        self.retired = False
        self.cv = threading.Condition(sender.st.lock)   # notified with a job, when retired, at close
        threading.Thread(target=self._run, name="deadpool-replica-push", daemon=True).start()

    def _run(self) -> None:
        st, link = self.sender.st, None
        try:
            while True:
                with st.lock:
                    while not self.jobs and not (self.retired or st.closed):
                        self.cv.wait(KEEP_S)
                    if not self.jobs:
                        return
                    slot, step, epoch = self.jobs.popleft()
                link = self.sender.push(slot, step, self.holder, epoch, link)
        finally:
            if link is not None:
                self.sender._drop(link)
