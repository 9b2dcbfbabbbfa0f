"""The node agent's state (agent/node.py ``NodeAgent.state``) and the moves allowed between its states.

Owns: ``NodeState``, the table ``ALLOWED`` (which state may follow which, each move named after the code that makes
it), ``check_transition``, and ``PendingExit`` (this node failed: what the agent's loop does next). Pure: nothing of
the agent is imported. ``NodeAgent.transition`` is the only writer of an agent's state; it checks each move here and
logs each change (``agent_state``, docs/troubleshooting.md).

The states are strings (a ``StrEnum``): what shows a state (the ``agent_state`` event, the node's metrics label
``deadpool_node_state{state}``) keeps the words it had before the enum, and a state compares equal to its word.
docs/architecture.md ("The node agent's states") has the same table with the moves' reasons.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class NodeState(enum.StrEnum):
    """What one node agent is doing; its value is the word the events and metrics show."""

    STARTING = "starting"     # its training processes build the model, the health check and pre-flight run
    TRAINING = "training"     # its training processes hold training ranks of the current generation
    SPARE = "spare"           # its training processes are idle spares of the current generation
    RETURNING = "returning"   # its training processes failed; it checks the node and asks to be readmitted
    DONE = "done"             # the run is over for this node: finished, failed (fenced) or kept out (quarantined)
    SAVED = "saved"           # the run's checkpoint is saved: the node leaves with the requeue's exit code


class IllegalTransition(RuntimeError):
    """A move of a node agent's state that ``ALLOWED`` does not list (a defect of the agent, not of the run)."""


S = NodeState
# state -> the states it may move to. Derived from every write of the state in agent/ (the code that makes each
# move is named); a move to the same state is listed where a recovery round ends in the role the node had.
ALLOWED: dict[NodeState, frozenset[NodeState]] = {
    # NodeAgent._start: the role of local rank 0; NodeAgent.node_failed during the start-up (timeout, health check,
    # pre-flight, a training process that exits before ctx.run)
    S.STARTING: frozenset({S.TRAINING, S.SPARE, S.DONE}),
    # Recovery (a round keeps its ranks, or saves the checkpoint); Comeback.come_back (an exit or a hang);
    # NodeAgent.node_failed / finish
    S.TRAINING: frozenset({S.TRAINING, S.RETURNING, S.DONE, S.SAVED}),
    # Recovery (a round promotes it, keeps it a spare, or saves the checkpoint); Comeback.come_back;
    # NodeAgent.node_failed (a planned swap or a re-check of the spare, too) / finish
    S.SPARE: frozenset({S.SPARE, S.TRAINING, S.RETURNING, S.DONE, S.SAVED}),
    # NodeAgent.restart_as_spare (readmitted); Comeback._quarantine, Comeback._pump (the run finished),
    # NodeAgent.node_failed (its fresh processes failed to start); Comeback._on_over (the members left for a requeue)
    S.RETURNING: frozenset({S.SPARE, S.DONE, S.SAVED}),
    # Comeback._pump: the run's ``finish`` came in the same pump as the members' ``over``
    S.SAVED: frozenset({S.DONE}),
    S.DONE: frozenset(),
}
del S


def check_transition(old: NodeState, new: NodeState) -> None:
    """Raise IllegalTransition, naming both states and the moves ``old`` allows, unless ``ALLOWED`` lists
    ``old`` -> ``new``. Raises ValueError for a word that is no NodeState."""
    old, new = NodeState(old), NodeState(new)
    if new not in ALLOWED[old]:
        allowed = ", ".join(sorted(s.value for s in ALLOWED[old])) or "none: it is final"
        raise IllegalTransition(f"the node agent's state cannot move from {old.value!r} to {new.value!r} "
                                f"(from {old.value!r} it may move to: {allowed})")


@dataclass(frozen=True)
class PendingExit:
    """This node failed (``NodeAgent.node_failed``: its training processes are ended, the others told): recorded
    where it was seen, and acted on at the top of the agent's loop, not raised through the waits under way (each
    wait of a recovery round or a barrier stops early when one is recorded). ``returning``: the node checks itself
    and asks to come back to the spare pool (agent/comeback.py); otherwise its agent leaves (fenced). ``reason``:
    what failed, ``cause``: its kind (``exit``, ``hang``, ``startup_timeout``, ``health_check``, ``planned``, ...)."""

    reason: str
    cause: str
    returning: bool
