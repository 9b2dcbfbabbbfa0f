"""The control-plane agent: one background thread per process that owns heartbeats and suspicion.

It speaks MPI point-to-point only (``Isend``/``Irecv`` + ``Test`` on its own duplicate of
COMM_WORLD), never a collective, so a dead or frozen peer can never block it: MPICH without ULFM
neither errors nor completes a collective that includes a dead rank (notes/ft-probes.md,
notes/mpi-under-slurm.md). Every ``period`` seconds it sends a heartbeat to each peer it believes
alive; a peer silent for ``deadline`` seconds is *suspected* (a crash and a hang look the same). The
first process to suspect a peer tells every other live process (``suspect`` notice), so all
survivors learn within one message latency of the first detection. A suspected peer is never trusted
again: its messages are dropped (it is fenced by the recovery). Other messages are verified (HMAC,
see wire.py) and handed to the main thread through ``inbox``.

Designed for mpi4py with MPI_THREAD_MULTIPLE: the main thread may send through ``send`` while this
thread polls.
"""
from __future__ import annotations

import queue
import threading
import time

import numpy as np

from . import wire

TAG_CONTROL = 7


class Agent(threading.Thread):
    """Heartbeat failure detector and message pump for one process.

    comm: an MPI communicator used for nothing else (a Dup of COMM_WORLD). secret: the per-job key.
    period / deadline: heartbeat interval and silence that makes a peer suspected (seconds).
    on_suspect(rank, reason, t): called from this thread when a peer becomes suspected.
    """

    def __init__(self, comm, secret: bytes, period: float, deadline: float, on_suspect=None):
        super().__init__(name="deadpool-agent", daemon=True)
        self.comm = comm
        self.me = comm.Get_rank()
        self.size = comm.Get_size()
        self.secret = secret
        self.period = period
        self.deadline = deadline
        self.on_suspect = on_suspect
        self.lock = threading.RLock()
        self.suspected: dict[int, float] = {}
        self.failure = threading.Event()
        self.inbox: queue.Queue = queue.Queue()
        self.last_suspicion = 0.0
        self.generation = 0
        self._watch = True
        self._stop = threading.Event()
        self._pending: list = []  # (request, buffer) pairs of sends not yet completed
        self._hb_req: dict[int, object] = {}
        now = time.monotonic()
        self._last_seen = {p: now for p in range(self.size) if p != self.me}
        self._rejected = 0

    # ---- views -------------------------------------------------------------------------
    def alive(self) -> list[int]:
        """MPI ranks (this one included) not suspected, in increasing order."""
        with self.lock:
            return [p for p in range(self.size) if p not in self.suspected]

    def is_suspected(self, rank: int) -> bool:
        with self.lock:
            return rank in self.suspected

    # ---- sending -----------------------------------------------------------------------
    def send(self, dest: int, kind: str, body: dict) -> None:
        """Send a control message to ``dest`` (non-blocking; dropped if ``dest`` is suspected)."""
        if dest == self.me:
            self.inbox.put((kind, self.me, body))
            return
        msg = np.frombuffer(wire.encode(kind, body, self.secret), dtype=np.uint8).copy()
        with self.lock:
            if dest in self.suspected:
                return
            self._pending.append((self.comm.Isend(msg, dest=dest, tag=TAG_CONTROL), msg))

    def broadcast(self, kind: str, body: dict, include_self: bool = False) -> None:
        """Send to every live peer (point-to-point; a dead peer cannot block it)."""
        for p in self.alive():
            if p != self.me or include_self:
                self.send(p, kind, body)

    def suspect(self, rank: int, reason: str, notify: bool = True) -> None:
        """Mark ``rank`` failed, wake the main thread, and tell every live peer (once)."""
        if rank == self.me:
            return
        with self.lock:
            if rank in self.suspected:
                return
            t = time.time()
            self.suspected[rank] = t
            self.last_suspicion = time.monotonic()
        self.failure.set()
        if self.on_suspect is not None:
            self.on_suspect(rank, reason, t)
        if notify:
            self.broadcast("suspect", {"ranks": [rank], "reason": reason})

    def stop_watching(self) -> None:
        """Stop suspecting silent peers (used at the end of the run, when peers exit on purpose)."""
        self._watch = False

    def stop(self) -> None:
        self._stop.set()

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> None:  # noqa: C901 - one polling loop, kept flat on purpose
        from mpi4py import MPI

        buf = np.empty(wire.MAX_MESSAGE_BYTES, dtype=np.uint8)
        status = MPI.Status()
        req = self.comm.Irecv(buf, source=MPI.ANY_SOURCE, tag=TAG_CONTROL)
        hb = np.frombuffer(wire.encode("hb", {}, self.secret), dtype=np.uint8).copy()
        next_hb = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            # receive everything that has arrived
            for _ in range(256):
                if not req.Test(status):
                    break
                src, n = status.Get_source(), status.Get_count(MPI.BYTE)
                self._handle(src, buf, n, now)
                req = self.comm.Irecv(buf, source=MPI.ANY_SOURCE, tag=TAG_CONTROL)
            if now >= next_hb:
                next_hb = now + self.period
                with self.lock:
                    peers = [p for p in range(self.size) if p != self.me and p not in self.suspected]
                    for p in peers:
                        prev = self._hb_req.get(p)
                        if prev is None or prev.Test():
                            self._hb_req[p] = self.comm.Isend(hb, dest=p, tag=TAG_CONTROL)
                    self._pending = [(r, m) for (r, m) in self._pending if not r.Test()]
            if self._watch:
                for p in [p for p, t in self._last_seen.items() if now - t > self.deadline]:
                    if not self.is_suspected(p):
                        self.suspect(p, f"no heartbeat for {now - self._last_seen[p]:.2f} s")
            self._stop.wait(0.005)

    def _handle(self, src: int, buf, n: int, now: float) -> None:
        if self.is_suspected(src):
            return  # fenced: never trusted again
        try:
            kind, body = wire.decode(buf, n, self.secret)
        except wire.WireError:
            self._rejected += 1
            return
        self._last_seen[src] = now
        if kind == "hb":
            return
        if kind == "suspect":
            for r in body.get("ranks", []):
                self.suspect(int(r), f"reported by rank {src}: {body.get('reason', '')}", notify=True)
            return
        if kind == "teardown":
            self.failure.set()
        self.inbox.put((kind, src, body))
