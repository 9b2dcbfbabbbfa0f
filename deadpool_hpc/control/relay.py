"""The joined nodes' part of an agent's control thread (``Peers.relays``): their links, their routes, and the
``Relay`` messages that carry their control messages (the rules: control/joining.py).

A joined node has no MPI. Its *sponsor* (the agent of the MPI world that admitted it, or took it over) holds a TCP
link to it (control/links.py); every other agent sends messages for it as a ``Relay`` to the sponsor over MPI, and
the sponsor passes them on over the link; the joined node sends everything over its link, and the sponsor passes on
what is for others. Which relays are believed: over MPI, one that speaks for its sender or for a node the sender
sponsors; on a link, one that speaks for the node at its other end (a joined node believes its sponsor for anyone).

Threads: ``attach``, ``join_through`` and ``route`` are called from the agent's main thread (control/joining.py,
agent/joindesk.py, control/plane.py) and write under the Peers' ``lock``; everything else runs on the control
thread, which alone reads and writes a link's socket once it is attached.
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import WireError
from ..ipc import wire
from .joining import Joined, Relay, Rerouted
from .links import LinkClosed

PARK_MAX = 256   # messages held per joined node while its sponsor is suspected (until it re-attaches)


class Relays:
    """``peers``: the Peers (control/peers.py) this belongs to: its ``lock``, ``me``, ``comm`` (None in a joined
    agent), ``secret``, ``suspected``, and its ``_isend``, ``_accept``, ``suspect``, bells and counters.

    links: node -> links.Link (a sponsor's to the nodes it sponsors; a joined agent's to its sponsor); routes: joined
    node -> its sponsor, as this agent knows it; via: (a joined agent) its sponsor, every message goes through it;
    detached: (a joined agent) monotonic time its sponsor was lost, until it re-attaches (None: attached)."""

    def __init__(self, peers):
        self.p = peers
        self.links: dict = {}
        self.routes: dict[int, int] = {}
        self.via: int | None = None
        self.detached: float | None = None
        self._parked: dict[int, list] = {}   # joined node -> (dest, msg, to_suspect) held while its sponsor is lost

    # ---- written by the main thread ------------------------------------------------------------------------
    def attach(self, node: int, link) -> None:
        """(a sponsor, control/joining.py ``admit`` / ``attach``) ``link`` (links.Link) is joined node ``node``'s:
        messages for it go over it, and MPI messages from the node's old rank are dropped from now on. The caller
        writes nothing more on the link: the control thread owns it."""
        with self.p.lock:
            self.links[node] = link
            self.routes[node] = self.p.me
            self.p._topology_dirty = True
        self._release(node)

    def join_through(self, sponsor: int, link) -> None:
        """(a joined agent) Every message goes through ``link`` to ``sponsor``, the agent that admitted it (or took
        it over after its first sponsor was lost)."""
        with self.p.lock:
            self.links[sponsor] = link
            self.via = sponsor
            self.detached = None
            self.p._topology_dirty = True
        self.p._wake.set()

    def route(self, node: int, via: int) -> None:
        """Messages for joined node ``node`` go through agent ``via`` (its sponsor); those held while its last
        sponsor was suspected leave now, in order."""
        with self.p.lock:
            self.routes[node] = via
        self._release(node)

    def _release(self, node: int) -> None:
        """Messages held for ``node`` go out now; sends still pending to its slot's old MPI rank are dropped (they
        never complete, and ``sends_done`` would wait on them: the slot is not suspected any more)."""
        with self.p.lock:
            parked = self._parked.pop(node, [])
            self.p._pending = [q for q in self.p._pending if q[2] != node]
        if parked:
            self.p._outbox.extendleft(reversed(parked))
        self.p._wake.set()

    # ---- the control thread ----------------------------------------------------------------------------------
    def on_notice(self, kind: str, body: dict) -> None:
        """A ``Joined`` or ``Rerouted`` notice: the node's route (and, joined, its bell and heartbeat addresses)
        at once, on the control thread, so that its relays arriving next are believed; the main thread applies the
        rest (control/joining.py ``on_joined``). A malformed one is left to the main thread to report."""
        try:
            msg = Joined.from_wire(body) if kind == Joined.KIND else Rerouted.from_wire(body)
        except ValueError:
            return
        if msg.node == self.p.me or msg.sponsor == self.p.me and msg.node in self.links:
            return
        if isinstance(msg, Joined):
            try:
                self.p.set_addresses(msg.node, msg.identity["wake"], msg.identity["hb"])
            except (KeyError, TypeError):
                return
        self.route(msg.node, msg.sponsor)

    def between_sponsors(self) -> bool:
        """A joined agent whose sponsor is lost: what it sends waits in the outbox until it re-attaches."""
        return self.p.comm is None and self.via is None

    def taken(self, rank: int) -> bool:
        """MPI rank ``rank``'s slot is a joined node's: only relays speak for it (its old agent is fenced)."""
        with self.p.lock:
            return rank in self.routes

    def flushed(self) -> bool:
        """Nothing is left to write on any link."""
        with self.p.lock:
            return all(not link.out for link in self.links.values())

    def send(self, dest: int, msg, to_suspect: bool) -> bool:
        """Send encoded message ``msg`` to ``dest`` if it goes by relay (``dest`` is a joined node, or this agent
        is one), or hold it while ``dest``'s sponsor is suspected; True when done so, False for a plain MPI send."""
        p = self.p
        with p.lock:
            relayed = self.via is not None or dest in self.routes
            hop = self.routes.get(dest)
            if relayed and hop is not None and hop != p.me and hop in p.suspected:
                held = self._parked.setdefault(dest, [])
                held.append((dest, msg, to_suspect))
                del held[:-PARK_MAX]
                return True
        if not relayed:
            return False
        kind, body = wire.decode(msg, len(msg), p.secret)
        self.pass_on(dest, Relay(to=dest, src=p.me, inner=kind, body=body).to_wire())
        return True

    def pass_on(self, dest: int, relay: dict) -> None:
        """Send ``relay`` (a Relay's wire form) one hop toward ``dest``: over this agent's link to it, through this
        (joined) agent's sponsor, through ``dest``'s sponsor over MPI, or to ``dest`` itself over MPI."""
        p = self.p
        with p.lock:
            link = self.links.get(dest)
            hop = dest if link is not None else self.via if self.via is not None else self.routes.get(dest, dest)
            if link is None and hop in self.links:
                link = self.links[hop]
        if link is not None:
            try:
                link.send(Relay.KIND, relay)
            except LinkClosed as exc:
                self.link_lost(hop, str(exc))
                return
            except WireError:   # the relay's few bytes more took it over the limit: said, not fatal
                p._rejected += 1
                p.prober.event("relay_too_big", to=dest, kind=relay.get("inner"))
                return
            p.sent += 1
            p._wake.ring(p._bells[hop])
        elif hop == p.me or p.comm is None:
            return   # its link is gone (it is suspected already)
        else:
            try:
                msg = np.frombuffer(wire.encode(Relay.KIND, relay, p.secret), dtype=np.uint8)
            except WireError:
                p._rejected += 1
                p.prober.event("relay_too_big", to=dest, kind=relay.get("inner"))
                return
            p._isend(hop, msg)

    def link_lost(self, node: int, why: str) -> None:
        """``node``'s link ended: a suspicion of it; a joined agent that lost its sponsor holds what it sends."""
        p = self.p
        with p.lock:
            link = self.links.pop(node, None)
            mine = self.via == node
            if mine:
                self.via = None
                self.detached = time.monotonic()
        if link is not None:
            link.close()
        p.suspect(node, f"its join link closed: {why}")

    def poll(self, now: float) -> int:
        """Read every link; returns the messages read."""
        with self.p.lock:
            links = list(self.links.items())
        got = 0
        for node, link in links:
            try:
                link.flush()
                msgs = link.receive()
            except LinkClosed as exc:
                self.link_lost(node, str(exc))
                continue
            for kind, body in msgs:
                got += 1
                if kind == Relay.KIND:
                    self.on_relay(node, body, now, via_link=True)
                else:
                    self.p._rejected += 1
        return got

    def on_relay(self, hop: int, body: dict, now: float, via_link: bool) -> None:
        """A Relay from ``hop`` (over its link, or over MPI): for this agent (handled as a message of its ``src``)
        or passed on; one that speaks for a node ``hop`` may not speak for is dropped."""
        p = self.p
        try:
            r = Relay.from_wire(body)
        except ValueError as exc:
            p._rejected += 1
            p.prober.event("bad_message", kind=Relay.KIND, src=hop, error=str(exc)[:300])
            return
        with p.lock:
            sponsor_of_src = self.routes.get(r.src)
            joined_here = self.via is not None
        if via_link and not joined_here and r.src != hop or not via_link and r.src != hop and sponsor_of_src != hop:
            p._rejected += 1
            return
        if r.to != p.me:
            self.pass_on(r.to, body)
            return
        p._accept(r.src, r.inner, r.body, now)
