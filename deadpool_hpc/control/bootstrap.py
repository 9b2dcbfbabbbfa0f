"""The control plane's start-up, while every agent is alive: MPI collectives are fine here and nowhere after.

``exchange_identities`` (an Allgather of each agent's identity record: fencing and the addresses of its servers),
``wire_up`` (every pair of processes connected at start-up, so no connection is made mid-recovery) and
``bcast_text`` (a short text from one agent to all). No pickle: fixed-size byte buffers. Used by
``ControlPlane`` (control/plane.py) before its control thread starts.
"""
from __future__ import annotations

import json

import numpy as np

from ..process import fence as fencing

HELLO_BYTES = 512   # one identity record on the wire, JSON padded with spaces


def exchange_identities(world, size: int, extra: dict) -> list[dict]:
    """Every agent's identity record (``fence.identity()`` plus ``extra``), indexed by MPI rank: an Allgather over
    ``world`` (``size`` processes). Raises ValueError when this agent's record exceeds HELLO_BYTES bytes."""
    mine = json.dumps({**fencing.identity(), **extra}).encode()
    if len(mine) > HELLO_BYTES:
        raise ValueError(f"identity record of {len(mine)} bytes exceeds {HELLO_BYTES}")
    out = np.empty(HELLO_BYTES * size, dtype=np.uint8)
    world.Allgather(np.frombuffer(mine.ljust(HELLO_BYTES, b" "), dtype=np.uint8), out)
    return [json.loads(out[i * HELLO_BYTES:(i + 1) * HELLO_BYTES].tobytes()) for i in range(size)]


def wire_up(MPI, comms, me: int, size: int) -> None:
    """Connect every pair of processes on each communicator of ``comms`` at start-up (one byte each way), so no
    connection is made mid-recovery."""
    for comm in comms:
        out = np.zeros(size, dtype=np.uint8)
        back = np.empty(size, dtype=np.uint8)
        reqs = []
        for p in range(size):
            if p != me:
                reqs.append(comm.Irecv(back[p:p + 1], source=p, tag=3))
                reqs.append(comm.Isend(out[p:p + 1], dest=p, tag=3))
        MPI.Request.Waitall(reqs)


def bcast_text(world, me: int, text: str | None, root: int = 0) -> str:
    """Broadcast a short text (at most 1024 bytes of UTF-8) from ``root`` over ``world`` (all processes alive)."""
    buf = np.zeros(1024, dtype=np.uint8)
    if me == root:
        raw = text.encode()
        buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    world.Bcast(buf, root=root)
    return buf.tobytes().rstrip(b"\0").decode()
