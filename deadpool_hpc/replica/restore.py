"""Restores over the replica plane: the process chosen as a rank's source sends its verified copy of the cut step to
the process that restores the rank (``send``); that one expects it (``expect``), receives it into an own slot on its
replica server's handler thread (``receive``) and hands it to its agent (``wait``, or ``poll`` between the agent's
other work).

Wire, source -> target: ``restore {generation, rank, step, ok, reason, nbytes, crc}`` -> ``go {ok, retry, reason}``
-> payload -> ``ack {ok, reason}``. The target accepts only the restore it expects (generation, rank and step of
the recovery decision, control/agreement.py ``sources``) and tells a source that comes before its agent has read the
decision to try again (``retry``: every ``RETRY_S`` until the source's deadline); an older generation's restore is
refused. The source sends only a verified copy (an own slot of that rank, else a held one), pinned
(``Slot.readers``) while it is read; lacking one, it says why (``ok`` false) and the target's wait raises that
reason. The target receives the payload straight into an own slot (``ReplicaState.claim_for_restore``) and checks
its size and CRC-32C before stamping it; a copy that arrives after its wait ended is never stamped.

Why a push: the source learns from the decision itself that it is one, as the target does, so the target need not
ask (a pull's request was one hand-off more between the decision and the restore: docs/architecture.md, "One
failure through the code"), and a node that takes over several ranks receives them all at once. Does not own: whom to
send to and from (the recovery decision, ``control/``), the failure flag (the agent's).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..errors import PeerFailure, ReplicaError, WireError
from .headers import Ack, Go, RestoreOffer
from .slots import ReplicaState
from .snapshot import RunningCrc, Slot
from .stream import POLL_S, Link, LinkError, fmt

RETRY_S = 0.01   # a source told to try again (the target has not read the decision yet) waits this long first


@dataclass(eq=False)
class Expected:
    """The restore one process waits for: training rank ``rank``'s copy of ``step``, sent for ``generation``. Set
    under the state's lock: ``slot`` once it arrived verified, else ``error`` once it cannot come."""
    generation: int
    rank: int
    step: int
    slot: Slot | None = None
    error: Exception | None = None
    receiving: bool = False

    def what(self, peer: str = "its source") -> str:
        return f"replica of rank {self.rank} step {self.step} from {peer} (the restore of generation {self.generation})"


# ---- the target ---------------------------------------------------------------------------------------------------
def expect(st: ReplicaState, rank: int, step: int, generation: int) -> None:
    """From now on accept the restore of training rank ``rank``'s ``step`` for ``generation`` (a previous expectation
    is dropped: its copy, if one still arrives, is refused or never stamped)."""
    with st.lock:
        st.expected = Expected(generation, rank, step)
        st.cv.notify_all()


def wait(st: ReplicaState, failure: threading.Event, timeout: float) -> Slot:
    """The expected copy, stamped in an own slot (``Slot.from_replica``: no kept shares), once it arrived and passed its
    checks. Raises ReplicaError when the source holds no such copy or what arrived does not match (naming both),
    PeerFailure when the transfer broke off, ``failure`` is set, the state is closed, or ``timeout`` seconds pass.
    Returns or raises within ``timeout`` (+ ~POLL_S); notices ``failure`` within POLL_S."""
    return _await(st, failure, time.monotonic(), timeout, None)


def poll(st: ReplicaState, failure: threading.Event, since: float, timeout: float, for_s: float) -> Slot | None:
    """``wait`` in pieces, for a waiter that does other work between them (the node agent ticks its loop): the wait
    that began at monotonic ``since`` and ends ``timeout`` seconds later, for at most ``for_s`` seconds now. None
    while the copy has not arrived and the end is ahead (the expectation stays: poll again); else returns or raises
    as ``wait`` does (PeerFailure once the end passed, naming ``timeout``)."""
    return _await(st, failure, since, timeout, time.monotonic() + for_s)


