"""Heartbeat send jitter of node agents while they push, hold and restore replicas, small against large, side by side.

    .venv/bin/python benchmarks/heartbeat_jitter.py --mb 1 1000 --runs 3

Each run is ``deadpool run --nodes 2 --spares 1 --steps S --kill node0@K`` with tests/trainfns.py:big_mlp, whose
per-rank ZeRO-1 state is ``--mb`` MB: every step node0 and node1 push each other their replica (MB each way), and at
the kill node1 (the source) sends node0's replica to node2 (the spare), which restores it. Each agent writes its
heartbeat send gaps at its exit (the ``heartbeat_stats`` event: p50, p99, max of the seconds between two sends; the
period is 0.2 s). Prints one row per agent role and size (medians over the runs) and, last, one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = {1: "node1: pushes, holds, sends the restore", 2: "node2: spare, receives the restore"}


def one_run(mb: float, steps: int, kill: int, run_dir: str) -> dict:
    env = dict(os.environ, DEADPOOL_TEST_STATE_MB=str(mb),
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    p = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "run", "--nodes", "2", "--spares", "1",
                        "--steps", str(steps), "--kill", f"node0@{kill}", "--train-fn", "trainfns:big_mlp",
                        "--run-dir", run_dir], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"run of {mb} MB failed (exit {p.returncode}): {p.stdout[-2000:]}{p.stderr[-2000:]}")
    stats = {}
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            if e["event"] == "heartbeat_stats":
                stats[e["node"]] = e
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[1, 1000], help="state per rank, MB (each a row)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-at", type=int, default=8)
    a = ap.parse_args()
    if a.runs < 1 or not 0 < a.kill_at < a.steps or any(m <= 0 for m in a.mb):
        ap.error(f"--runs {a.runs} / --kill-at {a.kill_at} / --mb {a.mb}: accepted: runs >= 1, "
                 f"0 < kill-at < steps ({a.steps}), sizes > 0")
    rows, out = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            for mb in a.mb:   # the sizes alternate within each repetition: both see the same machine
                stats = one_run(mb, a.steps, a.kill_at, os.path.join(tmp, f"{mb}-{i}"))
                for node in ROLES:
                    rows.append((mb, node, stats[node]))
                print(f"run {i}, {mb:g} MB: " + ", ".join(
                    f"node{n} p99 {stats[n]['send_gap_p99_s']} max {stats[n]['send_gap_max_s']} s" for n in ROLES),
                    flush=True)
    print(f"\n{'MB/rank':>8s}  {'agent':42s} {'p50 s':>7s} {'p99 s':>7s} {'max s':>7s}  (medians of {a.runs} runs)")
    for mb in a.mb:
        for node, role in ROLES.items():
            got = [s for m, n, s in rows if m == mb and n == node]
            med = {k: statistics.median(s[k] for s in got) for k in ("send_gap_p50_s", "send_gap_p99_s", "send_gap_max_s")}
            out[f"{mb:g}MB/node{node}"] = med
            print(f"{mb:8g}  {role:42s} {med['send_gap_p50_s']:7.3f} {med['send_gap_p99_s']:7.3f} "
                  f"{med['send_gap_max_s']:7.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
