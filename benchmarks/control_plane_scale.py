"""The control plane's scale study: node agents with no training processes, 8 to 256 on one machine.

    .venv/bin/python benchmarks/control_plane_scale.py [--sizes 8,16,32,64,128,256] [--window 10] [--out DIR]

For each size N it starts N control-plane probes (study/probe.py: a node agent's control plane and
ring link, no training processes) under MPICH's hydra, one proxy per agent as the local launcher does, N - 2
active and 2 spares, and measures:

- steady state: control messages per second per agent (sent, heartbeats included) and CPU per agent (% of a
  core, all threads), medians over the agents, over ``--window`` seconds;
- a **crash** (SIGKILL of agent N/2) and then a **freeze** (SIGSTOP of agent 0, the coordinator), which the probes
  inject themselves (so the same probes serve a Slurm sweep, sbatch/scaling.sbatch MODE=control-plane): detect
  (fault -> first agent knows), disseminate (first -> last agent knows), agree (last agent knows -> the
  coordinator sends the decision), broadcast (decision sent -> last agent applied), and total (fault -> last
  agent applied), and each agent's CPU in the recovery.

The old all-to-all heartbeats (every agent watches every other) run for comparison at the sizes in
``--all-sizes``. The analysis (study/scale_study.py) writes ``scale.csv`` and one PNG per measure
under ``--out`` (default benchmarks/out/scale), fits each phase, models a recovery with one agent per node,
projects 512, 4,096 and 16,384 nodes, and the last line printed is one JSON object with everything
(docs/scaling.md explains the model and its sources).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import secrets
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _hosts(n: int) -> str:
    # one hydra proxy per agent (as launch/local.py does): a SIGKILLed agent then leaves the others alive
    return ",".join(f"127.0.{i // 250}.{i % 250 + 1}" for i in range(n))


def _wait(out: str, pattern: str, count: int, timeout: float, proc) -> int:
    end = time.monotonic() + timeout
    while True:
        got = len(glob.glob(os.path.join(out, pattern)))
        if got >= count or time.monotonic() > end or proc.poll() is not None:
            return got
        time.sleep(0.2)


def run_size(n: int, topology: str, window: float, out_root: str) -> dict:
    """Start n probes, let them run their window, their crash (agent n/2) and their freeze (agent 0, the
    coordinator), which they inject themselves (study/probe.py), then end the run and return its row."""
    from study.scale_study import row
    from deadpool_hpc.launch.local import mpiexec_path

    out = os.path.join(out_root, f"{topology}-{n}")
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        os.unlink(os.path.join(out, f))
    env = dict(os.environ, DEADPOOL_JOB_SECRET=secrets.token_hex(16), PYTHONPATH=ROOT,
               MPIR_CVAR_NUM_CLIQUES=str(n), MPIR_CVAR_CLIQUES_BY_BLOCK="1", OMP_NUM_THREADS="1")
    cmd = [mpiexec_path(), "-disable-auto-cleanup", "-launcher", "fork", "-hosts", _hosts(n), "-ppn", "1",
           "-n", str(n), sys.executable, "-m", "study.probe", out, "--active", str(n - 2),
           "--watch-k", "0" if topology == "all" else "2", "--window", str(window), "--warmup", "3",
           "--crash", str(n // 2), "--freeze", "0", "--freeze-for", "5", "--exit-after", "0"]
    t0 = time.monotonic()
    log = open(os.path.join(out, "mpiexec.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ok = _wait(out, "steady-*.json", n, 120 + 2 * n + window, proc) == n
        startup = round(time.monotonic() - t0, 1)
        if ok:
            for gen, live in ((1, n - 1), (2, n - 2)):
                if _wait(out, f"recovery-*-{gen}.json", live, 60 + n / 4, proc) < live:
                    break
    finally:
        open(os.path.join(out, "stop"), "w").close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group: mpiexec, its proxies, the probes
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
        _reap_killer(out)
    return {"n": n, "topology": topology, **row(out, cores=os.cpu_count()), "startup_and_window_s": startup}


def _reap_killer(out: str) -> None:
    """Wait (at most 15 s) for the frozen probe's killer (study/probe.py) to have done its job and left."""
    try:
        with open(os.path.join(out, "fault-freeze.json")) as fh:
            pid = json.load(fh).get("killer_pid")
    except (OSError, ValueError):
        return
    end = time.monotonic() + 15
    while pid and os.path.exists(f"/proc/{pid}") and time.monotonic() < end:
        time.sleep(0.2)


def main() -> None:
    from study.scale_study import report

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,16,32,64,128,256")
    ap.add_argument("--all-sizes", default="8,16,32,64", help="sizes at which the all-to-all topology is also run")
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "scale"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for topology, sizes in (("ring", a.sizes), ("all", a.all_sizes)):
        for n in [int(x) for x in sizes.split(",") if x]:
            rows.append(run_size(n, topology, a.window, a.out))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps(report(rows, a.out)))


if __name__ == "__main__":
    main()
