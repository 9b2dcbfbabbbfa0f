"""An agent's UDP socket: its wake-up bell and its heartbeats.

MPI gives a thread no way to sleep until a message arrives: the agent must poll (``Improbe``), and each poll runs
MPI's progress engine. Measured here (MPICH wheel, UCX netmod, 8 agents): about 0.1 ms of CPU per pass, so an
agent that polls at every heartbeat (10 per second) spends 0.2-0.3 % of a core doing nothing: 256 idle agents
then use more than half a core together, which a large job cannot afford. Polling seldom instead would delay every
control message, once per hop of a dissemination tree. So:

- **Heartbeats are datagrams** to the agents that watch this one (topology.ring_neighbours), not MPI messages:
  ``H`` + the sender's MPI rank + a truncated HMAC-SHA256 of both with the job secret (a datagram from outside
  the job is dropped). The way SWIM-family failure detectors send theirs; a datagram sent to a frozen or dead
  agent is dropped by the kernel and never blocks the sender (MPI's eager cells can, notes/ft-probes.md).
- **The bell**: whoever sends this agent an MPI control message also rings it, one datagram (other agents:
  ``ring(address)`` after the MPI send; threads of the same process: ``set()``). A bell carries nothing trusted:
  it only ends the agent's sleep, and the agent then reads its MPI messages, which are authenticated (ipc/wire.py).

A quiet agent thus sleeps until its next heartbeat is due, runs MPI's progress engine only when rung (or every
``MPI_IDLE_POLL_S``, so a lost bell costs that much latency, never a message), and still reads a control
message within microseconds of its arrival.
"""
from __future__ import annotations

import hashlib
import hmac
import select
import socket
import struct

BELL = b"!"    # another agent sent this one an MPI control message
LOCAL = b"."   # a thread of this process queued something for the control thread (peers.py)
HEARTBEAT = b"H"
# the confirmation of a silent peer (control/suspicion.py, SWIM's probes): a ping, a ping request to a helper, an
# ack and a helper's nack; each ``kind`` + four big-endian uint32 (sender, origin, target, nonce) + 16-byte MAC
PING, PING_REQ, ACK, NACK = b"P", b"Q", b"A", b"N"
PROBE_KINDS = (PING, PING_REQ, ACK, NACK)
_MAC_BYTES = 16
_PROBE = struct.Struct(">IIII")


class Waker:
    """host: the address other agents reach this one at; secret: the per-job key. ``address`` (the bell) and
    ``hb_address`` (heartbeats), each [host, port], go into the agent's identity record (control/plane.py)."""

    def __init__(self, host: str = "127.0.0.1", secret: bytes = b""):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.setblocking(False)
        self.address = [host, self.sock.getsockname()[1]]
        # heartbeats arrive on a socket of their own that nobody sleeps on: read once per pass of the agent's loop
        # (at least once per heartbeat period), they never wake a quiet agent (three times the wake-ups, measured)
        self.hb_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.hb_sock.bind((host, 0))
        self.hb_sock.setblocking(False)
        self.hb_address = [host, self.hb_sock.getsockname()[1]]
        self._out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._out.setblocking(False)
        self._secret = secret
        self._beats: dict[int, bytes] = {}  # rank -> its heartbeat datagram (fixed bytes per sender)
        self.rejected = 0                   # datagrams dropped: not a bell, not a heartbeat of this job
        self.probes: list[tuple] = []       # verified probe datagrams read by drain, not taken yet

    def heartbeat(self, rank: int) -> bytes:
        """The heartbeat datagram of MPI rank ``rank``: ``H`` + rank (4 bytes, big-endian) + 16-byte MAC."""
        beat = self._beats.get(rank)
        if beat is None:
            head = HEARTBEAT + struct.pack(">I", rank)
            beat = self._beats[rank] = head + hmac.new(self._secret, head, hashlib.sha256).digest()[:_MAC_BYTES]
        return beat

    def beat(self, me: int, address) -> None:
        """Send this agent's (MPI rank ``me``) heartbeat to ``address``, another agent's ``hb_address``; never
        blocks or raises."""
        try:
            self._out.sendto(self.heartbeat(me), (address[0], int(address[1])))
        except OSError:
            pass

    def probe(self, kind: bytes, sender: int, origin: int, target: int, nonce: int, address) -> None:
        """Send a probe datagram (``kind``: one of PROBE_KINDS) to ``address``, another agent's ``hb_address``:
        ``sender`` sends it, on behalf of ``origin`` (the watcher that opened the probe), about ``target``. Never
        blocks or raises (a datagram to a frozen agent waits in its socket buffer, to a dead one is dropped)."""
        body = kind + _PROBE.pack(sender, origin, target, nonce & 0xFFFFFFFF)
        try:
            self._out.sendto(body + hmac.new(self._secret, body, hashlib.sha256).digest()[:_MAC_BYTES],
                             (address[0], int(address[1])))
        except OSError:
            pass

    def drain(self, bell: bool = True) -> tuple[int, list[int]]:
        """Read every datagram that has arrived (the bell's only when ``bell``: ``wait`` said it rang). Returns
        (how many other agents rang: messages on their way, the MPI ranks whose verified heartbeats came). Verified
        probe datagrams are appended to ``probes`` as (kind, sender, origin, target, nonce), for the caller to take."""
        rung, beats = 0, []
        if bell:
            try:
                while True:
                    rung += self.sock.recv(64) == BELL
            except (BlockingIOError, InterruptedError, OSError):
                pass
        while True:
            try:
                data = self.hb_sock.recv(64)
            except (BlockingIOError, InterruptedError, OSError):
                return rung, beats
            if len(data) == 1 + _PROBE.size + _MAC_BYTES and data[:1] in PROBE_KINDS:
                body = data[:-_MAC_BYTES]
                if hmac.compare_digest(data[-_MAC_BYTES:],
                                       hmac.new(self._secret, body, hashlib.sha256).digest()[:_MAC_BYTES]):
                    self.probes.append((data[:1], *_PROBE.unpack(body[1:])))
                else:
                    self.rejected += 1
            elif len(data) == 5 + _MAC_BYTES and data[:1] == HEARTBEAT:
                rank = struct.unpack(">I", data[1:5])[0]
                if hmac.compare_digest(data, self.heartbeat(rank)):
                    beats.append(rank)
                else:
                    self.rejected += 1
            else:
                self.rejected += 1

    def ring(self, address) -> None:
        """Wake the agent listening at ``address`` ([host, port]); never blocks, never raises."""
        try:
            self._out.sendto(BELL, (address[0], int(address[1])))
        except OSError:  # a full socket buffer means it is awake already; a gone peer needs no waking
            pass

    def set(self) -> None:
        """Wake this agent (from any thread); announces no message."""
        try:
            self._out.sendto(LOCAL, (self.address[0], int(self.address[1])))
        except OSError:
            pass

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds or until rung. Returns True when rung."""
        try:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        except (OSError, ValueError):  # closed: stop() is under way
            return True
        return bool(ready)

    def close(self) -> None:
        for s in (self.sock, self.hb_sock, self._out):
            try:
                s.close()
            except OSError:
                pass
