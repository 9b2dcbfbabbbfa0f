"""End to end: real MPI processes, real gloo process groups, real signals (deadpool run's engine).

The strongest check we have (DESIGN.md): a run that loses a node and recovers ends with parameters
bitwise equal to a run that never failed.
"""
import json
import os

import pytest

from deadpool_hpc.config import RunConfig
from deadpool_hpc.faultinject.spec import Fault
from deadpool_hpc.process.fence import _start_ticks, is_alive
from deadpool_hpc.events import read_events

from runs import launch_reaped  # tests/runs.py

pytestmark = pytest.mark.e2e   # every test launches a run (tests/README.md)

STEPS = 40


def run(tmp_path, name, **kw):
    cfg = RunConfig(**{**dict(nodes=3, spares=1, steps=STEPS, run_dir=str(tmp_path / name)), **kw}).validate()
    return launch_reaped(cfg, 300)  # whatever happened, no process of this run may be left behind


@pytest.fixture(scope="module")
def baseline(failure_free):
    s = failure_free(nodes=3, steps=STEPS)   # tests/conftest.py: one run per settings, shared by every module
    assert s["steps_completed"] == STEPS
    return s


def test_failure_free_run_trains(baseline):
    assert baseline["final_loss"] < 0.75 * baseline["first_loss"]
    assert baseline["world_size"] == 3
    assert baseline["bytes_replicated_per_rank_per_step"] > 0
    # rank 0 snapshots the start of every step and the end: the first one by the background copier (no slot is
    # reserved before the first update), most of the others inline, with the slot claimed while the optimizer ran
    snaps = baseline["snapshots"]
    assert snaps["inline"] + snaps["background"] == STEPS + 1, snaps
    assert snaps["inline"] >= STEPS // 2, snaps


def check_swapped(f, target):
    """One failure of a recovered run: ``target`` hot-swapped, timed in every phase, at most one step recomputed."""
    assert f["target"] == target and f["outcome"] == "hot swap", f
    assert f["recomputed_steps"] <= 1, f
    assert f["recovery_s"] is not None and all(v is not None and v >= 0 for v in f["phases"].values()), f


def check_recovered(s, baseline, targets):
    """Every fault of the run recovered by a hot swap, in order, and the parameters bitwise the baseline's."""
    assert s["completed"], s
    assert s["steps_completed"] == STEPS
    assert [f["target"] for f in s["failures"]] == list(targets), s["failures"]
    for f, target in zip(s["failures"], targets):
        check_swapped(f, target)
    assert s["swaps"] == len(targets) and s["spares_left"] == 0
    assert s["param_digest"] == baseline["param_digest"], "recovered run diverged from the failure-free run"


def test_kill_at_the_first_step_and_rank0s_node_over_the_unix_transport(tmp_path, baseline):
    """Two faults one after the other, each recovered before the next: node2 SIGKILLed at step 0 (before any
    snapshot of a later step exists), then node0, which hosts rank 0 and the generation-0 TCPStore, at step 15.
    Every replica and restore is pushed over abstract Unix sockets (``--replica-transport unix``,
    replica/transports.py, entry point group deadpool_hpc.transports) instead of TCP."""
    s = run(tmp_path, "unix", spares=2, replica_transport="unix",
            faults=[Fault("kill", "node", 2, 0), Fault("kill", "node", 0, 15)])
    check_recovered(s, baseline, ["node2", "node0"])
    assert s["failures"][0]["cut_step"] == 0
    hellos = [e for e in read_events(os.path.join(str(tmp_path / "unix"), "events.jsonl"))
              if e["event"] == "hello" and e.get("role") == "agent"]
    assert hellos and all(a[0] == "unix" for e in hellos for a in e["replica"])


