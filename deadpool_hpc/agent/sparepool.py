"""The spare pool's size, told to whoever asks Slurm for replacement nodes (``--spare-floor``; launch/companion.py).

One agent speaks for the job: the lowest live one (as the metrics' job view does). Whenever the number of live
spares it sees changes (a promotion after a loss, a spare lost or fenced, one back in the pool), it logs
``spare_pool`` (``spares``: how many, ``nodes``: which, ``generation``). The batch host's watcher reads that event
and runs the replacement policy (launch/spare_policy.py); the agent itself asks Slurm for nothing. Off (not built
by the agent) unless ``--spare-floor`` > 0.
"""
from __future__ import annotations

from typing import Protocol


class SparePoolHost(Protocol):
    """What the report reads of its node agent (agent/node.py's NodeAgent is one); nothing is written."""

    cp: object      # ControlPlane: me, generation, spare_nodes (the generation's spares, MPI ranks)
    peers: object   # Peers: alive() (this one included), is_suspected(rank), fenced
    log: object     # EventLog


class SparePool:
    """``tick()`` (the agent's loop): log ``spare_pool`` when this agent speaks for the job and the count changed."""

    def __init__(self, host: SparePoolHost) -> None:
        self.h = host
        self.last: int | None = None   # the count last logged by this agent (None: never)

    def tick(self) -> None:
        h = self.h
        alive = h.peers.alive()
        if not alive or min(alive) != h.cp.me or h.peers.fenced:
            self.last = None   # another agent speaks; should this one speak again, it logs its count at once
            return
        live = [n for n in h.cp.spare_nodes if not h.peers.is_suspected(n)]
        if len(live) != self.last:
            self.last = len(live)
            h.log.emit("spare_pool", spares=len(live), nodes=list(live), generation=h.cp.generation)
