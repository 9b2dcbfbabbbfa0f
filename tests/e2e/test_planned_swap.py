"""Planned swap (agent/health.py, agent/node.py): a node asked to leave (``deadpool swap``, a detector plugin such as
plugins/slurm-health) leaves at a step boundary and a spare takes its place with no step recomputed; the run ends
bitwise equal to a run that never swapped. Real runs (MPI, gloo, real processes); the request is made with the real
``deadpool swap`` command while the run trains. Detector plugins are registered the way pip would: a dist-info with
an entry_points.txt on PYTHONPATH."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from deadpool_hpc.config import RunConfig
from deadpool_hpc.faultinject.spec import parse_fault
from deadpool_hpc.events import read_events

from runs import launch_reaped  # tests/runs.py

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
HERE = paths.TESTS
DEADPOOL = [sys.executable, "-m", "deadpool_hpc.launch.cli"]


def _steps(run_dir) -> int:
    path = os.path.join(run_dir, "events.jsonl")
    return max((e["step"] for e in read_events(path) if e["event"] == "step"), default=-1) if os.path.exists(path) else -1


def swap(*args, env=None):
    return subprocess.run(DEADPOOL + ["swap", *args], capture_output=True, text=True, timeout=60, env=env)


def run_with_swap(tmp_path, name, node, at_step, refused=(), also=(), **kw):
    """Launch a local run; when it reaches ``at_step``, first check that each of ``refused`` (a node name) is
    refused by ``deadpool swap`` with exit 2, then request the swap of ``node`` (and at once of each of ``also``).
    Returns (summary, swap's output)."""
    cfg = RunConfig(**{**dict(nodes=3, spares=1, steps=40, run_dir=str(tmp_path / name)), **kw}).validate()
    out = {}

    def operator():
        end = time.time() + 240
        while _steps(cfg.output.run_dir) < at_step and time.time() < end:
            time.sleep(0.05)
        out["refused"] = {n: swap(cfg.output.run_dir, n) for n in refused}
        out["swap"] = swap(cfg.output.run_dir, node, "--reason", "ECC errors (test)")
        out["also"] = [swap(cfg.output.run_dir, n, "--reason", "ECC errors (test)") for n in also]

    t = threading.Thread(target=operator, daemon=True)
    t.start()
    s = launch_reaped(cfg, 300)
    t.join(30)
    return s, out


def check_planned(s, base, node_index):
    assert s["completed"], s
    assert s["planned_swaps"] == 1 and s["swaps"] == 1 and len(s["failures"]) == 1, s["failures"]
    f = s["failures"][0]
    assert f["kind"] == "planned swap" and f["outcome"] == "planned swap", f
    assert f["failed_nodes"] == [node_index] and "ECC errors (test)" in f["reason"], f
    assert f["recomputed_steps"] == 0, f
    assert f["recovery_s"] is not None and f["recovery_s"] > 0
    assert s["param_digest"] == base["param_digest"], "a planned swap changed the parameters"


@pytest.mark.e2e
def test_deadpool_swap_of_a_running_node_recomputes_nothing_and_stays_bitwise_equal(tmp_path, failure_free):
    base = failure_free(nodes=3, steps=40)   # tests/conftest.py: shared by every module
    s, out = run_with_swap(tmp_path, "swap1", "node1", 15, refused=("node3", "node7", "nodeX"))
    assert out["swap"].returncode == 0, out["swap"].stderr
    # bad requests while it ran: exit 2 with what is accepted, and the run was not disturbed (one swap only)
    spare, unknown, junk = (out["refused"][n] for n in ("node3", "node7", "nodeX"))
    assert spare.returncode == 2 and "is a spare" in spare.stderr and "node0, node1, node2" in spare.stderr
    assert unknown.returncode == 2 and "not in the run" in unknown.stderr
    assert junk.returncode == 2 and "not in the run" in junk.stderr
    check_planned(s, base, 1)
    ev = list(read_events(os.path.join(str(tmp_path / "swap1"), "events.jsonl")))
    req = [e for e in ev if e["event"] == "swap_requested"]
    assert len(req) == 1 and req[0]["detector"] == "swap-request" and req[0]["node"] == 1
    assert not os.path.exists(os.path.join(str(tmp_path / "swap1"), "swap", "node1.json")), "request not consumed"
    # the run is over: nothing to swap
    done = swap(str(tmp_path / "swap1"), "node2")
    assert done.returncode == 2 and ("no run is in progress" in done.stderr or "finished" in done.stderr), done.stderr


@pytest.mark.e2e
def test_planned_swap_of_rank0s_node_with_two_ranks_per_node(tmp_path, failure_free):
    """Node 0 holds ranks 0 and 1 (and the coordinator): both processes stop at the same boundary."""
    kw = dict(nodes=2, ranks_per_node=2, steps=24)
    base = failure_free(**kw)
    s, out = run_with_swap(tmp_path, "swap0", "node0", 12, spares=1, **kw)
    assert out["swap"].returncode == 0, out["swap"].stderr
    check_planned(s, base, 0)
    assert s["failures"][0]["promoted"] == {"0": 4, "1": 5}


@pytest.mark.e2e
def test_two_nodes_asked_together_leave_one_after_the_other(tmp_path, failure_free):
    """node0 and node1 asked back to back: node1 holds node0's replica, so leaving together would lose rank 0's
    state; the swap lease makes them leave one at a time, each with no step recomputed."""
    kw = dict(nodes=3, steps=40)
    base = failure_free(**kw)
    s, out = run_with_swap(tmp_path, "two", "node0", 12, also=("node1",), spares=2, **kw)
    assert out["swap"].returncode == 0 and out["also"][0].returncode == 0, (out["swap"].stderr, out["also"][0].stderr)
    assert s["completed"] and s["planned_swaps"] == 2 and s["swaps"] == 2, s["failures"]
    # one after the other, in whichever order the coordinator got the two asks
    assert sorted(f["failed_nodes"] for f in s["failures"]) == [[0], [1]], s["failures"]
    assert s["failures"][0]["cut_step"] < s["failures"][1]["cut_step"], s["failures"]
    assert all(f["recomputed_steps"] == 0 and f["kind"] == "planned swap" for f in s["failures"]), s["failures"]
    assert s["param_digest"] == base["param_digest"]


@pytest.mark.e2e
def test_stragglers_are_swapped_out_one_per_window_and_slowness_that_follows_the_ranks_is_reported(tmp_path,
                                                                                                 failure_free):
    """Issue 26, one 3 + 2 run (window 1 s, factor 2):

    - node1 is made 4 x slower from step 3 (``--slow node1@3:4``: its agent stops and continues its training
      process, real signals): a slow *node*;
    - training rank 2 does more work per step than the others from the start (``trainfns:heavy_rank2``): slow
      *work*, which follows rank 2 to whichever node holds it.

    The coordinator finds each node whose own work per step (step time less its waits on peers) stays over 2 x the
    other nodes' median for the window, one verdict per window: node1 and node2 are each swapped out by a planned swap
    (0 steps recomputed); the spare that took rank 2 is then slow too, so that one is reported, not swapped back and
    forth. The run ends with the failure-free run's parameters."""
    base = failure_free(nodes=3, steps=40)
    cfg = RunConfig(nodes=3, spares=2, steps=40, run_dir=str(tmp_path / "straggler"), train_fn="trainfns:heavy_rank2",
                    faults=[parse_fault("slow", "node1@3:4")], straggler_factor=2.0, straggler_window=1.0).validate()
    s = launch_reaped(cfg, 300)
    assert s["completed"] and s["param_digest"] == base["param_digest"], s
    found = s["stragglers"]
    assert all(x["ratio"] > 2.0 and x["slow_for_s"] >= 1.0 and x["own_s"] > 2 * x["median_s"] for x in found), found
    swapped = sorted(x["node"] for x in found if x["action"] == "swap")
    assert swapped == [1, 2], found
    assert s["planned_swaps"] == 2 and len(s["failures"]) == 2, s["failures"]
    assert all(f["outcome"] == "planned swap" and f["recomputed_steps"] == 0 for f in s["failures"]), s["failures"]
    assert all(f["t_fault_source"] == "planned swap requested (straggler)" and "straggler: own work" in f["reason"]
               for f in s["failures"]), s["failures"]
    assert {f["kind"] for f in s["failures"]} == {"slow", "planned swap"}, s["failures"]   # node1's: the injected fault
    ev = list(read_events(os.path.join(cfg.output.run_dir, "events.jsonl")))
    took_rank2 = [d["promoted"]["2"] for d in ev if d["event"] == "decision" and "2" in d.get("promoted", {})]
    reported = [x for x in found if x["action"] == "report"]
    assert len(took_rank2) == 1 and reported and {x["node"] for x in reported} == {took_rank2[0]}, (found, took_rank2)
    assert all("follows the ranks' work" in x["why"] for x in reported), reported
    assert len(reported) <= 2, reported   # once per generation (1 or 2 generations with rank 2 on that node)
    # the verdicts came at least a window apart
    t = sorted(e["t"] for e in ev if e["event"] == "straggler_detected")
    assert all(b - a >= 1.0 for a, b in zip(t, t[1:])), t


@pytest.mark.e2e
def test_a_swap_asked_during_the_last_steps_never_fails_the_run(tmp_path, failure_free):
    """Asked when the run is about to end: either the node leaves before the last step or the swap is refused
    ("the run ends ... before the next step boundary"); the run completes either way, with its parameters."""
    kw = dict(nodes=2, steps=16)
    base = failure_free(**kw)
    s, out = run_with_swap(tmp_path, "last", "node0", 15, spares=1, **kw)
    assert s["completed"] and s["param_digest"] == base["param_digest"], s
    refused = [r["why"] for r in s["swaps_refused"]]
    assert s["planned_swaps"] == 1 or any("the run ends at step 16" in w for w in refused) \
        or out["swap"].returncode == 2, (s["failures"], refused, out["swap"].stderr)


@pytest.mark.e2e
def test_deadpool_swap_refuses_a_run_without_replicas(tmp_path):
    cfg = RunConfig(nodes=2, spares=1, steps=60, replicate=False, run_dir=str(tmp_path / "norep")).validate()
    got = {}

    def operator():
        end = time.time() + 120
        while _steps(cfg.output.run_dir) < 3 and time.time() < end:
            time.sleep(0.05)
        got["r"] = swap(cfg.output.run_dir, "node0")

    t = threading.Thread(target=operator, daemon=True)
    t.start()
    s = launch_reaped(cfg, 300)
    t.join(30)
    assert got["r"].returncode == 2 and "--no-replicate" in got["r"].stderr, got["r"].stderr
    assert s["completed"] and s["planned_swaps"] == 0


def _plugin_env(tmp_path, entry_points: str) -> dict:
    """PYTHONPATH with a dist-info that registers ``entry_points`` (what pip install of a plugin writes)."""
    dist = tmp_path / "site" / "deadpool_test_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: deadpool-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[deadpool_hpc.detectors]\n" + entry_points)
    path = os.pathsep.join([str(tmp_path / "site"), os.path.join(HERE, "plugin_fixture"),
                            os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path)


@pytest.mark.e2e
def test_a_plugin_that_fails_to_import_is_named_and_nothing_starts(tmp_path):
    env = _plugin_env(tmp_path, "broken = broken_at_import:factory\n")
    run_dir = tmp_path / "run"
    r = subprocess.run(DEADPOOL + ["run", "--nodes", "2", "--spares", "1", "--steps", "5", "--run-dir", str(run_dir)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "detector plugin 'broken' (broken_at_import:factory) failed to import" in r.stderr, r.stderr
    assert "dependency is missing" in r.stderr
    assert not (run_dir / "events.jsonl").exists(), "the run started"


@pytest.mark.e2e
def test_a_plugin_that_raises_at_start_up_ends_the_run_by_name_and_a_failing_check_does_not(tmp_path):
    env = _plugin_env(tmp_path, "startup = detectors:raises_at_start\n")
    run_dir = tmp_path / "run"
    r = subprocess.run(DEADPOOL + ["run", "--nodes", "2", "--spares", "1", "--steps", "5", "--run-dir", str(run_dir),
                                   "--summary", str(tmp_path / "s.json")],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    s = json.load(open(tmp_path / "s.json"))
    assert not s["completed"] and s["steps_completed"] == 0, s
    assert any("detector plugin 'startup' (detectors:raises_at_start) raised at start-up" in str(e)
               and "cannot reach the health service" in str(e) for e in s["errors"]), s["errors"]
    # a detector whose checks raise: logged once per agent, the run completes as if it were not there
    env = _plugin_env(tmp_path / "b", "flaky = detectors:flaky\n")
    run_dir = tmp_path / "run2"
    r = subprocess.run(DEADPOOL + ["run", "--nodes", "2", "--spares", "1", "--steps", "10", "--run-dir", str(run_dir)],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    errs = [e for e in read_events(str(run_dir / "events.jsonl")) if e["event"] == "detector_error"]
    assert errs and all(e["detector"] == "flaky" and "timed out" in e["error"] for e in errs)
    assert len(errs) <= 3, "a failing check must be logged once per agent, not at every check"
