"""The notices control/peers.py's control thread reads itself (suspect, teardown, fenced), typed
(control/messages.py): what it does with each, what it passes on along the tree (the body as it came, key for key),
and a malformed notice dropped and said. A Peers is built on a stand-in communicator and never started: pure logic.
Run: DEADPOOL_SLURM_TESTS=0 .venv/bin/python -m pytest -q tests/unit/control/test_peers_notices.py
"""
from __future__ import annotations

from types import SimpleNamespace

from deadpool_hpc.control.messages import Fenced, Suspect, Teardown
from deadpool_hpc.control.peers import Peers
from deadpool_hpc.ipc import wire

SECRET = b"k" * 32


def _peers(me: int = 0, size: int = 4, generation: int = 2) -> tuple[Peers, list]:
    comm = SimpleNamespace(Get_rank=lambda: me, Get_size=lambda: size)
    waker = SimpleNamespace(set=lambda: None)
    p = Peers(comm, SECRET, 0.1, 1.0, waker=waker, wake_addresses=[], heartbeat_addresses=[],
              generation=lambda: generation)
    events = []
    p.on_probe = lambda event, **fields: events.append((event, fields))
    return p, events


def _sent(p: Peers) -> list[tuple[int, str, dict]]:
    return [(dest, *wire.decode(msg, len(msg), SECRET)) for dest, msg, _ in p._outbox]


def test_a_suspect_notice_suspects_its_ranks_and_is_passed_on_as_it_came():
    p, _ = _peers()
    work = {"rank": 1, "step": 7, "end": "SIGKILL", "node": 3, "generation": 2, "t": 5.0}
    failures = []
    p.on_work_failure = failures.append
    body = dict(Suspect((3,), "exit 137", 4.5, returning=True, work=work).to_wire(), origin=3)
    p._handle_control(3, Suspect.KIND, dict(body))
    assert 3 in p.suspected and p.returning.keys() == {3} and failures == [work] and p.failure.is_set()
    passed = [(dest, kind, b) for dest, kind, b in _sent(p) if kind == Suspect.KIND]
    assert passed and all(b == body for _, _, b in passed)   # the body as it came, key for key
    assert not any(kind == Fenced.KIND for _, kind, _ in _sent(p))   # the origin told the suspect itself


def test_a_malformed_notice_is_dropped_and_said_a_stale_teardown_is_passed_on_but_ignored():
    p, events = _peers()
    p._handle_control(1, Suspect.KIND, {"ranks": ["2"], "reason": "x", "last_heard": None})
    assert not p.suspected and p._outbox == type(p._outbox)() and p._rejected == 1
    assert events[0][0] == "bad_message" and "key 'ranks'" in events[0][1]["error"]
    p._handle_control(1, Teardown.KIND, Teardown(1).to_wire())   # generation 1 < 2: left behind
    assert not p.failure.is_set() and p.inbox.empty()
    p._handle_control(1, Teardown.KIND, Teardown(2).to_wire())
    assert p.failure.is_set() and p.inbox.get_nowait() == (Teardown.KIND, 1, {"g": 2, "origin": 1})


def test_a_fenced_notice_fences_this_agent_even_when_malformed():
    p, _ = _peers()
    p._handle_control(2, Fenced.KIND, Fenced("silent for 3 s").to_wire())
    assert p.fenced == "MPI rank 2 declared this process failed: silent for 3 s" and p.failure.is_set()
    q, _ = _peers()
    q._handle_control(2, Fenced.KIND, {"reason": 7})
    assert q.fenced.startswith("MPI rank 2 declared this process failed: (a malformed notice")
