"""Failure-free overhead of the replica plane: step time with replication on vs off, side by side.

Runs are interleaved (on, off, on, off, ...) so machine noise hits both alike; each run reports the
median step time over its steps after a warm-up; the ratio is median(on) / median(off).
Also prints the bytes each rank replicates per step.

    .venv/bin/python benchmarks/overhead.py --rounds 5 --steps 120
    .venv/bin/python benchmarks/overhead.py --rounds 5 --train-fn deadpool_hpc.train.demo:train_zero   # ZeRO-1
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

from deadpool_hpc.config import RunConfig
from deadpool_hpc.events import read_events
from deadpool_hpc.launch.local import launch


def median_step_s(run_dir: str, warmup: int) -> float:
    steps = [e["step_s"] for e in read_events(f"{run_dir}/events.jsonl") if e["event"] == "step" and e["step"] > warmup]
    return statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--train-fn", default=RunConfig.train_fn,
                    help="module:function (default: the demo, ctx.protect; deadpool_hpc.train.demo:train_zero: ZeRO-1)")
    a = ap.parse_args()
    on, off, nbytes = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for replicate in (True, False):
                cfg = RunConfig(nodes=a.nodes, spares=1, steps=a.steps, replicate=replicate,
                                train_fn=a.train_fn, run_dir=f"{tmp}/r{i}-{int(replicate)}").validate()
                s = launch(cfg, timeout=600)
                assert s["completed"], s
                t = median_step_s(cfg.run_dir, a.warmup)
                (on if replicate else off).append(t)
                if replicate:
                    nbytes = s["bytes_replicated_per_rank_per_step"]
                print(f"round {i} replication {'on ' if replicate else 'off'}: median step {t * 1e3:.1f} ms", flush=True)
    ratios = [x / y for x, y in zip(on, off)]
    print(f"step time, replication on : median {statistics.median(on) * 1e3:.1f} ms over {a.rounds} runs")
    print(f"step time, replication off: median {statistics.median(off) * 1e3:.1f} ms over {a.rounds} runs")
    print(f"ratio on/off: median of per-round ratios {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)}); ratio of medians {statistics.median(on) / statistics.median(off):.3f}")
    print(f"bytes replicated per rank per step: {nbytes:,}")


if __name__ == "__main__":
    main()
