"""The Replicator: one process's replica plane, assembled from its roles; ``Replicator`` is its interface.

A node agent makes one Replicator per local training rank (agent/node.py). Its roles, each in a module of its own:
- replica/slots.py ``ReplicaState``: the own snapshot slots (shared with the training process) and the held
  replicas of other ranks' snapshots, who writes an own slot, the configuration and its epoch, under one lock;
- replica/pusher.py ``Sender``: a slot the training process wrote (``claim``, ``written``: the snapshot protocol,
  replica/writer.py) is checksummed, pushed to the K holders by one push thread per holder over a connection kept
  between steps, and committed once every holder acked a verified copy (``on_commit``);
- replica/holder.py ``Holder``: the server thread; receives pushes into held slots, hands restores to ``receive``;
- replica/restore.py: a restore, sent by the rank's source (``send_restore``) to the process that expects it
  (``expect_restore``) into an own slot (``wait_restore``).

Does not own: who holds whom and who restores from whom (the recovery decision, ``control/``; the caller passes
addresses to ``configure`` and ``send_restore``), failure detection (a dead or frozen peer here only ends a transfer;
the caller's failure flag and timeouts end the waits), the payload layout and checksum (``snapshot.py``), the socket
mechanics (``stream.py``). No MPI: the control plane's heartbeats never wait behind a replica, whatever its size.
No thread holds the GIL for long (socket I/O releases it; the CRC-32C takes it for about 0.1 ms per MiB piece).

Every message is framed and HMAC-signed with the job secret (``stream.py``); payloads are raw bytes, nothing is
pickled. Each module describes its side of the wire. A quiesce (either side) shuts the push connections down; a
push that finds its kept connection gone before its ``go`` opens a new one and starts again.

Memory per process: 2 own slots + 2 slots per held rank, each of the payload's size, allocated at ``configure``
and freed when the rank is no longer held; no landing buffer, no per-transfer payload buffer (payloads are received
straight into their slot and checksummed there). With K replicas per rank spread evenly, each process holds K
ranks: memory per rank = (2 + 2K) x payload bytes (pages become resident as slots are first written).

Technique learned from torchft's ``HTTPTransport`` (pytorch/torchft, torchft/checkpointing/http_transport.py): a
restore moves between threads that exist for it in the processes at both ends, at addresses exchanged out of band,
with a timeout on every socket operation, and a checkpoint still being staged is never sent. Here instead: no pickle,
a signed header and an end-to-end checksum, pushes for replication and for restores (torchft's is a pull: the
recovering replica asks), abort flags checked between chunks.
"""
from __future__ import annotations

import threading
import time

from . import restore as _restore
from .holder import Holder
from .pusher import Sender
from .slots import ReplicaState
from .snapshot import Slot, SlotPair, StateLayout
from .stream import TCP


def _state_attr(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.state, name), lambda self, v: setattr(self.state, name, v), doc=doc)


