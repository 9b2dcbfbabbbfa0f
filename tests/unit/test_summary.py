"""build_summary over synthetic event logs: how decisions become failures and preemptions (pure logic)."""
from deadpool_hpc.summary import build_summary


def _decision(g, t, reason, failed_nodes, cut):
    return {"event": "decision", "t": t, "generation": g, "failed_nodes": failed_nodes, "promoted": {},
            "cut_step": cut, "exhausted": reason != "hot swap", "reason": reason, "recomputed_steps": 1,
            "t_decided": t}


def _steps(g, t0, first, last):
    return [{"event": "step", "t": t0 + 0.1 * i, "step": s, "generation": g, "loss": 3.0, "step_s": 0.1,
             "tokens_per_s": 1000.0 + s} for i, s in enumerate(range(first, last + 1))]


def test_preemption_alone_is_not_a_failure():
    ev = _steps(0, 0.0, 1, 20) + [
        {"event": "preempt_requested", "t": 2.5, "generation": 0},
        _decision(1, 2.6, "preempted", [], 20),
        {"event": "checkpoint_saved", "t": 2.8, "generation": 1, "step": 20, "reason": "preempted"},
        {"event": "requeued", "t": 3.0, "attempt": 1},
    ] + _steps(2, 30.0, 21, 40) + [{"event": "finished", "t": 40.0, "steps": 40, "param_digest": "d"}]
    s = build_summary(ev)
    assert s["failures"] == [] and s["swaps"] == 0 and s["requeues"] == 1 and s["completed"]
    (p,) = s["preemptions"]
    assert p["cut_step"] == 20 and p["resumed"]
    assert abs(p["save_s"] - 0.3) < 1e-9 and abs(p["signal_to_resume_s"] - 27.5) < 1e-9
    assert s["median_tokens_per_s"] == 1021.0 and s["median_step_s"] == 0.1


def test_a_node_lost_together_with_a_preemption_is_also_a_failure():
    ev = _steps(0, 0.0, 1, 10) + [
        {"event": "preempt_requested", "t": 1.5, "generation": 0},
        {"event": "suspect", "t": 1.6, "generation": 0, "suspect": 1},
        _decision(1, 1.7, "preempted", [1], 10),
        {"event": "checkpoint_saved", "t": 1.9, "generation": 1, "step": 10, "reason": "preempted"},
    ]
    s = build_summary(ev)
    assert len(s["preemptions"]) == 1 and not s["preemptions"][0]["resumed"]
    (f,) = s["failures"]
    assert f["failed_nodes"] == [1] and f["requeued"] and f["cut_step"] == 10
    assert not s["completed"]


def test_an_estimated_fault_time_is_never_after_the_first_suspicion():
    """One survivor suspects node 1 at t=1.60 (its connection reset); another reads a heartbeat that was still in
    flight at t=1.603 and suspects later. The fault happened no later than the first suspicion (CI saw a detect
    phase of -3 ms before this was clamped)."""
    ev = _steps(0, 0.0, 1, 10) + [
        {"event": "suspect", "t": 1.60, "generation": 0, "node": 1, "last_heard": 1.55},
        {"event": "suspect", "t": 1.70, "generation": 0, "node": 1, "last_heard": 1.603},
        _decision(1, 1.8, "hot swap", [1], 10),
    ]
    (f,) = build_summary(ev)["failures"]
    assert f["t_fault_source"] == "last heartbeat heard (estimated)"
    assert f["phases"]["detect"] == 0.0


def test_a_preemption_before_the_attempts_first_step_is_skipped_and_resumed():
    """Issue 46: the requeued attempt (generation 2, resumed from the generation-1 checkpoint of step 20) is signalled
    before its first step: nothing new to save (checkpoint_skipped); the next attempt resumes from the same checkpoint,
    so its steps carry generation 2 again. The preemption is `skipped` and `resumed` all the same."""
    ev = _steps(0, 0.0, 1, 20) + [
        {"event": "preempt_requested", "t": 2.5, "generation": 0},
        _decision(1, 2.6, "preempted", [], 20),
        {"event": "checkpoint_saved", "t": 2.8, "generation": 1, "step": 20, "reason": "preempted"},
        {"event": "requeued", "t": 3.0, "attempt": 1},
        {"event": "preempt_requested", "t": 10.0, "generation": 2},
        _decision(3, 10.5, "preempted", [], 20),
        {"event": "checkpoint_skipped", "t": 10.6, "generation": 3, "step": 20, "reason": "preempted"},
        {"event": "requeued", "t": 11.0, "attempt": 2, "idle": True},
    ] + _steps(2, 30.0, 21, 40) + [{"event": "finished", "t": 40.0, "steps": 40, "param_digest": "d"}]
    s = build_summary(ev)
    assert s["failures"] == [] and s["requeues"] == 2 and s["completed"]
    p1, p2 = s["preemptions"]
    assert not p1["skipped"] and p1["resumed"] and p2["skipped"] and p2["resumed"] and p2["cut_step"] == 20
    assert p2["save_s"] is None and abs(p2["signal_to_resume_s"] - 20.0) < 1e-9
