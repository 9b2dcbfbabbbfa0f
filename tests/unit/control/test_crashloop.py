"""Crash loops (control/crashloop.py): the rule that tells a failure that follows the work from one that follows the
node, and the recovery decision it changes (agreement.decide). Pure logic: no process starts here; the end-to-end run
of the issue's case is test_hotswap.py's test_a_crash_that_follows_the_work_stops_the_run_and_resumes."""
from __future__ import annotations

import pytest

from deadpool_hpc.config import RunConfig
from deadpool_hpc.control.agreement import decide as _decide
from deadpool_hpc.control.crashloop import (DEFAULT_LIMIT, STEP_WINDOW, CrashLoop, WorkFailure, end_of, find_loop,
                                            follows_work)
from deadpool_hpc.control.decision import Decision, decision_from_wire
from deadpool_hpc.control.messages import Report
from deadpool_hpc.errors import ConfigError


def wf(rank=1, step=50, end="SIGABRT", node=1, generation=0) -> WorkFailure:
    return WorkFailure(rank=rank, step=step, end=end, node=node, generation=generation, t=1000.0 + generation)


def test_the_same_rank_step_and_signal_on_limit_plus_one_nodes_is_a_loop():
    # the case: rank 1 aborts at step 50 on node1, then on the spares node3 and node4 that take it over
    fs = [wf(node=1, generation=0), wf(node=3, generation=1)]
    assert find_loop(fs, limit=2) is None            # one repeat: not yet
    fs.append(wf(node=4, generation=2))
    loop = find_loop(fs, limit=2)
    assert loop == CrashLoop(rank=1, end="SIGABRT", steps=(50, 50, 50), nodes=(1, 3, 4))
    assert loop.repeats == 2 and loop.step == 50
    assert loop.describe() == ("rank 1 ended by SIGABRT at step 50 on node1, node3, node4: a crash that follows the "
                               "work, not the node; stopped after 2 repeats (--crash-loop-limit)")
    assert find_loop(fs[:2], limit=1).nodes == (1, 3)   # --crash-loop-limit 1: the first repeat stops it


def test_off_and_default():
    fs = [wf(node=n, generation=g) for g, n in enumerate((1, 3, 4, 0, 2))]
    assert find_loop(fs, limit=0) is None               # 0: off, however often it repeats
    assert DEFAULT_LIMIT == RunConfig().comeback.crash_loop_limit == 2


@pytest.mark.parametrize("second, why", [
    (wf(step=80, node=3), "another step"),
    (wf(rank=2, node=3), "another rank"),
    (wf(end="SIGSEGV", node=3), "another signal"),
    (wf(end="exit code 1", node=3), "an exit code, not the signal"),
])
def test_different_steps_ranks_or_ends_are_not_a_loop(second, why):
    third = WorkFailure(**{**second.__dict__, "node": 4, "generation": 2})
    assert find_loop([wf(node=1), second, third], limit=2) is None, why
    # ... and the first failure is not counted with them: two repeats of *their* pattern are needed
    assert find_loop([wf(node=1), second, third, WorkFailure(**{**second.__dict__, "node": 0})], limit=2) is not None


def test_a_failure_that_follows_the_node_is_not_a_loop():
    # one bad node that fails again and again, the same way at the same step, wherever its ranks go: one node
    same_node = [wf(node=1, generation=g) for g in range(5)]
    assert find_loop(same_node, limit=2) is None
    # node1 crashes its ranks at whatever step it is at: different steps and ranks
    roaming = [wf(rank=r, step=s, node=1, generation=g) for g, (r, s) in enumerate([(1, 10), (0, 30), (2, 50)])]
    assert find_loop(roaming, limit=1) is None
    assert not follows_work(same_node[-1], same_node[:-1])   # quarantine may still keep node1 out


