"""The background persister's rounds (agent/persister.py) as pure logic: a fake host records the messages sent and the
disk work started; nothing is written. The end-to-end proof is tests/e2e/test_rundir_faults.py and
tests/slurm/test_slurm_persist.py (real agents, real disks)."""
import types

from deadpool_hpc.agent.persister import Persister
from deadpool_hpc.config import RunConfig
from deadpool_hpc.control.messages import Persisted


class _Peers:
    def __init__(self):
        self.sent = []

    def send(self, dst, kind, body):
        self.sent.append((dst, kind, dict(body)))

    def send_many(self, dsts, kind, body):
        for d in dsts:
            self.send(d, kind, body)


def _host(node=0, nodes=3, generation=0):
    cp = types.SimpleNamespace(handlers={}, peers=_Peers(), generation=generation, assignment=list(range(nodes)),
                               train_rank=lambda local: node)
    cp.on = cp.handlers.__setitem__
    rep = types.SimpleNamespace(committed_step=0)
    host = types.SimpleNamespace(cfg=RunConfig(persist_every=1.0, run_dir="/nonexistent", nodes=nodes, spares=0),
                                 cp=cp, log=types.SimpleNamespace(emit=lambda *a, **k: None), state="training", P=1,
                                 node=node, checkpoint_dir="/nonexistent/checkpoint", reps={0: rep}, layouts={},
                                 channel=types.SimpleNamespace(wake=lambda: None),
                                 recovery=types.SimpleNamespace(high_water=0))
    return host, rep


def _scheduler(nodes=3):
    host, rep = _host(nodes=nodes)
    p = Persister(host)
    p.want = None
    disk = []
    p._in_background = lambda what, fn, *args: disk.append((what, args))
    p._copy = lambda: None   # this node's own share is not the subject here
    return p, host, rep, disk


def _ask(p, rep, committed):
    rep.committed_step = committed
    p.next_t = 0.0
    p.tick()


def test_a_round_a_slow_node_still_writes_is_never_cleaned_away():
    """Seen in CI: a first round slowed by the import of torch.distributed.checkpoint was removed (the clean of
    every round older than the previous ask) before its commit, which then failed with 'lacks the shards'."""
    p, host, rep, disk = _scheduler()
    _ask(p, rep, 0)                                  # round 2
    asks = [b["step"] for d, k, b in host.cp.peers.sent if k == "persist"]
    assert asks == [2, 2, 2]
    p._on_persisted(0, Persisted.from_wire({"g": 0, "step": 2, "ok": True}))
    p._on_persisted(2, Persisted.from_wire({"g": 0, "step": 2, "ok": True}))      # node 1 still writes round 2
    _ask(p, rep, 2)                                  # round 4
    _ask(p, rep, 4)                                  # round 6: the old rule cleaned below 4 here, round 2 included
    assert [b["step"] for d, k, b in host.cp.peers.sent if k == "persist"][-1] == 6
    assert disk == [], disk                         # node 1 answered nothing: nothing is cleaned
    p._on_persisted(1, Persisted.from_wire({"g": 0, "step": 2, "ok": True}))
    assert ("commit", (0, 2)) in disk                # every node wrote round 2: committed
    for n in (0, 1, 2):
        p._on_persisted(n, Persisted.from_wire({"g": 0, "step": 4, "ok": n != 1}))   # node 1 failed round 4 (a full disk)
    assert ("commit", (0, 4)) not in disk
    _ask(p, rep, 6)
    assert disk[-1] == ("clean", (4,)), disk        # every node is done with 4: the rounds below it go


def test_missed_and_failed_rounds_are_answered_and_a_new_generation_starts_over():
    host, rep = _host(node=1)
    p = Persister(host)
    rep.committed_step = 9
    p.want = (0, 4)
    rep.copy_own = lambda step: None               # the rank is already past step 4
    p._copy()
    assert host.cp.peers.sent == [(0, "persisted", {"g": 0, "step": 4, "ok": False})]
    p._done = (0, 6, 0.1, 10, False)                 # the writer thread failed round 6
    p.tick()
    assert host.cp.peers.sent[-1] == (0, "persisted", {"g": 0, "step": 6, "ok": False})

    s, shost, srep, disk = _scheduler()
    for n in (0, 1, 2):
        s._on_persisted(n, Persisted.from_wire({"g": 0, "step": 4}))
    assert s._over() == 4 and ("commit", (0, 4)) in disk   # a node without ``ok`` answers written rounds only
    shost.cp.generation = 1
    assert s._over() is None                          # a recovery: nothing is known of the new generation's rounds
    s._on_persisted(0, Persisted.from_wire({"g": 0, "step": 6, "ok": True}))   # a stale answer is ignored
    assert s._over() is None
