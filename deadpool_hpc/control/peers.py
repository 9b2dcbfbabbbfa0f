"""The control thread (``Peers``): one background thread per node agent that owns heartbeats with the peer agents,
suspicion of them, and the MPI messages to and from them (the object is ``ControlPlane.peers``). Which peer is
overdue, probed, refuted or confirmed is decided by its failure detector (control/detector.py, pure logic on a clock:
last-heard times, adaptive deadlines, local health); this thread feeds it what it hears and sends what it asks for.

Heartbeats (control/topology.py and waker.py): on the ring of live agents each agent watches its ``k``
successors (default 2) and sends a heartbeat datagram every ``period`` seconds to its ``k`` predecessors, the
agents that watch it, so an agent's cost does not grow with the job. A watched peer silent for ``deadline``
seconds is *suspected* (a crash and a freeze look the same; a crash is usually seen earlier, through the ring
link's closed socket, agent/ringlink.py). The agent that suspects a peer starts a ``suspect`` notice that reaches
every live agent along a binomial tree (N - 1 messages, O(log N) hops). A suspected peer is not trusted again: its
messages are dropped (it is fenced by the recovery), with one exception: an agent that declared its own
node failed and lives on to return to the spare pool (``returning``, agent/comeback.py) may still send ``rejoin``,
and only the decision of the lowest live agent (``readmit``, control/membership.py) makes it a peer again. MPI keeps
the order of one sender's messages, so nothing it sent before its failure arrives after its ``rejoin``.

Control messages (suspicions, teardowns, agreement, the rendezvous store's keys) travel over MPI point-to-point
(``Isend`` + ``Improbe`` on its own duplicate of COMM_WORLD), never a collective, so a dead or frozen peer can
never block it: MPICH without ULFM neither errors nor completes a collective that includes a dead rank
(notes/ft-probes.md, notes/mpi-under-slurm.md). They are verified (HMAC, see ipc/wire.py) and handed to the main
thread through ``inbox``. The sender rings the receiver's bell (waker.py), so a quiet agent sleeps between
heartbeats and still reads a message at once.

It is also the only thread that calls MPI once it runs: other threads queue messages (``send``). It
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

from ..ipc import wire
from .detector import Detector
from .joining import Joined, Relay, Rerouted
from .messages import Fenced, Preempt, Rejoin, Suspect, Teardown
from .probing import Prober
from .relay import Relays
from .topology import ring_neighbours, tree_children

TAG_CONTROL = 7
RELAY_NOTICES = (Joined.KIND, Rerouted.KIND)   # read here first (routes), then by the main thread (the rest)
TREE_KINDS = (Suspect.KIND, Teardown.KIND)  # notices disseminated along a tree (topology.py), not sent to every peer
# a recovery's decision travels down the same kind of tree from its coordinator (control/plane.py)
TREE_DECISION = "decision"


MPI_IDLE_POLL_S = 0.5     # seconds between runs of MPI's progress engine in a quiet agent (waker.py)
MPI_ACTIVE_POLL_S = 0.25  # ... while a failure is handled or control messages flow (a bell still wakes it at once)
FAST_POLL_S = 0.005       # ... just after a bell rang, or while a send of this agent is in flight
RUNG_FAST_S = 0.05        # how long after a bell the agent keeps polling fast while what it announced has not come

class Peers(threading.Thread):
    """The message pump around one process's heartbeat failure detector (``detector``, control/detector.py).

    comm: an MPI communicator used for nothing else (a Dup of COMM_WORLD). secret: the per-job key.
    period / deadline: heartbeat interval and the silence after which a peer is probed (seconds; control/suspicion.py:
    adapted to the jitter observed and this agent's own health); ceiling: the longest a silent peer goes unconfirmed
    (seconds). A silent peer is suspected only once a probe (a direct ping and ``probe_k`` indirect ones through other
    agents) went unanswered for its window. on_probe(event, **fields): called from this thread when a probe starts
    (``probe_started``), is answered (``probe_refuted``) or would confirm while ``last_resort`` holds suspicions back
    (``suspicion_held``).
    on_suspect(rank, reason, t, last_heard): called (in whichever thread suspects) when a peer becomes
    suspected; t and last_heard are wall times (last_heard: when this process last heard from it, None
    when the suspicion was reported by another process that did not say). watch_k: how many agents watch
    each agent (its heartbeats go to them only, topology.ring_neighbours); 0: every agent watches every other
    (all-to-all, kept for comparison in benchmarks/control_plane_scale.py). waker: this agent's Waker
    (waker.py: its bell and heartbeat sockets); wake_addresses[rank]: each agent's bell, [host, port], rung after
    every control message sent to it; heartbeat_addresses[rank]: where that agent's heartbeats are received.
    generation(): the generation the agent has applied (read, never stored here: ControlPlane owns it); the
    notices it starts and the stale teardowns and collects it drops are judged by it.
    """

    def __init__(self, comm, secret: bytes, period: float, deadline: float, *, waker, wake_addresses: list,
                 heartbeat_addresses: list, generation, on_suspect=None, watch_k: int = 2, ceiling: float = 4.0,
                 probe_k: int = 3, me: int | None = None, size: int | None = None):
        super().__init__(name="deadpool-peers", daemon=True)
        self.comm = comm    # None in a joined agent (control/joining.py): it has no MPI, ``me`` and ``size`` say who
        self.me = comm.Get_rank() if comm is not None else int(me)
        self.size = comm.Get_size() if comm is not None else int(size)
        # joined nodes' links and routes (control/relay.py; control/joining.py says when each is written)
        self.relays = Relays(self)
        # confirming a silent peer: the probes this agent starts, answers and passes on (control/probing.py)
        self.prober = Prober(self)
        self.secret = secret
        self.period = period
        # the failure detector proper (control/detector.py): last-heard times, adaptive deadlines, probes' verdicts;
        # this thread feeds it what it hears and sends the pings it asks for. Shared with other threads: under ``lock``
        self.detector = Detector((p for p in range(self.size) if p != self.me), deadline, period, ceiling,
                                 probe_k=probe_k, seed=self.me)
        self.on_suspect = on_suspect
        self.on_probe = None                # on_probe(event, **fields), from this thread (see the class docstring)
        # no spare left: the survivors write the checkpoint that the job's requeue resumes from; a member slow in that
        # round may hold the last copy of some rank's state, so silence alone suspects nobody (a closed connection
        # still does, and a truly dead member fails the round's barrier, which names it)
        self.last_resort = False
        self.beat_gaps: deque = deque(maxlen=100_000)   # seconds between this agent's heartbeat sends (its jitter)
        self.lock = threading.RLock()
        self.suspected: dict[int, float] = {}
        self._alive: list[int] | None = None  # cache of alive(), dropped by suspect()
        self.failure = threading.Event()
        self.preempted = threading.Event()  # the job must save and leave (Slurm's SIGUSR2), see request_preempt
        self.preempt_signal = False         # set by a signal handler (a plain store: safe there); read by this thread
        self.on_preempt = None              # on_preempt(source_rank): called from this thread, once
        self.on_inject = None               # on_inject(body): a fault to fire on this process (faultinject/inject.py)
        self.on_work_failure = None         # on_work_failure(body): a suspect notice's "work" (control/crashloop.py)
        self.fenced: str | None = None      # why the others declared this process failed (it must stop)
        self.returning: dict[int, float] = {}  # suspected agents that declared their own failure and live on to return
        self.inbox: queue.Queue = queue.Queue()
        self.last_suspicion = 0.0
        self._generation_of = generation   # () -> the generation its ControlPlane applied (the owner: plane.py)
        self._watch = True
        self._stopping = threading.Event()
        self._wake = waker              # rung by stop(), every queued send, every peer that sent us a message
        self._bells = wake_addresses    # [rank] -> [host, port] of that agent's bell (its Waker)
        self._hb_to = heartbeat_addresses  # [rank] -> [host, port] its heartbeats go to
        self._rung = 0.0                # monotonic time another agent last rang this one's bell
        self._owed = 0                  # messages announced by bells and not received yet
        self._pending: list = []  # (request, buffer, dest) of sends not yet completed
        self.watch_k = watch_k
        self.watched: list[int] = []    # peers whose heartbeats this agent checks (its ring successors)
        self.heartbeat_to: list[int] = []  # peers this agent sends heartbeats to (its ring predecessors)
        self._topology_dirty = True     # recomputed by this thread after the set of suspected agents changed
        self.notice_g = -1              # generation in which a suspicion or teardown notice last reached us
        self.sent = 0                   # control messages sent / received and verified (heartbeats included)
        self.received = 0
        self.passes = 0                 # passes of this thread's loop, and runs of MPI's progress engine among them
        self.mpi_polls = 0
        self._rejected = 0
        self.stalls = 0
        self._outbox: deque = deque()   # (dest, bytes) queued by any thread, sent by this one
        self._ctl_seen = 0.0            # monotonic time of the last message other than a heartbeat
        self.on_notice = None           # called (from this thread) after anything the main thread must act on

    @property
    def generation(self) -> int:
        """The generation the control plane applied, read from it (``ControlPlane.generation``, its one owner)."""
        return self._generation_of()

    @property
    def deadline(self) -> float:
        """Seconds of silence after which a steady watched peer is probed (the start-up raises it, agent/node.py)."""
        return self.detector.deadline

    @deadline.setter
    def deadline(self, value: float) -> None:
        self.detector.deadline = value

    def start(self) -> None:
        """Start the control thread; every peer gets a full heartbeat deadline from now (the start-up's barrier
        may have taken a while)."""
        with self.lock:
            self.detector.reset()
        super().start()

    # ---- views -------------------------------------------------------------------------
    def alive(self) -> list[int]:
        """MPI ranks (this one included) not suspected, in increasing order (a copy of a list kept up to date by
        ``suspect``: a recovery asks for it at every pass, and N Python steps per pass add up at scale)."""
        with self.lock:
            if self._alive is None:
                self._alive = [p for p in range(self.size) if p not in self.suspected]
            return list(self._alive)

    def is_suspected(self, rank: int) -> bool:
        with self.lock:
            return rank in self.suspected

    def readmit(self, rank: int) -> None:
        """Trust ``rank`` again: an agent back in the spare pool (control/membership.py). It gets a full heartbeat
        deadline from now."""
        with self.lock:
            self.suspected.pop(rank, None)
            self.returning.pop(rank, None)
            self._alive = None
            self._topology_dirty = True
            self.detector.reset([rank])

    def rejoined(self, suspected) -> None:
        """(the returning agent) This agent is a peer again: take the readmitting agent's ``suspected`` ranks as its
        own view, forget the ``fenced`` notices its failure drew, and watch heartbeats again."""
        with self.lock:
            self.suspected = {int(r): time.time() for r in suspected if int(r) != self.me}
            self.returning.clear()
            self._alive = None
            self._topology_dirty = True
            self.detector.reset()
            self.fenced = None
        self._watch = True
        self.failure.clear()

    def set_addresses(self, node: int, wake, heartbeat) -> None:
        """Agent ``node``'s bell and heartbeat addresses ([host, port] each): a joined node's (control/joining.py)."""
        with self.lock:
            self._bells[node] = list(wake)
            self._hb_to[node] = list(heartbeat)

    def send_to_suspect(self, rank: int, kind: str, body: dict) -> None:
        """Send to a suspected agent (a returning one: ``rejoin``'s answers, the end of the run)."""
        self._outbox.append((rank, np.frombuffer(wire.encode(kind, body, self.secret), dtype=np.uint8).copy(), True))
        self._wake.set()

    # ---- sending -----------------------------------------------------------------------
    def send(self, dest: int, kind: str, body: dict) -> None:
        """Send a control message to ``dest`` (non-blocking; dropped if ``dest`` is suspected)."""
        self.send_many([dest], kind, body)

    def send_many(self, dests, kind: str, body: dict) -> None:
        """Send one control message to every MPI rank in ``dests``, encoded once (a decision to 255 agents is
        one JSON encoding and one MAC, not 255). Non-blocking; a suspected destination is skipped."""
        msg = None
        for dest in dests:
            if dest == self.me:
                self.inbox.put((kind, self.me, body))
                continue
            if msg is None:
                msg = np.frombuffer(wire.encode(kind, body, self.secret), dtype=np.uint8)  # read-only: shared
            self._outbox.append((dest, msg, False))
        if msg is not None:
            self._wake.set()

    def _flush_outbox(self) -> None:
        while self._outbox:
            if self.relays.between_sponsors():
                return   # a joined agent without a sponsor: kept until it re-attaches (relay.py)
            dest, msg, to_suspect = self._outbox.popleft()
            if self.is_suspected(dest) and not to_suspect:
                continue
            if not self.relays.send(dest, msg, to_suspect):   # (a joined node's: relayed, or held)
                self._isend(dest, msg)

    def _isend(self, dest: int, msg) -> None:
        try:
            req = self.comm.Isend(msg, dest=dest, tag=TAG_CONTROL)
        except Exception as exc:  # MPI.Exception: the transport already knows the peer is gone
            self.suspect(dest, f"send failed: {str(exc).splitlines()[-1][:120]}")
        else:
            self.sent += 1
            self._wake.ring(self._bells[dest])
            with self.lock:
                self._pending.append((req, msg, dest))

    def broadcast(self, kind: str, body: dict, include_self: bool = False) -> None:
        """Send to every live peer (point-to-point; a dead peer cannot block it)."""
        self.send_many([p for p in self.alive() if p != self.me or include_self], kind, body)

    def disseminate(self, kind: str, body: dict) -> None:
        """Start notice ``kind`` (one of TREE_KINDS, or TREE_DECISION) at this agent: it reaches every live agent
        along a binomial tree (topology.tree_children), N - 1 messages in all and O(log N) hops."""
        if kind != TREE_DECISION:
            self.notice_g = max(self.notice_g, self.generation)
        self._forward(kind, dict(body, origin=self.me))

    def _forward(self, kind: str, body: dict) -> None:
        with self.lock:
            dead = frozenset(self.suspected)
        self.send_many(tree_children(int(body["origin"]), self.me, self.size, dead), kind, body)

    def suspect(self, rank: int, reason: str, notify: bool = True, last_heard: float | None = None,
                tell_suspect: bool = True) -> None:
        """Mark ``rank`` failed, wake the main thread, and (``notify``) start a notice that reaches every live
        agent (once). ``last_heard``: wall time the suspect was last heard of (by default: by this process,
        from its heartbeats). ``tell_suspect``: send the suspect a ``fenced`` notice (False when the suspicion
        came down a dissemination tree: the agent that detected it already told it)."""
        if rank == self.me:
            return
        with self.lock:
            if rank in self.suspected:
                return
            t = time.time()
            self.suspected[rank] = t
            self.detector.forget(rank)
            self._alive = None
            self._topology_dirty = True
            now = self.detector.clock()
            self.last_suspicion = now
        if last_heard is None and rank in self.watched:  # only watched peers send us heartbeats
            last_heard = t - self.detector.silence(rank, now)
        self.failure.set()
        self._notice()
        if tell_suspect:
            # tell the suspect itself (the only message it still gets from us): if it lives on (a false suspicion,
            # a frozen process woken up), it must stop instead of carrying on alone (control/plane.py, Fenced)
            self._outbox.append((rank, np.frombuffer(wire.encode(Fenced.KIND, Fenced(reason).to_wire(), self.secret),
                                                     dtype=np.uint8).copy(), True))
            self._wake.set()
        if self.on_suspect is not None:
            self.on_suspect(rank, reason, t, last_heard)
        if rank == self.relays.via:   # a joined agent's sponsor, suspected however: it re-attaches (relay.py)
            self.relays.link_lost(rank, reason)
        if notify:
            self.disseminate(Suspect.KIND, Suspect((rank,), reason, last_heard).to_wire())

    def heartbeat_stats(self) -> dict:
        """This agent's heartbeat send gaps (seconds: p50, p99, max, count; the period is the ideal) and its probe
        counters (started, refuted, confirmed) and loop stalls: the ``heartbeat_stats`` event at its exit."""
        gaps = sorted(self.beat_gaps)
        q = (lambda f: round(gaps[min(len(gaps) - 1, int(f * len(gaps)))], 4)) if gaps else (lambda f: None)
        det = self.detector.stats()
        return {"period_s": self.period, "send_gap_p50_s": q(0.5), "send_gap_p99_s": q(0.99),
                "send_gap_max_s": round(gaps[-1], 4) if gaps else None, "beats": len(gaps),
                "probes_started": det["probes_started"], "probes_refuted": det["probes_refuted"],
                "probes_confirmed": det["probes_confirmed"], "loop_stalls": self.stalls, "health": det["health"]}

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
            self.broadcast(Preempt.KIND, Preempt().to_wire())
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
            return not self._outbox and all(d in self.suspected for (_r, _m, d) in self._pending) and \
                self.relays.flushed()

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

            logging.getLogger(__name__).critical("deadpool control thread (peers) died: %s: %s", type(exc).__name__,
                                                 exc, exc_info=True)
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
        if self.comm is not None:   # (a joined agent has no MPI: control/joining.py)
            from mpi4py import MPI

            status = MPI.Status()
        buf = np.empty(wire.MAX_MESSAGE_BYTES, dtype=np.uint8)
        next_hb = next_mpi = 0.0
        with self.lock:
            self.detector.tick()   # the first pass: a stall is measured from here
        bell = True
        while not self._stopping.is_set():
            now = self.detector.clock()
            self.passes += 1
            # this thread itself did not run (CPU starvation, a paused VM): the silence it would now see is its own,
            # so peers get the time back instead of being suspected; a late loop widens its deadlines (detector.py)
            with self.lock:
                if self.detector.tick(now):
                    self.stalls += 1
            rung, beats = self._wake.drain(bell)
            for src in beats:
                if src in self.detector and src not in self.suspected:  # a fenced agent is never trusted again
                    self.prober.alive_sign(src, now, beat=True)
            self.received += len(beats)
            if self._wake.probes:
                self.prober.on_probes(now)
            if rung:
                self._rung = now
                self._owed += rung  # messages announced by bells, not received yet
            # MPI's progress engine runs at once after a bell (and for RUNG_FAST_S after it: the message may land a
            # moment after its bell) and while a send of ours is in flight; every MPI_ACTIVE_POLL_S while a failure
            # is handled or control messages flow; else every MPI_IDLE_POLL_S (waker.py: a lost bell costs that).
            # Not faster: during a recovery every agent of the job is active at once, and on a shared host their
            # polling is what would slow the recovery down (measured at 128 agents on 2 cores:
            # benchmarks/control_plane_scale.py)
            if now - self._rung > RUNG_FAST_S:
                self._owed = 0  # a message that has not come by now comes with the next poll
            fast = self._owed > 0 or not self.sends_done()
            lively = fast or self.failure.is_set() or now - self._ctl_seen <= 1.0
            if fast or now >= next_mpi:
                self.mpi_polls += 1
                next_mpi = now + (MPI_ACTIVE_POLL_S if lively else MPI_IDLE_POLL_S)
                # receive everything that has arrived: matched probe + receive of that very message
                # (a preposted any-source Irecv stalled for good under the UCX netmod, measured)
                for got in range(256 if self.comm is not None else 0):
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
                else:
                    got = 256 if self.comm is not None else 0
                self._owed = max(0, self._owed - got)  # what the bells announced has arrived: stop polling fast
                self.reap_sends()
            if self.relays.links:   # every pass (a few non-blocking reads): a link's end is a suspicion at once
                self._owed = max(0, self._owed - self.relays.poll(now))
            if self._topology_dirty:
                self._retopology(now)
            if now >= next_hb:
                if next_hb:
                    self.beat_gaps.append(now - next_hb + self.period)
                next_hb = now + self.period
                with self.lock:
                    peers = [p for p in self.heartbeat_to if p not in self.suspected]
                for p in peers:
                    self._wake.beat(self.me, self._hb_to[p])
                self.sent += len(peers)
            if self.preempt_signal and not self.preempted.is_set():
                self._preempt(self.me)
            self._flush_outbox()
            if self._watch:
                self.prober.check_silence(now)
            elif self.detector.probes:
                with self.lock:
                    self.detector.drop_probes()
            # sleep until the next heartbeat or MPI poll is due, or a bell: a control message for this agent, or a
            # send queued by another thread (this thread's CPU is what an idle agent costs; docs/scaling.md: 256
            # idle agents under half a core)
            idle = max(0.0, min(next_hb, next_mpi) - time.monotonic())
            bell = self._wake.wait(FAST_POLL_S if fast or self._outbox else idle)

    def heard_from(self, rank: int) -> None:
        """(any thread) ``rank``'s agent did something only a live agent does (it pushed this node a replica): as
        good as a heartbeat for its silence, and an open probe of it ends refuted at its next look."""
        if rank not in self.suspected:
            self.detector.touch(rank)

    def _retopology(self, now: float) -> None:
        """Recompute the watched and heartbeat peers from the live ring (topology.ring_neighbours); a newly
        watched peer gets a full deadline from now (it may have been sending its heartbeats elsewhere)."""
        with self.lock:
            self._topology_dirty = False
            alive = [p for p in range(self.size) if p not in self.suspected]
        watched, heartbeat_to = ring_neighbours(self.me, alive, self.watch_k)
        # a joined agent also watches its sponsor, and a sponsor sends its heartbeats to the nodes it sponsors: a host
        # lost without its TCP connection closing is still seen, and the joined node re-attaches (relay.py)
        with self.lock:
            via, sponsored = self.relays.via, [n for n in self.relays.links if n != self.relays.via]
        watched += [via] if via is not None and via in alive and via not in watched else []
        self.heartbeat_to = heartbeat_to + [n for n in sponsored if n in alive and n not in heartbeat_to]
        with self.lock:
            for p in watched:
                if p not in self.watched:
                    self.detector.watch(p, now)
        self.watched = watched

    def _handle(self, src: int, buf, n: int, now: float) -> None:
        suspected = self.is_suspected(src)
        if suspected and src not in self.returning:
            return  # fenced: never trusted again
        if self.relays.taken(src):
            return  # the rank's slot is a joined node's now: only relays speak for it (the old agent is fenced)
        try:
            kind, body = wire.decode(buf, n, self.secret)
        except wire.WireError:
            self._rejected += 1
            return
        if kind == Relay.KIND:
            self.relays.on_relay(src, body, now, via_link=False)
            return
        self._accept(src, kind, body, now)

    def _accept(self, src: int, kind: str, body: dict, now: float) -> None:
        """A verified control message of agent ``src`` (over MPI, or relayed for a joined node)."""
        suspected = self.is_suspected(src)
        if suspected and src not in self.returning:
            return  # fenced: never trusted again
        if suspected:   # a returning agent: its request to come back, nothing else
            if kind == Rejoin.KIND:
                self.inbox.put((kind, src, body))
                self._notice()
            return
        self.prober.alive_sign(src, now, beat=False)
        self.received += 1
        self._ctl_seen = now
        try:
            self._handle_control(src, kind, body)
        finally:
            self._notice()

    def _notice(self) -> None:
        if self.on_notice is not None:
            self.on_notice()

    def _handle_control(self, src: int, kind: str, body: dict) -> None:
        if kind in RELAY_NOTICES:   # a joined node's route, on this thread before its relays can come (relay.py)
            self.relays.on_notice(kind, body)
        if kind == TREE_DECISION and "origin" in body:   # passed on first, then read by the main thread
            self._forward(kind, body)
        if kind in TREE_KINDS:
            body.setdefault("origin", src)
            try:
                note = (Suspect if kind == Suspect.KIND else Teardown).from_wire(body)
            except ValueError as exc:   # neither read nor passed on (an agent of another version: said, not fatal)
                self._rejected += 1
                self.prober.event("bad_message", kind=kind, src=src, error=str(exc)[:300])
                return
            if isinstance(note, Suspect) or note.g >= self.generation:  # a stale teardown tells nothing
                self.notice_g = max(self.notice_g, self.generation)
            if isinstance(note, Suspect):
                if note.returning and list(note.ranks) == [note.origin]:
                    with self.lock:   # (before the suspicion: _handle then lets its rejoin through)
                        self.returning[note.origin] = time.time()
                if note.work is not None and self.on_work_failure is not None:
                    self.on_work_failure(note.work)   # how its training process ended: before the round it starts
                for r in note.ranks:   # first: the forwarding below skips the newly suspected
                    self.suspect(r, f"reported by MPI rank {note.origin} (via {src}): {note.reason}",
                                 notify=False, last_heard=note.last_heard, tell_suspect=False)
                self._forward(kind, body)
                return
            self._forward(kind, body)
        if kind == Preempt.KIND:
            self._preempt(src)
            return
        if kind == Fenced.KIND:
            try:
                why = Fenced.from_wire(body).reason
            except ValueError as exc:   # fenced all the same: the notice's kind is what counts
                why = f"(a malformed notice: {exc})"
            self.fenced = self.fenced or f"MPI rank {src} declared this process failed: {why}"
            self.failure.set()
            return
        if kind == "inject":
            if self.on_inject is not None:
                self.on_inject(body)
            return
        if kind == Teardown.KIND and note.g < self.generation:
            return  # a round this process has already left behind
        if kind in (Teardown.KIND, "collect"):
            self.failure.set()  # a peer left the generation or a coordinator asks for reports: recover
        if kind == "collect" and int(body.get("g", -1)) >= self.generation:
            # a coordinator already collects this generation's reports: a teardown notice of ours would tell
            # nobody anything (without this, every agent reached by the collect before the suspicion started its
            # own tree: N trees, N^2 messages, measured at 64 agents)
            self.notice_g = max(self.notice_g, self.generation)
        self.inbox.put((kind, src, body))