def test_summary_file_written_by_cli(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "s.json"
    p = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "run", "--nodes", "2", "--spares", "1",
                        "--steps", "12", "--kill", "node1@6", "--run-dir", str(tmp_path / "cli"), "--summary", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    s = json.loads(out.read_text())
    for key in ("steps_completed", "first_loss", "final_loss", "world_size", "spares_left", "param_digest", "failures"):
        assert key in s
    assert s["steps_completed"] == 12 and len(s["failures"]) == 1
    assert set(s["failures"][0]["phases"]) == {"detect", "agree", "rebuild", "restore", "recompute"}
    assert "recoveries" in p.stdout


def test_no_spare_left_saves_checkpoint_requeues_and_resumes_identically(tmp_path, baseline):
    s = run(tmp_path, "requeue", spares=0, requeue=True, faults=[Fault("kill", "node", 1, 20)])
    assert s["completed"] and s["steps_completed"] == STEPS, s
    assert s["requeues"] == 1 and s["swaps"] == 0
    f = s["failures"][0]
    assert f["requeued"] and f["cut_step"] in (19, 20)
    events = list(read_events(os.path.join(str(tmp_path / "requeue"), "events.jsonl")))
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    resumed = [e for e in events if e["event"] == "resumed_from_checkpoint"]
    assert len(saved) == 1 and len(resumed) == 3 and {e["step"] for e in resumed} == {saved[0]["step"]}
    assert s["param_digest"] == baseline["param_digest"]


def test_sigusr2_preemption_saves_requeues_and_resumes_identically(tmp_path, baseline):
    """Slurm's warning before preemption or the time limit is SIGUSR2 (submitit's convention). Here one
    rank gets it (a real signal) at step 15: every process must save at one agreed step, exit, be
    requeued by the launcher and finish with the failure-free parameters."""
    import signal
    import threading
    import time

    run_dir = tmp_path / "preempt"
    out = {}
    th = threading.Thread(target=lambda: out.update(s=run(tmp_path, "preempt", requeue=True)), daemon=True)
    th.start()
    signalled = None
    while th.is_alive() and signalled is None:
        time.sleep(0.1)
        path = run_dir / "events.jsonl"
        ev = list(read_events(str(path))) if path.exists() else []
        if max([e["step"] for e in ev if e["event"] == "step"], default=0) >= 15:
            signalled = next(e for e in ev if e["event"] == "hello" and e.get("mpi_rank") == 2)
            os.kill(signalled["pid"], signal.SIGUSR2)
    th.join(300)
    s = out["s"]
    assert signalled is not None, "the run ended before step 15"
    assert s["completed"] and s["steps_completed"] == STEPS, s
    assert s["failures"] == [] and s["requeues"] == 1 and s["swaps"] == 0, s
    (p,) = s["preemptions"]
    assert p["resumed"] and p["cut_step"] >= 15, p
    events = list(read_events(str(run_dir / "events.jsonl")))
    asked = [e for e in events if e["event"] == "preempt_requested"]
    assert [e["mpi_rank"] for e in asked] == [2]
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    assert len(saved) == 1 and saved[0]["reason"] == "preempted" and saved[0]["step"] == p["cut_step"]
    resumed = [e for e in events if e["event"] == "resumed_from_checkpoint"]
    assert len(resumed) == 3 and {e["step"] for e in resumed} == {p["cut_step"]}
    assert s["param_digest"] == baseline["param_digest"]


def test_two_ranks_per_node_a_dead_rank_costs_its_whole_node(tmp_path, failure_free):
    kw = dict(nodes=2, ranks_per_node=2, steps=24)
    base = failure_free(**kw)
    s = run(tmp_path, "p2kill", faults=[Fault("kill", "rank", 1, 12)], spares=1, **kw)
    assert s["completed"] and len(s["failures"]) == 1, s
    f = s["failures"][0]
    assert f["failed_nodes"] == [0] and f["promoted"] == {"0": 4, "1": 5}  # spare node 2 = MPI ranks 4, 5
    assert s["param_digest"] == base["param_digest"]


def test_several_faults_one_run_a_spare_a_node_and_a_hung_rank(tmp_path, baseline):
    """An idle spare (node4) SIGKILLed at step 5: one spare fewer; node1 SIGKILLed at step 10: hot-swapped; rank 2
    SIGSTOPped at step 25: found by its agent from its progress page after --hang-timeout, fenced (killed) and
    hot-swapped, and its node, whose agent lives on, back in the spare pool. Each recovery is complete before the
    next fault."""
    s = run(tmp_path, "multi", spares=3, hang_timeout=3.0,
            faults=[Fault("kill", "node", 4, 5),    # a spare: it dies, one spare fewer
                    Fault("kill", "node", 1, 10), Fault("hang", "rank", 2, 25)])
    assert s["completed"] and s["steps_completed"] == STEPS, s
    assert [f["target"] for f in s["failures"]] == ["node4", "node1", "rank2"] and s["swaps"] == 2
    assert s["failures"][0]["outcome"] == "spare lost"
    # node4 and node1 were lost whole; node2, whose rank hung, came back to the pool (agent/comeback.py)
    assert [r["node"] for r in s["returns"]] == [2] and s["spares_left"] == 1, (s["returns"], s["spares_left"])
    for f, target in zip(s["failures"][1:], ["node1", "rank2"]):
        check_swapped(f, target)
    assert s["param_digest"] == baseline["param_digest"]
    events = list(read_events(os.path.join(str(tmp_path / "multi"), "events.jsonl")))
    (inj,) = [e for e in events if e["event"] == "fault_injected" and e["target"] == "rank2"]
    assert inj["signal"] == "SIGSTOP"
    assert not any(is_alive({"pid": p, "start": _start_ticks(p)}) for p in inj["pids"]), \
        "the hung process must be fenced (killed)"


def test_a_node_whose_process_died_comes_back_as_the_spare_and_takes_the_next_failure(tmp_path, baseline):
    """Spares that come back (agent/comeback.py, issue 27). Rank 0's process is SIGKILLed at step 5: node3, the only
    spare, takes its place, while node0's agent, alive, ends its processes, checks the node and returns to the pool.
    Once it is back (its ``node_returned`` event), this test SIGKILLs rank 1's process: node0 takes node1's place
    (without the return there would be no spare), and node1, whose --health-check now hangs, stays out: the check is
    killed at --health-check-timeout and counts as failed."""
    import signal
    import threading
    import time

    run_dir = tmp_path / "back"
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(s=run(
        tmp_path, "back", spares=1, faults=[Fault("kill", "rank", 0, 5)],
        health_check=f"test ! -e {tmp_path}/unhealthy-$DEADPOOL_NODE || sleep 120", health_check_timeout=2.0)),
        daemon=True)
    th.start()
    killed = None
    while th.is_alive() and killed is None:
        time.sleep(0.05)
        ev = list(read_events(str(run_dir / "events.jsonl"))) if (run_dir / "events.jsonl").exists() else []
        if any(e["event"] == "node_returned" and e["node"] == 0 for e in ev):
            (tmp_path / "unhealthy-1").touch()
            rank1 = [e for e in ev if e["event"] in ("started", "recovered") and e.get("rank") == 1]
            killed = (rank1[-1], max(e["step"] for e in ev if e["event"] == "step"), time.time())
            os.kill(rank1[-1]["pid"], signal.SIGKILL)
    th.join(300)
    s = out["s"]
    assert killed is not None, "node0 did not come back before the run ended"
    assert killed[0]["node"] == 1 and killed[1] < STEPS, killed
    assert s["completed"] and s["steps_completed"] == STEPS, s
    first, second = s["failures"]
    check_swapped(first, "rank0")
    assert first["spare_nodes_used"] == [3] and first["cause"] == "exit"
    assert second["failed_nodes"] == [1] and second["spare_nodes_used"] == [0], second   # the node that came back
    assert second["outcome"] == "hot swap" and second["recomputed_steps"] <= 1, second
    assert [r["node"] for r in s["returns"]] == [0] and s["returns"][0]["health_s"] is not None, s["returns"]
    # node1's check is killed 2 s after it starts: when node0 came back late, the run may end before that (then
    # node1 is simply never back, asserted above); a run that went on past it must have quarantined node1
    last_step = max(e["t"] for e in read_events(str(run_dir / "events.jsonl")) if e["event"] == "step")
    if s["quarantined"] or last_step - killed[2] > 2.0 + 1.0:
        (out_,) = s["quarantined"]
        assert out_["node"] == 1 and "still running after 2 s" in out_["reason"], out_
    assert s["spares_left"] == 0
    assert s["param_digest"] == baseline["param_digest"], "a run that reused a returned node diverged"
    events = list(read_events(str(run_dir / "events.jsonl")))
    (readmitted,) = [e for e in events if e["event"] == "node_readmitted"]
    assert readmitted["returned"] == 0 and readmitted["generation"] == 1   # between recoveries, never in a round


