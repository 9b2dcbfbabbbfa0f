"""Ring link: each node agent holds a TCP connection to its successor on the ring of live agents (and accepts
one from its predecessor), only to learn at once that the process at the other end is gone.

When a process dies, its kernel closes its sockets: the peer reads end-of-file (or a reset) within
milliseconds, long before a heartbeat deadline. That covers a crashed or killed agent (its node's processes
included: they die with it). It cannot cover a frozen agent or a node that lost power (nothing closes): the
heartbeats (control/peers.py) do. Each agent is linked to two peers (successor, predecessor), so the cost per agent
does not grow with the job. A connection's first message is a ``watch`` hello signed with the job secret
(ipc/wire.py); anything else is dropped.

Owns: the listening socket, the two connections, and reporting EOF as a lost node. Does not own: what a lost
node means (the node agent suspects it through the control plane).
"""
from __future__ import annotations

import select
import socket
import struct
from dataclasses import dataclass

from ..ipc import wire
from ..ipc.schema import WATCH, Message


@dataclass(frozen=True)
class RingHello(Message, plane=WATCH, kind="watch"):
    """The first frame on a ring-link connection: its sender is node ``node`` (its MPI rank)."""

    node: int


class RingLink:
    """me: this node; secret: the job secret; host: the address peers reach this node at."""

    def __init__(self, me: int, secret: bytes, host: str):
        self.me = me
        self.secret = secret
        self.listener = socket.create_server((host, 0), backlog=16)
        self.listener.setblocking(False)
        self.address = [host, self.listener.getsockname()[1]]
        self.links: dict[socket.socket, int | None] = {}  # connection -> peer node (None: hello not read yet)
        self.successor: int | None = None
        self.enabled = True

    def retarget(self, alive: list[int], addresses: dict) -> None:
        """Link to the successor of this node on the ring of ``alive`` nodes (dial it if it changed). addresses:
        node -> [host, port]. A successor that cannot be reached within 1 s is left to the heartbeats."""
        ring = sorted(alive)
        if self.me not in ring or len(ring) < 2:
            return
        succ = ring[(ring.index(self.me) + 1) % len(ring)]
        if succ == self.successor:
            return
        self.successor = succ
        try:
            s = socket.create_connection(tuple(addresses[succ]), timeout=1.0)
            payload = wire.encode(RingHello.KIND, RingHello(self.me).to_wire(), self.secret)
            s.sendall(struct.pack(">I", len(payload)) + payload)
            s.setblocking(False)
            self.links[s] = succ
        except OSError:
            pass

    def poll(self) -> list[int]:
        """Nodes whose connection ended since the last call (their process is gone). Never blocks."""
        lost = []
        try:
            while True:
                c, _ = self.listener.accept()
                c.setblocking(False)
                self.links[c] = None
        except (BlockingIOError, OSError):
            pass
        if not self.links:
            return lost
        ready, _, _ = select.select(list(self.links), [], [], 0)
        for c in ready:
            peer = self.links[c]
            try:
                data = c.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if peer is None and data:  # the predecessor's hello
                try:
                    n = struct.unpack(">I", data[:4])[0]
                    kind, body = wire.decode(data[4:4 + n], n, self.secret)
                    self.links[c] = RingHello.from_wire(body).node if kind == RingHello.KIND else None
                except (struct.error, wire.WireError, KeyError, ValueError, TypeError):
                    self._drop(c)
                continue
            if not data:
                self._drop(c)
                if peer is not None and self.enabled:
                    lost.append(peer)
        return lost

    def _drop(self, c) -> None:
        self.links.pop(c, None)
        try:
            c.close()
        except OSError:
            pass

    def close(self) -> None:
        self.enabled = False
        for c in list(self.links):
            self._drop(c)
        self.listener.close()
