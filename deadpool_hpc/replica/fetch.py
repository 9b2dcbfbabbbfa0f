"""Restores over the replica plane: serving a verified copy (``serve``) and pulling one (``fetch``).

Wire: ``fetch {generation, rank, step}`` -> ``replica {ok, reason, rank, step, nbytes, crc}`` -> payload. The
server sends only a verified copy (an own slot of that rank, else a held one), pinned (``Slot.readers``) while it
is read, from its connection's handler thread (replica/holder.py): nothing to do on the holder's main thread. The
fetcher receives it straight into an own slot (``ReplicaState.claim_for_fetch``) and checks rank, step, size and
CRC-32C before stamping it. Does not own: whom to fetch from (the recovery decision, ``control/``).
"""
from __future__ import annotations

import threading
import time

from ..errors import PeerFailure, ReplicaError, WireError
from .slots import ReplicaState
from .snapshot import RunningCrc, Slot
from .stream import Link, LinkError, fmt


def serve(st: ReplicaState, link: Link, req: dict) -> None:
    """Answer the fetch request ``req`` on ``link``."""
    rank, step = req.get("rank"), req.get("step")
    if not (isinstance(rank, int) and isinstance(step, int)):
        link.send_msg("replica", {"ok": False, "reason": f"malformed fetch request {req}"}, st.secret)
        return
    with st.lock:
        slot = st.own.find(step)
        if slot is None or slot.rank != rank:
            pair = st.held.get(rank)
            slot = pair.find(step) if pair is not None else None
        if slot is None:
            reason = (f"no verified copy of rank {rank} step {step} here (own rank {st.my_rank}: "
                      f"{st.own.steps()}; held: {({str(r): p.steps() for r, p in st.held.items()})})")
        else:
            slot.readers += 1
            crc = slot.crc
    if slot is None:
        link.send_msg("replica", {"ok": False, "reason": reason}, st.secret)
        return
    total = st.layout.wire_nbytes
    try:
        link.send_msg("replica", {"ok": True, "reason": "", "rank": rank, "step": step, "nbytes": total, "crc": crc},
                      st.secret)
        hook = st.serve_hook
        link.send(st.layout.wire(slot), None if hook is None else (lambda sent: hook(rank, step, sent, total)))
    except LinkError as exc:
        st.log.emit("replica_transfer_abandoned", kind="serve", peer=link.peer, rank=rank, step=step,
                    done_bytes=exc.done, nbytes=total, reason=f"{type(exc).__name__}: {exc}"[:300])
    finally:
        with st.lock:
            slot.readers -= 1
            st.cv.notify_all()


def fetch(st: ReplicaState, address, rank: int, step: int, failure: threading.Event, timeout: float) -> Slot:
    """Pull training rank ``rank``'s verified copy of ``step`` from the process at ``address`` ([host, port]) into
    ``own.begin(step)``; verify rank, step, size and CRC-32C; stamp and return the slot.

    Raises ReplicaError if the server holds no such copy or what arrives does not match (naming expected and got),
    PeerFailure on a connection error, EOF, ``failure`` set, or ``timeout`` seconds passed. Returns or raises within
    ``timeout`` (+ ~POLL_S); notices ``failure`` within POLL_S."""
    peer = fmt(address)
    what = f"replica of rank {rank} step {step} from {peer}"
    stop = lambda: ("failure flag set" if failure.is_set() else None) or ("closed" if st.closed else None)  # noqa: E731
    deadline = time.monotonic() + timeout
    nbytes = st.layout.wire_nbytes
    link, w = None, None
    try:
        link = Link.connect(address, stop, deadline=deadline, transport=st.transport)
        st.track(link, st.other_links)
        link.send_msg("fetch", {"generation": st.generation, "rank": rank, "step": step}, st.secret)
        kind, hdr = link.recv_msg(st.secret)
        if kind != "replica":
            raise ReplicaError(f"{what}: expected a 'replica' header, got {kind!r}")
        if not hdr.get("ok"):
            raise ReplicaError(f"{what}: {hdr.get('reason')}")
        got = (hdr.get("rank"), hdr.get("step"), hdr.get("nbytes"))
        if got != (rank, step, nbytes) or not isinstance(hdr.get("crc"), int):
            raise ReplicaError(f"{what}: got rank {got[0]} step {got[1]} ({got[2]} bytes); expected rank {rank} "
                               f"step {step} ({nbytes} bytes)")
        w = st.claim_for_fetch(step, lambda: stop() or time.monotonic() > deadline)
        if w is None:
            link.check()
            raise PeerFailure(f"{what}: an own slot stayed busy until the timeout ({timeout:g} s)")
        slot = w.slot
        slot.rank = rank
        wire = st.layout.wire(slot)
        crc = RunningCrc(wire)
        link.recv_into(wire, crc.update)
        if crc.value != hdr["crc"]:
            st.log.emit("replica_rejected", role="fetcher", peer=peer, rank=rank, step=step,
                        reason=f"checksum mismatch: header {hdr['crc']}, payload {crc.value}")
            raise ReplicaError(f"{what} fails its checksum (header {hdr['crc']}, payload {crc.value})")
        with st.lock:
            slot.pulled = True   # the wire part only: no kept shares (Slot)
            slot.stamp(step, crc.value)
        return slot
    except WireError as exc:
        raise ReplicaError(f"{what}: {exc}") from exc
    except LinkError as exc:
        st.log.emit("replica_transfer_abandoned", kind="fetch", peer=peer, rank=rank, step=step,
                    done_bytes=exc.done, nbytes=nbytes, reason=f"{type(exc).__name__}: {exc}"[:300])
        raise PeerFailure(f"{what} failed: {exc}") from exc
    finally:
        if link is not None:
            st.untrack(link, st.other_links)
            link.close()
        if w is not None:
            with st.lock:
                st.end_write(w)
