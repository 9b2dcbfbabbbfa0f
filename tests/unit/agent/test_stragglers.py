"""The straggler check's pure parts (agent/stragglers.py): the coordinator's judge and a node's meter over real
progress pages (ipc/shm.py). The end-to-end proof, a node slowed by real signals and swapped out, is in
tests/e2e/test_planned_swap.py and tests/slurm/test_slurm_planned_swap.py."""
from __future__ import annotations

import pytest

from deadpool_hpc.agent.stragglers import StragglerJudge, WorkMeter, interval_for
from deadpool_hpc.ipc.shm import ProgressPage


def feed(judge, t, figs, gen=0):
    """One summary per node at time ``t``: ``figs`` node -> own seconds per step. Returns the verdicts."""
    out = []
    for node, own in figs.items():
        v = judge.add(node, gen, own, own * 1.1, (node,), t)
        if v is not None:
            out.append(v)
    return out


def test_a_node_slow_for_the_whole_window_is_a_straggler_once_per_window():
    j = StragglerJudge(1.5, 10.0, interval=1.0)
    verdicts = []
    for t in range(0, 30):
        verdicts += [(t, v) for v in feed(j, float(t), {0: 0.10, 1: 0.21 if t >= 5 else 0.10, 2: 0.11})]
    # slow from t=5, its figure (the median of its last 3) from t=6: found at t=16 (the window); a verdict starts the
    # count again: the next at t=27
    assert [(t, v.node) for t, v in verdicts] == [(16, 1), (27, 1)]
    v = verdicts[0][1]
    # compared with the lower median of the others (0.10 and 0.11: the lower, 0.10)
    assert v.median_s == pytest.approx(0.10) and v.ratio == pytest.approx(0.21 / 0.10) and v.slow_for_s == 10.0
    assert v.site is None
    assert v.ranks == (1,)


def test_noise_and_a_broken_run_of_slow_figures_are_not_a_straggler():
    j = StragglerJudge(1.5, 10.0, interval=1.0)
    for t in range(0, 60):   # over the factor every other second, or 2 s out of 4: never for a whole window
        slow = 0.2 if (t % 2 if t < 30 else t % 4 < 2) else 0.1
        assert feed(j, float(t), {0: 0.1, 1: slow, 2: 0.1}) == []
    # one quick interval in a slow stretch (a burst of load on the others) does not start the count again
    j = StragglerJudge(1.5, 10.0, interval=1.0)
    found = [t for t in range(30) for v in feed(j, float(t), {0: 0.1, 1: 0.1 if t == 8 else 0.25, 2: 0.1})]
    assert found == [10, 21], found   # slow from t=0: the dip at t=8 is outvoted by its last 3 summaries
    j = StragglerJudge(1.5, 10.0, interval=1.0)
    for t in range(0, 60):   # every node 40 % noisy, none over 1.5 x the others' median for long
        figs = {n: 0.1 * (1.4 if (t + n) % 3 == 0 else 1.0) for n in range(3)}
        assert feed(j, float(t), figs) == []


def test_two_slow_nodes_of_three_are_each_compared_with_the_healthy_one():
    """A slow node and the spare that took a slow rank, beside one healthy node: the mean of the others would hide
    both (0.25 against (0.06 + 0.26) / 2 = 0.16: 1.6 x); the lower median finds each (4 x), one per window."""
    j = StragglerJudge(2.0, 1.5, interval=0.5)
    found = [(t / 2, v.node) for t in range(20) for v in feed(j, t / 2, {0: 0.06, 1: 0.25, 3: 0.26})]
    assert {n for _, n in found} == {1, 3} and found[0][0] == 1.5, found
    assert all(b - a >= 1.5 for (a, _), (b, _) in zip(found, found[1:])), found


def test_a_node_reported_is_not_reported_again_in_the_generation():
    j = StragglerJudge(1.5, 2.0, interval=1.0)
    first = [(t, v.node) for t in range(5) for v in feed(j, float(t), {0: 0.1, 1: 0.3, 2: 0.1})]
    assert first == [(2, 1)]
    j.mute(1)
    assert [v for t in range(5, 20) for v in feed(j, float(t), {0: 0.1, 1: 0.3, 2: 0.1})] == []
    assert [(t, v.node) for t in range(20, 25) for v in feed(j, float(t), {0: 0.1, 1: 0.3, 2: 0.1}, gen=1)] == [(22, 1)]


