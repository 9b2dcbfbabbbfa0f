"""The node agent's state (agent/state.py) and its one writer, ``NodeAgent.transition`` (agent/node.py): the pure
parts, without processes. The moves themselves are made by real runs: tests/e2e/test_hotswap.py, test_lifecycle.py,
test_planned_swap.py, test_stragglers.py, test_heartbeat_faults.py and test_crashloop.py go through every path of
the table below (an illegal move ends the agent with an ``error`` event, which those tests fail on)."""
import ast
import json
import os

import pytest

from deadpool_hpc.agent.node import NodeAgent
from deadpool_hpc.agent.state import ALLOWED, IllegalTransition, NodeState, check_transition
from deadpool_hpc.events import EventLog, read_events
from deadpool_hpc.metrics import node_samples

S = NodeState
import paths  # tests/paths.py: the checkout's folders, wherever this file lies
AGENT = os.path.join(paths.ROOT, "deadpool_hpc", "agent")

# the table as docs/architecture.md ("The node agent's states") writes it: state -> the states it may move to
EXPECTED = {
    S.STARTING: {S.TRAINING, S.SPARE, S.DONE},
    S.TRAINING: {S.TRAINING, S.RETURNING, S.DONE, S.SAVED},
    S.SPARE: {S.SPARE, S.TRAINING, S.RETURNING, S.DONE, S.SAVED},
    S.RETURNING: {S.SPARE, S.DONE, S.SAVED},
    S.SAVED: {S.DONE},
    S.DONE: set(),
}


def test_the_table_is_the_documented_one_and_every_state_is_reached_and_ends():
    assert {k: set(v) for k, v in ALLOWED.items()} == EXPECTED
    assert set(ALLOWED) == set(NodeState)
    reached, todo = {S.STARTING}, [S.STARTING]
    while todo:
        for n in ALLOWED[todo.pop()] - reached:
            reached.add(n)
            todo.append(n)
    assert reached == set(NodeState)
    for s in NodeState:   # every state can still end (the run ends for every node)
        seen, todo = {s}, [s]
        while todo:
            for n in ALLOWED[todo.pop()] - seen:
                seen.add(n)
                todo.append(n)
        assert S.DONE in seen, s
    with open(os.path.join(AGENT, "..", "..", "docs", "architecture.md")) as fh:
        doc = fh.read()
    for s in NodeState:   # the documented table has a row per state
        assert f"| `{s.value}` |" in doc, s


@pytest.mark.parametrize("old,new", [(o, n) for o in NodeState for n in NodeState])
def test_check_transition_allows_exactly_the_table(old, new):
    if new in EXPECTED[old]:
        check_transition(old, new)
        return
    with pytest.raises(IllegalTransition) as info:
        check_transition(old, new)
    msg = str(info.value)
    assert f"from {old.value!r} to {new.value!r}" in msg   # names both states
    for s in EXPECTED[old]:
        assert s.value in msg.split("may move to:")[1]


def test_a_word_that_is_no_state_is_refused_by_name():
    with pytest.raises(ValueError, match="'trainin'"):
        check_transition(S.SPARE, "trainin")
    check_transition("spare", "training")   # the words are the states


def test_the_states_keep_their_words_wherever_they_are_shown():
    assert [s.value for s in NodeState] == ["starting", "training", "spare", "returning", "done", "saved"]
    for s in NodeState:
        assert s == s.value and str(s) == s.value and f"{s}" == s.value
        assert json.loads(json.dumps({"state": s})) == {"state": s.value}
    assert S.TRAINING in ("training", "spare") and "spare" in (S.TRAINING, S.SPARE)
    # the node's metrics label (agent/metrics.py gathers str(agent.state))
    assert node_samples({"state": str(S.SPARE), "generation": 1, "bytes_total": 0,
                         "bytes_per_s": 0.0})["deadpool_node_state"] == [(("spare",), 1)]


class _Agent:
    """What ``NodeAgent.transition`` reads of its agent: its state, its log, its control plane's generation."""

    def __init__(self, log, state=S.STARTING, generation=0):
        self._state, self.log = state, log
        self.cp = type("CP", (), {"generation": generation})()

    state = NodeAgent.state
    transition = NodeAgent.transition


def test_transition_moves_logs_each_change_once_and_refuses_an_illegal_move(tmp_path):
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path)
    a = _Agent(log, generation=3)
    a.transition(S.SPARE, "started: its processes are spares")
    assert a.state is S.SPARE
    a.transition(S.SPARE, "recovery round 1: a spare of generation 4")   # the same role: checked, not logged
    a.transition(S.TRAINING, "recovery round 2: training ranks of generation 5")
    with pytest.raises(IllegalTransition, match="from 'training' to 'spare'"):
        a.transition(S.SPARE, "no such move")
    assert a.state is S.TRAINING   # unchanged by the refused move
    a.transition(S.DONE, "the run is complete")
    with pytest.raises(IllegalTransition, match="from 'done' to 'training'.*none: it is final"):
        a.transition(S.TRAINING, "after the end")
    with pytest.raises(AttributeError):
        a.state = S.SPARE   # the state has one writer
    log.close()
    got = [(e["previous"], e["state"], e["reason"], e["generation"]) for e in read_events(path)
           if e["event"] == "agent_state"]
    assert got == [("starting", "spare", "started: its processes are spares", 3),
                   ("spare", "training", "recovery round 2: training ranks of generation 5", 3),
                   ("training", "done", "the run is complete", 3)]


def _state_writes() -> list[str]:
    """Every assignment to an attribute ``state`` or ``_state`` in agent/ (file:line, the function it is in)."""
    out = []
    for f in sorted(os.listdir(AGENT)):
        if not f.endswith(".py"):
            continue
        with open(os.path.join(AGENT, f)) as fh:
            tree = ast.parse(fh.read(), f)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(el, ast.Attribute) and el.attr in ("state", "_state"):
                            out.append(f"{f}:{node.lineno} {fn.name}")
    return out


def test_transition_is_the_only_writer_of_the_agent_state():
    writes = _state_writes()
    assert sorted(w.split()[1] for w in writes) == ["__init__", "transition"], writes
    assert all(w.startswith("node.py:") for w in writes), writes