def _await(st: ReplicaState, failure: threading.Event, since: float, timeout: float,
           until: float | None) -> Slot | None:
    deadline = since + timeout
    with st.lock:
        e = st.expected
        if e is None:
            raise ReplicaError("no restore is expected here (expect first)")
        ended = True   # the wait ends here (returned or raised): the expectation with it
        try:
            while e.slot is None and e.error is None:
                why = ("failure flag set" if failure.is_set() else None) or ("closed" if st.closed else None)
                now = time.monotonic()
                if why is None and now > deadline:
                    why = f"it did not arrive within {timeout:g} s"
                if why is not None:
                    raise PeerFailure(f"{e.what()}: {why}")
                if until is not None and now >= until:
                    ended = False
                    return None
                st.cv.wait(POLL_S if until is None else max(0.0, min(POLL_S, until - now)))
            if e.error is not None:
                raise e.error
            return e.slot
        finally:
            if ended and st.expected is e:
                st.expected = None


def receive(st: ReplicaState, link: Link, hdr: RestoreOffer) -> None:
    """(a replica server's handler thread) The restore ``hdr`` announced on ``link``: accept it if expected and
    receive it, else say why (and whether to try again)."""
    gen, rank, step, nbytes, crc = hdr.generation, hdr.rank, hdr.step, hdr.nbytes, hdr.crc
    src = hdr.source
    peer = fmt(src) if src is not None and len(src) == 2 else link.peer   # its replica address, not a port
    retry, e = False, None
    with st.lock:
        cur = st.expected
        if cur is None or cur.generation < gen:
            reason, retry = f"no restore of generation {gen} expected yet", True
        elif (cur.generation, cur.rank, cur.step) != (gen, rank, step):
            reason = (f"this process expects rank {cur.rank} step {cur.step} for generation {cur.generation}, not "
                      f"rank {rank} step {step} for generation {gen}")
        elif cur.receiving:
            reason, retry = "the expected copy is arriving on another connection", True
        elif cur.slot is not None or cur.error is not None:
            reason = "the expected restore has ended already"
        elif not hdr.ok:
            cur.error = ReplicaError(f"{cur.what(peer)}: {hdr.reason[:500]}")
            st.cv.notify_all()
            reason = "noted"
        elif nbytes != st.layout.wire_nbytes:
            cur.error = ReplicaError(f"{cur.what(peer)}: announced {nbytes} bytes (crc {crc!r}); expected "
                                     f"{st.layout.wire_nbytes} bytes")
            st.cv.notify_all()
            reason = cur.error.args[0]
        else:
            reason, e = None, cur
            e.receiving = True
    if e is None:
        link.send_msg(Go(ok=False, retry=retry, reason=reason), st.secret)
        return
    w = None
    # the transfer ends with the wait for it (a frozen source must not keep the own slot from the next restore)
    link.stop = lambda: (("closed" if st.closed else None)
                         or (None if st.expected is e or e.slot is not None else "its wait ended"))
    try:
        w = st.claim_for_restore(step, lambda: st.closed or st.expected is not e)
        if w is None:
            link.send_msg(Go(ok=False, retry=False, reason="the expected restore has ended"), st.secret)
            return
        link.send_msg(Go(ok=True, retry=False, reason=""), st.secret)
        slot = w.slot
        slot.rank = rank
        wire = st.layout.wire(slot)
        got = RunningCrc(wire)
        link.recv_into(wire, got.update)
        with st.lock:
            if got.value != crc:
                ok, reason = False, f"checksum mismatch: header {crc}, payload {got.value}"
                e.error = ReplicaError(f"{e.what(peer)} fails its checksum (header {crc}, payload {got.value})")
            elif st.expected is not e:
                ok, reason = False, "the expected restore has ended"   # its wait gave up: never stamped
            else:
                ok, reason = True, ""
                slot.from_replica = True   # the wire part only: no kept shares (Slot)
                slot.stamp(step, crc)
                e.slot = slot
        if not ok and e.error is not None:
            st.log.emit("replica_rejected", role="restore", peer=peer, rank=rank, step=step, reason=reason)
        link.send_msg(Ack(ok=ok, reason=reason), st.secret)
    except LinkError as exc:
        with st.lock:
            if e.slot is None and e.error is None:
                e.error = PeerFailure(f"{e.what(peer)} failed: {exc}")
        st.log.emit("replica_transfer_abandoned", kind="restore_receive", peer=peer, rank=rank, step=step,
                    done_bytes=exc.done, nbytes=nbytes, reason=f"{type(exc).__name__}: {exc}"[:300])
    finally:
        with st.lock:
            e.receiving = False
            if w is not None:
                st.end_write(w)
            st.cv.notify_all()


