"""Recovery time from a node's SIGKILL to the first completed step after the swap, by phase.

    .venv/bin/python benchmarks/recovery.py --runs 5 --nodes 3 --spares 1 --kill node1@40
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

from deadpool_hpc.config import RunConfig, parse_fault
from deadpool_hpc.launch.local import launch

PHASES = ("detect", "agree", "rebuild", "restore", "recompute")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill", default="node1@40")
    ap.add_argument("--hang", action="store_true", help="SIGSTOP instead of SIGKILL")
    a = ap.parse_args()
    rows, digests = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            cfg = RunConfig(nodes=a.nodes, spares=a.spares, steps=a.steps, run_dir=f"{tmp}/r{i}",
                            faults=[parse_fault("hang" if a.hang else "kill", a.kill)]).validate()
            s = launch(cfg, timeout=600)
            assert s["completed"] and len(s["failures"]) == 1, s
            f = s["failures"][0]
            rows.append(f)
            digests.add(s["param_digest"])
            print(f"run {i}: recovery {f['recovery_s']:.3f} s, recomputed {f['recomputed_steps']} step(s), "
                  + ", ".join(f"{p} {f['phases'][p]:.3f}" for p in PHASES), flush=True)
    med = statistics.median(r["recovery_s"] for r in rows)
    print(f"median recovery over {a.runs} runs: {med:.3f} s (min {min(r['recovery_s'] for r in rows):.3f}, "
          f"max {max(r['recovery_s'] for r in rows):.3f}); max steps recomputed: {max(r['recomputed_steps'] for r in rows)}")
    for p in PHASES:
        m = statistics.median(r["phases"][p] for r in rows)
        print(f"  {p:<9} median {m:.3f} s ({100 * m / med:.0f}% of the median recovery)")
    print(f"distinct final parameter digests across runs: {len(digests)}")


if __name__ == "__main__":
    main()