def test_steps_within_the_window_count_as_the_same_step():
    fs = [wf(step=50, node=1), wf(step=50 + STEP_WINDOW, node=3), wf(step=50 + 1, node=4)]
    assert find_loop(fs, limit=2).steps == (50, 50 + STEP_WINDOW, 51)
    assert CrashLoop(1, "SIGKILL", (50, 52, 51), (1, 3, 4)).describe().startswith(
        "rank 1 ended by SIGKILL at steps 50, 51, 52 on node1, node3, node4")
    far = [wf(step=50, node=1), wf(step=50 + STEP_WINDOW + 1, node=3), wf(step=50 + 2 * STEP_WINDOW + 2, node=4)]
    assert find_loop(far, limit=2) is None


def test_the_newest_failure_decides_which_pattern_is_judged():
    # the loop is complete only when its own failure comes: an unrelated failure in between does not complete it
    fs = [wf(node=1), wf(node=3), wf(rank=0, step=7, end="SIGKILL", node=0)]
    assert find_loop(fs, limit=1) is None
    assert find_loop(fs + [wf(node=4)], limit=1).nodes == (1, 3, 4)


def test_follows_work_needs_another_node_with_the_same_work():
    mine = wf(node=3, generation=1)
    assert follows_work(mine, [wf(node=1), mine])
    assert not follows_work(mine, [mine])
    assert not follows_work(mine, [wf(node=1, step=20)])


def test_end_of_names_the_signal_or_the_code():
    assert end_of(-6) == "SIGABRT" and end_of(-9) == "SIGKILL" and end_of(3) == "exit code 3"


def test_wire_forms_round_trip_and_refuse_bad_values():
    f = wf()
    assert WorkFailure.from_wire(f.to_wire()) == f
    with pytest.raises(ValueError, match="key 'step' is '50'"):
        WorkFailure.from_wire({**f.to_wire(), "step": "50"})
    loop = CrashLoop(1, "SIGABRT", (50, 50), (1, 3))
    assert CrashLoop.from_wire(loop.to_wire()) == loop
    with pytest.raises(ValueError, match=r"a crash loop of rank 1 has steps \[\] and nodes \[1\]"):
        CrashLoop.from_wire({"rank": 1, "end": "SIGABRT", "steps": [], "nodes": [1]})


# ---- the decision ----------------------------------------------------------------------------------------------
def decide(**kw):
    """``agreement.decide`` with each report read from its wire form (a dict; {}: a spare that holds nothing)."""
    return _decide(**dict(kw, reports={m: Report.from_wire(r) for m, r in kw["reports"].items()}))


def _reports(W: int, own: list[int], start: int = 0) -> dict:
    """Each of W virtual processes (P = 1) holds its own rank's snapshots ``own`` and its left neighbour's."""
    return {m: {"own_rank": m, "own": own, "held": {str((m - 1) % W): own}, "done_step": max(own),
                "start_step": start} for m in range(W)}


def test_decide_stops_a_crash_loop_with_spares_left_and_saves_the_cut():
    # 3 + 2 nodes (P = 1): node4 (a spare promoted into rank 1) failed; node3 and node1 failed the same way before
    # it, and node1 is back as a spare: spares 1 and ... left, still no promotion
    assignment = [0, 4, 2]
    reports = {m: r for m, r in _reports(5, [48, 49]).items() if m in (0, 2, 1, 3)}
    reports[1] = reports[3] = {}   # spares hold nothing
    reports[0]["held"] = {"2": [48, 49]}
    reports[2]["held"] = {"1": [48, 49]}
    failures = (wf(node=1, generation=0), wf(node=3, generation=1), wf(node=4, generation=2))
    d = decide(generation=3, ranks_per_node=1, assignment=assignment, spare_nodes=[1], failed={4}, reports=reports,
               work_failures=failures, crash_loop_limit=2)
    assert d.reason == "crash loop" and d.exhausted
    assert d.promoted == {} and d.assignment == tuple(assignment)
    assert d.crash_loop == CrashLoop(1, "SIGABRT", (50, 50, 50), (1, 3, 4))
    assert d.cut_step == 49 and d.sources == {1: 2}   # rank 1's state, for the checkpoint, from its holder
    back = decision_from_wire(d.to_wire())
    assert isinstance(back, Decision) and back == d

    # the same failures with the rule off: an ordinary hot swap onto the spare
    d0 = decide(generation=3, ranks_per_node=1, assignment=assignment, spare_nodes=[1], failed={4}, reports=reports,
                work_failures=failures, crash_loop_limit=0)
    assert d0.reason == "hot swap" and d0.promoted == {1: 1} and d0.crash_loop is None
    # one repeat only: a hot swap too
    d1 = decide(generation=3, ranks_per_node=1, assignment=assignment, spare_nodes=[1], failed={4}, reports=reports,
                work_failures=failures[1:], crash_loop_limit=2)
    assert d1.reason == "hot swap" and d1.crash_loop is None


