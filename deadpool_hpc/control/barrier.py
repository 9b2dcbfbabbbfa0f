"""Barriers among the member agents of a generation: point-to-point ``sync`` messages, never an MPI collective (a
collective that includes a dead or frozen process never returns on MPICH without ULFM, notes/ft-probes.md 2b).
``ControlPlane.barrier`` calls ``barrier``; ``pump`` files each ``sync`` into ``cp._sync``."""
from __future__ import annotations

import time

from ..errors import PeerFailure
from .messages import Sync


def barrier(cp, tag: str, participants: list[int], timeout: float, tick=None, stop=None) -> bool:
    """Wait until every MPI rank in ``participants`` has reached the barrier ``tag`` (point-to-point
    messages, so a dead participant blocks nothing): True. ``tick()``: called each pass (the caller's loop);
    ``stop()``: checked after it, False returned at once when it is true (the caller's own failure). Raises
    PeerFailure when a participant is suspected, the failure flag is raised, or ``timeout`` seconds pass (naming
    who is missing)."""
    for p in participants:
        if p != cp.me:
            cp.peers.send(p, Sync.KIND, Sync(tag).to_wire())
    end = time.monotonic() + timeout
    while True:
        cp.pump(0.01)
        if tick is not None:
            tick()
        if stop is not None and stop():
            return False
        got = cp._sync.get(tag, set()) | {cp.me}
        missing = [p for p in participants if p not in got]
        if not missing:
            cp._sync.pop(tag, None)
            return True
        dead = [p for p in participants if cp.peers.is_suspected(p)]
        if dead:
            raise PeerFailure(f"barrier {tag}: MPI rank(s) {dead} failed")
        if cp.peers.failure.is_set():
            raise PeerFailure(f"barrier {tag}: a peer failed")
        if time.monotonic() > end:
            raise PeerFailure(f"barrier {tag}: MPI rank(s) {missing} did not arrive within {timeout:.1f} s")
