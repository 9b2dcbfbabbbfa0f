"""The control plane's topology (control/topology.py): sparse ring monitoring and tree dissemination."""
import pytest

from deadpool_hpc.control.topology import ring_neighbours, tree_children


def _reached(origin: int, size: int, dead=frozenset()):
    """Walk the tree from ``origin`` as the agents would: returns {rank: hops}."""
    hops = {origin: 0}
    todo = [origin]
    while todo:
        node = todo.pop()
        for c in tree_children(origin, node, size, dead):
            assert c not in hops, f"{c} reached twice (origin {origin}, size {size})"
            hops[c] = hops[node] + 1
            todo.append(c)
    return hops


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16, 100, 256, 4096])
def test_a_notice_reaches_every_agent_once_in_log_hops(size):
    for origin in {0, size // 2, size - 1}:
        hops = _reached(origin, size)
        assert sorted(hops) == list(range(size))
        assert max(hops.values()) <= max(1, (size - 1).bit_length())
        fanout = max(len(tree_children(origin, n, size)) for n in range(size))
        assert fanout <= max(1, (size - 1).bit_length())


def test_a_known_dead_agent_does_not_cut_its_subtree_off():
    size, origin = 64, 5
    dead = frozenset({6, 7, 9, 13, 37})  # 6 = origin + 1: the root's first child, with children of its own
    hops = _reached(origin, size, dead)
    assert sorted(hops) == sorted(set(range(size)) - dead)


def test_every_agent_is_watched_by_k_agents_and_sends_to_them():
    alive = [0, 1, 3, 4, 5, 8, 9]
    for k in (1, 2, 3):
        watched_by = {p: [] for p in alive}
        for me in alive:
            watched, hb_to = ring_neighbours(me, alive, k)
            assert len(watched) == len(hb_to) == k and me not in watched
            for w in watched:
                watched_by[w].append(me)
            for p in hb_to:  # I send to exactly the agents that watch me
                assert me in ring_neighbours(p, alive, k)[0]
        assert all(len(v) == k for v in watched_by.values())


def test_all_to_all_and_small_rings():
    assert ring_neighbours(2, [0, 1, 2, 3], 0) == ([0, 1, 3], [0, 1, 3])
    assert ring_neighbours(1, [1, 5], 2) == ([5], [5])  # fewer peers than k: all of them
    assert ring_neighbours(0, [0], 2) == ([], [])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="k=-1"):
        ring_neighbours(0, [0, 1], -1)
    with pytest.raises(ValueError, match="agent 4 is not on the ring"):
        ring_neighbours(4, [0, 1], 1)
    with pytest.raises(ValueError, match="0..7"):
        tree_children(9, 0, 8)


def test_heartbeats_and_bells_over_real_udp_sockets():
    """waker.py: a heartbeat with the job's MAC is accepted and names its sender; one with another job's secret
    or garbage is dropped; bells are counted, a thread's own wake-up is not."""
    import time

    from deadpool_hpc.control.waker import Waker

    me, peer, stranger = Waker(secret=b"k" * 16), Waker(secret=b"k" * 16), Waker(secret=b"x" * 16)
    try:
        peer.beat(7, me.hb_address)
        stranger.beat(8, me.hb_address)              # another job's secret
        peer._out.sendto(b"H\0\0\0\1" + b"\0" * 16, tuple(me.hb_address))  # a forged MAC
        peer.ring(me.address)
        peer.ring(me.address)
        me.set()
        assert me.wait(1.0)
        time.sleep(0.05)
        rung, beats = me.drain()
        assert (rung, beats) == (2, [7])
        assert me.rejected == 2
        assert not me.wait(0.05)  # nothing more: the wait times out
    finally:
        for w in (me, peer, stranger):
            w.close()
