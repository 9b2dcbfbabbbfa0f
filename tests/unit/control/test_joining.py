"""A replacement node's admission and its messages (control/joining.py, control/links.py, control/peers.py): which
slot is free, who may admit, how messages for a joined node are relayed through its sponsor, and what is dropped.
Peers are built on stand-in communicators and never started (their handlers are called directly); the links are
real TCP connections. The whole path on a real cluster: tests/slurm/test_slurm_companion.py.
Run: DEADPOOL_SLURM_TESTS=0 .venv/bin/python -m pytest -q tests/unit/control/test_joining.py
"""
from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from deadpool_hpc.control import joining
from deadpool_hpc.control.links import Handshake, Link, LinkClosed, listen
from deadpool_hpc.control.membership import Membership
from deadpool_hpc.control.peers import Peers
from deadpool_hpc.ipc import wire
from deadpool_hpc.ipc.frames import encode_frame

SECRET = b"j" * 32
SIZE = 4


def _peers(me: int, comm=True) -> tuple[Peers, list]:
    sent = []
    c = SimpleNamespace(Get_rank=lambda: me, Get_size=lambda: SIZE,
                        Isend=lambda msg, dest, tag: sent.append((dest, bytes(msg))) or SimpleNamespace(
                            Test=lambda: True)) if comm else None
    waker = SimpleNamespace(set=lambda: None, ring=lambda address: None)
    p = Peers(c, SECRET, 0.1, 1.0, waker=waker, wake_addresses=[["h", n] for n in range(SIZE)],
              heartbeat_addresses=[["h", 100 + n] for n in range(SIZE)], generation=lambda: 1, me=me, size=SIZE)
    p.on_probe = lambda event, **fields: None
    return p, sent


def _pair() -> tuple[Link, Link]:
    srv, address = listen("127.0.0.1")
    a = socket.create_connection(tuple(address))
    b, _ = srv.accept()
    srv.close()
    return Link(a, SECRET), Link(b, SECRET)


def _poll(p: Peers, n: int, until=None) -> int:
    """Read ``p``'s links until ``n`` messages came, or ``until()`` (loopback TCP delivers at once, almost always),
    at most 5 s."""
    got, end = 0, time.monotonic() + 5.0
    while got < n and not (until is not None and until()) and time.monotonic() < end:
        got += p.relays.poll(0.0)
        time.sleep(0.001)
    return got


def _inbox(p: Peers) -> list:
    out = []
    while not p.inbox.empty():
        out.append(p.inbox.get_nowait())
    return out


def test_a_joined_node_is_reached_through_its_sponsor_both_ways():
    sponsor, sponsor_mpi = _peers(0)
    other, other_mpi = _peers(2)
    newcomer, _ = _peers(1, comm=False)
    near, far = _pair()
    for p in (sponsor, other):
        p.suspected[1] = 0.0   # node 1 was lost whole; its slot is taken by the newcomer
    sponsor.relays.attach(1, near)
    sponsor.readmit(1)
    other.relays.route(1, 0)
    other.readmit(1)
    newcomer.relays.join_through(0, far)
    # the other agent -> the newcomer: a Relay to the sponsor over MPI, then the sponsor's link
    other.send(1, "store_set", {"key": "k", "value": "v"})
    other._flush_outbox()
    (dest, raw), = other_mpi
    assert dest == 0 and wire.decode(raw, len(raw), SECRET)[0] == joining.Relay.KIND
    sponsor._handle(2, raw, len(raw), 0.0)
    assert _poll(newcomer, 1) == 1
    assert _inbox(newcomer) == [("store_set", 2, {"key": "k", "value": "v"})]
    # the newcomer -> the other agent and -> the sponsor: through the link; the sponsor passes the first on
    newcomer.send(2, "sync", {"tag": "t"})
    newcomer.send(0, "sync", {"tag": "u"})
    newcomer._flush_outbox()
    assert _poll(sponsor, 2) == 2
    assert _inbox(sponsor) == [("sync", 1, {"tag": "u"})]
    (dest, raw), = sponsor_mpi
    assert dest == 2
    other._handle(0, raw, len(raw), 0.0)
    assert _inbox(other) == [("sync", 1, {"tag": "t"})]


