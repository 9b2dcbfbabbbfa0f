"""The scale study's harness on real processes (issue 8): 8 node-agent control planes under hydra, a real SIGKILL
and a real SIGSTOP; the benchmark's last line is one JSON object."""
import glob
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e   # runs benchmarks/control_plane_scale.py: 8 node agents as processes

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = paths.ROOT


def test_eight_agents_sparse_heartbeats_crash_and_freeze_recovered(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "control_plane_scale.py"), "--sizes", "8",
                        "--all-sizes", "", "--window", "3", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    (row,) = result["sizes"]
    assert row["n"] == 8 and "error" not in row and row["false_suspicions"] == 0, row
    # k = 2 watchers, one heartbeat each per period (0.2 s): 10 per second, whatever the size
    assert 8 <= row["sent_per_s"] <= 13, row
    # a crash is seen at once through the ring link's closed socket; a freeze after the heartbeat deadline (1 s) and
    # its confirmation (as long again: control/suspicion.py), within the ceiling (4 s)
    assert row["crash_detect_s"] < 0.5 and row["crash_agents"] == 7 and row["crash_knew"] == 7, row
    assert row["crash_total_s"] < 2.0, row
    assert 1.7 <= row["freeze_detect_s"] < 4.5 and row["freeze_agents"] == 6, row
    # the frozen agent was the coordinator (MPI rank 0): the next lowest took over
    recs = [json.load(open(f)) for f in glob.glob(str(tmp_path / "ring-8" / "recovery-*-2.json"))]
    assert recs and {r["coordinator"] for r in recs} == {1} and all(r["failed_nodes"] == [0] for r in recs), recs
    # the faults were injected by the probes themselves, and recorded
    crash, freeze = (json.load(open(tmp_path / "ring-8" / f"fault-{x}.json")) for x in ("crash", "freeze"))
    assert (crash["rank"], crash["signal"], freeze["rank"], freeze["signal"]) == (4, "SIGKILL", 0, "SIGSTOP")
    # nothing of the run is left alive: the probes, and the frozen probe's killer
    pids = [json.load(open(f))["pid"] for f in glob.glob(str(tmp_path / "ring-8" / "steady-*.json"))]
    for pid in pids + [freeze["killer_pid"]]:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid
