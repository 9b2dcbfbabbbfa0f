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

It is also the only thread that calls MPI once it runs: other threads queue messages (``send``) and
register pollers (``add_poller(obj)``: ``obj.poll()`` each iteration, e.g. the progress watchdog). It
never blocks: every MPI call it makes is non-blocking (Isend, Improbe + a matched receive of a message
that has arrived, Test). Measured with the MPICH wheel's UCX netmod: a collective on one thread while another
thread runs point-to-point traffic stalls delivery for good in about 1 run of 4, while the same
traffic from one thread never did (0 of 8); the OFI netmod has no stall but aborts the process when
a peer dies. So MPI is used from one thread, whatever level MPI_Init_thread grants.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque

import numpy as np

from . import wire

TAG_CONTROL = 7


IDLE_POLL_S = 0.02  # seconds between passes of a quiet agent's loop (heartbeats only)

class Agent(threading.Thread):
    """Heartbeat failure detector and message pump for one process.

    comm: an MPI communicator used for nothing else (a Dup of COMM_WORLD). secret: the per-job key.
    period / deadline: heartbeat interval and silence that makes a peer suspected (seconds).
    on_suspect(rank, reason, t, last_heard): called (in whichever thread suspects) when a peer becomes
    suspected; t and last_heard are wall times (last_heard: when this process last heard from it, None
    when the suspicion was reported by another process that did not say).
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
        self.preempted = threading.Event()  # the job must save and leave (Slurm's SIGUSR2), see request_preempt
        self.preempt_signal = False         # set by a signal handler (a plain store: safe there); read by this thread
        self.on_preempt = None              # on_preempt(source_rank): called from this thread, once
        self.on_inject = None               # on_inject(body): a fault to fire on this process (worker/faults.py)
        self.watchdog = None                # a Watchdog (watchdog.py) credited for this thread's own stalls
        self.fenced: str | None = None      # why the others declared this process failed (it must stop)
        self.inbox: queue.Queue = queue.Queue()
        self.last_suspicion = 0.0
        self.generation = 0
        self._watch = True
        self._stopping = threading.Event()
        self._wake = threading.Event()   # set by stop() and by every queued send: the loop sends it at once
        self._pending: list = []  # (request, buffer, dest) of sends not yet completed
        self._hb_req: dict[int, list] = {}  # heartbeat sends not yet completed, per peer (hb buffer is never freed)
        now = time.monotonic()
        self._last_seen = {p: now for p in range(self.size) if p != self.me}
        self._rejected = 0
        self.stalls = 0
        self._outbox: deque = deque()   # (dest, bytes) queued by any thread, sent by this one
        self._pollers: list = []
        self._ctl_seen = 0.0            # monotonic time of the last message other than a heartbeat
        self.on_notice = None           # called (from this thread) after anything the main thread must act on

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
        self._outbox.append((dest, msg, False))
        self._wake.set()

    def _flush_outbox(self) -> None:
        while self._outbox:
            dest, msg, to_suspect = self._outbox.popleft()
            if self.is_suspected(dest) and not to_suspect:
                continue
            try:
                req = self.comm.Isend(msg, dest=dest, tag=TAG_CONTROL)
            except Exception as exc:  # MPI.Exception: the transport already knows the peer is gone
                self.suspect(dest, f"send failed: {str(exc).splitlines()[-1][:120]}")
            else:
                with self.lock:
                    self._pending.append((req, msg, dest))

    def add_poller(self, poller) -> None:
        """Call ``poller.poll()`` on every iteration of this thread (it may use MPI; it must not block)."""
        self._pollers.append(poller)

    def broadcast(self, kind: str, body: dict, include_self: bool = False) -> None:
        """Send to every live peer (point-to-point; a dead peer cannot block it)."""
        for p in self.alive():
            if p != self.me or include_self:
                self.send(p, kind, body)

    def suspect(self, rank: int, reason: str, notify: bool = True, last_heard: float | None = None) -> None:
        """Mark ``rank`` failed, wake the main thread, and tell every live peer (once). ``last_heard``: wall
        time the suspect was last heard of (by default: by this process, from its heartbeats)."""
        if rank == self.me:
            return
        with self.lock:
            if rank in self.suspected:
                return
            t = time.time()
            self.suspected[rank] = t
            now = time.monotonic()
            self.last_suspicion = now
        if last_heard is None and rank in self._last_seen:
            last_heard = t - (now - self._last_seen[rank])
        self.failure.set()
        self._notice()
        # tell the suspect itself (the only message it still gets from us): if it lives on (a false suspicion, a
        # frozen process woken up), it must stop instead of carrying on alone (control/plane.py, Fenced)
        self._outbox.append((rank, np.frombuffer(wire.encode("fenced", {"reason": reason}, self.secret),
                                                 dtype=np.uint8).copy(), True))
        self._wake.set()
        if self.on_suspect is not None:
            self.on_suspect(rank, reason, t, last_heard)
        if notify:
            self.broadcast("suspect", {"ranks": [rank], "reason": reason, "last_heard": last_heard})

    def request_preempt(self) -> None:
        """Ask every live process to save a persistent checkpoint and leave (preemption or time limit).
        Safe to call from a signal handler: it only sets a flag that this thread acts on."""
        self.preempt_signal = True

    def _preempt(self, source: int) -> None:
        if self.preempted.is_set():
            return
        self.preempted.set()  # acted on by the worker at its next step boundary (Context._one_step), never
        # mid-recovery: a restore interrupted half-way would leave a promoted spare with no state to save
        if source == self.me:
            self.broadcast("preempt", {})
        if self.on_preempt is not None:
            self.on_preempt(source)
        self._notice()

    def reap_sends(self) -> bool:
        """Drop completed sends (MPI thread only); True when none is queued or in flight to a live peer."""
        with self.lock:
            pending = list(self._pending)
        alive = [(r, m, d) for (r, m, d) in pending if not self._test(r, d)]
        with self.lock:
            self._pending = alive
        return self.sends_done()

    def sends_done(self) -> bool:
        """True when no send is queued, or in flight to a peer not suspected (a send to a dead peer never
        completes on MPICH: it is kept, its buffer alive, but nobody waits for it)."""
        with self.lock:
            return not self._outbox and all(d in self.suspected for (_r, _m, d) in self._pending)

    def stop_watching(self) -> None:
        """Stop suspecting silent peers (used at the end of the run, when peers exit on purpose)."""
        self._watch = False

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # a process without a detector must not linger half-alive
            import logging
            import os

            logging.getLogger(__name__).critical("deadpool agent died: %s: %s", type(exc).__name__, exc,
                                                 exc_info=True)
            logging.shutdown()
            os._exit(70)

    def _test(self, req, peer: int) -> bool:
        """Test a send request; an MPI error on it means the peer is gone (OFI reports it at once)."""
        try:
            return req.Test()
        except Exception as exc:
            self.suspect(peer, f"send failed: {str(exc).splitlines()[-1][:120]}")
            return True

    def _run(self) -> None:  # noqa: C901 - one polling loop, kept flat on purpose
        from mpi4py import MPI

        buf = np.empty(wire.MAX_MESSAGE_BYTES, dtype=np.uint8)
        status = MPI.Status()
        hb = np.frombuffer(wire.encode("hb", {}, self.secret), dtype=np.uint8).copy()
        next_hb = 0.0
        last_loop = time.monotonic()
        while not self._stopping.is_set():
            now = time.monotonic()
            stalled, last_loop = now - last_loop, now
            if stalled > self.deadline / 2:
                # this thread itself did not run (CPU starvation, a paused VM): the silence it would
                # now see is its own, so peers get the time back instead of being suspected
                for p in self._last_seen:
                    self._last_seen[p] += stalled
                if self.watchdog is not None:
                    self.watchdog.credit(stalled)
                self.stalls += 1
            # receive everything that has arrived: matched probe + receive of that very message
            # (a preposted any-source Irecv stalled for good under the UCX netmod, measured)
            for _ in range(256):
                try:
                    msg = self.comm.Improbe(source=MPI.ANY_SOURCE, tag=TAG_CONTROL, status=status)
                    if msg is None:
                        break
                    n = status.Get_count(MPI.BYTE)
                    if n > len(buf):
                        msg.Recv(np.empty(n, dtype=np.uint8))
                        continue
                    msg.Recv(buf, status=status)
                except Exception:
                    break
                self._handle(status.Get_source(), buf, n, now)
            if now >= next_hb:
                next_hb = now + self.period
                with self.lock:
                    peers = [p for p in range(self.size) if p != self.me and p not in self.suspected]
                for p in peers:
                    # a new heartbeat every period, whether or not the previous send has completed:
                    # gating on completion would silence a live peer whenever a completion is slow
                    pending = [r for r in self._hb_req.get(p, []) if not self._test(r, p)][-32:]
                    try:
                        pending.append(self.comm.Isend(hb, dest=p, tag=TAG_CONTROL))
                    except Exception as exc:
                        self.suspect(p, f"send failed: {str(exc).splitlines()[-1][:120]}")
                    self._hb_req[p] = pending
                self.reap_sends()
            if self.preempt_signal and not self.preempted.is_set():
                self._preempt(self.me)
            self._flush_outbox()
            busy = False
            for p in self._pollers:
                busy = p.poll() or busy
            if self._watch:
                for p in [p for p, t in self._last_seen.items() if now - t > self.deadline]:
                    if not self.is_suspected(p):
                        self.suspect(p, f"no heartbeat for {now - self._last_seen[p]:.2f} s")
            # poll fast while anything is going on (a control message in the last second, a failure, work of a
            # poller); a quiet agent (heartbeats only) wakes every IDLE_POLL_S, which keeps its CPU low (issue 7:
            # < 2 % of a core) and adds at most that much to the heartbeat jitter, far below the deadline
            quiet = not self.failure.is_set() and now - self._ctl_seen > 1.0 and not self._outbox
            self._wake.wait(0.0005 if busy else (IDLE_POLL_S if quiet else 0.005))
            self._wake.clear()

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
        self._ctl_seen = now
        try:
            self._handle_control(src, kind, body)
        finally:
            self._notice()

    def _notice(self) -> None:
        if self.on_notice is not None:
            self.on_notice()

    def _handle_control(self, src: int, kind: str, body: dict) -> None:
        if kind == "suspect":
            for r in body.get("ranks", []):
                self.suspect(int(r), f"reported by MPI rank {src}: {body.get('reason', '')}", notify=True,
                             last_heard=body.get("last_heard"))
            return
        if kind == "preempt":
            self._preempt(src)
            return
        if kind == "fenced":
            self.fenced = self.fenced or f"MPI rank {src} declared this process failed: {body.get('reason', '')}"
            self.failure.set()
            return
        if kind == "inject":
            if self.on_inject is not None:
                self.on_inject(body)
            return
        if kind == "teardown" and int(body.get("g", 0)) < self.generation:
            return  # a round this process has already left behind
        if kind in ("teardown", "collect"):
            self.failure.set()  # a peer left the generation or a coordinator asks for reports: recover
        self.inbox.put((kind, src, body))