def test_the_old_rank_of_a_taken_slot_and_a_relay_from_the_wrong_hop_are_dropped():
    sponsor, _ = _peers(0)
    near, _far = _pair()
    sponsor.relays.attach(1, near)
    msg = wire.encode("sync", {"tag": "t"}, SECRET)
    sponsor._handle(1, msg, len(msg), 0.0)   # MPI rank 1: the fenced old agent of the slot
    assert _inbox(sponsor) == []
    other, _ = _peers(2)
    other.relays.route(1, 0)
    forged = wire.encode(joining.Relay.KIND, joining.Relay(to=2, src=1, inner="sync", body={"tag": "x"}).to_wire(),
                         SECRET)
    other._handle(3, forged, len(forged), 0.0)   # agent 3 does not sponsor node 1
    assert _inbox(other) == [] and other._rejected == 1
    other._handle(0, forged, len(forged), 0.0)   # its sponsor does
    assert _inbox(other) == [("sync", 1, {"tag": "x"})]


def test_a_closed_link_is_a_suspicion_and_a_joined_agent_keeps_its_messages_until_it_re_attaches():
    sponsor, _ = _peers(0)
    near, far = _pair()
    sponsor.relays.attach(1, near)
    far.close()
    _poll(sponsor, 1, until=lambda: 1 in sponsor.suspected)
    assert 1 in sponsor.suspected and 1 not in sponsor.relays.links
    newcomer, _ = _peers(1, comm=False)
    a, b = _pair()
    newcomer.relays.join_through(0, b)
    a.close()
    _poll(newcomer, 1, until=lambda: newcomer.relays.detached is not None)
    assert newcomer.relays.via is None and 0 in newcomer.suspected and not newcomer.fenced
    newcomer.send(2, "sync", {"tag": "t"})
    newcomer._flush_outbox()
    assert len(newcomer._outbox) >= 1   # kept: no path to the job until it re-attaches
    other, other_mpi = _peers(3)
    near3, far3 = _pair()
    other.relays.attach(1, near3)               # agent 3 took it over (joining.attach)
    newcomer.relays.join_through(3, far3)
    assert newcomer.relays.detached is None
    newcomer._flush_outbox()
    _poll(other, 2)
    sent = [(dest, wire.decode(raw, len(raw), SECRET)) for dest, raw in other_mpi]
    assert any(dest == 2 and kind == joining.Relay.KIND and body["inner"] == "sync" and body["src"] == 1
               for dest, (kind, body) in sent), sent


def _cp(me=0, suspected=(), returning=(), members=(0, 2, 3), assignment=(0, 2), failure=False):
    peers = SimpleNamespace(lock=threading.RLock(), suspected={n: 0.0 for n in suspected},
                            returning={n: 0.0 for n in returning}, relays=SimpleNamespace(routes={}),
                            alive=lambda: [n for n in range(SIZE) if n not in suspected])
    return SimpleNamespace(me=me, P=1, peers=peers, members=members, assignment=assignment, world=object(),
                           failure=SimpleNamespace(is_set=lambda: failure))


def test_the_free_slot_is_a_node_lost_whole_whose_decision_is_applied():
    assert joining.free_slot(_cp(suspected=(1,))) == 1
    assert joining.free_slot(_cp()) is None                                    # nothing lost
    assert joining.free_slot(_cp(suspected=(1,), returning=(1,))) is None      # it comes back by itself
    assert joining.free_slot(_cp(suspected=(1,), members=(0, 1, 2, 3))) is None   # its decision not applied yet
    assert joining.free_slot(_cp(suspected=(3, 1), members=(0, 2))) == 1      # the lowest
    cp = _cp(suspected=(1,))
    cp.peers.relays.routes = {1: 0}      # a joined node held slot 1 and was lost in turn: free again
    assert joining.free_slot(cp) == 1


def test_only_the_lowest_live_agent_admits_and_never_during_a_recovery():
    assert joining.may_admit(_cp(me=0, suspected=(1,))) is None
    assert joining.may_admit(_cp(me=2, suspected=(1,))) == "not the lowest live agent of the MPI world"
    cp = _cp(me=3, suspected=(1,))
    cp.peers.relays.routes = {0: 3}             # node 0 is a joined node: it admits nobody, agent 2 does
    assert joining.may_admit(cp) == "not the lowest live agent of the MPI world"
    cp.me = 2
    assert joining.may_admit(cp) is None
    assert joining.may_admit(_cp(me=0, failure=True)) == "a recovery is under way"