# ---- the source ---------------------------------------------------------------------------------------------------
def send(st: ReplicaState, address, rank: int, step: int, generation: int, failure: threading.Event,
         timeout: float) -> None:
    """Send training rank ``rank``'s verified copy of ``step`` to the process at ``address`` ([host, port]), which
    restores it for ``generation``; returns once that process acknowledged a verified copy.

    Raises ReplicaError when this process holds no such copy (the target is told why) or the target refuses it for
    good (naming why), PeerFailure on a connection error, EOF, ``failure`` set, or ``timeout`` seconds passed (a target
    that does not expect it yet is asked again every RETRY_S until then)."""
    peer = fmt(address)
    what = f"replica of rank {rank} step {step} to {peer} (the restore of generation {generation})"
    stop = lambda: ("failure flag set" if failure.is_set() else None) or ("closed" if st.closed else None)  # noqa: E731
    deadline = time.monotonic() + timeout
    total = st.layout.wire_nbytes
    while True:
        link, slot, again = None, None, False
        try:
            link = Link.connect(address, stop, deadline=deadline, transport=st.transport)
            st.track(link, st.other_links)
            with st.lock:
                slot = st.own.find(step)
                if slot is None or slot.rank != rank:
                    pair = st.held.get(rank)
                    slot = pair.find(step) if pair is not None else None
                if slot is None:
                    reason = (f"no verified copy of rank {rank} step {step} at its source (own rank {st.my_rank}: "
                              f"{st.own.steps()}; held: {({str(r): p.steps() for r, p in st.held.items()})})")
                else:
                    slot.readers += 1
            link.send_msg(RestoreOffer(generation=generation, rank=rank, step=step, ok=slot is not None,
                                       source=None if st.address is None else list(st.address),
                                       reason="" if slot is not None else reason,
                                       nbytes=total, crc=slot.crc if slot is not None else 0), st.secret)
            go = link.recv_msg(st.secret)
            if not isinstance(go, Go):
                raise ReplicaError(f"{what}: expected 'go', got {go.KIND!r}")
            if not go.ok and go.retry:
                again = True   # not expected yet: ask again, with the copy or with why there is none
                continue
            if slot is None:
                raise ReplicaError(reason)   # (the target was told why)
            if not go.ok:
                raise ReplicaError(f"{what}: refused: {go.reason}")
            hook = st.restore_send_hook
            link.send(st.layout.wire(slot), None if hook is None else (lambda sent: hook(rank, step, sent, total)))
            ack = link.recv_msg(st.secret)
            if not isinstance(ack, Ack) or not ack.ok:
                raise ReplicaError(f"{what}: not acknowledged: {ack}")
            return
        except WireError as exc:
            raise ReplicaError(f"{what}: {exc}") from exc
        except LinkError as exc:
            st.log.emit("replica_transfer_abandoned", kind="restore_send", peer=peer, rank=rank, step=step,
                        done_bytes=exc.done, nbytes=total, reason=f"{type(exc).__name__}: {exc}"[:300])
            raise PeerFailure(f"{what} failed: {exc}") from exc
        finally:
            if slot is not None:
                with st.lock:
                    slot.readers -= 1
                    st.cv.notify_all()
            if link is not None:
                st.untrack(link, st.other_links)
                link.close()
            if again:
                time.sleep(RETRY_S)