class Replicator:
    """Snapshot replication and restore transfers for one training rank's slots in one process (a node agent).

    secret: the job's HMAC key. layout: StateLayout of this job's payload. log: has ``emit(name, **fields)``.
    host: the address peers reach this process at (bound as given; not a wildcard), or ``sock``: a listening
    socket already bound there (its address is exchanged before the layout is known). timeout: seconds
    without progress after which a push or an incoming transfer is abandoned. own: the own SlotPair (shared with
    the training process; default: private memory). transport: replica/transports.py's (default TCP).
    Raises ValueError for a wildcard or empty host, OSError if it cannot listen.
    """

    layout = _state_attr("layout", "The StateLayout of the payload.")
    on_commit = _state_attr("on_commit", "on_commit(generation, step), under the lock (must not block): the "
                                         "committed step grew (agent/node.py stores the committed word).")
    restore_send_hook = _state_attr("restore_send_hook", "Test hook: restore_send_hook(rank, step, sent_bytes, "
                                                         "total) after each piece of a restore sent.")
    receive_hook = _state_attr("receive_hook", "Test hook: receive_hook(rank, step, received_bytes, total) after "
                                               "each piece of a push.")

    def __init__(self, secret: bytes, layout: StateLayout, log, *, host: str | None = None, sock=None,
                 timeout: float = 30.0, own: SlotPair | None = None, transport=None):
        transport = transport or TCP  # replica/transports.py: which sockets (tcp, unix, a plugin's)
        if sock is None:  # else: a listener made by the transport before the layout was known (agent/__main__.py)
            sock = transport.listen(host)  # ValueError for a wildcard TCP host, OSError if it cannot listen
        self.state = ReplicaState(secret, layout, log, timeout, transport,
                                  own if own is not None else SlotPair(layout.nbytes))
        self.own = self.state.own
        self.sender = Sender(self.state)
        self.holder = Holder(self.state, sock)
        self.state.address = list(self.holder.address)

    # ---- configuration and state ---------------------------------------------------------------
    @property
    def address(self) -> list:
        """This process's replica server address, the transport's JSON form (TCP: [host, port])."""
        return list(self.holder.address)

    @property
    def generation(self) -> int:
        """The generation of the last ``configure``."""
        return self.state.generation

    @property
    def committed_step(self) -> int:
        """The newest step every holder has acknowledged (-1: none since the last ``configure``)."""
        return self.sender.committed

    @property
    def bytes_sent(self) -> int:
        """Payload bytes acknowledged by holders."""
        return self.sender.bytes_sent

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
        with self.state.lock:
            self.state.configure(generation, my_rank, hs, held_ranks)
            self.sender.reconfigure()

    def held(self, rank: int) -> SlotPair:
        """The slots holding replicas of training rank ``rank``. Raises ReplicaError if not held."""
        return self.state.held_pair(rank)

    def report(self) -> dict:
        """Verified copies only: {"own_rank": int|None, "own": [steps], "held": {"<rank>": [steps]}}."""
        return self.state.report()

    def copy_own(self, step: int) -> Slot | None:
        """A private copy of this rank's own verified snapshot of ``step``, or None (``ReplicaState.copy_own``)."""
        return self.state.copy_own(step)

    # ---- the snapshot protocol's agent side (agent/desk.py; replica/writer.py describes it) ----------
    def claim(self, step: int, generation: int | None = None) -> int | None:
        """Reserve the own slot for ``step`` (invalidated) for the training process and return its index in
        ``own.slots``, or None if an own slot is busy right now (ask again) or the claim is of another
        ``generation`` than the configured one (a stale claim: never granted). Follow with ``written``."""
        return self.state.claim(step, generation)

    def written(self, step: int, index: int) -> bool:
        """The training process finished writing ``step`` into the claimed slot ``index``: checksum it, stamp it and
        push it to the holders (``Sender.written``). False for a claim a ``quiesce``/``configure`` dropped."""
        return self.sender.written(step, index)

    # ---- restore (replica/restore.py: the wire, what is checked, what is raised) --------------------------------
    def expect_restore(self, rank: int, step: int, generation: int) -> None:
        """Accept from now on the copy of training rank ``rank``'s ``step`` that its source sends for ``generation``
        (``wait_restore`` or ``poll_restore`` takes it)."""
        _restore.expect(self.state, rank, step, generation)

    def wait_restore(self, failure: threading.Event, timeout: float) -> Slot:
        """The expected copy, verified, in an own slot; raises ReplicaError (no such copy at the source, a mismatch)
        or PeerFailure (the transfer broke off, ``failure`` set, ``timeout`` seconds passed)."""
        return _restore.wait(self.state, failure, timeout)

    def poll_restore(self, failure: threading.Event, since: float, timeout: float, for_s: float) -> Slot | None:
        """``wait_restore`` in pieces (the node agent ticks its loop between them): waits up to ``for_s`` seconds of
        the wait that began at monotonic ``since`` and ends ``timeout`` seconds later; None while the copy has not
        arrived and the end is ahead (poll again). Raises as ``wait_restore`` does (PeerFailure once the end passed)."""
        return _restore.poll(self.state, failure, since, timeout, for_s)

    def send_restore(self, address, rank: int, step: int, generation: int, failure: threading.Event,
                     timeout: float) -> None:
        """As the source of training rank ``rank``: send this process's verified copy of ``step`` to the process at
        ``address``, which restores it for ``generation``; returns once it acknowledged a verified copy. Raises
        ReplicaError (no such copy here, refused) or PeerFailure (connection, ``failure``, ``timeout``)."""
        _restore.send(self.state, address, rank, step, generation, failure, timeout)

    # ---- pause and end ----------------------------------------------------------------------------
    def quiesce(self) -> None:
        """Stop replicating: drop a claim (its slot stays invalid), the written slots not yet checksummed and every
        push in flight in either direction (their target slots stay invalid), and refuse new pushes until
        ``configure``; an expected restore is dropped, restores being sent go on. Returns at once (the links are shut
        down here)."""
        links = self.state.quiesce()
        self.sender.quiesce()
        for link in links:
            link.shutdown()

    def close(self) -> None:
        """Stop every thread and transfer and close the sockets. Returns within about 1 s."""
        links = self.state.close()
        for link in links:
            link.shutdown()
        try:
            self.holder.listener.close()
        except OSError:
            pass
        end = time.monotonic() + 1.0
        self.sender.close()
        self.holder.close(max(0.0, end - time.monotonic()))
