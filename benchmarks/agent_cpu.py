"""CPU of node agents during a failure-free run, read from /proc: an idle agent (a spare node's: heartbeats only,
its training processes wait) and a busy one (an active node's: heartbeats, snapshot shipping, replicas held).

    .venv/bin/python benchmarks/agent_cpu.py --window 30

Starts a local run (3 + 1 nodes, the demo), waits for its first steps, then samples utime + stime
(/proc/PID/stat, clock ticks) of every node agent over ``--window`` seconds of wall time. Prints, per agent,
the share of one core it used, and last one JSON line. The run is ended (SIGTERM to the launcher's process
group: the launcher's death ends every process of the run) when the window is over.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from deadpool_hpc.events import read_events

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (fields 14 and 15 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=30.0, help="seconds of wall time sampled")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--spares", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = f"{tmp}/run"
        # enough steps to outlast the window on 2 cores; the run is ended when the window is over
        cmd = [sys.executable, "-m", "deadpool_hpc.launch.cli", "run", "--nodes", str(a.nodes), "--spares",
               str(a.spares), "--steps", "100000", "--run-dir", run_dir]
        out = open(f"{tmp}/launcher.out", "w+")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        total = a.nodes + a.spares
        try:
            deadline = time.monotonic() + 300
            agents: dict[int, int] = {}
            while time.monotonic() < deadline and proc.poll() is None:
                es = list(read_events(f"{run_dir}/events.jsonl")) if os.path.exists(f"{run_dir}/events.jsonl") else []
                agents = {e["node"]: e["pid"] for e in es if e["event"] == "hello" and e.get("role") == "agent"}
                if len(agents) == total and any(e["event"] == "step" and e["step"] >= 5 for e in es):
                    break
                time.sleep(0.2)
            else:
                out.seek(0)
                raise SystemExit(f"the run did not reach step 5 within 300 s (launcher rc {proc.poll()}):\n"
                                 + out.read()[-3000:])
            before = {n: cpu_seconds(p) for n, p in agents.items()}
            t0 = time.monotonic()
            time.sleep(a.window)
            after = {n: cpu_seconds(p) for n, p in agents.items()}
            wall = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(120)
        share = {n: 100.0 * (after[n] - before[n]) / wall for n in agents}
        for n in sorted(share):
            role = "spare (idle)" if n >= a.nodes else "active"
            print(f"node {n} agent (pid {agents[n]}, {role}): {share[n]:.2f} % of one core over {wall:.1f} s")
        print(json.dumps({"window_s": round(wall, 1), "agent_cpu_percent": {str(n): round(v, 2) for n, v in
                                                                           share.items()},
                          "idle_agent_cpu_percent": round(max(v for n, v in share.items() if n >= a.nodes), 2)}))


if __name__ == "__main__":
    main()
