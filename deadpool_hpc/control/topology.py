"""Who watches whom, and how a notice reaches every agent: the control plane's topology, chosen so that an idle
agent's heartbeat cost stays the same however large the job grows.

Both are pure functions of the job's size and the set of live agents, so every agent computes them alone and
they are unit-tested directly.

- **Sparse monitoring** (``ring_neighbours``): on the ring of live agents (MPI ranks in increasing order), each
  agent watches its ``k`` successors and sends heartbeats to its ``k`` predecessors, the agents that watch it.
  An agent's message rate is then ``k / period`` each way, whatever the job's size (the all-to-all scheme it
  replaces sent ``(N - 1) / period``). It is the ring of SWIM-style and Chord-style failure detectors with a
  fixed number of monitors per member; with ``k`` >= 2 any single loss leaves every agent watched.
- **Dissemination** (``tree_children``): a notice (a suspicion, a generation's teardown) that starts at agent
  ``origin`` travels down a binomial tree over all MPI ranks rotated to start at ``origin``: ``N - 1`` messages
  in all, at most ``ceil(log2 N)`` hops, fan-out at most ``log2 N`` per agent. An agent known to be dead is
  skipped: its children are served by its parent. (An agent that died unnoticed loses its subtree this notice;
  the recovery's ``collect`` from the coordinator reaches every live agent anyway, control/plane.py.)
"""
from __future__ import annotations


def ring_neighbours(me: int, alive: list[int], k: int) -> tuple[list[int], list[int]]:
    """(watched, heartbeat_to) for agent ``me`` on the ring of ``alive`` agents (MPI ranks).

    watched: the ``k`` successors of ``me`` (whose heartbeats it checks); heartbeat_to: its ``k`` predecessors
    (who check its heartbeats). ``k`` = 0 means every other live agent for both (the all-to-all topology).
    Raises ValueError when ``k`` < 0 or ``me`` is not in ``alive``.
    """
    if k < 0:
        raise ValueError(f"watch fan-in k={k!r}: accepted: 0 (all-to-all) or more")
    ring = sorted(set(alive))
    if me not in ring:
        raise ValueError(f"agent {me} is not on the ring of live agents {ring[:8]}{'...' if len(ring) > 8 else ''}")
    others = [p for p in ring if p != me]
    if k == 0 or k >= len(others):
        return others, others
    i = ring.index(me)
    n = len(ring)
    return [ring[(i + j) % n] for j in range(1, k + 1)], [ring[(i - j) % n] for j in range(1, k + 1)]


def tree_children(origin: int, node: int, size: int, dead=frozenset()) -> list[int]:
    """The agents ``node`` forwards a notice from ``origin`` to, on the binomial tree over ranks 0..size-1
    rotated to start at ``origin``. A child in ``dead`` is replaced by its own children (recursively), so a
    known-dead agent never cuts its subtree off. Returns MPI ranks; [] for a leaf."""
    if not (0 <= origin < size and 0 <= node < size):
        raise ValueError(f"origin {origin} / node {node}: accepted: MPI ranks 0..{size - 1}")

    def kids(i: int) -> list[int]:  # binomial tree on indices: i's children are i + 2^j for 2^j > i
        out, step = [], 1
        while step <= i:
            step <<= 1
        while i + step < size:
            out.append(i + step)
            step <<= 1
        return out

    result: list[int] = []
    todo = kids((node - origin) % size)
    while todo:
        i = todo.pop(0)
        rank = (i + origin) % size
        if rank in dead:
            todo.extend(kids(i))
        else:
            result.append(rank)
    return result
