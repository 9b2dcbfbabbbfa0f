"""The straggler check's pure parts (agent/stragglers.py): the coordinator's judge and a node's meter over real
progress pages (ipc/shm.py). The end-to-end proof, a node slowed by real signals and swapped out, is in
tests/test_planned_swap.py and tests/slurm/test_slurm_planned_swap.py."""
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
    # slow from t=5: found at t=15 (the window); a verdict starts the count again: the next at t=26
    assert [(t, v.node) for t, v in verdicts] == [(15, 1), (26, 1)]
    v = verdicts[0][1]
    assert v.median_s == pytest.approx(0.105) and v.ratio == pytest.approx(0.21 / 0.105) and v.slow_for_s == 10.0
    assert v.ranks == (1,)


def test_noise_and_a_broken_run_of_slow_figures_are_not_a_straggler():
    j = StragglerJudge(1.5, 10.0, interval=1.0)
    for t in range(0, 60):   # over the factor 9 s out of every 10: never for a whole window
        slow = 0.2 if t % 10 else 0.12
        assert feed(j, float(t), {0: 0.1, 1: slow, 2: 0.1}) == []
    j = StragglerJudge(1.5, 10.0, interval=1.0)
    for t in range(0, 60):   # every node 40 % noisy, none over 1.5 x the others' median for long
        figs = {n: 0.1 * (1.4 if (t + n) % 3 == 0 else 1.0) for n in range(3)}
        assert feed(j, float(t), figs) == []


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
