"""Issue 28: a node may die at any moment of the job's start: while its training processes import torch
(``startup``), inside the user's function once the model is built (``build``), and with the first snapshot written
but not yet committed (``first``); a training process whose import fails, or that never reaches ``ctx.run`` within
``--startup-timeout``. Each loss is a failure of its node like any other: a spare takes its place, the ranks whose
state exists nowhere start again from their initial state (agreement.decide's fresh start), and the run ends
bitwise equal to the failure-free one. Real MPI processes, real gloo groups, real signals.

The three runs share the failure-free baseline of tests/e2e/test_never_hang.py (3 nodes, 24 steps); each carries the
faults that do not race with each other (a node lost at ``build`` keeps the first process group from forming, so
a ``first`` fault elsewhere in the same run might never be reached).
"""
import os
import signal
import threading
import time

import pytest

from deadpool_hpc.agent.preflight import RETIMES


from runs import SMALL_RUN_STEPS as STEPS, run_driven, run_events, run_faults  # tests/runs.py

pytestmark = pytest.mark.e2e   # every test launches a run (tests/README.md)



run, events = run_faults, run_events   # tests/runs.py


@pytest.fixture(scope="module")
def baseline(failure_free):
    return failure_free(nodes=3, steps=STEPS)["param_digest"]   # tests/conftest.py: the never_hang module's too


def _fresh_ranks(run_dir) -> dict:
    """{training rank: node} of every process that started again from its initial state."""
    return {e["rank"]: e["node"] for e in events(run_dir) if e["event"] == "fresh_start"}


def test_nodes_lost_while_importing_and_while_a_spare_builds_are_replaced(tmp_path, baseline):
    """node1 is SIGKILLed as its training process starts importing (its agent's control plane just came up); the
    spare node4 while its user's function hands the model over. Nothing has trained yet: node3 takes rank 1, which
    starts from its initial state as the spare built it, and the run ends bitwise equal."""
    s = run(tmp_path, "startup", "kill node1@startup", "kill node4@build")
    assert s["completed"] and s["param_digest"] == baseline, s
    assert s["swaps"] == 1 and s["spares_left"] == 0, s
    assert sorted((f["target"], f["phase"]) for f in s["failures"]) == [("node1", "startup"), ("node4", "build")]
    assert all(f["during_start_up"] and f["recomputed_steps"] == 0 for f in s["failures"]), s["failures"]
    assert _fresh_ranks(tmp_path / "startup").get(1) == 3, "rank 1 must start fresh on the spare node3"
    assert s["start_up_s"] is not None and s["start_up_s"] > 0


def test_rank_0s_node_lost_with_its_first_snapshot_uncommitted(tmp_path, baseline):
    """node0 (training rank 0, the coordinator-to-be, the first store host) dies once its snapshot of step 0 is
    written and before it is committed at its holder: a spare takes rank 0 from its initial state (or from the
    replica, had the commit won the race), cut at step 0."""
    s = run(tmp_path, "first", "kill node0@first", spares=1)
    assert s["completed"] and s["param_digest"] == baseline, s
    (f,) = s["failures"]
    assert (f["target"], f["phase"], f["cut_step"], f["outcome"]) == ("node0", "first", 0, "hot swap"), f
    assert s["swaps"] == 1 and s["spares_left"] == 0


