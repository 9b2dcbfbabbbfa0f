"""False suspicions under load: failure-free runs while CPU hogs oversubscribe the machine, this checkout against
another one (today's main, say) side by side, alternating run by run.

    git worktree add /tmp/main-before 620cd12      # the tree to compare with
    .venv/bin/python benchmarks/false_suspicions.py --runs 20 --hsdp-runs 5 --before /tmp/main-before

Every run is failure-free, so every node suspected (and so fenced) is a false suspicion: a live node lost. The
benchmark starts its hogs (``--hogs``, default 3 x the cores: a busy loop each, in their own process group) before the
first run and ends them, by pid, after the last; each run is ``deadpool run`` with PYTHONPATH set to the tree under
test. Prints one row per run and a table: runs, runs with a false suspicion, nodes suspected in all, probes started
and refuted (control/suspicion.py; none in a tree without them), median wall seconds. Its last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HSDP = ["--nodes", "4", "--spares", "1", "--train-fn", "examples.fsdp2_gpt:train"] + [
    x for kv in ("n_layer=1", "n_head=2", "d_model=32", "context=32", "batch_size=4", "replicate=2")
    for x in ("--train-arg", kv)]
DEMO = ["--nodes", "3", "--spares", "1"]


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]


def stop_hogs(hogs) -> None:
    for h in hogs:
        try:
            os.killpg(h.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        h.wait()


def one_run(tree: str, layout: list[str], steps: int, run_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.path.join(tree, "tests")]))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "run", *layout, "--steps", str(steps),
                        "--run-dir", run_dir], env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    es = []
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        for line in f:
            try:
                es.append(json.loads(line))
            except ValueError:
                pass
    suspected = sorted({e["suspect"] for e in es if e["event"] == "suspect"})
    return {"rc": p.returncode, "wall_s": round(wall, 1), "suspected": suspected,
            "probes_started": sum(e["event"] == "probe_started" for e in es),
            "probes_refuted": sum(e["event"] == "probe_refuted" for e in es),
            "completed": any(e["event"] == "finished" for e in es) and p.returncode == 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="demo runs (3 + 1 nodes) per tree")
    ap.add_argument("--hsdp-runs", type=int, default=5, help="2 x 2 HSDP example runs (4 + 1 nodes) per tree")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hogs", type=int, default=3 * (os.cpu_count() or 2))
    ap.add_argument("--before", help="another checkout to compare with (its deadpool_hpc, examples, tests)")
    a = ap.parse_args()
    for name, v in (("--runs", a.runs), ("--hsdp-runs", a.hsdp_runs), ("--steps", a.steps), ("--hogs", a.hogs)):
        if v < 0 or (name == "--steps" and v < 1):
            ap.error(f"{name} {v}: accepted: a whole number >= {1 if name == '--steps' else 0}")
    if a.before and not os.path.isdir(os.path.join(a.before, "deadpool_hpc")):
        ap.error(f"--before {a.before}: not a checkout of deadpool-hpc (no deadpool_hpc/ there)")
    trees = [("this", ROOT)] + ([("before", os.path.abspath(a.before))] if a.before else [])
    rows = {(t, k): [] for t, _ in trees for k in ("demo", "hsdp")}
    plan = [("demo", DEMO)] * a.runs + [("hsdp", HSDP)] * a.hsdp_runs
    hogs = start_hogs(a.hogs)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, (kind, layout) in enumerate(plan):
                for name, tree in (trees if i % 2 == 0 else trees[::-1]):   # alternate which tree goes first
                    r = one_run(tree, layout, a.steps, os.path.join(tmp, f"{name}-{kind}-{i}"))
                    rows[(name, kind)].append(r)
                    print(f"{name:6s} {kind:4s} run {i}: rc {r['rc']}, {r['wall_s']} s, suspected {r['suspected']}, "
                          f"probes {r['probes_started']} (refuted {r['probes_refuted']})", flush=True)
    finally:
        stop_hogs(hogs)
    out = {}
    print(f"\n{a.hogs} CPU hogs on {os.cpu_count()} cores; {a.steps} steps per run")
    print(f"{'tree':6s} {'run':4s} {'runs':>4s} {'completed':>9s} {'with a suspicion':>16s} {'nodes suspected':>15s} "
          f"{'probes':>6s} {'refuted':>7s} {'median s':>8s}")
    for (name, kind), rs in rows.items():
        if not rs:
            continue
        row = {"runs": len(rs), "completed": sum(r["completed"] for r in rs),
               "runs_with_suspicion": sum(bool(r["suspected"]) for r in rs),
               "nodes_suspected": sum(len(r["suspected"]) for r in rs),
               "probes_started": sum(r["probes_started"] for r in rs),
               "probes_refuted": sum(r["probes_refuted"] for r in rs),
               "median_wall_s": statistics.median(r["wall_s"] for r in rs)}
        out[f"{name}/{kind}"] = row
        print(f"{name:6s} {kind:4s} {row['runs']:4d} {row['completed']:9d} {row['runs_with_suspicion']:16d} "
              f"{row['nodes_suspected']:15d} {row['probes_started']:6d} {row['probes_refuted']:7d} "
              f"{row['median_wall_s']:8.1f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