def test_a_preemption_is_not_reported_as_a_crash_loop():
    failures = (wf(node=1), wf(node=3), wf(node=4))
    d = decide(generation=3, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[], failed=set(),
               reports=_reports(3, [10]), preempt=True, work_failures=failures, crash_loop_limit=2)
    assert d.reason == "preempted" and d.crash_loop is None


def test_the_limit_is_checked():
    with pytest.raises(ConfigError, match=r"--crash-loop-limit -1: accepted: an integer >= 0"):
        RunConfig(crash_loop_limit=-1).validate()
    with pytest.raises(ConfigError, match=r"--crash-loop-limit True"):
        RunConfig(crash_loop_limit=True).validate()


def test_the_summary_names_the_loop_and_does_not_call_it_a_requeue():
    from deadpool_hpc.summary import build_summary

    loop = {"rank": 1, "end": "SIGABRT", "steps": [50, 50, 50], "nodes": [1, 3, 4]}
    line = "rank 1 ended by SIGABRT at step 50 on node1, node3, node4: ..."
    events = [
        {"t": 0.5, "event": "decision", "generation": 2, "failed_nodes": [3], "promoted": {"1": 4}, "replaced": {"3": 4},
         "cut_step": 50, "exhausted": False, "reason": "hot swap", "crash_loop": None, "t_decided": 0.5,
         "recomputed_steps": 0},
        {"t": 1.0, "event": "node_failed", "node": 4, "generation": 2, "cause": "exit", "rank": 1, "step": 50,
         "end": "SIGABRT"},
        {"t": 1.1, "event": "decision", "generation": 3, "failed_nodes": [4], "promoted": {}, "replaced": {},
         "cut_step": 50, "exhausted": True, "reason": "crash loop", "crash_loop": loop, "t_decided": 1.1,
         "recomputed_steps": 0},
        {"t": 2.0, "event": "checkpoint_saved", "step": 50, "generation": 3, "reason": "crash loop"},
        {"t": 2.0, "event": "crash_loop", "rank": 1, "end": "SIGABRT", "step": 50, "steps": [50, 50, 50],
         "nodes": [1, 3, 4], "repeats": 2, "limit": 2, "checkpoint_step": 50, "error": line},
        {"t": 2.0, "event": "error", "error": line},
    ]
    s = build_summary(events, RunConfig(nodes=3, spares=2, steps=60))
    assert not s["completed"] and s["errors"] == [line]
    assert s["crash_loop"]["nodes"] == [1, 3, 4] and s["crash_loop"]["checkpoint_step"] == 50
    swapped, f = s["failures"]
    assert swapped["outcome"] == ("swapped, then the same crash on the spare (rank 1 ended by SIGABRT at step 50: "
                                  "crash loop)"), swapped
    assert not f["requeued"] and f["cause"] == "exit"
    assert f["outcome"] == ("crash loop: rank 1 ended by SIGABRT at step 50 on node1, node3, node4 (the work, not the "
                            "node): checkpoint saved, run stopped")
