"""control/detector.py, the heartbeat failure detector apart from the control thread's MPI pump: driven by a fake
clock, no process, no socket. The rules it applies are control/suspicion.py's (tests/unit/control/test_suspicion.py); the
end-to-end proof (a stalled node kept, a frozen one replaced within the ceiling) is tests/e2e/test_heartbeat_faults.py."""
import time

import pytest

from deadpool_hpc.control.detector import Detector
from deadpool_hpc.control.suspicion import HEALTH_DECAY, MAX_HEALTH, PHI_SIGMAS


class Clock:
    """A clock the test moves (seconds)."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


def detector(clock, peers=(1, 2, 3), deadline=1.0, period=0.2, ceiling=4.0):
    return Detector(peers, deadline, period, ceiling, seed=0, clock=clock)


def test_the_default_clock_is_monotonic_and_every_peer_starts_heard_of_now():
    d = Detector([1, 2], 1.0, 0.2, 4.0)
    assert d.clock is time.monotonic
    clock = Clock(50.0)
    d = detector(clock)
    assert d.silences([1, 2, 3]) == {1: 0.0, 2: 0.0, 3: 0.0} and 4 not in d and 1 in d


def test_a_peer_heard_on_time_is_never_overdue():
    """Heartbeats every period, or late by up to just under the deadline, for a long while: never overdue, never
    probed, whatever the time between looks."""
    clock = Clock()
    d = detector(clock)
    for i in range(500):
        gap = 0.2 if i % 7 else 0.95    # now and then a beat almost a deadline late
        for _ in range(3):             # the watcher looks three times between beats
            clock.advance(gap / 3)
            d.tick()
            assert d.overdue([1]) == [], (i, d.silence(1))
        d.heard(1)
    assert not d.probes and d.expired() == [] and d.health == 0


def test_a_peer_silent_past_its_deadline_is_overdue_probed_once_and_confirmed():
    clock = Clock()
    d = detector(clock)
    for _ in range(20):
        clock.advance(0.2)
        d.heard(1), d.heard(2)
    t0 = clock.t
    clock.advance(0.99)
    d.heard(1)
    assert d.overdue([1, 2]) == []
    clock.advance(0.02)                # peer 2 silent 1.01 s > its deadline of 1 s; peer 1 heard 0.02 s ago
    assert d.silence(2) == pytest.approx(1.01) and d.overdue([1, 2]) == [2]
    probe = d.start_probe(2, d.silence(2), helpers=[1, 3])
    assert probe.t0 == clock.t and d.overdue([1, 2]) == []   # one probe at a time
    clock.advance(probe.window() - 0.01)
    assert d.expired() == []
    clock.t = probe.t0 + probe.window()
    assert [p.target for p in d.expired()] == [2] and not d.probes
    assert clock.t - t0 <= 4.0 + 1e-9   # confirmed by the ceiling


def test_a_sign_of_life_refutes_an_open_probe_and_a_touch_from_another_thread_does_at_the_next_look():
    clock = Clock()
    d = detector(clock)
    clock.advance(1.5)
    assert sorted(d.overdue([1, 2])) == [1, 2]
    p1 = d.start_probe(1, 1.5, [2, 3])
    p2 = d.start_probe(2, 1.5, [1, 3])
    clock.advance(0.1)
    assert d.heard(1, beat=False) is p1            # an ack: refuted at once, its silence restarts
    assert d.silence(1) == 0.0 and d.health == 1   # the watcher was wrong about it: it is the slow one
    clock.advance(0.1)
    d.touch(2)                                     # a replica it pushed (another thread): no verdict yet
    assert d.touched_while_probed() == [2] and 2 in d.probes
    clock.advance(0.1)
    assert d.refute(2) is p2 and not d.probes and d.silence(2) == pytest.approx(0.1)
    assert d.touched_while_probed() == [] and d.refute(2) is None


def test_the_deadline_follows_the_jitter_observed():
    """A peer whose heartbeats come at 0.2 and 1.4 s by turns gets mean + PHI_SIGMAS * std of its gaps; a steady
    peer keeps the user's deadline: the same silence makes only the steady one overdue."""
    clock = Clock()
    d = detector(clock, ceiling=10.0)
    gaps = []
    for i in range(64):
        gap = 0.2 if i % 2 else 1.4
        clock.advance(gap)
        gaps.append(gap)
        d.heard(1)              # its heartbeats: jittery
        d.heard(3, beat=False)  # heard of as often (acks, messages), but no heartbeat gap: no statistics
    observed = gaps[1:]        # the first beat has no gap before it
    mean = sum(observed) / len(observed)
    std = (sum((g - mean) ** 2 for g in observed) / len(observed)) ** 0.5
    assert d.deadline_of(1) == pytest.approx(mean + PHI_SIGMAS * std)
    assert d.deadline_of(1) > 2.0 and d.deadline_of(3) == pytest.approx(1.0)
    clock.advance(2.0)
    assert d.overdue([1, 3]) == [3]
    # ... and never past the ceiling, less the probe's minimum window
    d2 = detector(Clock(), ceiling=3.0)
    for i in range(64):
        d2.clock.advance(0.2 if i % 2 else 1.4)
        d2.heard(1)
    assert d2.deadline_of(1) == pytest.approx(3.0 - 1.0)