def test_a_data_plane_down_at_start_up_and_on_an_idle_spare_are_found_by_the_link_checks(tmp_path, baseline):
    """Scope 6, the pre-flight's link check (agent/preflight.py), two faults in one 3 + 2 run (paced steps):

    - node2's data-plane interface is down from its start (``--nic-down node2``: its gloo is given an interface
      that does not exist; its agent's control plane works, so it comes up like the others). Its all-reduces with
      both neighbours on the ring of nodes 0..4 (node1, node3) fail while those pass with their other neighbour, so
      node2 is fenced (cause preflight_link) and the spare node3 takes rank 2 before any step, fresh; the nodes
      beside it are not blamed;
    - the idle spare node4 passes its re-checks (every second: an all-reduce with a training node, a different one
      each time) until its interface goes down at step 6 (``--nic-down node4@6``); its next two re-checks fail, with
      two different training nodes, and it leaves the pool (cause preflight_link, not during the start-up); the run
      goes on.

    These machines have no packet filter (no iptables, no nft), so the fault is the interface, not a lossy link."""
    s = run(tmp_path, "link", "nic_down node2", "nic_down node4@6", spare_check_every=1.0,
            train_fn="trainfns:paced")
    assert s["completed"] and s["param_digest"] == baseline, s
    by_node = {n: f for f in s["failures"] for n in f["failed_nodes"]}
    assert sorted(by_node) == [2, 4], s["failures"]
    assert by_node[2]["cause"] == "preflight_link" and by_node[2]["during_start_up"], by_node[2]
    assert by_node[4]["cause"] == "preflight_link" and not by_node[4]["during_start_up"], by_node[4]
    assert s["swaps"] == 1 and s["spares_left"] == 0 and all(f["recomputed_steps"] == 0 for f in s["failures"]), s
    es = events(tmp_path / "link")
    checks = {e["node"]: e for e in es if e["event"] == "link_check"}
    assert sorted(checks) == [0, 1, 2, 3, 4], checks
    assert checks[2]["blamed"] and set(checks[2]["pairs"]) == {"1", "3"}, checks[2]
    assert all(not r["ok"] and "dp-nic-down" in r["error"] for r in checks[2]["pairs"].values()), checks[2]
    assert not any(c["blamed"] for n, c in checks.items() if n != 2), checks
    assert checks[1]["pairs"]["0"]["ok"] and checks[3]["pairs"]["4"]["ok"], checks   # their other links passed
    assert checks[0]["pairs"]["1"]["seconds"] > 0, checks[0]   # a link that passed has its all-reduce's time
    assert _fresh_ranks(tmp_path / "link").get(2) == 3, "rank 2 must start fresh on the spare node3"
    failed = {e["node"]: e for e in es if e["event"] == "node_failed"}
    assert "all-reduce with neighbour node(s) [1, 3] failed" in failed[2]["reason"], failed[2]
    rechecks = [e for e in es if e["event"] == "spare_link_checked" and e["node"] == 4 and not e["stale"]]
    assert rechecks and rechecks[0]["ok"], rechecks
    last2 = rechecks[-2:]
    assert all(not e["ok"] and not e["partner_fault"] and "dp-nic-down" in e["error"] for e in last2), rechecks
    assert last2[0]["partner"] != last2[1]["partner"], rechecks
    assert {e["partner"] for e in rechecks} <= {0, 1, 3}, rechecks   # training nodes only
    assert f"training nodes {sorted(e['partner'] for e in last2)} failed in turn" in failed[4]["reason"], failed[4]


def test_a_failed_import_and_a_frozen_start_up_are_each_their_nodes_failure(tmp_path, baseline, monkeypatch):
    """node1's training process fails to import the training module (ImportError); node2's is frozen (SIGSTOP) as
    it appears, so it never reaches ``ctx.run``: its agent gives up at --startup-timeout (30 s: room for ten
    processes importing torch on two cores that the Slurm tests' jobs share: 20 s was once too short there). Both nodes are replaced by the two spares, each loss is named
    by its cause, and the run ends bitwise equal (it used to end with StartupTimeout, or with JobAborted
    for the import)."""
    monkeypatch.setenv("DEADPOOL_TEST_BROKEN_NODE", "1")   # tests/trainfns_startup.py
    run_dir = tmp_path / "import"

    def drive(run_dir, th):
        t0 = time.monotonic()
        victim = None
        while th.is_alive() and victim is None and time.monotonic() - t0 < 120:
            victim = next(iter(_workers_of(run_dir, nodes={2})), None)
            time.sleep(0.005)
        assert victim is not None, "no training process of node2 appeared before the run ended"
        os.kill(victim, signal.SIGSTOP)

    # fresh interpreters (no fork server): node2's process is found by its command line and parent (its agent) as
    # it appears, before it could say hello; a forked one would be the fork server's child, named like it
    s, _ = run_driven(tmp_path, "import", drive, train_fn="trainfns_startup:train", startup_timeout=30.0,
                      fork_server=False, join_s=180)   # (it must not hang at start-up)
    assert s["completed"] and s["param_digest"] == baseline, (s["errors"], [(f["cause"], f["failed_nodes"], f["promoted"]) for f in s["failures"]])
    # one recovery or two (node2's agent reports only once it gives up, so usually one decision covers both)
    assert sorted(n for f in s["failures"] for n in f["failed_nodes"]) == [1, 2], s["failures"]
    assert sum(len(f["promoted"]) for f in s["failures"]) == 2 and s["spares_left"] == 0, s
    causes = {c for f in s["failures"] for c in (f["cause"] or "").split(",")}
    assert causes == {"startup_failed", "startup_timeout"}, s["failures"]
    assert all(f["during_start_up"] for f in s["failures"]), s["failures"]
    failed = [e for e in events(run_dir) if e["event"] == "startup_failed"]
    assert [e["node"] for e in failed] == [1] and "ImportError" in failed[0]["error"], failed


