"""Failure-free overhead of ``ctx.protect`` on the DDP example (examples/ddp_gpt.py): step time side by side.

Three variants, interleaved round by round (so machine noise hits all alike), each reporting the median wall time
of a step (from one step's end to the next's, rank 0) after a warm-up:

- ``protected``: ``deadpool run --train-fn examples.ddp_gpt:train`` (snapshot + replication every step);
- ``unreplicated``: the same with ``--no-replicate`` (the pollable gradient average and the step loop, no snapshots);
- ``plain``: the plain torch loop of the example (``build`` + the same step), under torchrun, no deadpool at all.

Also prints the bytes each rank replicates per step (what is unique to a rank: the DDP parameters and optimizer
state stay in the ranks' own snapshots, docs/your-loop.md).

    .venv/bin/python benchmarks/overhead_ddp.py --rounds 3 --steps 60
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plain_worker(steps: int, out: str) -> None:
    """(under torchrun) The example's plain loop, timing each step; rank 0 writes the times to ``out``."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    from examples.ddp_gpt import Settings, build

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, opt, sched, data = build(Settings(), steps)
    times = []
    for step in range(steps):
        t = time.perf_counter()
        x, y = data.get(step, dist.get_rank())
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t)
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(times, fh)
    dist.destroy_process_group()


def deadpool_run(run_dir: str, nodes: int, steps: int, replicate: bool, warmup: int) -> tuple[float, int]:
    from deadpool_hpc.config import RunConfig
    from deadpool_hpc.events import read_events
    from deadpool_hpc.launch import LocalExecutor

    cfg = RunConfig(nodes=nodes, spares=1, steps=steps, replicate=replicate, run_dir=run_dir,
                    train_fn="examples.ddp_gpt:train").validate()
    s = LocalExecutor(timeout=900).run(cfg)
    assert s["completed"], s
    # wall time between rank 0's consecutive step events: the step, the snapshot hand-off, the loop's own work
    ts = [e["t"] for e in read_events(f"{run_dir}/events.jsonl") if e["event"] == "step" and e["step"] > warmup]
    return statistics.median(b - a for a, b in zip(ts, ts[1:])), s["bytes_replicated_per_rank_per_step"]


def plain_run(tmp: str, nodes: int, steps: int, warmup: int) -> float:
    import socket

    out = os.path.join(tmp, f"plain-{time.monotonic_ns()}.json")
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nodes),
                    "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__), "--plain-worker", "--steps", str(steps),
                    "--out", out], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=900)
    with open(out) as fh:
        return statistics.median(json.load(fh)[warmup:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.plain_worker:
        plain_worker(a.steps, a.out)
        return
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    res: dict[str, list[float]] = {"protected": [], "unreplicated": [], "plain": []}
    nbytes = None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for variant in res:
                if variant == "plain":
                    t = plain_run(tmp, a.nodes, a.steps, a.warmup)
                else:
                    t, b = deadpool_run(f"{tmp}/r{i}-{variant}", a.nodes, a.steps, variant == "protected", a.warmup)
                    if variant == "protected":
                        nbytes = b
                res[variant].append(t)
                print(f"round {i} {variant:12s}: median step {t * 1e3:.1f} ms", flush=True)
    for variant, ts in res.items():
        print(f"{variant:12s}: median {statistics.median(ts) * 1e3:.1f} ms over {a.rounds} runs "
              f"({', '.join(f'{x * 1e3:.1f}' for x in ts)})")
    for variant in ("protected", "unreplicated"):
        ratios = [x / y for x, y in zip(res[variant], res["plain"])]
        print(f"ratio {variant}/plain: median of per-round ratios {statistics.median(ratios):.3f} "
              f"({', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"bytes replicated per rank per step: {nbytes:,}")


if __name__ == "__main__":
    main()