def test_a_late_loop_raises_the_local_health_multiplier_and_a_quiet_time_lowers_it():
    clock = Clock()
    d = detector(clock, period=0.1)
    d.tick()
    clock.advance(0.1)
    d.tick()
    assert d.health == 0 and d.deadline_of(1) == pytest.approx(1.0)
    clock.advance(0.3)                  # > 2 periods + 50 ms late, < half a deadline: no stall, a slow watcher
    assert d.tick() == 0.0
    assert d.health == 1 and d.deadline_of(1) == pytest.approx(2.0)
    d.reset()
    clock.advance(1.5)                  # silent 1.5 s: past the user's deadline, not past this watcher's
    assert d.overdue([1]) == []
    for _ in range(MAX_HEALTH + 2):
        d.degrade()                     # probed by others, again and again
    assert d.health == MAX_HEALTH
    assert d.deadline_of(1) == pytest.approx(4.0 - 1.0)   # wide as the ceiling allows
    clock.advance(HEALTH_DECAY * 1.0 * MAX_HEALTH + 0.01)  # quiet: one point per HEALTH_DECAY deadlines
    assert d.deadline_of(1) == pytest.approx(1.0) and d.health == 0


def test_the_watchers_own_stall_is_not_counted_against_its_peers():
    clock = Clock()
    d = detector(clock)
    d.tick()
    clock.advance(0.4)
    d.tick()
    clock.advance(5.0)                  # this watcher did not run for 5 s
    assert d.tick() == pytest.approx(5.0)
    assert d.silence(1) == pytest.approx(0.4) and d.overdue([1, 2, 3]) == []
    assert d.health == 1                # and it knows it was slow


def test_reset_and_watch_give_a_full_deadline_and_the_deadline_is_settable():
    clock = Clock()
    d = detector(clock)
    clock.advance(3.0)
    assert sorted(d.overdue([1, 2, 3])) == [1, 2, 3]
    d.reset([1])                        # readmitted
    d.watch(2)                          # newly watched: its silence counts from now at the latest
    assert d.overdue([1, 2, 3]) == [3]
    d.watch(2, now=clock.t - 10.0)      # never earlier than it was
    assert d.silence(2) == 0.0
    d.deadline = 5.0                    # the start-up's longer deadline (agent/node.py): 3 s of silence is fine
    assert d.deadline == 5.0 and d.deadline_of(3) == pytest.approx(5.0) and d.overdue([3]) == []
    clock.advance(0.5)
    d.reset()
    assert d.overdue([1, 2, 3]) == []
    with pytest.raises(ValueError, match="period 0 s"):
        Detector([1], 1.0, 0, 4.0)