def _workers_of(run_dir, nodes) -> list[int]:
    """PIDs of the training processes of ``run_dir`` whose parent is the agent of one of ``nodes``."""
    try:
        agents = {e["pid"] for e in events(run_dir) if e["event"] == "hello" and e.get("role") == "agent"
                  and e["node"] in nodes}
    except (OSError, ValueError):
        return []
    pids = []
    for d in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"deadpool_hpc.worker.entry" in cmd and str(run_dir).encode() in cmd:
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid in agents:
                pids.append(int(d))
    return pids


def test_a_failed_health_check_a_slow_node_and_a_spare_gone_bad_are_each_replaced_or_dropped(tmp_path, baseline):
    """Scope 6, the pre-flight checks (agent/preflight.py), three faults in one 3 + 3 run:

    - node1's --health-check CMD exits 1 at start-up: fenced (cause health_check), a spare takes rank 1, fresh;
    - node2 runs 30 times slower once its model is built (--slow: its agent stops and continues its training
      process, real signals): its timed matmul is far over the other nodes' median, so it is fenced (cause
      preflight_slow) and a spare takes rank 2 before any step (30, not 3: the nodes share two cores here, so the
      others' figures are inflated by their contention while node2's last repetitions run alone: measured 2.8 x for a
      factor of 6, and 2.5 x at the second opinion for a factor of 12 in a CI run, which kept node2);
    - the last spare, node5, passes at start-up and re-checks itself every second while idle (passing); once the
      test makes its check fail (from step 12), it leaves the pool (cause health_check, not during the start-up) and the run goes on.

    The run ends bitwise equal to the failure-free one (the paced demo only sleeps before each step)."""
    bad = tmp_path / "node5-unhealthy"
    cmd = f'echo "node $DEADPOOL_NODE"; test "$DEADPOOL_NODE" != 1 && ! test -e {bad}-$DEADPOOL_NODE'
    run_dir = tmp_path / "check"

    def spoil_node5_once_training():   # from step 12 (about 3 s of paced steps) on, the spare's check fails
        end = time.monotonic() + 200
        while time.monotonic() < end:
            if os.path.exists(run_dir / "events.jsonl") and any(e["event"] == "step" and e["step"] >= 12
                                                                 for e in events(run_dir)):
                open(f"{bad}-5", "w").close()
                return
            time.sleep(0.1)

    threading.Thread(target=spoil_node5_once_training, daemon=True).start()
    s = run(tmp_path, "check", "slow node2@build:30", spares=3, health_check=cmd, spare_check_every=1.0,
            train_fn="trainfns:paced")
    assert s["completed"] and s["param_digest"] == baseline, s
    by_node = {n: f for f in s["failures"] for n in f["failed_nodes"]}   # (1 and 2 may share a decision)
    assert sorted(by_node) == [1, 2, 5], s["failures"]
    assert "health_check" in by_node[1]["cause"] and by_node[1]["during_start_up"], by_node[1]
    assert "preflight_slow" in by_node[2]["cause"] and by_node[2]["during_start_up"], by_node[2]
    assert by_node[5]["cause"] == "health_check" and not by_node[5]["during_start_up"], by_node[5]
    es = events(run_dir)
    assert {e["node"]: e["rc"] for e in es if e["event"] == "health_check" and e["node"] != 5} == {0: 0, 1: 1, 2: 0,
                                                                                                  3: 0, 4: 0}
    assert [e["rc"] for e in es if e["event"] == "health_check" and e["node"] == 5][-1] == 1
    assert "node 1" in open(run_dir / "health-check-node1.log").read()
    # the matmul figures: node2's judged far over the others' median, every other node's not
    verdicts = {e["node"]: e for e in es if e["event"] == "preflight"}
    assert verdicts[2]["slow"] and verdicts[2]["seconds"] > 3 * verdicts[2]["others_median"], verdicts[2]
    assert verdicts[2]["retimes"] == RETIMES, verdicts[2]   # slow again at each second opinion, not a burst of load
    assert not any(v["slow"] for n, v in verdicts.items() if n != 2), verdicts
    assert sorted(_fresh_ranks(run_dir)) == [0, 1, 2]   # nothing was trained when nodes 1 and 2 were lost
    # before that, node5 passed its re-checks, the matmul held to the start-up's median included
    assert any(e["event"] == "spare_checked" and e["node"] == 5 and not e["slow"] for e in es), es
