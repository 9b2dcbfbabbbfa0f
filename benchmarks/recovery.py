"""Recovery time from a node's SIGKILL to the first completed step after the swap, by phase.

    .venv/bin/python benchmarks/recovery.py --runs 5 --nodes 3 --spares 1 --kill node1@40
    .venv/bin/python benchmarks/recovery.py --runs 5 --hang rank1@40 --hang-timeout 3
    .venv/bin/python benchmarks/recovery.py --runs 3 --spares 2 --replicas 2 --kill node1@40 --kill node2@restore

With several faults, each failure of the summary is reported on its own (a second node lost during the
first one's recovery is recovered by a later round; its time runs from its own fault to the resume).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

from deadpool_hpc.config import RunConfig
from deadpool_hpc.faultinject.spec import parse_fault
from deadpool_hpc.launch import LocalExecutor

PHASES = ("detect", "agree", "rebuild", "restore", "recompute")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill", action="append", default=[], help="fault spec, repeatable (default node1@40)")
    ap.add_argument("--hang", action="append", default=[], help="SIGSTOP fault spec, repeatable")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--train-fn", default=RunConfig().train.train_fn,
                    help="module:function (default: the demo, ctx.protect; deadpool_hpc.train.demo:train_zero: ZeRO-1)")
    ap.add_argument("--hang-timeout", type=float, default=RunConfig().timeouts.hang_timeout,
                    help="seconds without progress before a frozen training process is fenced (for --hang)")
    a = ap.parse_args()
    specs = [("kill", k) for k in a.kill] + [("hang", h) for h in a.hang] or [("kill", "node1@40")]
    rows, digests = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            cfg = RunConfig(nodes=a.nodes, spares=a.spares, steps=a.steps, run_dir=f"{tmp}/r{i}", replicas=a.replicas,
                            train_fn=a.train_fn,
                            hang_timeout=a.hang_timeout, faults=[parse_fault(k, v) for k, v in specs]).validate()
            s = LocalExecutor(timeout=600).run(cfg)
            assert s["completed"] and len(s["failures"]) == len(specs), s
            rows.append(s["failures"])
            digests.add(s["param_digest"])
            for f in s["failures"]:
                print(f"run {i}: {f['kind']} {f['target']}: recovery {f['recovery_s']:.3f} s, recomputed "
                      f"{f['recomputed_steps']} step(s), rounds {f['rounds']}, "
                      + ", ".join(f"{p} {_fmt(f['phases'][p])}" for p in PHASES), flush=True)
    for j, (kind, spec) in enumerate(specs):
        col = [r[j] for r in rows]
        med = statistics.median(f["recovery_s"] for f in col)
        print(f"--{kind} {spec}: median recovery over {a.runs} runs: {med:.3f} s (min "
              f"{min(f['recovery_s'] for f in col):.3f}, max {max(f['recovery_s'] for f in col):.3f}); "
              f"max steps recomputed: {max(f['recomputed_steps'] for f in col)}")
        for p in PHASES:
            vals = [f["phases"][p] for f in col if f["phases"][p] is not None]
            if vals:
                m = statistics.median(vals)
                print(f"  {p:<9} median {m:.3f} s ({100 * m / med:.0f}% of the median recovery)")
    print(f"distinct final parameter digests across runs: {len(digests)}")


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    main()
