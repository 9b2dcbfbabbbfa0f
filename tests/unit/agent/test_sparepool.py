"""agent/sparepool.py: the lowest live agent logs the spare pool's size when it changes (pure: a fake host)."""
from __future__ import annotations

from types import SimpleNamespace

from deadpool_hpc.agent.sparepool import SparePool


class Log:
    def __init__(self):
        self.lines = []

    def emit(self, event, **fields):
        self.lines.append((event, fields))


def host(me, alive, spares, suspected=()):
    peers = SimpleNamespace(alive=lambda: list(alive), is_suspected=lambda n: n in suspected, fenced=None)
    return SimpleNamespace(cp=SimpleNamespace(me=me, spare_nodes=tuple(spares), generation=3), peers=peers, log=Log())


def test_the_lowest_live_agent_logs_each_change_once():
    h = host(0, [0, 1, 2, 3], spares=[3])
    pool = SparePool(h)
    pool.tick()
    pool.tick()
    assert h.log.lines == [("spare_pool", {"spares": 1, "nodes": [3], "generation": 3})]
    h.peers.is_suspected = lambda n: n == 3   # the spare is suspected: one fewer
    pool.tick()
    assert h.log.lines[-1][1]["spares"] == 0 and len(h.log.lines) == 2


def test_another_agent_stays_silent_until_it_is_the_lowest():
    h = host(1, [0, 1, 2], spares=[2])
    pool = SparePool(h)
    pool.tick()
    assert h.log.lines == []
    h.peers.alive = lambda: [1, 2]            # agent 0 was lost: this one speaks now
    pool.tick()
    assert h.log.lines == [("spare_pool", {"spares": 1, "nodes": [2], "generation": 3})]