def test_the_others_median_and_a_new_generation_start_afresh():
    j = StragglerJudge(1.3, 5.0, interval=1.0)
    # two nodes: the job's median (the mean of both) would hide a node 1.5 x slower; the other's does not
    assert [v.node for t in range(8) for v in feed(j, float(t), {0: 0.1, 1: 0.15})] == [1]
    j = StragglerJudge(1.3, 5.0, interval=1.0)
    feed(j, 0.0, {0: 0.1, 1: 0.2})
    assert feed(j, 4.0, {0: 0.1, 1: 0.2}) == []
    assert feed(j, 5.0, {0: 0.1, 1: 0.2}, gen=1) == []   # a recovery: the slow run so far does not count
    assert feed(j, 6.0, {0: 0.1, 1: 0.2}, gen=0) == []   # an older generation's figure is dropped
    assert [v.node for v in feed(j, 10.0, {0: 0.1, 1: 0.2}, gen=1)] == [1]
    # alone (no other node's fresh figure), or beside stale figures only: nothing to compare with
    j = StragglerJudge(1.3, 1.0, interval=1.0)
    feed(j, 0.0, {0: 0.1})
    assert [feed(j, float(t), {1: 1.0}) for t in range(4, 10)] == [[]] * 6


def test_a_site_s_slow_figure_is_judged_by_the_same_rules():
    """A detector's Slow(factor) (a NIC at a lower speed: invisible in the own work, every node waits alike) counts
    like the own-work ratio: over the factor for the window, then a verdict that names it."""
    j = StragglerJudge(1.5, 5.0, interval=1.0)
    nic = (2.5, "site-nic: eth0 at 10 Gb/s of 100")
    found = []
    for t in range(12):
        for n in (0, 1, 2):
            v = j.add(n, 0, 0.1, 0.2, (n,), float(t), nic if n == 2 and t >= 3 else None)
            found += [(t, v)] if v else []
    assert [(t, v.node, v.ratio, v.site) for t, v in found] == [(8, 2, 2.5, nic)], found
    j = StragglerJudge(1.5, 5.0, interval=1.0)   # under the factor, or alone, a site's figure decides nothing
    assert [j.add(0, 0, 0.1, 0.2, (0,), float(t), (1.2, "x")) for t in range(10)] == [None] * 10


def test_a_detector_s_slow_figure_reaches_the_check_and_expires(tmp_path):
    """agent/health.py: a detector that returns Slow is asked again (it is not a swap verdict), its figure counts
    for 3 intervals after it last said so; a bad factor is a detector_error, not a figure."""
    import threading
    import time

    from deadpool_hpc.agent.health import DetectorRunner, Slow

    class Clocks:
        interval_s = 0.05

        def __init__(self, answers):
            self.answers, self.asked = list(answers), 0

        def check(self):
            self.asked += 1
            return self.answers.pop(0) if self.answers else None

    class Log:
        def __init__(self):
            self.events = []

        def emit(self, kind, **kw):
            self.events.append((kind, kw))

    good, bad = Clocks([Slow(1.8, "SM clock 1.1 of 1.98 GHz")] * 4), Clocks([Slow(0.5, "faster?")])
    log = Log()
    w = DetectorRunner([("dcgm", good), ("bad", bad)], log, wake=threading.Event().set).start()
    try:
        end = time.monotonic() + 5
        while good.asked < 3 and time.monotonic() < end:
            time.sleep(0.01)
        assert w.slowness() == (1.8, "dcgm: SM clock 1.1 of 1.98 GHz") and w.pending() == []
        assert [k for k, kw in log.events] == ["detector_error"] and "accepted: a finite number > 1" in \
            log.events[0][1]["error"]
        while good.answers and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(4 * good.interval_s)   # it stopped saying so: believed after 3 intervals
        assert w.slowness() is None
    finally:
        w.stop()


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="straggler factor 1.0"):
        StragglerJudge(1.0, 10.0)
    with pytest.raises(ValueError, match="straggler window 0"):
        StragglerJudge(1.5, 0)
    assert interval_for(60) == 5.0 and interval_for(6) == 1.0 and interval_for(1) == 0.5


def test_the_meter_reads_each_rank_s_own_work_per_step_from_its_progress_page():
    pages = {0: ProgressPage.create(), 1: ProgressPage.create()}
    try:
        m = WorkMeter(pages.get, 2)
        m.rebase()
        assert m.read() is None   # no step yet
        pages[0].add_step(0.010, 0.030)
        assert m.read() is None   # rank 1 completed no step yet: the interval goes on
        pages[1].add_step(0.025, 0.030)
        for _ in range(3):
            pages[0].add_step(0.010, 0.030)
            pages[1].add_step(0.025, 0.030)
        own, wall = m.read()   # the node's slowest rank
        assert own == pytest.approx(0.025, abs=1e-5) and wall == pytest.approx(0.030, abs=1e-5)
        pages[0].add_step(0.010, 0.020)
        assert m.read() is None   # rank 1 completed no step in this interval
        assert pages[0].work()[0] == 5 and pages[1].work()[0] == 4
    finally:
        for p in pages.values():
            p.close()
