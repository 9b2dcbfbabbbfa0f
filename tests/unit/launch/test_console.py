"""launch/console.py: what the live view says, from events (no run)."""
import io

from deadpool_hpc.config import RunConfig


def console_lines(cfg: RunConfig, evs: list[dict]) -> list[str]:
    from rich.console import Console

    from deadpool_hpc.launch.console import LiveView

    with LiveView(cfg, Console(file=io.StringIO(), width=300)) as view:
        view.update(evs)
    return [t.plain for t in view.lines]


def _no_spare(step: int, reason: str = "no spare node left") -> list[dict]:
    return [{"event": "decision", "t": 1.0, "t_decided": 1.0, "generation": 1, "failed_nodes": [] if reason ==
             "preempted" else [1], "promoted": {}, "cut_step": step, "exhausted": True, "reason": reason},
            {"event": "checkpoint_saved", "t": 2.0, "step": step, "generation": 1, "reason": reason}]


def test_console_after_no_spare_left_says_what_happens():
    stop = console_lines(RunConfig(nodes=2, spares=0), _no_spare(9))
    assert any("no spare left: checkpoint saved at step 9; the run stops here (without --requeue" in x for x in stop)
    assert not any("requeueing" in x for x in stop), stop
    again = console_lines(RunConfig(nodes=2, spares=0, requeue=True), _no_spare(9))
    assert any("requeueing: the run restarts from it" in x for x in again), again
    last = console_lines(RunConfig(nodes=2, spares=0, requeue=True, max_requeues=1),
                         _no_spare(9) + [{"event": "requeued", "t": 3.0, "attempt": 1}] + _no_spare(12))
    assert "the run stops here: it was requeued 1 times already" in last[-1], last
    pre = console_lines(RunConfig(nodes=2, spares=1, requeue=True), _no_spare(7, "preempted"))
    assert any("no node lost, preempted: save a checkpoint" in x for x in pre)
    assert any(x.strip().startswith("preempted (SIGUSR2/SIGTERM): checkpoint saved at step 7") for x in pre), pre


def test_console_shows_each_node_s_step_time_and_a_straggler_swapped_out():
    from rich.console import Console

    from deadpool_hpc.launch.console import LiveView

    cfg = RunConfig(nodes=2, spares=1)
    times = {"0": {"own_s": 0.05, "step_s": 0.12}, "1": {"own_s": 0.11, "step_s": 0.12}}
    evs = [{"event": "fault_injected", "t": 0.5, "kind": "slow", "target": "node1", "node": 1, "step": 40,
            "phase": None, "pids": [7], "signal": "SIGSTOP/SIGCONT"},
           {"event": "node_step_times", "t": 1.0, "generation": 0, "nodes": times},
           {"event": "straggler_detected", "t": 2.0, "node": 1, "ratio": 2.2, "own_s": 0.11, "median_s": 0.05,
            "slow_for_s": 60.2, "action": "swap", "why": None}]
    with LiveView(cfg, Console(file=io.StringIO(), width=200)) as view:
        view.update(evs)
        shown = Console(file=io.StringIO(), width=200)
        shown.print(view._render())
        table = " ".join(shown.file.getvalue().split())
        assert "node1 slow 120 ms (110 ms)" in table and "node0 active 120 ms (50 ms)" in table, table
        view.update([{"event": "decision", "t": 3.0, "t_decided": 3.0, "generation": 1, "failed_nodes": [1],
                      "promoted": {"1": 2}, "cut_step": 70}])
        assert view.roles == {0: "active", 1: "out: slow", 2: "active"} and 1 not in view.step_times
    assert any("straggler: node1's own work 110.0 ms/step, 2.20 x the others' median for 60 s: planned swap" in x
               for x in (t.plain for t in view.lines)), [t.plain for t in view.lines]
