"""The Slurm start-up watch's logic (launch/slurm_startup.py) on files in a temporary run directory: which tasks
count as lost, what is recorded, and the relaunch's config. No Slurm here (no job id: no step is ended); the
real node crashes are tests/slurm/test_slurm_startup.py."""
import json
import os
import time

import pytest

from deadpool_hpc import rundir
from deadpool_hpc.config import RunConfig
from deadpool_hpc.errors import ConfigError
from deadpool_hpc.events import read_events
from deadpool_hpc.launch import slurm_startup as st


def _run_dir(tmp_path, spares=1):
    tmp_path.mkdir(parents=True, exist_ok=True)
    d = str(tmp_path)
    rundir.write_config(d, RunConfig(nodes=2, spares=spares, steps=10, run_dir=d).validate())
    st.write_launch(d, "0.0", ["h0", "h1", "h2"])
    os.makedirs(os.path.join(d, "starting", "0.0"))
    return d


def _beacon(d, task, host, lid="0.0"):
    with open(os.path.join(d, "starting", lid, str(task)), "w") as fh:
        fh.write(host + "\n")


def test_a_beacon_that_stands_still_is_a_lost_node_and_the_relaunch_costs_a_spare(tmp_path):
    d = _run_dir(tmp_path)
    for t, h in enumerate(["h0", "h1", "h2"]):
        _beacon(d, t, h)
    called = []
    w = st.BeaconCheck(d, None, stale_s=0.3, on_lost=lambda: called.append(1))
    assert w.poll([]) == []
    time.sleep(0.2)
    for t in (0, 2):   # tasks 0 and 2 keep touching theirs; task 1's node is gone
        os.utime(os.path.join(d, "starting", "0.0", str(t)), (time.time(), time.time() + 1))
    assert w.poll([]) == []
    time.sleep(0.35)
    os.utime(os.path.join(d, "starting", "0.0", "0"), (time.time(), time.time() + 2))
    os.utime(os.path.join(d, "starting", "0.0", "2"), (time.time(), time.time() + 2))
    assert w.poll([]) == ["h1"] and called == [1]
    assert w.poll([]) == []   # once per launch
    rec = json.load(open(os.path.join(d, "relaunch", "0.0.json")))
    assert rec["lost_hosts"] == ["h1"] and "stood still" in rec["why"]
    total, spares, excluded = st.relaunch(d, "0.0")
    assert (total, spares, excluded) == (2, 0, ["h1"])
    assert json.load(open(os.path.join(d, "config.json")))["layout"]["spares"] == 0
    kinds = [e["event"] for e in read_events(os.path.join(d, "events.jsonl"))]
    assert kinds == ["startup_node_lost", "relaunched"]
    # a second loss with no spare left: the reason, and nothing relaunched
    st.write_launch(d, "0.1", ["h0", "h2"])
    with open(os.path.join(d, "relaunch", "0.1.json"), "w") as fh:
        json.dump({"launch": "0.1", "lost_hosts": ["h2"], "why": "test"}, fh)
    with pytest.raises(ConfigError, match="only 0 spare node"):
        st.relaunch(d, "0.1")


def test_once_an_agent_said_hello_the_watch_leaves_it_to_the_control_plane(tmp_path):
    d = _run_dir(tmp_path)
    _beacon(d, 0, "h0")
    w = st.BeaconCheck(d, None, stale_s=0.0, missing_s=0.0)
    hello = [{"event": "hello", "role": "agent", "t": time.time() + 1, "mpi_rank": 0}]
    time.sleep(0.05)
    assert w.poll(hello) == [] and not os.path.exists(os.path.join(d, "relaunch"))


def test_a_task_srun_could_not_launch_is_the_lost_one(tmp_path):
    d = _run_dir(tmp_path)
    _beacon(d, 0, "h0")
    _beacon(d, 2, "h2")
    assert st.after_failed_step(d, "0.0", [])
    assert json.load(open(os.path.join(d, "relaunch", "0.0.json")))["lost_hosts"] == ["h1"]
    # nothing to say when every task (or none) started, or when the MPI world existed
    d2 = _run_dir(tmp_path / "b")
    assert not st.after_failed_step(d2, "0.0", [])
    with pytest.raises(LookupError):
        st.relaunch(d2, "0.0")
