"""Replica transport: ships each snapshot to its holders and serves verified copies back, over TCP.

Owns: this process's snapshot slots (``own``) and the replicas it holds for other training ranks
(``held(rank)``); the background copy of the state into a slot; pushing it to the K holders and
counting their acknowledgements (a step is *committed* once every holder acked a verified copy);
receiving pushes; serving and pulling (``fetch``) verified copies for a restore. Does not own: who
holds whom and whom to fetch from (the recovery decision, ``control/``; the caller passes addresses to
``configure`` and ``fetch``), failure detection (a dead or frozen peer here only ends a transfer; the
caller's failure flag and timeouts end the waits), the payload layout and checksum (``snapshot.py``),
the socket mechanics (``stream.py``). No MPI: the control plane's heartbeats never wait behind a
replica, whatever its size.

Threads, none of which holds the GIL for long (socket I/O releases it; the CRC-32C takes it for about
0.1 ms per MiB piece, ``snapshot.py``):
- *accept*: accepts connections on ``address`` and gives each a handler thread, which receives pushes
  (one after another, for as long as the pusher keeps the connection) or serves one fetch;
- *copier*: for each ``submit``, copies the state into ``own.begin(step)`` in 4 MiB chunks, each
  checksummed while in cache (overlapping the next forward/backward), stamps the slot, then hands it
  to the *push* thread of each holder;
- *push* (one per holder, for as long as it is a holder): pushes the steps handed to it in order over
  one connection it keeps open between steps (a new connection and two new threads per step and
  holder cost about as much CPU as moving 1.8 MB, issue 7), and opens a new one when that one fails.

Wire (each message framed and HMAC-signed with the job secret, ``stream.py``; payloads are raw bytes,
nothing is pickled). A push: ``push {generation, rank, step, nbytes, crc}`` -> ``go {ok, reason,
retry}`` -> payload -> ``ack {rank, step, crc, ok, reason}``. The holder checks the signature before
anything else, refuses a rank it does not hold (``configure``), a wrong size, a quiesced state, or a
rank already being written (``retry``: the pusher tries again every ``POLL_S`` until ``timeout``);
it writes into the held slot that does not hold the newest verified copy (invalidated first), checks
the CRC-32C, and only then stamps step and CRC and acks. An ack commits only the step, rank and CRC
it names. A fetch: ``fetch {generation, rank, step}`` -> ``replica {ok, reason, rank, step, nbytes,
crc}`` -> payload, served from a verified slot that is pinned (``Slot.readers``) while it is read.
A push connection carries one push after another; a quiesce (either side) shuts it down, and a push
that finds its kept connection gone before its ``go`` opens a new one and starts again.
A push carries the sender's generation but is accepted by rank alone: a replica of step s is a
replica of step s. A push begun before a ``quiesce``/``configure`` (an *epoch*) never stamps a held
slot nor commits a step; a local copy under way is aborted between two chunks (or, if it had just
finished, kept: it is complete and verified).

Memory per process: 2 own slots + 2 slots per held rank, each of the payload's size, allocated at
``configure`` and freed when the rank is no longer held; no landing buffer, no per-transfer payload
buffer (payloads are received straight into their slot and checksummed there). With K replicas per
rank spread evenly, each process holds K ranks: memory per rank = (2 + 2K) x payload bytes (pages
become resident as slots are first written).

Technique learned from torchft's ``HTTPTransport`` (pytorch/torchft,
torchft/checkpointing/http_transport.py): a restore is a pull from a server thread in the process
that has the state, at an address exchanged out of band, with a timeout on every socket operation, and
a checkpoint still being staged is never served. Here instead: no pickle, a signed header and an
end-to-end checksum, pushes for replication, abort flags checked between chunks.
"""
from __future__ import annotations

import threading
import time
from collections import deque

from ..errors import PeerFailure, ReplicaError, WireError
from .snapshot import Slot, SlotPair, StateLayout, checksum
from .stream import POLL_S, TCP, Link, LinkError, PeerGone, Stalled, Stopped, fmt

MAX_CONNECTIONS = 64      # concurrent incoming connections; more are closed at once
HELLO_S = 10.0            # an incoming connection must send its first message within this
INLINE_STAMP_BYTES = 1 << 20  # a written payload up to this many bytes on the wire is checksummed by the caller of
#                               ``written`` (the agent's desk), a larger one by the copy thread (``Replicator.written``)
KEEP_S = 600.0            # a push connection with no push for this long is closed (the pusher opens a new one)


