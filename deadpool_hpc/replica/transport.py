"""Replica transport: ships each snapshot to its holder over MPI point-to-point, in the background.

For the rank it trains, a copier thread copies the state into a preallocated slot (overlapping the
next forward/backward) and checksums it; the control-plane agent thread (the only thread that calls
MPI, see control/agent.py) then sends a header (rank, step, size, CRC-32; HMAC-signed) and the raw
payload to the holder, on a communicator used for nothing else. The holder verifies size, rank and
checksum before it stamps its slot and acknowledges; a step is *committed* when its ack arrives.
For the rank it holds, it receives into the slot that does not hold the newest verified copy.
Nothing is pickled: payloads are raw bytes, headers are signed JSON (control/wire.py).

Only point-to-point messages with per-generation tags are used, so a dead peer can block nothing:
an operation whose peer is suspected is abandoned (its buffers kept alive, a half-received slot
replaced), and a later generation's messages can never match it.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from ..control import wire
from ..errors import PeerFailure, ReplicaError
from .snapshot import SlotPair, StateLayout, checksum

HDR, DATA, ACK, RHDR, RDATA = 1, 2, 3, 4, 5
_HDR_BYTES = 4096


def tag(kind: int, generation: int) -> int:
    return 100 + 10 * (generation % 100_000) + kind


class Replicator:
    """Background snapshot + replication for one process.

    comm: MPI communicator for replica traffic only. agent: the control-plane Agent (runs MPI).
    layout: StateLayout of this job's payload. log: EventLog.
    """

    def __init__(self, comm, secret: bytes, layout: StateLayout, agent, log):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.secret = secret
        self.layout = layout
        self.agent = agent
        self.is_suspected = agent.is_suspected
        self.log = log
        self.own = SlotPair(layout.nbytes)
        self.held = SlotPair(layout.nbytes)
        self.held_rank: int | None = None
        self.cv = threading.Condition()
        self.jobs: deque = deque()
        self.local_done = -1
        self.committed = -1
        self.generation = 0
        self.my_rank: int | None = None
        self.holder: int | None = None
        self.source: int | None = None
        self._to_send = None      # a stamped own slot waiting for the MPI thread
        self._send = None
        self._recv = None
        self._acks: list = []
        self._graveyard: list = []
        self._landing = None      # receive buffer of the next replica (verified before it is copied in)
        self._busy_local = False
        self._paused = True
        self._stop = False
        self.bytes_sent = 0
        self.wait_s = 0.0
        self._copier = threading.Thread(target=self._copy_loop, name="deadpool-snapshot", daemon=True)
        self._copier.start()
        agent.add_poller(self)

    # ---- main-thread API --------------------------------------------------------------------
    def configure(self, generation: int, my_rank: int | None, holder: int | None, source: int | None,
                  held_rank: int | None) -> None:
        """Set the peers of ``generation`` and resume. holder/source are MPI ranks (None: none)."""
        with self.cv:
            self.generation = generation
            self.my_rank = my_rank
            self.holder, self.source = holder, source
            if held_rank != self.held_rank:
                self.held.clear()
            self.held_rank = held_rank
            self._paused = False
            self.cv.notify_all()

    def submit(self, step: int, tensors, rng) -> None:
        """Snapshot ``tensors`` (+ ``rng`` bytes) as step ``step`` in the background, then replicate.

        The caller must not modify ``tensors`` until ``wait_committed(step)`` returns.
        """
        with self.cv:
            self.jobs.append((step, tensors, rng))
            self.cv.notify_all()

    def wait_committed(self, step: int, failure) -> None:
        """Block until the holder acknowledged ``step``. Raises PeerFailure if ``failure`` gets set."""
        t0 = time.perf_counter()
        with self.cv:
            while self.committed < step:
                if failure.is_set():
                    raise PeerFailure(f"replica of step {step} not committed: a peer failed")
                self.cv.wait(0.002)
        self.wait_s += time.perf_counter() - t0

    def quiesce(self) -> None:
        """Pause: finish the local copy in progress (a memcpy, it cannot hang), then abandon every
        transfer in flight and drop queued jobs. Abandoned buffers are kept alive (MPI may still
        touch them); held slots are only written after verification, so no partial copy is ever
        reported. Per-generation tags keep abandoned operations from matching later ones."""
        with self.cv:
            self._paused = True
            self.jobs.clear()
            self.cv.notify_all()
            while self._busy_local:
                self.cv.wait(0.005)
            self._to_send = None
            if self._send is not None:
                self._graveyard.append(self._send)
                self._send = None
            if self._recv is not None:
                self._graveyard.append(self._recv)
                self._recv = None

    def report(self) -> dict:
        with self.cv:
            rep = {"own": self.own.steps()}
            if self.held_rank is not None:
                rep["held"] = {str(self.held_rank): self.held.steps()}
            return rep

    def stop(self) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify_all()

    # ---- restore transfers (main thread, while paused; MPI runs in the agent thread) ---------
    def send_held(self, dest: int, step: int, generation: int, timeout: float = 60.0) -> None:
        """Send the verified held replica of ``step`` to ``dest`` (a promoted spare), tagged with the new
        ``generation`` (the receiver has never been configured, so only the decision's number is shared)."""
        slot = self.held.get(step)
        hdr = self._header(self.held_rank, step, slot.crc)
        g = generation
        reqs = self.agent.call(lambda: [self.comm.Isend(hdr, dest=dest, tag=tag(RHDR, g)),
                                        self.comm.Isend(slot.buf, dest=dest, tag=tag(RDATA, g))])
        self._wait(reqs, dest, timeout)

    def recv_restore(self, src: int, rank: int, step: int, generation: int, timeout: float = 60.0):
        """Receive ``rank``'s replica of ``step`` from ``src`` (tagged with ``generation``) into an own
        slot and verify it. Returns the slot. Raises ReplicaError if the step, rank, size or CRC-32 do
        not match, PeerFailure if ``src`` fails first.
        """
        g, MPI = generation, self.MPI
        hbuf = np.empty(_HDR_BYTES, dtype=np.uint8)
        st = MPI.Status()
        req = self.agent.call(lambda: self.comm.Irecv(hbuf, source=src, tag=tag(RHDR, g)))
        self._wait([req], src, timeout, status=st)
        hdr = self._parse_header(hbuf, st.Get_count(MPI.BYTE))
        if hdr["rank"] != rank or hdr["step"] != step or hdr["nbytes"] != self.layout.nbytes:
            raise ReplicaError(f"replica from MPI rank {src} is rank {hdr['rank']} step {hdr['step']} "
                               f"({hdr['nbytes']} bytes); expected rank {rank} step {step} ({self.layout.nbytes} bytes)")
        slot = self.own.begin()
        req = self.agent.call(lambda: self.comm.Irecv(slot.buf, source=src, tag=tag(RDATA, g)))
        self._wait([req], src, timeout)
        if checksum(slot.buf) != hdr["crc"]:
            self.own.replace(slot)
            raise ReplicaError(f"replica of rank {rank} step {step} from MPI rank {src} fails its CRC-32")
        slot.crc, slot.step = hdr["crc"], step
        return slot

    def _wait(self, reqs, peer, timeout, status=None) -> None:
        end = time.monotonic() + timeout
        test = (lambda: reqs[0].Test(status)) if status is not None else (lambda: all([r.Test() for r in reqs]))
        while True:
            try:
                if self.agent.call(test):
                    return
            except Exception as exc:
                raise PeerFailure(f"replica transfer with MPI rank {peer} failed: {exc}") from exc
            if self.is_suspected(peer) or time.monotonic() > end:
                raise PeerFailure(f"replica transfer with MPI rank {peer} did not complete")
            time.sleep(0.0005)

    # ---- wire helpers ------------------------------------------------------------------------
    def _header(self, rank: int, step: int, crc: int) -> np.ndarray:
        body = {"rank": rank, "step": step, "nbytes": self.layout.nbytes, "crc": crc}
        return np.frombuffer(wire.encode("replica", body, self.secret), dtype=np.uint8).copy()

    def _parse_header(self, buf, n: int) -> dict:
        kind, body = wire.decode(buf, n, self.secret)
        if kind not in ("replica", "ack"):
            raise ReplicaError(f"unexpected replica message {kind!r}")
        return body

    # ---- the copier thread (no MPI) ------------------------------------------------------------
    def _copy_loop(self) -> None:
        while True:
            with self.cv:
                while not self._stop and (self._paused or not self.jobs or self._to_send or self._send):
                    self.cv.wait(0.01)
                if self._stop:
                    return
                step, tensors, rng = self.jobs.popleft()
                self._busy_local = True
                slot = self.own.begin()
            self.layout.write(slot, tensors, rng, step)
            with self.cv:
                self._busy_local = False
                self.local_done = step
                if self._paused:
                    pass
                elif self.holder is None:
                    self.committed = step
                else:
                    self._to_send = slot
                self.cv.notify_all()

    # ---- the MPI part, called by the agent thread ----------------------------------------------
    def poll(self) -> bool:
        """Advance sends and receives; True while anything is in flight."""
        with self.cv:
            if self._paused:
                return False
            try:
                if self._to_send is not None and self._send is None:
                    slot, self._to_send = self._to_send, None
                    self._start_send(slot)
                self._progress_send()
            except Exception as exc:  # MPI error: the holder is gone; the agent suspects it
                self.log.emit("replica_transfer_abandoned", peer=self.holder, error=f"{type(exc).__name__}: {exc}"[:300])
                self._graveyard.append(self._send)
                self._send = None
            try:
                self._progress_recv()
            except Exception as exc:
                self.log.emit("replica_transfer_abandoned", peer=self.source, error=f"{type(exc).__name__}: {exc}"[:300])
                self._graveyard.append(self._recv)
                self._recv = None
            self.cv.notify_all()
            return self._send is not None or (self._recv is not None and self._recv["hdr"] is not None)

    def _start_send(self, slot) -> None:
        g = self.generation
        hdr = self._header(self.my_rank, slot.step, slot.crc)
        ack = np.empty(_HDR_BYTES, dtype=np.uint8)
        self._send = {
            "step": slot.step, "peer": self.holder, "ackbuf": ack, "hdr": hdr, "slot": slot,
            "reqs": [self.comm.Isend(hdr, dest=self.holder, tag=tag(HDR, g)),
                     self.comm.Isend(slot.buf, dest=self.holder, tag=tag(DATA, g))],
            "ack": self.comm.Irecv(ack, source=self.holder, tag=tag(ACK, g)),
            "status": self.MPI.Status(),
        }

    def _progress_send(self) -> None:
        s = self._send
        if s is None:
            return
        s["reqs"] = [r for r in s["reqs"] if not r.Test()]
        if not s["reqs"] and s["ack"].Test(s["status"]):
            body = self._parse_header(s["ackbuf"], s["status"].Get_count(self.MPI.BYTE))
            if body.get("step") == s["step"] and body.get("ok"):
                self.committed = s["step"]
                self.bytes_sent += self.layout.nbytes
            else:
                self.log.emit("replica_rejected", step=s["step"], holder=s["peer"], reason=body.get("reason"))
            self._send = None
        elif self.is_suspected(s["peer"]):
            self._graveyard.append(s)
            self._send = None  # abandoned: the holder is gone

    def _progress_recv(self) -> None:
        """Receive the next replica into a landing buffer (both receives posted at once, so the eager
        fragments land in place, not in MPI's unexpected queue); verify it, then copy it into the held
        slot that does not hold the newest verified copy. A held slot is never partially written."""
        if self.source is None:
            return
        MPI, g = self.MPI, self.generation
        r = self._recv
        if self.is_suspected(self.source):
            if r is not None:
                self._graveyard.append(r)  # its landing buffer goes with it: MPI may still write there
            self._recv = None
            self.source = None
            return
        if r is None:
            hbuf = np.empty(_HDR_BYTES, dtype=np.uint8)
            land, self._landing = (self._landing if self._landing is not None
                                   else np.empty(self.layout.nbytes, dtype=np.uint8)), None
            self._recv = r = {"hbuf": hbuf, "status": MPI.Status(), "land": land, "hdr": None,
                              "hreq": self.comm.Irecv(hbuf, source=self.source, tag=tag(HDR, g)),
                              "dreq": self.comm.Irecv(land, source=self.source, tag=tag(DATA, g))}
        if r["hdr"] is None:
            if not r["hreq"].Test(r["status"]):
                return
            r["hdr"] = self._parse_header(r["hbuf"], r["status"].Get_count(MPI.BYTE))
        if not _spin(r["dreq"]):
            return
        hdr, land = r["hdr"], r["land"]
        ok, reason = True, ""
        if hdr["nbytes"] != self.layout.nbytes or hdr["rank"] != self.held_rank:
            ok, reason = False, (f"rank {hdr['rank']} / {hdr['nbytes']} bytes, expected rank {self.held_rank} / "
                                 f"{self.layout.nbytes}")
        elif checksum(land) != hdr["crc"]:
            ok, reason = False, "CRC-32 mismatch"
        if ok:
            slot = self.held.begin()
            slot.buf[:] = land
            slot.crc, slot.step = hdr["crc"], hdr["step"]
        else:
            self.log.emit("replica_rejected", step=hdr["step"], source=self.source, reason=reason)
        self._landing = land
        body = {"step": hdr["step"], "ok": ok, "reason": reason}
        ack = np.frombuffer(wire.encode("ack", body, self.secret), dtype=np.uint8).copy()
        self._acks = [(q, b) for (q, b) in self._acks if not q.Test()]
        self._acks.append((self.comm.Isend(ack, dest=self.source, tag=tag(ACK, g)), ack))
        self._recv = None


def _spin(req, tries: int = 64) -> bool:
    """Test ``req`` a few times in a row: each Test drives MPI's progress engine, which moves the
    eager fragments of a large message; one Test per agent iteration would stretch a transfer."""
    for _ in range(tries):
        if req.Test():
            return True
    return False
