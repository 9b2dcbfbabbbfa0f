"""Issue 11, "never hang, never lose": faults during a recovery, a frozen training thread, real-size replicas,
k replicas, flat memory and honest reports. Real MPI processes, real gloo groups, real signals.

Every run ends bitwise equal to the failure-free run, or with a clear, documented exit; never a hang (each
``launch`` has a timeout well above the run's length, and the run's own deadlines end it first).
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from deadpool_hpc.config import RunConfig

from runs import SMALL_RUN_STEPS as STEPS, run_driven, run_events, run_faults  # tests/runs.py

pytestmark = pytest.mark.e2e   # every test launches a run (tests/README.md)

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
HERE = paths.TESTS


run, events = run_faults, run_events   # tests/runs.py


@pytest.fixture(scope="module")
def baseline(failure_free):
    return failure_free(nodes=3, steps=STEPS)["param_digest"]   # tests/conftest.py: shared by every module


@pytest.fixture()
def test_fns(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.syspath_prepend(HERE)


# ---- a second node lost at each moment of a recovery ----------------------------------------------------------
@pytest.mark.parametrize("phase", ["detect", "agree", "decided", "rebuild", "restore", "resume"])
def test_second_failure_at_each_recovery_phase(tmp_path, baseline, phase):
    """node1 dies at step 10; node2 (which holds a replica of node1's rank, and is its first source) dies at
    ``phase`` of that recovery. With two replicas per rank the run must end bitwise equal to the failure-free one."""
    s = run(tmp_path, phase, "kill node1@10", f"kill node2@{phase}", replicas=2)
    assert s["completed"], s
    assert [f["target"] for f in s["failures"]] == ["node1", "node2"], s["failures"]
    assert all(f["recovery_s"] is not None for f in s["failures"]), s["failures"]
    assert all(f["recomputed_steps"] <= 1 for f in s["failures"])
    assert s["swaps"] == 2 and s["spares_left"] == 0
    assert s["param_digest"] == baseline, "recovered run diverged from the failure-free run"
    inj = [e for e in events(tmp_path / phase) if e["event"] == "fault_injected"]
    assert [(e["target"], e["phase"]) for e in inj] == [("node1", None), ("node2", phase)]


@pytest.mark.parametrize("phase", ["decided", "rebuild"])
def test_the_coordinator_and_store_host_lost_during_a_recovery(tmp_path, baseline, phase):
    """node0 coordinates node1's recovery and hosts the new generation's store; it dies once it has sent the
    decision, or while the others join the process group it serves the store of."""
    s = run(tmp_path, phase, "kill node1@10", f"kill node0@{phase}", replicas=2)
    assert s["completed"] and s["param_digest"] == baseline, s
    assert [f["target"] for f in s["failures"]] == ["node1", "node0"]
    assert all(f["recovery_s"] < 8.0 for f in s["failures"]), s["failures"]  # never the rendezvous timeout


def test_a_hung_rank_of_a_two_rank_node_does_not_make_its_node_mate_coordinator(tmp_path, failure_free):
    """MPI rank 0 shares node 0 with the hung rank 1: it must not coordinate (it would host the store and be
    fenced with its node), or the others wait out the rendezvous timeout (a review found 24 s)."""
    kw = dict(nodes=2, ranks_per_node=2, steps=24, rendezvous_timeout=10.0, hang_timeout=2.0)
    base = failure_free(**kw)
    s = run(tmp_path, "p2hang", "hang rank1@12", spares=1, **kw)
    assert s["completed"] and s["param_digest"] == base["param_digest"], s
    (f,) = s["failures"]
    # a frozen training process is seen by its agent's progress watch after --hang-timeout (2 s)
    assert f["failed_nodes"] == [0] and f["rounds"] == 1 and f["recovery_s"] < 2.0 + 5.0, f
    (d,) = [e for e in events(tmp_path / "p2hang") if e["event"] == "decision"]
    assert d["node"] == 1, "the coordinator must be on a node that is not being fenced"


def test_an_idle_spare_killed_during_the_agreement(tmp_path, baseline):
    """The issue's first repro: a spare dies after it reported to the coordinator (it used to hang the
    agent thread in MPI_Comm_create_group for ever)."""
    s = run(tmp_path, "spare", "kill node1@10", "kill node4@agree")
    assert s["completed"] and s["param_digest"] == baseline, s
    assert sorted(f["target"] for f in s["failures"]) == ["node1", "node4"]


def test_two_adjacent_losses_with_one_replica_are_refused_before_start(tmp_path):
    p = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "run", "--run-dir", str(tmp_path / "r"),
                        "--nodes", "3", "--spares", "2", "--steps", "80", "--kill", "node0@40", "--kill", "node1@40"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "every holder of its replica" in p.stderr and "--replicas 2" in p.stderr
    assert not (tmp_path / "r").exists()


def test_state_lost_with_every_holder_ends_clearly_and_lists_the_failures(tmp_path):
    """Two adjacent nodes SIGKILLed together by someone else (not our injection) with one replica: the run
    cannot go on; it must end promptly with the reason, and the summary must list both failures."""
    def drive(run_dir, th):
        victims = _wait_for_step(run_dir, th, 8, lambda e: e["node"] in (0, 1))   # agents and their trainers
        for e in victims:
            try:
                os.kill(e["pid"], signal.SIGKILL)
            except ProcessLookupError:   # a trainer whose agent was just killed may have left already (lifeline)
                pass
        return time.monotonic()

    s, t = run_driven(tmp_path, "lost", drive, spares=2, steps=200, join_s=120)   # (it must not hang)
    assert time.monotonic() - t < 60
    assert not s["completed"]
    assert any("ReplicaError" in (e or "") for e in s["errors"]), s["errors"]
    # one round, or two when one loss was seen before the other (a loaded machine: a first round that found only
    # node0 lost already had no copy of rank 0's state, its holder node1 not reporting): both listed, both fatal
    fs = s["failures"]
    assert sorted(n for f in fs for n in f["failed_nodes"]) == [0, 1], fs
    assert all(f["outcome"].startswith("unrecoverable: ReplicaError") and f["kind"] == "not injected" for f in fs), fs


@pytest.mark.parametrize("role", ["trainer", "agent"])
def test_a_fault_we_did_not_inject_is_timed_from_what_was_seen(tmp_path, baseline, role):
    """A SIGKILL nobody injected. To node 1's training process: its agent sees the exit at once, and the fault is
    timed from that exit. To node 1's agent (its training processes die with it): nobody saw it, and the fault
    time is estimated from the last heartbeat the survivors heard."""
    def drive(run_dir, th):
        (victim,) = _wait_for_step(run_dir, th, 10, lambda e: e["node"] == 1 and e.get("role") == role)
        os.kill(victim["pid"], signal.SIGKILL)
        return time.time()

    run_dir = tmp_path / "ext"
    s, t_kill = run_driven(tmp_path, "ext", drive, spares=1)
    assert s["completed"] and s["param_digest"] == baseline, s
    (f,) = s["failures"]
    est = f["phases"]["detect"]
    if role == "trainer":
        assert f["kind"] == "not injected" and f["t_fault_source"] == "process exit seen by its agent", f
        assert 0 <= est < 1.0, f
        (nf,) = [e for e in events(run_dir) if e["event"] == "node_failed"]
        assert nf["t"] - t_kill < 1.0 and nf["cause"] == "exit", nf
    else:
        assert f["kind"] == "not injected" and f["t_fault_source"] == "last heartbeat heard (estimated)", f
        assert 0 <= est < 3.0, f
        sus = [e for e in events(run_dir) if e["event"] == "suspect" and e["last_heard"] is not None]
        assert min(abs(e["last_heard"] - t_kill) for e in sus) < 1.0


def test_kill_a_spare_through_the_cli(tmp_path, baseline):
    s = run(tmp_path, "spare_kill", "kill node3@6", "kill node1@12")
    assert s["completed"] and s["param_digest"] == baseline, s
    spare, swap = s["failures"]
    assert spare["target"] == "node3" and spare["outcome"] == "spare lost" and spare["promoted"] == {}
    assert swap["target"] == "node1" and swap["spare_nodes_used"] == [4]


# ---- liveness by progress ----------------------------------------------------------------------------------
def test_a_frozen_training_thread_is_detected_and_fenced(tmp_path, test_fns, failure_free):
    """Rank 2's training thread sleeps for ever at step 25 while its process and heartbeats live on: its
    watchdog declares it failed after --hang-timeout, and a spare takes its place."""
    kw = dict(spares=1, steps=40, hang_timeout=3.0)
    base = failure_free(nodes=3, steps=40)   # the demo's arithmetic (trainfns.frozen_rank2 freezes, computes nothing)
    s = run(tmp_path, "frozen", train_fn="trainfns:frozen_rank2", **kw)
    assert s["completed"] and s["param_digest"] == base["param_digest"], s
    (f,) = s["failures"]
    assert f["failed_nodes"] == [2] and f["recomputed_steps"] <= 1
    (hang,) = [e for e in events(tmp_path / "frozen") if e["event"] == "hang_detected"]
    assert 3.0 <= hang["stuck_s"] < 6.0 and hang["where"] == "step 25"
    assert 3.0 <= f["recovery_s"] < 15.0, f


# ---- replicas of real size ----------------------------------------------------------------------------------
def test_a_200_mb_replica_is_restored(tmp_path, test_fns):
    """Each rank's state is 200 MB: replication runs beside training without starving heartbeats (no false
    suspicion), and the promoted spare restores 200 MB from the live holder."""
    kw = dict(nodes=2, steps=8, train_fn="trainfns:big_mlp", log_every=1)
    base = run(tmp_path, "bbase", spares=0, **kw)
    s = run(tmp_path, "big", "kill node1@4", spares=1, **kw)
    assert s["completed"] and s["param_digest"] == base["param_digest"], s
    assert s["bytes_replicated_per_rank_per_step"] >= 200 * 2**20
    (f,) = s["failures"]
    assert f["target"] == "node1" and f["recomputed_steps"] <= 1
    sus = [e for e in events(tmp_path / "big") if e["event"] == "suspect"]
    assert {e["node"] for e in sus} == {1}, f"a live process was suspected: {sus}"


# ---- memory flat across generations ----------------------------------------------------------------------
def test_memory_of_a_surviving_rank_stays_flat_over_four_recoveries(tmp_path):
    s = run(tmp_path, "mem", "kill node1@8", "kill node2@16", "kill node3@24", "kill node4@32", nodes=2, spares=4,
            steps=40)
    assert s["completed"] and s["swaps"] == 4, s
    rss = {e["generation"]: e["rss_bytes"] for e in events(tmp_path / "mem")
           if e["event"] == "recovered" and e["rank"] == 0}
    assert sorted(rss) == [1, 2, 3, 4], rss
    # a leak grows with every recovery; a warm-up (a path first taken in the second recovery, a lazily grown buffer)
    # grows once: seen in CI on a loaded machine, 311.6 -> 319.2 -> 319.25 -> 319.27 MB
    steady = max(rss[g] for g in (3, 4)) - rss[2]
    assert steady < 5 * 2**20, f"rank 0 grew by {steady / 2**20:.1f} MB over the last two recoveries: {rss}"
    growth = max(rss[g] for g in (2, 3, 4)) - rss[1]
    assert growth < 16 * 2**20, f"rank 0 grew by {growth / 2**20:.1f} MB after the first recovery: {rss}"


def _wait_for_step(run_dir, th, step, pick, timeout=120):
    end = time.monotonic() + timeout
    while th.is_alive() and time.monotonic() < end:
        ev = events(run_dir) if (run_dir / "events.jsonl").exists() else []
        if max([e["step"] for e in ev if e["event"] == "step"], default=0) >= step:
            return [e for e in ev if e["event"] == "hello" and pick(e)]
        time.sleep(0.05)
    pytest.fail(f"the run never reached step {step}")



def test_an_idle_spare_waits_as_long_as_the_run_lasts_and_is_still_promoted(tmp_path, test_fns, monkeypatch,
                                                                            failure_free):
    """A spare's training process waits for its role for as long as the run lasts. It used to give up after the
    recovery + ready timeouts (196 s with the defaults) and abort a failure-free run. Here those add up to 12.5 s
    (hang timeout 1.5 s, rendezvous 2 s); steps are paced to >= 0.25 s, so node1 dies at step 70 well after that,
    and the spare that idled all along is promoted and the run ends bitwise equal to a failure-free one."""
    monkeypatch.setenv("DEADPOOL_TEST_STEP_S", "0.25")
    kw = dict(nodes=2, steps=80, hang_timeout=1.5, rendezvous_timeout=2.0, train_fn="trainfns:paced")
    idle_bound = RunConfig(**kw).timeouts.recovery_timeout + RunConfig(**kw).timeouts.ready_timeout
    base = failure_free(**kw)   # the demo's arithmetic: trainfns.paced only sleeps before each step
    s = run(tmp_path, "paced-kill", "kill node1@70", spares=1, **kw)
    assert s["completed"] and s["swaps"] == 1 and s["param_digest"] == base["param_digest"], s
    es = events(tmp_path / "paced-kill")
    ready = min(e["t"] for e in es if e["event"] == "spare_ready")
    decided = min(e["t"] for e in es if e["event"] == "decision")
    assert decided - ready > idle_bound, (decided - ready, idle_bound)
