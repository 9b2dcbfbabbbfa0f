"""torchft (Lighthouse + Manager) beside the hot swap: 3 replica groups of 1 process, one killed at a time.

    .venv/bin/pip install -c constraints.txt torchft-nightly==2026.10.26   # Rust lighthouse in the wheel; keeps torch
    .venv/bin/python benchmarks/torchft_baseline.py --mtbf 30,60,120 --minutes 2
    .venv/bin/python benchmarks/torchft_baseline.py --mtbf 30 --minutes 2 --heartbeat-ms 1000

torchft 0.2.0 (what ``pip install torchft`` picks) runs here but cannot survive a fault: when a peer dies, gloo's
``work.wait()`` raises, ``_ManagedWork.wait`` returns False before the future chain exists, and the comm hook of
torchft.DistributedDataParallel hits ``assert fut._fut`` (torchft/ddp.py:76): an AssertionError in backward() kills
every surviving group, and all restart from step 0 (no disk checkpoint). torchft-nightly 2026.10.26 handles that case
(it returns the bucket as is, should_commit() then says no). Both import as ``torchft``; install one.

The demo's model, data and optimizer (deadpool_hpc.train: micro GPT, Shakespeare, AdamW + linear warm-up, DemoConfig
defaults); group g reads the batches DDP rank g reads (``Batches.get(step, g)``). The shape of torchft's
examples/ddp/train_ddp.py: ``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``, per
group ``torchrun --standalone --nproc-per-node 1 --max-restarts 100000`` running a Manager (ProcessGroupGloo, timeout
5 s, synchronous quorum), torchft.DistributedDataParallel and torchft.Optimizer; the learning rate is set from
``manager.current_step()`` (a LambdaLR cannot know whether a step was committed). No disk checkpoint: a restarted
group heals from a live peer (torchft's HTTP transport) while the others go on once the lighthouse stops counting the
dead one (its heartbeat timeout: 5 s unless --heartbeat-ms).

Per MTBF S the driver SIGKILLs one group's process (pid from RUN/pid.G, a child of that group's torchrun not yet hit)
at exponential gaps of mean S (seeded), for M minutes from the first step all 3 groups took together; then it writes
RUN/stop with a step 3 past the current one, and every group ends there (N).

Columns. steps: N less the first full step; wall: from that step's end to the first group reaching N. goodput: steps
x t' / wall, t' the mean time of a committed step with 3 participants (those over 3 x the median, stalled by a quorum
change, left out); samples: the same with each step weighted by participants / 3 (a step without a dead group's
batch is less work). lost/fault: (wall - steps x t') / faults. stall: fault -> next committed step (median); back:
fault -> the first committed step the restarted group takes part in (median). aborted: steps run and not committed,
per fault. Driver and processes exchange text files.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from restart_baseline import children, kill_tree, mtbf_list, target, write_json  # benchmarks/: the same /proc helpers, JSON writer, --mtbf

G = 3


def worker(a) -> None:
    from datetime import timedelta

    import torch
    import torchft

    from deadpool_hpc.train.corpus import Batches, load_tokens
    from deadpool_hpc.train.demo import DemoConfig
    from deadpool_hpc.train.model import GPT, GPTConfig

    torch.set_num_threads(1)
    g, run, launch_t = a.group, Path(a.rundir), time.time()
    if (run / "stop").exists():       # restarted after the others ended: alone it would start over from step 0
        os._exit(0)
    (run / f"pid.{g}").write_text(str(os.getpid()))
    cfg = DemoConfig()
    torch.manual_seed(cfg.seed)                     # every group builds the same model: init_sync=False
    gpt = GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model, context=cfg.context))
    inner = torch.optim.AdamW(gpt.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = Batches(load_tokens(), cfg.batch_size, cfg.context, cfg.seed)

    def load(sd):
        gpt.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout)),
                              load_state_dict=load,
                              state_dict=lambda: {"model": gpt.state_dict(), "optim": inner.state_dict()},
                              min_replica_size=1, replica_id=f"group{g}", timeout=timedelta(seconds=30),
                              use_async_quorum=False, init_sync=False)
    model = torchft.DistributedDataParallel(manager, gpt)
    opt = torchft.Optimizer(manager, inner)
    log = open(run / f"steps.{g}", "a", buffering=1)   # launch, step, end, seconds, participants, committed
    stop = None
    while stop is None or manager.current_step() < stop:
        t0 = time.perf_counter()
        opt.zero_grad()                              # quorum; a restarted group heals from a peer here
        s = manager.current_step()
        for pg in inner.param_groups:
            pg["lr"] = cfg.lr * min(1.0, (s + 1) / max(1, cfg.warmup_steps))
        x, y = data.get(s, g)
        _, loss = model(x, y)
        loss.backward()
        opt.step()                                   # steps the optimizer only if every participant agrees
        log.write(f"{launch_t} {manager.current_step()} {time.time()} {time.perf_counter() - t0:.6f} "
                  f"{manager.num_participants()} {int(manager.current_step() > s)}\n")
        if stop is None and (run / "stop").exists():
            stop = int((run / "stop").read_text())
    log.close()
    manager.shutdown(wait=False)
    os._exit(0)


def read(run: Path) -> list:
    rows = []
    for g in range(G):
        p = run / f"steps.{g}"
        if p.exists():
            rows += [(g, float(r[0]), int(r[1]), float(r[2]), float(r[3]), int(r[4]), int(r[5]))
                     for r in (line.split() for line in p.read_text().splitlines()) if len(r) == 6]
    return rows


def one(run: Path, minutes: float, mtbf: float, seed: int, pg_timeout: float, heartbeat_ms: int) -> dict:
    run.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs = [], []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        logs.append(open(run / "lighthouse.log", "w"))
        procs.append(subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind",
                                       f"127.0.0.1:{port}", "--min_replicas", "1", "--quorum_tick_ms", "100",
                                       "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", str(heartbeat_ms)],
                                      stdout=logs[-1], stderr=subprocess.STDOUT,
                                      start_new_session=True))
        for g in range(G):
            logs.append(open(run / f"torchrun.{g}.log", "w"))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                 "--max-restarts", "100000", __file__, "--worker", "--group", str(g), "--rundir", str(run),
                 "--pg-timeout", str(pg_timeout)],
                stdout=logs[-1], stderr=subprocess.STDOUT, env=env, start_new_session=True))
        agents = [p.pid for p in procs[1:]]
        deadline = time.time() + 300
        while not any(r[5] == G and r[6] for r in read(run)):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"no step with {G} groups; see {run}/*.log")
            time.sleep(0.2)
        rng, kills, dead = random.Random(seed), [], set()
        t_start = time.time()
        next_fault = t_start + rng.expovariate(1 / mtbf)
        while time.time() < t_start + 60 * minutes:
            if time.time() >= next_fault:
                g = rng.randrange(G)
                pid = target(run / f"pid.{g}", agents[g], dead)
                if pid is not None:     # else that group's next process is not up yet: hit it when it is
                    dead |= children(agents[g])
                    os.kill(pid, signal.SIGKILL)
                    kills.append((time.time(), g))
                    with open(run / "kills", "a") as f:
                        f.write(f"{kills[-1][0]} group{g} pid {pid}\n")
                    next_fault = time.time() + rng.expovariate(1 / mtbf)
            time.sleep(0.05)
        while not (now := [r[2] for r in read(run) if r[3] > time.time() - 3]):
            time.sleep(0.2)             # no group stepping right now (all restarting): wait for one
        stop = max(now) + 3             # the current progress (a group restarted from 0 is behind it)
        (run / "stop.tmp").write_text(str(stop))
        os.rename(run / "stop.tmp", run / "stop")
        end = time.time() + 120
        for p in procs[1:]:             # a group restarted at the very end may wait for a quorum: killed below
            try:
                p.wait(timeout=max(1, end - time.time()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            kill_tree(p)                       # what we started and its workers (own sessions), by pid
        for f in logs:
            f.close()
    rows = read(run)
    full = [r for r in rows if r[5] == G and r[6]]
    first = min(full, key=lambda r: r[3])
    done = min(r[3] for r in rows if r[2] >= stop and r[6])
    med = statistics.median(r[4] for r in full)
    t = statistics.mean(r[4] for r in full if r[4] < 3 * med)   # steps a quorum change stalled left out
    parts = {}
    for r in rows:
        if r[6] and first[2] < r[2] <= stop:
            parts[r[2]] = max(parts.get(r[2], 0), r[5])
    stall, back = [], []
    for k, g in kills:
        after = [r[3] for r in rows if r[6] and r[3] > k]
        if after:
            stall.append(min(after) - k)
        rejoined = [r[3] for r in rows if r[0] == g and r[1] > k and r[6]]
        if rejoined:
            back.append(min(rejoined) - k)
    return dict(steps=stop - first[2], wall=done - first[3], faults=len(kills), t=t,
                samples=sum(parts.values()) / G, aborted=sum(1 for r in rows if not r[6] and r[3] > first[3]),
                stall=statistics.median(stall) if stall else float("nan"),
                back=statistics.median(back) if back else float("nan"), load=os.getloadavg()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mtbf", default="30,60,120", help="mean seconds between faults, comma-separated")
    ap.add_argument("--minutes", type=float, default=2.0, help="length of each run")
    ap.add_argument("--json", metavar="PATH", help="also write the table's numbers here")
    ap.add_argument("--pg-timeout", type=float, default=5.0,
                    help="ProcessGroupGloo timeout, seconds (torchft's example: 5)")
    ap.add_argument("--heartbeat-ms", type=int, default=5000,
                    help="lighthouse --heartbeat_timeout_ms (its default 5000): how long a dead group counts as alive")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", help="keep the run directories here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--group", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rundir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    mtbfs = mtbf_list(ap, a.mtbf, a.minutes)
    import importlib.metadata as md
    versions = {}
    for dist in ("torchft", "torchft-nightly", "torch"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    print(", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    base = Path(a.keep or tempfile.mkdtemp(prefix="torchft-baseline-"))
    try:
        res = []
        for i, s in enumerate(mtbfs):
            r = one(base / f"mtbf-{i}", a.minutes, s, a.seed + i, a.pg_timeout, a.heartbeat_ms)
            res.append((s, r))
            print(f"MTBF {s:g} s: {r['steps']} steps in {r['wall']:.1f} s, {r['faults']} faults, step "
                  f"{r['t'] * 1e3:.1f} ms (3 groups), load {r['load']:.1f}", flush=True)
        print(f"\n{'MTBF s':>6} {'faults':>6} {'steps':>5} {'wall s':>6} {'goodput':>7} {'samples':>7} "
              f"{'lost/fault s':>12} {'stall s':>7} {'back s':>6} {'aborted/fault':>13}")
        table = []
        for s, r in res:
            nf = r["faults"] or math.nan
            table.append(dict(r, mtbf=s, goodput=r["steps"] * r["t"] / r["wall"],
                              goodput_samples=r["samples"] * r["t"] / r["wall"],
                              lost_per_fault=(r["wall"] - r["steps"] * r["t"]) / nf,
                              aborted_per_fault=r["aborted"] / nf))
            print(f"{s:>6g} {r['faults']:>6} {r['steps']:>5} {r['wall']:>6.1f} {table[-1]['goodput']:>7.3f} "
                  f"{table[-1]['goodput_samples']:>7.3f} {table[-1]['lost_per_fault']:>12.2f} "
                  f"{r['stall']:>7.2f} {r['back']:>6.2f} {table[-1]['aborted_per_fault']:>13.1f}")
        if a.json:
            write_json(a.json, {"versions": versions, "minutes": a.minutes, "seed": a.seed,
                                "pg_timeout": a.pg_timeout, "heartbeat_ms": a.heartbeat_ms, "rows": table})
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
