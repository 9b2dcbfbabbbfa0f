"""The receiving side of the replica plane: the server thread, and the pushes a holder receives.

Owns: accepting connections on the replica address (*accept* thread; at most ``MAX_CONNECTIONS`` at once, each
must send its first message within ``HELLO_S``), one handler thread per connection, which receives pushes (one
after another, for as long as the pusher keeps the connection) or receives one restore (replica/restore.py
``receive``); the holder's side of a push. Does not own: the slots (replica/slots.py), the sender's side
(replica/pusher.py).

A push is checked before its payload moves: the signature first (replica/stream.py), then the header. A holder
refuses a rank it does not hold (``configure``), a wrong size, a quiesced state, or a rank already being written
(``retry``: the pusher tries again), and a push of an older generation than its own (a process left behind must not
evict a copy the live rank committed since); otherwise it is accepted by rank alone (a replica of step s is a
replica of step s). The payload goes straight into the held slot that does not hold the newest verified copy
(invalidated first), is checksummed as it arrives, and only then is the slot stamped and the push acked. A push
begun before a ``quiesce``/``configure`` (an epoch) never stamps a held slot.
"""
from __future__ import annotations

import threading
import time

from ..errors import WireError
from .headers import Ack, Go, Push, RestoreOffer
from .restore import receive
from .slots import ReplicaState
from .snapshot import RunningCrc
from .stream import KEEP_S, POLL_S, Link, LinkError, PeerGone, Stalled

MAX_CONNECTIONS = 64      # concurrent incoming connections; more are closed at once
HELLO_S = 10.0            # an incoming connection must send its first message within this


class Holder:
    """The server side for one ReplicaState ``st`` listening on ``listener`` (a bound, listening socket of
    ``st.transport``). Starts its accept thread; ``close`` after ``st.close()`` (and after closing the listener)."""

    def __init__(self, st: ReplicaState, listener):
        self.st = st
        self.listener = listener
        self.listener.settimeout(POLL_S)
        self.address = st.transport.address(listener)
        self.handlers = 0   # connections being handled
        self._thread = threading.Thread(target=self._accept_loop, name="deadpool-replica-accept", daemon=True)
        self._thread.start()

    def close(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _accept_loop(self) -> None:
        st = self.st
        while not st.closed:
            try:
                sock, addr = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if st.closed:
                    return
                time.sleep(POLL_S)
                continue
            with st.lock:
                full = self.handlers >= MAX_CONNECTIONS
                if not full:
                    self.handlers += 1
            if full:
                sock.close()
                continue
            threading.Thread(target=self._handle, args=(sock, addr), daemon=True, name="deadpool-replica-serve").start()

    def _handle(self, sock, addr) -> None:
        st = self.st
        closed = lambda: "closed" if st.closed else None  # noqa: E731
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else f"{st.transport.peer(self.address)} (incoming)"
        link = Link(sock, peer, closed, deadline=time.monotonic() + min(HELLO_S, st.timeout))
        st.track(link, st.other_links)
        try:
            first = True
            while True:
                try:
                    msg = link.recv_msg(st.secret)
                except WireError as exc:
                    st.log.emit("replica_rejected", role="receiver", peer=link.peer, reason=str(exc)[:300])
                    return
                except (PeerGone, Stalled) as exc:
                    if first or exc.done:
                        raise
                    return  # the pusher closed its kept connection between two pushes, or left it idle KEEP_S
                link.deadline = None
                link.idle = st.timeout
                if isinstance(msg, Push):
                    if not self._receive(link, msg):
                        return
                elif isinstance(msg, RestoreOffer):
                    return receive(st, link, msg)
                else:
                    st.log.emit("replica_rejected", role="receiver", peer=link.peer,
                                reason=f"unexpected message {msg.KIND!r}")
                    return
                first = False
                link.stop, link.idle, link.last = closed, KEEP_S, time.monotonic()
        except (LinkError, WireError, OSError) as exc:
            if not st.closed:
                st.log.emit("replica_transfer_abandoned", kind="incoming", peer=link.peer,
                            done_bytes=getattr(exc, "done", None), reason=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            st.untrack(link, st.other_links)
            st.untrack(link, st.links)
            link.close()
            with st.lock:
                self.handlers -= 1

    def _receive(self, link: Link, hdr: Push) -> bool:
        """One push on ``link``; True when the exchange completed (the link can carry the next push)."""
        st = self.st
        rank, step, nbytes, crc, generation = hdr.rank, hdr.step, hdr.nbytes, hdr.crc, hdr.generation
        slot = pair = None
        retry = False
        token = object()
        with st.lock:
            epoch = st.epoch
            if generation < st.generation and not st.paused:
                reason = f"push of generation {generation}; this holder is at generation {st.generation}"
            elif nbytes != st.layout.wire_nbytes:
                reason = f"payload of {nbytes} bytes, expected {st.layout.wire_nbytes}"
            elif st.paused:
                reason, retry = "not accepting pushes (quiesced, not yet configured)", True
            elif rank not in st.held:
                reason, retry = f"rank {rank} is not held here (held ranks: {sorted(st.held)})", True
            elif rank in st.writing or st.held[rank].target(step).readers:
                reason, retry = f"rank {rank}'s slot is busy (another push, or a restore being sent)", True
            else:
                reason = None
                pair = st.held[rank]
                slot = pair.begin(step)
                slot.rank = rank
                st.writing[rank] = token
        if reason is not None:
            if not retry:  # a retryable refusal (busy, not configured yet) is the pusher's to report if it gives up
                st.log.emit("replica_rejected", role="holder", peer=link.peer, rank=rank, step=step,
                            reason=reason[:300])
            link.send_msg(Go(ok=False, retry=retry, reason=reason), st.secret)
            return True
        try:
            link.stop = st.stop_for(epoch)
            st.track(link, st.links)
            link.send_msg(Go(ok=True, retry=False, reason=""), st.secret)
            wire = st.layout.wire(slot)
            got = RunningCrc(wire)
            hook = st.receive_hook
            on_recv = got.update if hook is None else (lambda n: (got.update(n), hook(rank, step, n, nbytes)))
            try:
                link.recv_into(wire, on_recv)
            except LinkError as exc:
                st.log.emit("replica_transfer_abandoned", kind="receive", peer=link.peer, rank=rank, step=step,
                            done_bytes=exc.done, nbytes=nbytes, reason=f"{type(exc).__name__}: {exc}"[:300])
                return False
            with st.lock:
                if got.value != crc:
                    ok, reason = False, f"checksum mismatch: header {crc}, payload {got.value}"
                elif st.epoch != epoch or st.held.get(rank) is not pair:
                    return False  # quiesced or reconfigured while it arrived: dropped, the slot stays invalid
                else:
                    ok, reason = True, ""
                    slot.stamp(step, crc)
                self._release(rank, token)   # before the ack: the sender's next push must not find it busy
            if not ok:
                st.log.emit("replica_rejected", role="holder", peer=link.peer, rank=rank, step=step, reason=reason)
            link.send_msg(Ack(ok=ok, reason=reason, rank=rank, step=step, crc=crc), st.secret)
            return True
        finally:
            with st.lock:
                self._release(rank, token)
                st.cv.notify_all()

    def _release(self, rank: int, token: object) -> None:
        """(under the lock) End this push's claim on ``rank``, never a later push's."""
        if self.st.writing.get(rank) is token:
            del self.st.writing[rank]
