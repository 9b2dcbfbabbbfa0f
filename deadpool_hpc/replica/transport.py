"""Replica transport: ships each snapshot to its holder over MPI point-to-point, in the background.

One ``Replicator`` thread per process, on its own duplicate of COMM_WORLD (separate from the
control plane's and from the training collectives). For the rank it trains it copies the state
into a preallocated slot (overlapping the next forward/backward), checksums it, and sends a header
(step, size, CRC-32; HMAC-signed) and the raw payload to its holder; the holder verifies size, step
and checksum before it stamps its slot and acknowledges. A step is *committed* when its ack
arrives. For the rank it holds, it receives into the slot not holding the newest verified copy.
Nothing is pickled: payloads are raw bytes, headers are signed JSON (control/wire.py).

Only point-to-point messages with per-generation tags are used, so a dead peer can block nothing:
an operation whose peer is suspected is abandoned, and its receive buffer is replaced.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from ..control import wire
from ..errors import PeerFailure, ReplicaError
from .snapshot import SlotPair, StateLayout

HDR, DATA, ACK, RHDR, RDATA = 1, 2, 3, 4, 5
_HDR_BYTES = 4096


def tag(kind: int, generation: int) -> int:
    return 100 + 10 * (generation % 100_000) + kind


class Replicator(threading.Thread):
    """Background snapshot + replication for one process.

    comm: MPI communicator for replica traffic only. layout: StateLayout of this job's payload.
    is_suspected(mpi_rank) -> bool: the control plane's view. log: EventLog.
    """

    def __init__(self, comm, secret: bytes, layout: StateLayout, is_suspected, log):
        super().__init__(name="deadpool-replicator", daemon=True)
        self.comm = comm
        self.secret = secret
        self.layout = layout
        self.is_suspected = is_suspected
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
        self._send = None
        self._recv = None
        self._busy_local = False
        self._paused = True
        self._stop = False
        self._graveyard: list = []
        self._acks: list = []
        self.bytes_sent = 0
        self.wait_s = 0.0

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

        The caller must not modify ``tensors`` until ``wait_committed(step)`` (or ``wait_local``) returns.
        """
        with self.cv:
            self.jobs.append((step, tensors, rng))
            self.cv.notify_all()

    def wait_local(self, step: int, failure=None) -> None:
        """Block until the local copy of ``step`` is complete (it cannot hang: a memcpy)."""
        with self.cv:
            while self.local_done < step:
                self.cv.wait(0.01)

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
        touch them) and a held slot that was being received is replaced, so no partial copy is
        ever reported. Per-generation tags keep abandoned operations from matching later ones."""
        with self.cv:
            self._paused = True
            self.cv.notify_all()
            while self._busy_local:
                self.cv.wait(0.005)
            if self._send is not None:
                self._graveyard.append(self._send)
                self._send = None
            if self._recv is not None:
                if self._recv.get("slot") is not None:
                    self.held.replace(self._recv["slot"])
                self._graveyard.append(self._recv)
                self._recv = None
            self.jobs.clear()

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

    # ---- restore transfers (main thread, while paused) -------------------------------------
    def send_held(self, dest: int, step: int, failure, timeout: float = 60.0) -> None:
        """Send the verified held replica of ``step`` to ``dest`` (a promoted spare)."""
        slot = self.held.get(step)
        hdr = self._header(self.held_rank, step, slot.crc)
        reqs = [self.comm.Isend(hdr, dest=dest, tag=tag(RHDR, self.generation)),
                self.comm.Isend(slot.buf, dest=dest, tag=tag(RDATA, self.generation))]
        self._wait_all(reqs, dest, failure, timeout)

    def recv_restore(self, src: int, rank: int, step: int, failure, timeout: float = 60.0):
        """Receive ``rank``'s replica of ``step`` from ``src`` into an own slot and verify it.

        Returns the slot. Raises ReplicaError if the step, rank, size or CRC-32 do not match.
        """
        hbuf = np.empty(_HDR_BYTES, dtype=np.uint8)
        from mpi4py import MPI

        st = MPI.Status()
        req = self.comm.Irecv(hbuf, source=src, tag=tag(RHDR, self.generation))
        self._wait_all([req], src, failure, timeout, status=st)
        hdr = self._parse_header(hbuf, st.Get_count(MPI.BYTE))
        if hdr["rank"] != rank or hdr["step"] != step or hdr["nbytes"] != self.layout.nbytes:
            raise ReplicaError(f"replica from MPI rank {src} is rank {hdr['rank']} step {hdr['step']} "
                               f"({hdr['nbytes']} bytes); expected rank {rank} step {step} ({self.layout.nbytes} bytes)")
        slot = self.own.begin()
        req = self.comm.Irecv(slot.buf, source=src, tag=tag(RDATA, self.generation))
        self._wait_all([req], src, failure, timeout)
        from .snapshot import checksum

        if checksum(slot.buf) != hdr["crc"]:
            self.own.replace(slot)
            raise ReplicaError(f"replica of rank {rank} step {step} from MPI rank {src} fails its CRC-32")
        slot.crc, slot.step = hdr["crc"], step
        return slot

    def _wait_all(self, reqs, peer, failure, timeout, status=None) -> None:
        end = time.monotonic() + timeout
        pending = list(reqs)
        while pending:
            if status is not None and len(pending) == 1 and pending[0] is reqs[0]:
                done = pending[0].Test(status)
            else:
                done = pending[0].Test()
            if done:
                pending.pop(0)
                continue
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

    # ---- the thread --------------------------------------------------------------------------
    def run(self) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        while True:
            with self.cv:
                if self._stop:
                    return
                idle = self._paused or (not self.jobs and self._send is None and self.source is None)
                if idle and not self._busy_local:
                    self.cv.wait(0.01)
                    continue
                job = self.jobs.popleft() if (self.jobs and self._send is None and not self._paused) else None
                if job is not None:
                    self._busy_local = True
                    slot = self.own.begin()
            if job is not None:
                step, tensors, rng = job
                self.layout.write(slot, tensors, rng, step)
                with self.cv:
                    self._busy_local = False
                    self.local_done = step
                    if self.holder is None:
                        self.committed = step
                    else:
                        self._start_send(slot)
                    self.cv.notify_all()
            with self.cv:
                if not self._paused:
                    self._progress_send()
                    self._progress_recv()
                self.cv.notify_all()
            time.sleep(0.0005)

    def _start_send(self, slot) -> None:
        g = self.generation
        hdr = self._header(self.my_rank, slot.step, slot.crc)
        ack = np.empty(_HDR_BYTES, dtype=np.uint8)
        self._send = {
            "step": slot.step, "peer": self.holder, "ackbuf": ack, "hdr": hdr, "slot": slot,
            "reqs": [self.comm.Isend(hdr, dest=self.holder, tag=tag(HDR, g)),
                     self.comm.Isend(slot.buf, dest=self.holder, tag=tag(DATA, g))],
            "ack": self.comm.Irecv(ack, source=self.holder, tag=tag(ACK, g)),
            "status": self._MPI.Status(),
        }

    def _progress_send(self) -> None:
        s = self._send
        if s is None:
            return
        s["reqs"] = [r for r in s["reqs"] if not r.Test()]
        if not s["reqs"] and s["ack"].Test(s["status"]):
            body = self._parse_header(s["ackbuf"], s["status"].Get_count(self._MPI.BYTE))
            if body.get("step") == s["step"] and body.get("ok"):
                self.committed = s["step"]
                self.bytes_sent += self.layout.nbytes
            else:
                self.log.emit("replica_rejected", step=s["step"], holder=s["peer"], reason=body.get("reason"))
            self._send = None
        elif self.is_suspected(s["peer"]):
            self._send = None  # abandoned: the holder is gone

    def _progress_recv(self) -> None:
        if self.source is None:
            return
        MPI = self._MPI
        r = self._recv
        g = self.generation
        if r is None:
            buf = np.empty(_HDR_BYTES, dtype=np.uint8)
            st = MPI.Status()
            self._recv = r = {"hbuf": buf, "status": st, "slot": None,
                              "req": self.comm.Irecv(buf, source=self.source, tag=tag(HDR, g))}
        if self.is_suspected(self.source):
            if r["slot"] is not None:
                self.held.replace(r["slot"])
            self._recv = None
            self.source = None
            return
        if r["slot"] is None:
            if not r["req"].Test(r["status"]):
                return
            r["hdr"] = self._parse_header(r["hbuf"], r["status"].Get_count(MPI.BYTE))
            r["slot"] = self.held.begin()
            r["req"] = self.comm.Irecv(r["slot"].buf, source=self.source, tag=tag(DATA, g))
            return
        if not r["req"].Test():
            return
        from .snapshot import checksum

        hdr, slot = r["hdr"], r["slot"]
        ok, reason = True, ""
        if hdr["nbytes"] != self.layout.nbytes or hdr["rank"] != self.held_rank:
            ok, reason = False, f"rank {hdr['rank']} / {hdr['nbytes']} bytes, expected rank {self.held_rank} / {self.layout.nbytes}"
        elif checksum(slot.buf) != hdr["crc"]:
            ok, reason = False, "CRC-32 mismatch"
        if ok:
            slot.crc, slot.step = hdr["crc"], hdr["step"]
        else:
            self.held.replace(slot)
            self.log.emit("replica_rejected", step=hdr["step"], source=self.source, reason=reason)
        body = {"step": hdr["step"], "ok": ok, "reason": reason}
        ack = np.frombuffer(wire.encode("ack", body, self.secret), dtype=np.uint8).copy()
        self._acks = [(q, b) for (q, b) in self._acks if not q.Test()]
        self._acks.append((self.comm.Isend(ack, dest=self.source, tag=tag(ACK, g)), ack))
        self._recv = None