class Replicator:
    """Background snapshot, replication and restore transfers for one process.

    secret: the job's HMAC key. layout: StateLayout of this job's payload. log: has ``emit(name, **fields)``.
    host: the address peers reach this process at (bound as given; not a wildcard), or ``sock``: a listening
    socket already bound there (its address is exchanged before the layout is known). timeout: seconds
    without progress after which a push or an incoming transfer is abandoned.
    Raises ValueError for a wildcard or empty host, OSError if it cannot listen.
    """

    def __init__(self, secret: bytes, layout: StateLayout, log, *, host: str | None = None, sock=None,
                 timeout: float = 30.0, own: SlotPair | None = None, transport=None):
        self.transport = transport or TCP  # replica/transports.py: which sockets (tcp, unix, a plugin's)
        if sock is None:  # else: a listener made by the transport before the layout was known (agent/__main__.py)
            sock = self.transport.listen(host)  # ValueError for a wildcard TCP host, OSError if it cannot listen
        self.secret = secret
        self.layout = layout
        self.log = log
        self.timeout = timeout
        self.serve_hook = None    # test hook: serve_hook(rank, step, sent_bytes, total) after each piece served
        self.receive_hook = None  # test hook: receive_hook(rank, step, received_bytes, total) after each piece of a push
        self.own = own if own is not None else SlotPair(layout.nbytes)  # own: shared with a training process
        self.bytes_sent = 0       # payload bytes acked by holders
        self.wait_s = 0.0         # time spent in wait_committed
        # one lock; waiters wait on their own condition, so a change wakes only whom it concerns: the copy thread
        # (_copy_cv: a job, the end of a pause), each holder's push thread (_Pusher.cv: a job, retired), the rest
        # (_cv: claims, commits, slots freed). A notify_all on one shared condition woke every thread of this
        # object several times a step (the closing note of this change)
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._copy_cv = threading.Condition(self._lock)
        self._held: dict[int, SlotPair] = {}
        self._writing: dict[int, object] = {}   # held rank -> token of the push being received into it
        self._own_busy: str | None = None  # "copy", "fetch" or "writer" while one writes an own slot
        self._claimed = None               # (slot, epoch) claimed by a training process (``claim``)
        self._jobs: deque = deque()
        self._epoch = 0
        self._paused = True
        self._closed = False
        self._generation = 0
        self._my_rank: int | None = None
        self._holders: list[tuple[str, int]] = []
        self._committed = -1
        self.on_commit = None     # on_commit(generation, step), under this object's lock (must not block): the
        #                           committed step grew
        self._pending: dict[int, set[str]] = {}   # step -> holders that have not acked it
        self._refused: dict[int, tuple] = {}      # step -> (why a holder refused it, transient?)
        self._last_reason: dict[str, str] = {}    # holder -> why its last push did not complete
        self._links: set[Link] = set()            # pushes in either direction (quiesce aborts them)
        self._pushers: dict[tuple[str, int], _Pusher] = {}  # holder -> its push thread
        self._other_links: set[Link] = set()      # fetches and serves (only close aborts them)
        self._listener = sock
        self._listener.settimeout(POLL_S)
        self._address = self.transport.address(sock)
        self._handlers = 0
        self._threads = [threading.Thread(target=self._accept_loop, name="deadpool-replica-accept", daemon=True),
                         threading.Thread(target=self._copy_loop, name="deadpool-snapshot", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- configuration and state ---------------------------------------------------------------
    @property
    def address(self) -> list:
        """This process's replica server address, the transport's JSON form (TCP: [host, port])."""
        return list(self._address)

    def held(self, rank: int) -> SlotPair:
        """The slots holding replicas of training rank ``rank``. Raises ReplicaError if not held."""
        with self._cv:
            pair = self._held.get(rank)
            if pair is None:
                raise ReplicaError(f"this process holds no replica of rank {rank}; held ranks: {sorted(self._held)}")
            return pair

    def configure(self, generation: int, my_rank: int | None, holders: list[list], held_ranks: list[int]) -> None:
        """Set the peers of ``generation`` and resume (after quiesce, or at start).

        my_rank: the training rank this process snapshots (None: a spare). holders: [host, port] of
        the K processes that must hold my_rank's replica ([]: a step commits once copied locally).
        held_ranks: training ranks whose replicas this process accepts. Held copies of ranks still
        listed are kept; those of ranks no longer listed are freed. Raises ValueError on a malformed
        argument (naming it).
        """
        hs = []
        for h in holders:
            if not (isinstance(h, (list, tuple)) and len(h) == 2 and isinstance(h[0], str)
                    and ((isinstance(h[1], int) and 0 < h[1] < 65536) or (isinstance(h[1], str) and h[1]))):
                raise ValueError(f"holder address {h!r} is not [host, port] (TCP) or a transport's [kind, name]")
            hs.append((h[0], h[1]))
        if hs and my_rank is None:
            raise ValueError(f"holders {holders} given without a rank to replicate (my_rank is None)")
        if len(set(hs)) != len(hs):
            raise ValueError(f"holder addresses repeat: {holders}")
        if any(not isinstance(r, int) or r < 0 for r in held_ranks):
            raise ValueError(f"held_ranks {held_ranks} must be training ranks (ints >= 0)")
        with self._cv:
            self._epoch += 1                # whatever was in flight belongs to the previous configuration
            if self._own_busy == "writer":  # a training process's claim of the previous configuration
                self._own_busy, self._claimed = None, None
            self._generation = generation
            self._my_rank = my_rank
            for slot in self.own.slots:     # a snapshot of another rank's state is not this rank's
                if my_rank is not None and slot.rank != my_rank and not slot.readers:
                    slot.invalidate()
            self._holders = hs
            for h in [h for h in self._pushers if h not in hs]:
                pusher = self._pushers.pop(h)
                pusher.retired = True
                pusher.cv.notify()
            for r in list(self._held):
                if r not in held_ranks:
                    del self._held[r]       # freed once no transfer reads it
            for r in held_ranks:
                if r not in self._held:
                    self._held[r] = SlotPair(self.layout.nbytes)
            self._committed = -1
            self._pending.clear()
            self._refused.clear()
            self._last_reason.clear()
            self._paused = False
            self._cv.notify_all()
            self._copy_cv.notify_all()

    def _commit_notice(self) -> None:
        if self.on_commit is not None:
            self.on_commit(self._generation, self._committed)

    @property
    def generation(self) -> int:
        """The generation of the last ``configure``."""
        return self._generation

    @property
    def committed_step(self) -> int:
        """The newest step every holder has acknowledged (-1: none since the last ``configure``)."""
        return self._committed

    def copy_own(self, step: int):
        """A private copy (a new Slot, same step, CRC, rank and ``pulled``) of this rank's own verified snapshot of
        ``step``, or None when the own slots no longer hold it. The slot is pinned (``readers``) while it is copied,
        so the training process's next snapshot cannot rewrite it meanwhile (agent/persister.py)."""
        with self._cv:
            slot = self.own.find(step)
            if slot is None or slot.rank != self._my_rank:
                return None
            slot.readers += 1
        try:
            out = Slot(self.layout.nbytes)
            out.buf[:] = slot.buf
            out.step, out.crc, out.rank, out.pulled = slot.step, slot.crc, slot.rank, slot.pulled
            return out
        finally:
            with self._cv:
                slot.readers -= 1
                self._cv.notify_all()

    def report(self) -> dict:
        """Verified copies only: {"own_rank": int|None, "own": [steps], "held": {"<rank>": [steps]}}."""
        with self._cv:
            return {"own_rank": self._my_rank, "own": self.own.steps(),
                    "held": {str(r): p.steps() for r, p in sorted(self._held.items())}}

    # ---- snapshot and replication ----------------------------------------------------------------
    def submit(self, step: int, tensors, rng) -> None:
        """Snapshot ``tensors`` (+ ``rng``, uint8) as ``step`` in the background, then push it to every
        holder. The caller must not modify ``tensors`` until ``wait_committed(step)`` returns."""
        with self._cv:
            self._jobs.append((step, tensors, rng))
            self._copy_cv.notify()

    def wait_committed(self, step: int, failure: threading.Event, timeout: float, beat=None) -> None:
        """Return once every holder acked a verified copy of ``step`` (no holders: once the local copy
        is done). Raises PeerFailure when ``failure`` is set, after ``timeout`` seconds, or when a holder kept
        answering "retry" (busy, not yet configured) past the transfer timeout; ReplicaError when a holder refused
        the step for good (wrong size, bad checksum). ``beat()``, if given, is called
        while it waits (the progress page's beat, ipc/shm.py: waiting on peers is not a hang)."""
        t0 = time.monotonic()
        end = t0 + timeout
        try:
            with self._cv:
                while self._committed < step:
                    if step in self._refused:
                        why, transient = self._refused[step]
                        raise (PeerFailure if transient else ReplicaError)(why)
                    if failure.is_set():
                        raise PeerFailure(f"replica of step {step} not committed: a peer failed "
                                          f"({self._waiting_for(step)})")
                    left = end - time.monotonic()
                    if left <= 0:
                        raise PeerFailure(f"replica of step {step} not committed within {timeout:g} s "
                                          f"({self._waiting_for(step)})")
                    self._cv.wait(min(left, 0.01))
                    if beat is not None:
                        beat()
        finally:
            self.wait_s += time.monotonic() - t0

    def _waiting_for(self, step: int) -> str:
        pending = self._pending.get(step)
        if pending is None:
            return f"its local copy is not done; holders: {[fmt(h) for h in self._holders]}"
        return "; ".join(f"no ack from {h}" + (f" (last: {self._last_reason[h]})" if h in self._last_reason else "")
                         for h in sorted(pending)) or "all acked"

    def quiesce(self) -> None:
        """Stop replicating: drop queued snapshots, abort the local copy in progress (its slot stays
        invalid) and every push in flight in either direction (their target slots stay invalid), and
        refuse new pushes until ``configure``. Serving fetches goes on. Returns within about 0.5 s."""
        with self._cv:
            self._paused = True
            self._epoch += 1
            self._jobs.clear()
            if self._own_busy == "writer":  # a training process's claim: its slot stays invalid
                self._own_busy = None
                self._claimed = None
            links = list(self._links)
            self._cv.notify_all()
        for link in links:
            link.shutdown()
        end = time.monotonic() + 0.5
        with self._cv:
            while self._own_busy == "copy" and time.monotonic() < end:
                self._cv.wait(0.005)

    def _copy_loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._paused or not self._jobs):
                    self._copy_cv.wait(1.0)
                if self._closed:
                    return
                step, tensors, rng = self._jobs.popleft()
                epoch = self._epoch
                if tensors is None:  # a large payload the training process wrote into its claimed slot (``written``)
                    slot, claim_epoch = rng
                    if claim_epoch != epoch:
                        continue   # quiesced meanwhile: the quiesce released the claim
                else:
                    slot = self._claim_own("copy", lambda: self._epoch != epoch or self._closed, step)
                    if slot is None:
                        continue
                    slot.rank = self._my_rank
            if tensors is None:
                self._stamp(slot, step, epoch)
                continue
            try:
                done = self.layout.write(slot, tensors, rng, step,
                                         should_stop=lambda: self._epoch != epoch or self._closed)
            except Exception as exc:  # a bad submit (shapes not those of the layout): fail its wait, keep the thread
                done = False
                with self._cv:
                    self._refused[step] = (f"snapshot of step {step} failed: {type(exc).__name__}: {exc}", False)
            finally:
                with self._cv:
                    self._own_busy = None
                    self._cv.notify_all()
            with self._cv:
                if done and self._epoch == epoch:  # else aborted (slot invalid), or done just as we quiesced
                    self._ship(slot, step, epoch)

    def _ship(self, slot: Slot, step: int, epoch: int) -> None:
        """(under _cv) ``slot`` holds ``step``, stamped: commit it (no holders) or queue it to every holder's pusher."""
        if not self._holders:
            self._committed = max(self._committed, step)
            self._commit_notice()
            self._cv.notify_all()
            return
        self._pending[step] = {fmt(h) for h in self._holders}
        slot.readers += len(self._holders)
        for h in self._holders:
            pusher = self._pushers.get(h)
            if pusher is None:
                pusher = self._pushers[h] = _Pusher(self, h)
            pusher.jobs.append((slot, step, epoch))
            pusher.cv.notify()

    def claim(self, step: int, generation: int | None = None) -> int | None:
        """For a training process that writes its own snapshot into the shared own slots (node agents): reserve
        the slot for ``step`` (invalidated) and return its index in ``own.slots``, or None if an own slot is busy
        right now (ask again) or the claim is of another ``generation`` than the configured one (a stale claim:
        never granted). Follow with ``written(step, index)`` once the bytes are there."""
        with self._cv:
            if generation is not None and generation != self._generation:
                return None
            if self._paused or self._own_busy or self.own.target(step).readers:
                return None
            self._own_busy = "writer"
            slot = self.own.begin(step)
            slot.rank = self._my_rank
            self._claimed = (slot, self._epoch)
            return self.own.slots.index(slot)

    def written(self, step: int, index: int) -> bool:
        """The training process finished writing ``step`` into the claimed slot ``index``: checksum it, stamp it
        and push it to the holders in the background (as ``submit`` does after its own copy). A payload of at most
        ``INLINE_STAMP_BYTES`` on the wire is checksummed here, in the caller's thread (a node agent's snapshot
        desk: no hand-off per step); a larger one by this object's copy thread (the desk serves every rank of the
        node: one rank's checksum must not hold up the others). A claim from before a ``quiesce``/``configure`` is
        dropped (its slot stays invalid). Returns False for such a dropped claim."""
        with self._cv:
            claimed, self._claimed = self._claimed, None
            if claimed is None or self.own.slots.index(claimed[0]) != index or claimed[1] != self._epoch:
                if self._own_busy == "writer":
                    self._own_busy = None
                return False
            slot, epoch = claimed
            if self.layout.wire_nbytes > INLINE_STAMP_BYTES:
                self._jobs.append((step, None, claimed))
                self._copy_cv.notify()
                return True
        self._stamp(slot, step, epoch)
        return True

    def _stamp(self, slot: Slot, step: int, epoch: int) -> None:
        """Checksum and stamp ``slot``, written by the training process, and ship it (unless quiesced meanwhile)."""
        done = False
        try:
            done = self.layout.stamp_written(slot, step, should_stop=lambda: self._epoch != epoch or self._closed)
        except Exception as exc:  # noqa: BLE001 - (a slot unmapped under us) the step is not committed: say why
            with self._cv:
                self._refused[step] = (f"snapshot of step {step} failed: {type(exc).__name__}: {exc}", False)
        finally:
            with self._cv:
                if self._epoch == epoch:   # else a quiesce released the claim (and a new one may hold the slots)
                    self._own_busy = None
                    if done:
                        self._ship(slot, step, epoch)
                self._cv.notify_all()

    def _claim_own(self, who: str, give_up, step: int) -> Slot | None:
        """(under _cv) Wait until no one writes an own slot and the one to write ``step`` into has no readers;
        begin it."""
        while self._own_busy or self.own.target(step).readers:
            if give_up():
                return None
            self._cv.wait(0.01)
        self._own_busy = who
        return self.own.begin(step)

    def _push(self, slot: Slot, step: int, holder, epoch: int, link: Link | None) -> Link | None:
        """Push ``step`` from ``slot`` to ``holder`` over ``link`` (kept from the previous push; None: connect).
        Returns the link to keep for the next push, or None (closed)."""
        peer = fmt(holder)
        rank = self._my_rank
        stop = lambda: ("quiesced" if self._epoch != epoch else None) or ("closed" if self._closed else None)
        start = time.monotonic()
        ok = stop() is not None  # a job of an old epoch (quiesced before its turn) ends here; the link is kept
        try:
            if ok:
                return link
            while True:
                kept = link is not None
                if link is None:
                    link = Link.connect(holder, stop, idle=self.timeout, transport=self.transport)
                    self._track(link, self._links)
                link.stop, link.idle, link.last = stop, self.timeout, time.monotonic()
                try:
                    link.send_msg("push", {"generation": self._generation, "rank": rank, "step": step,
                                           "nbytes": self.layout.wire_nbytes, "crc": slot.crc}, self.secret)
                    kind, go = link.recv_msg(self.secret)
                except PeerGone:
                    if not kept or stop():
                        raise
                    # the kept connection was closed while idle (a quiesce on either side, the holder's KEEP_S):
                    # nothing of this push has moved yet, so start again on a new one
                    self._drop(link)
                    link = None
                    continue
                if kind != "go":
                    raise WireError(f"expected 'go', got {kind!r}")
                if go.get("ok"):
                    break
                reason = str(go.get("reason"))
                self._note(epoch, peer, f"refused: {reason}")
                if not go.get("retry"):
                    ok = True  # the exchange completed: the connection is still good
                    self._refuse(epoch, step, peer, reason)
                    return link
                if time.monotonic() - start > self.timeout:  # busy or not configured for too long: transient
                    ok = True
                    self._refuse(epoch, step, peer, f"still refused after {self.timeout:g} s: {reason}", transient=True)
                    return link
                with self._cv:
                    self._cv.wait(POLL_S)
                    if stop():
                        raise Stopped(stop())
            link.send(self.layout.wire(slot))
            kind, ack = link.recv_msg(self.secret)
            if kind != "ack" or ack.get("rank") != rank or ack.get("step") != step or ack.get("crc") != slot.crc:
                raise WireError(f"expected the ack of rank {rank} step {step} crc {slot.crc}, got {kind} {ack}")
            ok = True
            if not ack.get("ok"):
                self._refuse(epoch, step, peer, str(ack.get("reason")))
                return link
            with self._cv:
                if self._epoch == epoch:
                    self._last_reason.pop(peer, None)
                    pending = self._pending.get(step, set())
                    pending.discard(peer)
                    self.bytes_sent += self.layout.wire_nbytes
                    if not pending:
                        self._committed = max(self._committed, step)
                        self._commit_notice()
                    self._cv.notify_all()
        except (LinkError, WireError, OSError) as exc:
            self._note(epoch, peer, f"{type(exc).__name__}: {exc}")
            self.log.emit("replica_transfer_abandoned", kind="push", peer=peer, rank=rank, step=step,
                          done_bytes=getattr(exc, "done", None), nbytes=self.layout.wire_nbytes,
                          reason=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            if link is not None and not ok:
                self._drop(link)
                link = None
            with self._cv:
                slot.readers -= 1
                self._cv.notify_all()
        return link

    def _drop(self, link: Link) -> None:
        self._untrack(link, self._links)
        link.close()

    def _note(self, epoch: int, peer: str, reason: str) -> None:
        with self._cv:
            if epoch == self._epoch:
                self._last_reason[peer] = reason[:200]

    def _refuse(self, epoch: int, step: int, peer: str, reason: str, transient: bool = False) -> None:
        self.log.emit("replica_rejected", role="sender", peer=peer, rank=self._my_rank, step=step, reason=reason[:300])
        with self._cv:
            if epoch == self._epoch:
                self._refused.setdefault(step, (f"holder {peer} refused the replica of step {step}: {reason}", transient))
                self._cv.notify_all()

    # ---- restore -------------------------------------------------------------------------------
    def fetch(self, address, rank: int, step: int, failure: threading.Event, timeout: float) -> Slot:
        """Pull training rank ``rank``'s verified copy of ``step`` from the process at ``address``
        ([host, port]) into ``own.begin(step)``; verify rank, step, size and CRC-32C; stamp and return the slot.

        Raises ReplicaError if the server holds no such copy or what arrives does not match (naming
        expected and got), PeerFailure on a connection error, EOF, ``failure`` set, or ``timeout``
        seconds passed. Returns or raises within ``timeout`` (+ ~POLL_S); notices ``failure`` within POLL_S.
        """
        peer = fmt(address)
        what = f"replica of rank {rank} step {step} from {peer}"
        stop = lambda: ("failure flag set" if failure.is_set() else None) or ("closed" if self._closed else None)
        deadline = time.monotonic() + timeout
        link, slot, claimed = None, None, False
        try:
            link = Link.connect(address, stop, deadline=deadline, transport=self.transport)
            self._track(link, self._other_links)
            link.send_msg("fetch", {"generation": self._generation, "rank": rank, "step": step}, self.secret)
            kind, hdr = link.recv_msg(self.secret)
            if kind != "replica":
                raise ReplicaError(f"{what}: expected a 'replica' header, got {kind!r}")
            if not hdr.get("ok"):
                raise ReplicaError(f"{what}: {hdr.get('reason')}")
            got = (hdr.get("rank"), hdr.get("step"), hdr.get("nbytes"))
            if got != (rank, step, self.layout.wire_nbytes) or not isinstance(hdr.get("crc"), int):
                raise ReplicaError(f"{what}: got rank {got[0]} step {got[1]} ({got[2]} bytes); expected rank {rank} "
                                   f"step {step} ({self.layout.wire_nbytes} bytes)")
            with self._cv:
                slot = self._claim_own("fetch", lambda: stop() or time.monotonic() > deadline, step)
                if slot is None:
                    link.check()
                    raise PeerFailure(f"{what}: an own slot stayed busy until the timeout ({timeout:g} s)")
                claimed = True
                slot.rank = rank
            wire = self.layout.wire(slot)
            crc = _RunningCrc(wire)
            link.recv_into(wire, crc.update)
            if crc.value != hdr["crc"]:
                self.log.emit("replica_rejected", role="fetcher", peer=peer, rank=rank, step=step,
                              reason=f"checksum mismatch: header {hdr['crc']}, payload {crc.value}")
                raise ReplicaError(f"{what} fails its checksum (header {hdr['crc']}, payload {crc.value})")
            with self._cv:
                slot.pulled = True   # the wire part only: no kept shares (Slot)
                slot.stamp(step, crc.value)
            return slot
        except WireError as exc:
            raise ReplicaError(f"{what}: {exc}") from exc
        except LinkError as exc:
            self.log.emit("replica_transfer_abandoned", kind="fetch", peer=peer, rank=rank, step=step,
                          done_bytes=exc.done, nbytes=self.layout.wire_nbytes, reason=f"{type(exc).__name__}: {exc}"[:300])
            raise PeerFailure(f"{what} failed: {exc}") from exc
        finally:
            if link is not None:
                self._untrack(link, self._other_links)
                link.close()
            if claimed:
                with self._cv:
                    self._own_busy = None
                    self._cv.notify_all()

    # ---- the server side -----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(POLL_S)
                continue
            with self._cv:
                full = self._handlers >= MAX_CONNECTIONS
                if not full:
                    self._handlers += 1
            if full:
                sock.close()
                continue
            threading.Thread(target=self._handle, args=(sock, addr), daemon=True, name="deadpool-replica-serve").start()

    def _handle(self, sock, addr) -> None:
        closed = lambda: "closed" if self._closed else None  # noqa: E731
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else f"{self.transport.peer(self._address)} (incoming)"
        link = Link(sock, peer, closed, deadline=time.monotonic() + min(HELLO_S, self.timeout))
        self._track(link, self._other_links)
        try:
            first = True
            while True:
                try:
                    kind, body = link.recv_msg(self.secret)
                except WireError as exc:
                    self.log.emit("replica_rejected", role="receiver", peer=link.peer, reason=str(exc)[:300])
                    return
                except (PeerGone, Stalled) as exc:
                    if first or exc.done:
                        raise
                    return  # the pusher closed its kept connection between two pushes, or left it idle KEEP_S
                link.deadline = None
                link.idle = self.timeout
                if kind == "push":
                    if not self._receive(link, body):
                        return
                elif kind == "fetch":
                    return self._serve(link, body)
                else:
                    self.log.emit("replica_rejected", role="receiver", peer=link.peer,
                                  reason=f"unexpected message {kind!r}")
                    return
                first = False
                link.stop, link.idle, link.last = closed, KEEP_S, time.monotonic()
        except (LinkError, WireError, OSError) as exc:
            if not self._closed:
                self.log.emit("replica_transfer_abandoned", kind="incoming", peer=link.peer,
                              done_bytes=getattr(exc, "done", None), reason=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            self._untrack(link, self._other_links)
            self._untrack(link, self._links)
            link.close()
            with self._cv:
                self._handlers -= 1

    def _receive(self, link: Link, hdr: dict) -> bool:
        """One push on ``link``; True when the exchange completed (the link can carry the next push)."""
        rank, step, nbytes, crc = (hdr.get(k) for k in ("rank", "step", "nbytes", "crc"))
        slot = pair = None
        retry = False
        token = object()
        generation = hdr.get("generation")
        with self._cv:
            epoch = self._epoch
            if not all(isinstance(v, int) for v in (rank, step, nbytes, crc, generation)):
                reason = f"malformed push header {hdr}"
            elif generation < self._generation and not self._paused:
                # a process still on an older generation (one the others left: fenced, or not yet told) must not
                # evict a copy the live rank has committed since
                reason = f"push of generation {generation}; this holder is at generation {self._generation}"
            elif nbytes != self.layout.wire_nbytes:
                reason = f"payload of {nbytes} bytes, expected {self.layout.wire_nbytes}"
            elif self._paused:
                reason, retry = "not accepting pushes (quiesced, not yet configured)", True
            elif rank not in self._held:
                reason, retry = f"rank {rank} is not held here (held ranks: {sorted(self._held)})", True
            elif rank in self._writing or self._held[rank].target(step).readers:
                reason, retry = f"rank {rank}'s slot is busy (another push, or a fetch being served)", True
            else:
                reason = None
                pair = self._held[rank]
                slot = pair.begin(step)
                slot.rank = rank
                self._writing[rank] = token
        if reason is not None:
            if not retry:  # a retryable refusal (busy, not configured yet) is the pusher's to report if it gives up
                self.log.emit("replica_rejected", role="holder", peer=link.peer, rank=rank, step=step, reason=reason[:300])
            link.send_msg("go", {"ok": False, "reason": reason, "retry": retry}, self.secret)
            return True
        try:
            link.stop = lambda: ("quiesced" if self._epoch != epoch else None) or ("closed" if self._closed else None)
            self._track(link, self._links)
            link.send_msg("go", {"ok": True, "reason": "", "retry": False}, self.secret)
            wire = self.layout.wire(slot)
            got = _RunningCrc(wire)
            hook = self.receive_hook
            on_recv = got.update if hook is None else (lambda n: (got.update(n), hook(rank, step, n, nbytes)))
            try:
                link.recv_into(wire, on_recv)
            except LinkError as exc:
                self.log.emit("replica_transfer_abandoned", kind="receive", peer=link.peer, rank=rank, step=step,
                              done_bytes=exc.done, nbytes=nbytes, reason=f"{type(exc).__name__}: {exc}"[:300])
                return False
            with self._cv:
                if got.value != crc:
                    ok, reason = False, f"checksum mismatch: header {crc}, payload {got.value}"
                elif self._epoch != epoch or self._held.get(rank) is not pair:
                    return False  # quiesced or reconfigured while it arrived: dropped, the slot stays invalid
                else:
                    ok, reason = True, ""
                    slot.stamp(step, crc)
                self._release(rank, token)   # before the ack: the sender's next push must not find it busy
            if not ok:
                self.log.emit("replica_rejected", role="holder", peer=link.peer, rank=rank, step=step, reason=reason)
            link.send_msg("ack", {"rank": rank, "step": step, "crc": crc, "ok": ok, "reason": reason}, self.secret)
            return True
        finally:
            with self._cv:
                self._release(rank, token)
                self._cv.notify_all()

    def _release(self, rank: int, token: object) -> None:
        """(under _cv) End this push's claim on ``rank``, never a later push's."""
        if self._writing.get(rank) is token:
            del self._writing[rank]

    def _serve(self, link: Link, req: dict) -> None:
        rank, step = req.get("rank"), req.get("step")
        if not (isinstance(rank, int) and isinstance(step, int)):
            link.send_msg("replica", {"ok": False, "reason": f"malformed fetch request {req}"}, self.secret)
            return
        with self._cv:
            slot = self.own.find(step)
            if slot is None or slot.rank != rank:
                pair = self._held.get(rank)
                slot = pair.find(step) if pair is not None else None
            if slot is None:
                reason = (f"no verified copy of rank {rank} step {step} here (own rank {self._my_rank}: "
                          f"{self.own.steps()}; held: {({str(r): p.steps() for r, p in self._held.items()})})")
            else:
                slot.readers += 1
                crc = slot.crc
        if slot is None:
            link.send_msg("replica", {"ok": False, "reason": reason}, self.secret)
            return
        try:
            link.send_msg("replica", {"ok": True, "reason": "", "rank": rank, "step": step,
                                      "nbytes": self.layout.wire_nbytes, "crc": crc}, self.secret)
            hook, total = self.serve_hook, self.layout.wire_nbytes
            link.send(self.layout.wire(slot), None if hook is None else (lambda sent: hook(rank, step, sent, total)))
        except LinkError as exc:
            self.log.emit("replica_transfer_abandoned", kind="serve", peer=link.peer, rank=rank, step=step,
                          done_bytes=exc.done, nbytes=self.layout.wire_nbytes, reason=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            with self._cv:
                slot.readers -= 1
                self._cv.notify_all()

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _track(self, link: Link, links: set) -> None:
        with self._cv:
            links.add(link)

    def _untrack(self, link: Link, links: set) -> None:
        with self._cv:
            links.discard(link)

    def close(self) -> None:
        """Stop every thread and transfer and close the sockets. Returns within about 1 s."""
        with self._cv:
            self._closed = True
            self._epoch += 1
            links = list(self._links | self._other_links)
            self._cv.notify_all()
            self._copy_cv.notify_all()
            for pusher in self._pushers.values():
                pusher.cv.notify()
        for link in links:
            link.shutdown()
        try:
            self._listener.close()
        except OSError:
            pass
        end = time.monotonic() + 1.0
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))


class _Pusher:
    """The push thread of one holder: pushes the (slot, step, epoch) jobs handed to it in order, keeping its
    connection between pushes; ends once ``retired`` (the holder left the configuration) or closed, when no
    job is left (a job of an old epoch ends at once: its stop says "quiesced")."""

    def __init__(self, rep: Replicator, holder: tuple[str, int]):
        self.rep, self.holder = rep, holder
        self.jobs: deque = deque()
        self.retired = False
        self.cv = threading.Condition(rep._lock)   # notified with a job, when retired, at close
        threading.Thread(target=self._run, name="deadpool-replica-push", daemon=True).start()

    def _run(self) -> None:
        rep, link = self.rep, None
        try:
            while True:
                with rep._cv:
                    while not self.jobs and not (self.retired or rep._closed):
                        self.cv.wait(KEEP_S)
                    if not self.jobs:
                        return
                    slot, step, epoch = self.jobs.popleft()
                link = rep._push(slot, step, self.holder, epoch, link)
        finally:
            if link is not None:
                rep._drop(link)


class _RunningCrc:
    """CRC-32C of a buffer filled front to back, computed in pieces of >= 1 MiB as bytes arrive."""

    PIECE = 1 << 20

    def __init__(self, buf):
        self.mv = memoryview(buf).cast("B")
        self.done = 0
        self.value = 0

    def update(self, upto: int) -> None:
        if upto - self.done >= self.PIECE or upto == len(self.mv):
            self.value = checksum(self.mv[self.done:upto], self.value)
            self.done = upto
