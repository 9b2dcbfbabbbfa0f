"""The rendezvous on one node agent: each generation's key/value store, kept equal across the member agents.

Owns: this agent's ``GenerationStore`` of each generation (agent/store.py; the newest two are kept), carrying a
local ``set`` to the other agents that serve the generation (a ``kv`` control message) and applying theirs, keys
that arrive for a generation before this agent opened its store, failing every parked wait at once when a member
agent is lost, and the store the pre-flight's link pairs meet through (``LINK_GENERATION``: every agent's, spares
included; a key goes to its pair's two nodes only, O(1) messages per node). Does not own: what a store does with
a request (agent/store.py), nor the transport of control messages (control/).
"""
from __future__ import annotations

import base64

from ..control.messages import Kv
from ..ipc.messages import LINK_GENERATION
from .preflight import link_pair_of
from .store import GenerationStore


class Rendezvous:
    """``cp``: the node's ControlPlane (its ``kv`` handler and ``on_member_lost`` are wired here)."""

    def __init__(self, cp):
        self.cp = cp
        self.stores: dict[int, GenerationStore] = {}
        self.early: dict[int, list] = {}   # generation -> [(key, value)] broadcast before we had that store
        self.link = GenerationStore(LINK_GENERATION, broadcast=lambda key, value: self._broadcast(LINK_GENERATION,
                                                                                                  key, value))
        cp.on(Kv.KIND, self._on_kv)
        cp.on_member_lost = self.fail_all

    def open(self, g: int) -> GenerationStore:
        """Generation ``g``'s store (made now, with the keys that came early, if it is new)."""
        if g not in self.stores:
            st = GenerationStore(g, broadcast=lambda key, value, g=g: self._broadcast(g, key, value))
            for key, value in self.early.pop(g, []):
                st.apply(key, value)
            self.stores = {gen: s for gen, s in self.stores.items() if gen >= g - 1}
            self.stores[g] = st
        return self.stores[g]

    def handle(self, local: int, kind: str, body: dict, send) -> None:
        """A ``store_*`` request of training process ``local``; the reply goes through ``send(local, kind, body)``."""
        gen = body.get("generation")
        if gen == LINK_GENERATION:
            self.link.handle(local, kind, body, send)   # the pre-flight's link pairs meet here
            return
        g = self.cp.generation
        (self.stores.get(gen) or self.stores.get(g) or self.open(g)).handle(local, kind, body, send)

    def expire(self) -> None:
        """Fail the parked waits whose deadline passed (each pass of the agent's loop)."""
        for st in self.stores.values():
            st.expire()
        self.link.expire()

    def fail_all(self) -> None:
        """A member agent was lost (any thread): every rendezvous wait fails now, not at its timeout."""
        for st in list(self.stores.values()):
            st.fail_all("a member node was lost")

    def _broadcast(self, g: int, key: str, value: bytes) -> None:
        """Carry a local ``set`` of generation ``g``'s store to the other agents that serve it: the generation's
        members; for the link store, the key's pair only (O(1) messages per node, not O(nodes))."""
        cp = self.cp
        msg = Kv(g=g, key=key, value=base64.b64encode(value).decode())
        if g == LINK_GENERATION:
            dests = set(link_pair_of(key) or cp.peers.alive())
        else:
            dests = set(cp.member_nodes)
        cp.peers.send_many(sorted(dests - {cp.me}), Kv.KIND, msg.to_wire())   # encoded once; a suspected node skipped

    def _on_kv(self, src: int, msg: Kv) -> None:
        g, key, value = msg.g, msg.key, base64.b64decode(msg.value)
        if g == LINK_GENERATION:
            self.link.apply(key, value)
        elif g in self.stores:
            self.stores[g].apply(key, value)
        elif g > self.cp.generation - 1:
            self.early.setdefault(g, []).append((key, value))