def test_a_crash_that_follows_the_work_stops_the_run_and_resumes(tmp_path, baseline):
    """Crash loops (control/crashloop.py), the issue's case through the command a user runs: training rank 1 calls
    ``os.abort()`` at step 30 on every node that takes it (``trainfns:abort_rank1``), 3 + 2 nodes, spares that come
    back on, ``--requeue``. With the default --crash-loop-limit (2) the run swaps rank 1 onto node3, then node4; when
    node4 aborts too it stops: no further promotion (node1, back in the pool, is not promoted into it), nobody
    quarantined, the checkpoint of the cut saved, no requeue, exit status 4, the rank, step and signal named in the
    summary's errors and on the console. ``deadpool run --resume`` with the plain demo then completes from that
    checkpoint, bitwise equal to a run that never failed."""
    import subprocess
    import sys

    run_dir = tmp_path / "loop"
    cmd = [sys.executable, "-m", "deadpool_hpc.launch.cli", "run", "--nodes", "3", "--spares", "2", "--steps",
           str(STEPS), "--run-dir", str(run_dir), "--summary", str(tmp_path / "loop.json")]
    env = dict(os.environ, DEADPOOL_TEST_ABORT_STEP="30")
    p = subprocess.run(cmd + ["--train-fn", "trainfns:abort_rank1", "--requeue"], capture_output=True, text=True,
                       timeout=300, env=env)
    events = list(read_events(str(run_dir / "events.jsonl")))
    for e in events:
        if e["event"] == "hello":
            assert not is_alive(e), f"pid {e['pid']} ({e.get('role')}) outlived the run"
    assert p.returncode == 4, p.stdout[-3000:] + p.stderr[-2000:]
    s = json.loads((tmp_path / "loop.json").read_text())
    assert not s["completed"] and s["requeues"] == 0, s
    loop = s["crash_loop"]
    assert (loop["rank"], loop["end"], loop["steps"], loop["nodes"], loop["repeats"]) == \
        (1, "SIGABRT", [30, 30, 30], [1, 3, 4], 2), loop
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    assert len(saved) == 1 and saved[0]["reason"] == "crash loop" and saved[0]["step"] == loop["checkpoint_step"]
    text = (f"rank 1 ended by SIGABRT at step 30 on node1, node3, node4: a crash that follows the work, not the node; "
            f"stopped after 2 repeats (--crash-loop-limit); checkpoint at step {saved[0]['step']} saved in "
            f"{run_dir}/checkpoint")
    assert s["errors"] == [text], s["errors"]
    assert "rank 1 ended by SIGABRT at step 30" in p.stdout and "crash loop" in p.stdout, p.stdout[-3000:]
    # two hot swaps into the crash, then the stop; the nodes it ran into are not blamed
    swaps, last = s["failures"][:2], s["failures"][-1]
    assert len(s["failures"]) == 3 and [f["spare_nodes_used"] for f in swaps] == [[3], [4]], s["failures"]
    assert last["failed_nodes"] == [4] and last["outcome"].startswith("crash loop: rank 1 ended by SIGABRT"), last
    assert s["quarantined"] == [], s["quarantined"]
    promoted = [e for e in events if e["event"] == "decision" and e.get("promoted")]
    assert len(promoted) == 2
    t_first = min(e["t"] for e in events if e["event"] == "node_failed" and e.get("cause") == "exit")
    (stop,) = [e for e in events if e["event"] == "crash_loop"]
    print(f"first abort -> crash loop stopped (checkpoint saved): {stop['t'] - t_first:.2f} s")
    assert stop["t"] - t_first < 60, stop["t"] - t_first

    # resume from the checkpoint, the bad batch fixed (the demo itself)
    p2 = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-2000:]
    s2 = json.loads((tmp_path / "loop.json").read_text())
    assert s2["completed"] and s2["steps_completed"] == STEPS and s2["failures"] == [], s2
    resumed = [e for e in read_events(str(run_dir / "events.jsonl")) if e["event"] == "resumed_from_checkpoint"]
    assert {e["step"] for e in resumed} == {saved[0]["step"]}, resumed
    assert s2["param_digest"] == baseline["param_digest"], "the run resumed from the crash loop's checkpoint diverged"
