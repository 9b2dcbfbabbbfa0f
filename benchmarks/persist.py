"""What the agents' background persistence (``--persist-every``, agent/persister.py) costs the training steps.

Each round runs the same failure-free job twice, side by side in time: with persistence off, then on (every
``--every`` seconds, far more often than the default 300 s, so that most steps of a short run share the machine with
a write). Two estimators, each the median over rounds:

- **between runs**: median step time with persistence on / off (rank 0's ``step`` events after ``--warmup``);
- **within the run with persistence on**: median time of the steps that overlapped a background write (the
  ``persisted`` events give each write's end and length) / median of the steps that did not.

Also printed: how long a write took (median, seconds) and its size (bytes per node). On these 2 shared cores the
write competes with training for CPU; on a GPU node it runs on the host's otherwise idle cores.

    .venv/bin/python benchmarks/persist.py --rounds 3 --steps 150 --every 2
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

from deadpool_hpc.config import RunConfig
from deadpool_hpc.events import read_events
from deadpool_hpc.launch import LocalExecutor


def _run(run_dir: str, args, every: float) -> list[dict]:
    cfg = RunConfig(nodes=args.nodes, spares=0, steps=args.steps, run_dir=run_dir, persist_every=every).validate()
    s = LocalExecutor(timeout=600).run(cfg)
    if not s["completed"]:
        raise SystemExit(f"run {run_dir} did not complete: {s['errors']}")
    return list(read_events(f"{run_dir}/events.jsonl"))


def _steps(events: list[dict], warmup: int) -> list[tuple[float, float]]:
    """(end time, seconds) of rank 0's steps after ``warmup``."""
    return [(e["t"], e["step_s"]) for e in events if e["event"] == "step" and e["step"] > warmup]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--every", type=float, default=2.0, help="--persist-every of the runs with persistence on (s)")
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    between, within, write_s, sizes = [], [], [], []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as off_dir, tempfile.TemporaryDirectory() as on_dir:
            off = _steps(_run(off_dir, args, 0.0), args.warmup)
            on_events = _run(on_dir, args, args.every)
        on = _steps(on_events, args.warmup)
        writes = [(e["t"] - e["seconds"], e["t"]) for e in on_events if e["event"] == "persisted"]
        write_s += [b - a for a, b in writes]
        sizes += [e["bytes"] for e in on_events if e["event"] == "persisted"]
        r_between = statistics.median(s for _, s in on) / statistics.median(s for _, s in off)
        hit = [s for t, s in on if any(a < t and t - s < b for a, b in writes)]
        miss = [s for t, s in on if not any(a < t and t - s < b for a, b in writes)]
        r_within = statistics.median(hit) / statistics.median(miss) if hit and miss else float("nan")
        between.append(r_between)
        within.append(r_within)
        print(f"round {i + 1}: on/off between runs {r_between:.3f}; within the run, steps during a write / the others "
              f"{r_within:.3f} ({len(hit)} of {len(on)} steps overlapped {len(writes)} writes)", flush=True)
    print(f"median over {args.rounds} rounds: between runs {statistics.median(between):.3f}, within the run "
          f"{statistics.median(within):.3f}; a write took {statistics.median(write_s):.3f} s (median) for "
          f"{statistics.median(sizes):,.0f} bytes per node, every {args.every} s")


if __name__ == "__main__":
    main()