def test_admit_takes_the_slot_and_tells_the_newcomer_and_the_others():
    near, far = _pair()
    readmitted, attached, told, idents = [], [], [], {}
    view = [Membership(1, (0, 2, 3), (), (0, 2, 3))]
    peers = SimpleNamespace(lock=threading.RLock(), suspected={1: 0.0},
                            relays=SimpleNamespace(attach=lambda n, l: attached.append(n), routes={}),
                            readmit=readmitted.append, broadcast=lambda kind, body: told.append((kind, body)))
    big = [{"n": n, "pad": "x" * 30_000} for n in range(SIZE)]   # records too large for one 64 KiB message
    cp = SimpleNamespace(me=0, P=1, size=SIZE, peers=peers, idents=big,
                         take_identity=lambda n, i: idents.update({n: i}))
    cp = _ViewCp(cp, view)
    join = joining.Join(host="node5", job_id="42", identity={"wake": ["h", 9], "hb": ["h", 10]}, nonce="n1", t=0.0)
    answer, readmit = joining.admit(cp, near, join, 1, resume={"step": 7})
    near.sock.setblocking(True)
    while near.out:   # (the control thread's flush, here)
        near.flush()
    h = Handshake(far.sock, SECRET)
    kind, body = h.receive(2.0)
    got = joining.Admit.from_wire(body)
    assert kind == joining.Admit.KIND and got.node == 1 and got.nonce == "n1" and got.spare_nodes == (1,)
    assert got.members == (0, 1, 2, 3) and got.suspected == () and got.size == SIZE and got.resume == {"step": 7}
    assert joining._receive_idents(h, got.idents_total, 2.0) == big   # in pieces (4 of them here), in order
    assert attached == [1] and readmitted == [1] and idents == {1: join.identity}
    (kind, body), = told
    assert kind == joining.Joined.KIND and joining.Joined.from_wire(body).sponsor == 0
    assert readmit.node == 1 and readmit.spare_nodes == (1,)


class _ViewCp:
    """A stand-in control plane whose view (generation, assignment, ...) is the newest Membership adopted."""

    def __init__(self, ns, views):
        self.__dict__.update(ns.__dict__)
        self._views = views

    membership = property(lambda self: self._views[-1])
    generation = property(lambda self: self._views[-1].generation)
    assignment = property(lambda self: self._views[-1].assignment)
    spare_nodes = property(lambda self: self._views[-1].spare_nodes)
    members = property(lambda self: self._views[-1].members)

    def adopt(self, v):
        self._views.append(v)


def test_a_link_refuses_a_forged_frame_and_the_handshake_has_a_deadline():
    srv, address = listen("127.0.0.1")
    try:
        c = socket.create_connection(tuple(address))
        s, _ = srv.accept()
        receiver = Link(s, SECRET)
        c.sendall(encode_frame("sync", {"tag": "t"}, b"x" * 32))   # another job's secret
        with pytest.raises(LinkClosed):
            end = time.monotonic() + 5.0
            while time.monotonic() < end:   # (until the frame has arrived and been refused)
                receiver.receive()
                time.sleep(0.001)
        with pytest.raises(TimeoutError):
            Handshake(socket.create_connection(tuple(address)), SECRET).receive(0.2)
        c.close()
    finally:
        srv.close()


def test_messages_for_a_joined_node_whose_sponsor_is_lost_wait_for_its_new_route():
    other, sent = _peers(2)
    other.relays.route(1, 0)
    other.suspected[0] = 0.0          # its sponsor is lost
    other.send(1, "ready", {"n": 1})
    other.send(1, "ready", {"n": 2})
    other._flush_outbox()
    assert sent == [] and len(other.relays._parked[1]) == 2
    other.relays.route(1, 3)                 # it re-attached to agent 3 (Rerouted)
    other._flush_outbox()
    relays = [wire.decode(raw, len(raw), SECRET)[1] for dest, raw in sent if dest == 3]
    assert [r["body"]["n"] for r in relays] == [1, 2] and not other.relays._parked


def test_a_newcomer_that_cannot_reach_the_job_says_why_once_and_gives_up_at_its_deadline(tmp_path):
    srv, address = listen("127.0.0.1")
    srv.close()                                   # nobody listens there any more
    joining.publish(str(tmp_path), 0, address, 1)
    said = []
    log = SimpleNamespace(emit=lambda event, **fields: said.append((event, fields)))
    with pytest.raises(joining.JoinFailed, match="not admitted within 1.5 s"):
        joining.request(str(tmp_path), SECRET, "node5", "42", {}, timeout=1.5, log=log)
    assert [e for e, _ in said] == ["join_waiting"], said   # once per reason, not once per try
    assert "cannot connect" in said[0][1]["reason"]
