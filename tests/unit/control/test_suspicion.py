"""control/suspicion.py, the pure logic of confirming a silent peer (no processes: a clock the test moves), and the
probe datagrams of control/waker.py between real UDP sockets. The end-to-end proof (a stalled node kept, a frozen
one fenced within the ceiling, no false suspicion under load) is tests/e2e/test_heartbeat_faults.py."""
import math
import time

import pytest

from deadpool_hpc.control.suspicion import MAX_HEALTH, Suspicion, helpers_for
from deadpool_hpc.control.waker import ACK, NACK, PING, PING_REQ, Waker


def feed(s, peer, t0, n, gap):
    for i in range(n):
        s.heard(peer, t0 + i * gap)
    return t0 + (n - 1) * gap


def test_a_steady_peer_is_probed_after_the_base_deadline_and_confirmed_no_later_than_the_ceiling():
    s = Suspicion(base=1.0, period=0.2, ceiling=4.0)
    t = feed(s, 1, 0.0, 20, 0.2)
    assert s.deadline(1, t) == pytest.approx(1.0)
    assert s.due({1: 0.9}, t + 0.9) == [] and s.due({1: 1.01}, t + 1.01) == [1]
    p = s.start(1, t + 1.01, 1.01, helpers=[2, 3, 4])
    assert (p.w_min, p.w_max) == pytest.approx((1.0, 2.99))
    assert s.due({1: 1.5}, t + 1.5) == []          # one probe at a time
    assert s.expired(t + 1.01 + 2.9) == []
    assert [q.target for q in s.expired(t + 1.01 + 2.99)] == [1]
    assert s.confirmed_n == 1 and not s.probes


def test_nacks_shrink_the_window_to_its_minimum_and_a_sign_of_life_refutes():
    s = Suspicion(base=1.0, period=0.2, ceiling=4.0)
    p = s.start(1, 10.0, 1.0, helpers=[2, 3, 4])
    w0 = p.window()
    s.nack(1, p.nonce, 2)
    s.nack(1, p.nonce + 1, 3)        # another probe's nack counts nothing
    s.nack(1, p.nonce, 9)            # nor one from a member that was not asked
    w1 = p.window()
    assert w0 == pytest.approx(3.0) and w1 == pytest.approx(3.0 - 2.0 * math.log(2) / math.log(4))
    s.nack(1, p.nonce, 3), s.nack(1, p.nonce, 4)
    assert p.window() == pytest.approx(1.0)
    assert s.heard(1, 10.5, beat=False) is p and s.refuted == 1 and not s.probes
    assert s.health == 1            # the watcher was wrong: it is the slow one for a while


def test_jitter_widens_a_peers_deadline_and_local_health_widens_all_within_the_ceiling():
    s = Suspicion(base=1.0, period=0.2, ceiling=4.0)
    t = 0.0
    for i in range(40):              # gaps of 0.2 and 0.9 s, alternating: std 0.35 s
        t += 0.2 if i % 2 else 0.9
        s.heard(1, t)
    assert 2.5 < s.deadline(1, t) <= 3.0
    s2 = Suspicion(base=1.0, period=0.2, ceiling=10.0)
    for _ in range(MAX_HEALTH + 3):
        s2.degrade(100.0)
    assert s2.health == MAX_HEALTH and s2.deadline(7, 100.0) == pytest.approx(5.0)
    assert s2.start(7, 100.0, 5.0, []).w_min == pytest.approx(5.0)
    # a quiet HEALTH_DECAY deadlines per point bring it back
    assert s2.factor(100.0 + 8 * 1.0 * MAX_HEALTH + 0.01) == 1
    s3 = Suspicion(base=1.0, period=0.2, ceiling=3.0)
    for _ in range(MAX_HEALTH):
        s3.degrade(0.0)
    assert s3.deadline(1, 0.0) == pytest.approx(2.0)   # ceiling - confirm: the minimum window still fits


def test_a_watchers_own_stall_moves_its_clock_and_bad_settings_are_refused():
    s = Suspicion(base=1.0, period=0.2, ceiling=4.0)
    feed(s, 1, 0.0, 10, 0.2)
    p = s.start(1, 3.0, 1.2, [2])
    s.shift(2.0)
    assert p.t0 == 5.0 and s.heard_at[1] == pytest.approx(3.8)
    with pytest.raises(ValueError, match="period 0 s"):
        Suspicion(base=1.0, period=0, ceiling=4.0)


def test_helpers_are_the_targets_ring_predecessors_first_never_the_watcher_or_the_target():
    assert helpers_for(5, me=4, alive=list(range(8)), k=3) == [3, 2, 1]
    assert helpers_for(0, me=7, alive=[0, 2, 5, 6, 7], k=2) == [6, 5]
    assert helpers_for(1, me=0, alive=[0, 1], k=3) == []


def test_probe_datagrams_are_verified_and_carry_their_fields():
    me, peer, stranger = Waker(secret=b"k" * 16), Waker(secret=b"k" * 16), Waker(secret=b"x" * 16)
    try:
        for kind in (PING, PING_REQ, ACK, NACK):
            peer.probe(kind, 3, 1, 2, 0xABCDEF, me.hb_address)
        stranger.probe(ACK, 3, 1, 2, 7, me.hb_address)
        deadline = time.monotonic() + 2
        while len(me.probes) < 4 and time.monotonic() < deadline:
            me.drain()
            time.sleep(0.01)
        time.sleep(0.05)
        me.drain()
        assert me.probes == [(k, 3, 1, 2, 0xABCDEF) for k in (PING, PING_REQ, ACK, NACK)]
        assert me.rejected == 1
    finally:
        for w in (me, peer, stranger):
            w.close()
