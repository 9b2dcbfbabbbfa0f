"""Failure-free overhead of the replica plane: step time with replication on vs off, side by side.

Two estimators, both printed, each the median of per-round ratios:

- **within a run** (the figure to quote): one run per round alternates blocks of ``--block`` steps with replication
  on and off (``RunConfig.interleave_replication``); the round's ratio is median(step time, on blocks) /
  median(step time, off blocks). Both halves see the same processes and the same machine at the same moment.
- **between runs**: a run with replication on, then one with it off (``--no-replicate``); ratio of their median
  step times. On this shared 2-core machine the hypervisor takes 0-30 % of the CPU (``st`` in ``top``) and the
  median step of one run drifts between 130 and 230 ms over blocks of 20 steps, so this one swings by +-15 %.

The noise floor of the within-run estimator is printed too: the same even/odd block split applied to the runs with
replication off (an A/A comparison: its true ratio is 1). And what replication costs in CPU, which the
hypervisor's share does not move much: the CPU seconds of the job's node agents and training processes
(``/proc/<pid>/stat``) between step ``--warmup`` and 10 steps before the end, per step, on vs off. On these 2 cores
every process is CPU-bound, so that CPU is the overhead; on a GPU node the copy is a device-to-host copy on a side
stream and the agent runs on otherwise idle cores.

    .venv/bin/python benchmarks/overhead.py --rounds 5 --steps 120
    .venv/bin/python benchmarks/overhead.py --rounds 5 --train-fn deadpool_hpc.train.demo:train_zero   # ZeRO-1
    .venv/bin/python benchmarks/overhead.py --rounds 5 --steps 200 --train-fn examples.ddp_gpt:train --train-arg batch_size=32
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

from deadpool_hpc.config import RunConfig, parse_train_arg
from deadpool_hpc.events import EventTail, read_events
from deadpool_hpc.launch import LocalExecutor


def step_times(run_dir: str, warmup: int) -> dict[int, float]:
    """{step index s (0-based, the s-th step run): seconds} for the steps after ``warmup``, from rank 0's events."""
    return {e["step"] - 1: e["step_s"] for e in read_events(f"{run_dir}/events.jsonl")
            if e["event"] == "step" and e["step"] > warmup}


def _cpu_s(run_dir: str) -> dict[int, tuple[str, float]]:
    """{pid: ("agent" | "training", CPU seconds so far)} of this run's Python processes."""
    hz, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if run_dir.encode() not in cmd or b"-m" not in cmd:
                continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            kind = "agent" if b"deadpool_hpc.agent" in cmd else "training"
            out[int(pid)] = (kind, (int(fields[11]) + int(fields[12])) / hz)
        except (OSError, IndexError, ValueError):   # gone meanwhile
            pass
    return out


def run(cfg: RunConfig, warmup: int) -> tuple[dict, dict[str, float]]:
    """Launch ``cfg``; returns (its summary, {"agent" | "training": CPU seconds per step of all such processes,
    between step ``warmup`` and 10 steps before the end})."""
    box = {}
    t = threading.Thread(target=lambda: box.update(s=LocalExecutor(timeout=600).run(cfg)))
    t.start()
    tail, step, marks = EventTail(f"{cfg.output.run_dir}/events.jsonl"), 0, []
    for at in (warmup, cfg.train.steps - 10):
        while t.is_alive() and step < at:
            time.sleep(0.02)
            step = max([step] + [e["step"] for e in tail.poll() if e["event"] == "step"])
        marks.append((step, _cpu_s(cfg.output.run_dir)))
    t.join()
    (s0, a), (s1, b) = marks
    per = {"agent": 0.0, "training": 0.0}
    for pid, (kind, sec) in b.items():
        if pid in a:
            per[kind] += (sec - a[pid][1]) / max(1, s1 - s0)
    return box["s"], per


def block_ratio(steps: dict[int, float], block: int) -> float:
    """median(steps in even blocks of ``block`` steps) / median(steps in odd blocks)."""
    even = [t for s, t in steps.items() if (s // block) % 2 == 0]
    odd = [t for s, t in steps.items() if (s // block) % 2 == 1]
    return statistics.median(even) / statistics.median(odd)


def _line(name: str, ratios: list[float]) -> str:
    return f"{name}: median {statistics.median(ratios):.3f} (rounds: {', '.join(f'{r:.3f}' for r in ratios)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--block", type=int, default=4, help="steps per on / off block of the within-run estimator")
    ap.add_argument("--train-fn", default=RunConfig().train.train_fn,
                    help="module:function (default: the demo, ctx.protect; deadpool_hpc.train.demo:train_zero: ZeRO-1)")
    ap.add_argument("--train-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the training function, as for deadpool run (e.g. batch_size=32)")
    a = ap.parse_args()
    train_args = dict(parse_train_arg(x) for x in a.train_arg)
    within, between, floor, nbytes = [], [], [], None
    cpu = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            t = {}
            for mode in ("interleaved", "on", "off"):
                cfg = RunConfig(nodes=a.nodes, spares=1, steps=a.steps, replicate=mode != "off",
                                interleave_replication=a.block if mode == "interleaved" else 0,
                                train_fn=a.train_fn, train_args=train_args, run_dir=f"{tmp}/r{i}-{mode}").validate()
                s, per = run(cfg, a.warmup)
                assert s["completed"], s
                if mode in cpu:
                    cpu[mode].append(per)
                t[mode] = step_times(cfg.output.run_dir, a.warmup)
                if mode == "on":
                    nbytes = s["bytes_replicated_per_rank_per_step"]
            within.append(block_ratio(t["interleaved"], a.block))
            between.append(statistics.median(t["on"].values()) / statistics.median(t["off"].values()))
            floor.append(block_ratio(t["off"], a.block))
            print(f"round {i}: within a run {within[-1]:.3f}, between runs {between[-1]:.3f} "
                  f"(median step on {statistics.median(t['on'].values()) * 1e3:.1f} ms, "
                  f"off {statistics.median(t['off'].values()) * 1e3:.1f} ms), A/A {floor[-1]:.3f}", flush=True)
    print(_line(f"ratio on/off within a run (blocks of {a.block} steps)", within))
    print(_line("ratio on/off between runs", between))
    print(_line("noise floor, A/A (replication off, even / odd blocks)", floor))
    W = a.nodes
    for kind in ("agent", "training"):
        on, off = (statistics.median(c[kind] for c in cpu[m]) * 1e3 for m in ("on", "off"))
        print(f"CPU per step, all {kind} processes: on {on:.2f} ms, off {off:.2f} ms (medians)")
    extra = [sum(x.values()) - sum(y.values()) for x, y in zip(cpu["on"], cpu["off"])]
    print(f"replication's CPU per rank per step: median {statistics.median(extra) / W * 1e3:.2f} ms "
          f"(rounds: {', '.join(f'{e / W * 1e3:.2f}' for e in extra)})")
    print(f"bytes replicated per rank per step: {nbytes:,}")


if __name__ == "__main__":
    main()
