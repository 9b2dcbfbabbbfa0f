"""The job's ids, one type each: which space an ``int`` numbers, said in its annotation.

Types for the checker only (``typing.NewType`` of ``int``): at run time each is ``int`` itself, so a message field
annotated with one keeps its wire form (a JSON integer; ``ipc/schema.py`` reads a NewType as its base), and
``NodeId(3) == 3``. Nothing is converted or checked here; a value is wrapped where it is made, or not at all.

Places (docs/architecture.md, "Glossary"), with P the ranks per node (``--ranks-per-node``):

- ``NodeId``: a node, that is its one node agent; the agent's MPI rank *is* its node id, fixed for the job
  (0 .. nodes + spares - 1). In ``control/`` an unqualified "rank" is this.
- ``LocalRank``: a training process on its node (0 .. P - 1): the key of its snapshot slots, its progress page and
  its channel connection in its agent.
- ``ProcId``: a virtual process, a training process in the job: ``node * P + local``, so its node is
  ``proc // P``. The ids the recovery decision works in (assignment, members, fenced, sources' holders).
- ``Rank``: a training rank, a share of the training work: the rank in the generation's process group
  (0 .. world size - 1). A rank lives on a node: ``assignment[rank]`` is the ProcId that holds it now, on node
  ``assignment[rank] // P``; a spare's processes hold none.
- ``LogicalNode``: ``rank // P``, a position on the ring of replica holders (placement.py); a swap does not change
  it (a promoted spare becomes the lost node's logical node).

Times (they number events, not places):

- ``Generation``: the number of a membership, 0 at the start, one more per recovery decision applied (each
  membership change); the process group, the store and every role are tagged with it.
- ``Round``: the count of recovery attempts (a recovery round: report, decide, restore, rebuild), or the counter in
  a coordinator's agreement round id ``(NodeId, Round)``. A round that succeeds yields a generation; several rounds
  may be spent on one (a round that fails); a generation is never a round.
"""
from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", int)
LocalRank = NewType("LocalRank", int)
ProcId = NewType("ProcId", int)
Rank = NewType("Rank", int)
LogicalNode = NewType("LogicalNode", int)
Generation = NewType("Generation", int)
Round = NewType("Round", int)

__all__ = ["NodeId", "LocalRank", "ProcId", "Rank", "LogicalNode", "Generation", "Round"]
