"""What users do instead of a hot swap: plain DDP under torchrun, a DCP checkpoint every C steps, restart on a fault.

    .venv/bin/python benchmarks/restart_baseline.py --mtbf 30,60,120 --minutes 2
    .venv/bin/python benchmarks/restart_baseline.py --mtbf 60 --minutes 2 --buckets fixed   # bitwise-equal variant
    .venv/bin/python benchmarks/restart_baseline.py --mtbf 60 --minutes 2 --every 20        # a fixed C

The demo's model, data and optimizer (deadpool_hpc.train: micro GPT, Shakespeare, AdamW + linear warm-up, DemoConfig
defaults), DistributedDataParallel over gloo on CPU, 3 ranks under ``torchrun --standalone --nproc-per-node 3
--max-restarts 100000``. Every C steps the ranks save a torch.distributed.checkpoint (model, optimizer, scheduler, step,
each rank's torch RNG) into RUN/ckpt/.tmp-STEP; rank 0 renames it to RUN/ckpt/step-STEP once ``dcp.save`` has returned,
so a checkpoint half written is never loaded; at start the ranks load the newest step-*. torchrun runs with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch 2.13's default (the agent's TCPStore, kept across restarts) a
restarted group reads the previous launch's gloo addresses and fails to connect or hangs (pytorch/pytorch#135712).

Resumed != failure-free with DDP's defaults, though model, optimizer, scheduler, step and RNG come back exactly: DDP
rebuilds its gradient buckets (gradient-ready order) after the first step of every launch, so that step reduces with
the initial buckets where the failure-free run used rebuilt ones, gloo's ring sums an element in an order set by its
offset in the bucket, and the rounding differs (~1e-8 after one step; training then drifts apart). --buckets fixed
(find_unused_parameters=True: never rebuilt, as torchft's DDP does) makes the resumed run bitwise equal.

1. Calibration: a failure-free run of 60 steps, a checkpoint every 10: step time t, checkpoint time d.
2. Per MTBF S: C = round(sqrt(2 d S) / t) steps (Young/Daly), unless --every. The job runs M minutes (from its first
   step); the driver SIGKILLs one rank's process (the pid the rank wrote to RUN/pid.R, a child of this torchrun and not
   of a launch already hit) at exponential gaps of mean S (seeded); torchrun's agent restarts the whole group, which
   resumes from the newest checkpoint. After M minutes the driver writes RUN/stop and the ranks end after the step
   they agree on (N). Then failure-free runs to N: with the same C, and (one, to the largest N) without checkpoints.

Columns. wall: first step's start to last step's end (the first launch's start-up left out, every restart's in).
goodput: N t' / wall, t' the run's own mean step time (step end to step end less checkpoints, a launch's first 3
steps left out), so a load change on a shared machine between runs does not count as a fault's cost; (ref):
T_ref(N) / wall, T_ref(N) the failure-free run's time to step N. lost/fault: (wall - N t' - floor(N/C) d') / faults,
d' the run's median checkpoint time. restart: fault -> first step of the launch it caused (median). redone: steps
run that did not count, per fault. ckpt ovh: 1 + d'/(C t'); (ref): T_ckpt(N) / T_ref(N), two failure-free runs.
equal: final parameters vs the reference's at step N, else the largest |difference|. Driver and ranks exchange
text, JSON and .npy files (no pickle).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BIG = 10**9


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from deadpool_hpc.train.corpus import Batches, load_tokens
    from deadpool_hpc.train.demo import DemoConfig
    from deadpool_hpc.train.model import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, run = dist.get_rank(), Path(a.rundir)
    (run / f"pid.{rank}").write_text(str(os.getpid()))
    cfg = DemoConfig()
    torch.manual_seed(cfg.seed)
    gpt = GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model, context=cfg.context))
    model = DDP(gpt, find_unused_parameters=a.buckets == "fixed")   # fixed: buckets never rebuilt (see the docstring)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, cfg.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    data = Batches(load_tokens(), cfg.batch_size, cfg.context, cfg.seed)
    ckdir = run / "ckpt"

    def state(step: int) -> dict:
        msd, osd = get_state_dict(model, opt)
        sch = sched.state_dict()
        return {"model": msd, "optim": osd, "step": torch.tensor(step),
                "sched": {k: torch.tensor(sch[k], dtype=torch.float64 if k == "_last_lr" else torch.int64)
                          for k in ("last_epoch", "_step_count", "_last_lr")},
                f"rng.{rank}": torch.get_rng_state()}   # a per-rank key: DCP keeps every rank's own

    def params(step: int) -> str:
        flat = torch.cat([p.detach().reshape(-1) for _, p in sorted(model.module.state_dict().items())])
        np.save(run / f"params-{step}.npy", flat.numpy(), allow_pickle=False)
        return str(step)

    start, launch_t = 0, time.time()
    done = sorted(ckdir.glob("step-*")) if ckdir.is_dir() else []
    if done:
        sd = state(0)
        dcp.load(sd, checkpoint_id=str(done[-1]))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        sched.load_state_dict({**sched.state_dict(), **{k: v.tolist() for k, v in sd["sched"].items()}})
        torch.set_rng_state(sd[f"rng.{rank}"])
        start = int(sd["step"])
    keep = {int(s) for s in a.params_at.split(",") if s}
    stop = torch.zeros(1)
    if rank == 0:
        with open(run / "starts", "a") as f:
            f.write(f"{launch_t} {start}\n")
        log = open(run / "steps.log", "a", buffering=1)   # launch, step, end time, step s, checkpoint s
        times = {}
        if not (run / "first").exists():
            (run / "first").write_text(str(time.time()))
    step = start
    while step < a.steps:
        t0 = time.perf_counter()
        x, y = data.get(step, rank)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        t1 = time.perf_counter()
        if a.every and step % a.every == 0:
            tmp, final = ckdir / f".tmp-{step:09d}", ckdir / f"step-{step:09d}"
            dcp.save(state(step), checkpoint_id=str(tmp))   # returns once rank 0 has written the metadata
            if rank == 0:
                os.rename(tmp, final)
                for old in ckdir.iterdir():
                    if old != final:
                        shutil.rmtree(old, ignore_errors=True)
        if rank == 0:
            log.write(f"{launch_t} {step} {time.time()} {t1 - t0:.6f} {time.perf_counter() - t1:.6f}\n")
            if step in keep:
                times[step] = time.time()
                params(step)
            stop[0] = float((run / "stop").exists())
        dist.all_reduce(stop)   # every rank ends after the same step
        if stop[0]:
            break
    if rank == 0:
        times[step] = time.time()
        params(step)
        (run / "result.json").write_text(json.dumps({"step": step, "end": time.time(), "times": times}))
    del model, opt, sched   # else some ranks hang in a futex at exit when these outlive the group (torch 2.13, gloo)
    dist.destroy_process_group()


def launch(run: Path, steps: int, every: int, buckets: str, keep=(), minutes=None, mtbf=None, seed=0) -> dict:
    """One torchrun job in RUN; with MTBF, faults at exponential gaps of that mean while the clock runs."""
    run.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "--max-restarts", "100000", __file__, "--worker", "--rundir", str(run), "--steps", str(steps),
           "--every", str(every), "--buckets", buckets, "--params-at", ",".join(map(str, keep))]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the agent's shared TCPStore (the default) a restarted group reads
    # the previous launch's gloo addresses from it and fails to connect, or hangs (pytorch/pytorch#135712; 2.13 too)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = open(run / "torchrun.log", "w")
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    rng, kills, dead = random.Random(seed), [], set()
    try:
        while not (run / "first").exists():
            if p.poll() is not None:
                raise RuntimeError(f"torchrun ended with {p.returncode} before a step; see {run}/torchrun.log")
            time.sleep(0.05)
        t_start = time.time()
        next_fault = t_start + rng.expovariate(1 / mtbf) if mtbf else math.inf
        while minutes is not None and time.time() < t_start + 60 * minutes:
            if time.time() >= next_fault:
                pid = target(run / f"pid.{rng.randrange(3)}", p.pid, dead)
                if pid is not None:     # else that rank's next process is not up yet: hit it when it is
                    dead |= children(p.pid)   # this launch's processes: torchrun tears them down
                    os.kill(pid, signal.SIGKILL)
                    kills.append(time.time())
                    with open(run / "kills", "a") as f:
                        f.write(f"{kills[-1]} pid {pid}\n")
                    next_fault = time.time() + rng.expovariate(1 / mtbf)
            time.sleep(0.05)
        if minutes is not None:
            (run / "stop").write_text("")
        p.wait(timeout=600)
    finally:
        kill_tree(p)
        out.close()
    if p.returncode != 0:
        raise RuntimeError(f"torchrun ended with {p.returncode}; see {run}/torchrun.log")
    res = json.loads((run / "result.json").read_text())
    first = float((run / "first").read_text())
    rows = [line.split() for line in (run / "steps.log").read_text().splitlines()]
    starts = sorted(float(line.split()[0]) for line in (run / "starts").read_text().splitlines())
    restart = []
    for ls in starts[1:]:   # fault -> first step of the launch it caused
        ends = [float(r[2]) for r in rows if float(r[0]) == ls]
        cause = [k for k in kills if k < ls]
        if ends and cause:
            restart.append(min(ends) - cause[-1])
    n, gaps = res["step"], []
    ck = [float(r[4]) for r in rows if every and int(r[1]) % every == 0]
    for ls in starts:       # step time: end-to-end interval less any checkpoint, a launch's first 3 steps left out
        mine = [(float(r[2]), float(r[4])) for r in rows if float(r[0]) == ls]
        gaps += [e - prev - c for (prev, _), (e, c) in zip(mine[2:], mine[3:])]
    res.update(wall=res["end"] - first, faults=len(kills), launches=len(starts), redone=len(rows) - n,
               t=statistics.mean(gaps), d=statistics.median(ck) if ck else 0.0,
               ck=ck, restart=statistics.median(restart) if restart else float("nan"), load=os.getloadavg()[0],
               rel={int(k): v - first for k, v in res["times"].items()},
               params={int(k): np.load(run / f"params-{k}.npy") for k in res["times"]})
    return res


def stat(pid) -> list:
    """/proc/PID/stat's fields after the command name: state, ppid, ... ([] if gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def children(parent: int) -> set:
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and stat(p)[1:2] == [str(parent)]}


def target(path: Path, parent: int, dead: set):
    """The pid in PATH if it is a live child of PARENT not of a launch already hit (DEAD), else None."""
    try:
        pid = int(path.read_text())
    except (OSError, ValueError):
        return None
    f = stat(pid)
    return pid if f and f[0] != "Z" and int(f[1]) == parent and pid not in dead else None


def write_json(path: str, obj) -> None:
    """OBJ as JSON in PATH (written whole, then renamed), NaN as null (JSON has no NaN)."""
    def clean(v):
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return [clean(x) for x in v] if isinstance(v, (list, tuple)) else v
    with open(f"{path}.tmp", "w") as fh:
        json.dump(clean(obj), fh, indent=1)
    os.replace(f"{path}.tmp", path)


def kill_tree(p) -> None:
    """SIGKILL a process we started (a Popen) and its descendants (own sessions: torchrun's workers), by pid, if it
    still runs; then reap it."""
    if p.poll() is None:
        for pid in children(p.pid) | {p.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def mtbf_list(ap, text: str, minutes: float) -> list[float]:
    """The seconds of ``--mtbf`` (comma-separated); ``ap.error`` (exit 2) names a bad value and what is accepted."""
    out = []
    for x in text.split(","):
        try:
            v = float(x)
        except ValueError:
            v = float("nan")
        if not (math.isfinite(v) and v > 0):
            ap.error(f"--mtbf {x.strip()!r}: accepted: seconds > 0, comma-separated (e.g. 30,60,120)")
        out.append(v)
    if not (math.isfinite(minutes) and minutes > 0):
        ap.error(f"--minutes {minutes!r}: accepted: a number > 0")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mtbf", default="30,60,120", help="mean seconds between faults, comma-separated")
    ap.add_argument("--minutes", type=float, default=2.0, help="length of each faulty run")
    ap.add_argument("--json", metavar="PATH", help="also write the table's numbers (and the calibration's) here")
    ap.add_argument("--every", type=int, default=0, help="checkpoint every C steps (default: Young/Daly per MTBF)")
    ap.add_argument("--buckets", choices=("ddp", "fixed"), default="ddp",
                    help="DDP's defaults, or buckets never rebuilt (find_unused_parameters=True: bitwise equal)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", help="keep the run directories here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rundir", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=BIG, help=argparse.SUPPRESS)
    ap.add_argument("--params-at", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    mtbfs = mtbf_list(ap, a.mtbf, a.minutes)
    base = Path(a.keep or tempfile.mkdtemp(prefix="restart-baseline-"))
    try:
        cal = launch(base / "calibrate", steps=60, every=10, buckets=a.buckets)
        t, d = cal["t"], cal["d"]
        print(f"calibration (failure-free, 60 steps, checkpoint every 10, buckets {a.buckets}): step {t * 1e3:.1f} ms "
              f"(mean), checkpoint {d * 1e3:.1f} ms (median; all: {', '.join(f'{c * 1e3:.0f}' for c in cal['ck'])} "
              f"ms); load average {cal['load']:.1f}", flush=True)
        rows = []
        for i, s in enumerate(mtbfs):
            c = a.every or max(1, round(math.sqrt(2 * d * s) / t))
            print(f"MTBF {s:g} s: checkpoint every {c} steps ({c * t:.1f} s; Young/Daly sqrt(2 x {d:.3f} s x {s:g} s)"
                  f" = {math.sqrt(2 * d * s):.1f} s); {a.minutes:g} min with faults", flush=True)
            f = launch(base / f"faults-{i}", BIG, c, a.buckets, minutes=a.minutes, mtbf=s, seed=a.seed + i)
            ff = launch(base / f"ckpt-{i}", f["step"], c, a.buckets)
            rows.append((s, c, f, ff))
            print(f"  step {f['step']} in {f['wall']:.1f} s, {f['faults']} faults, {f['launches']} launches, step "
                  f"{f['t'] * 1e3:.1f} ms, checkpoint {f['d'] * 1e3:.1f} ms, load {f['load']:.1f}; failure-free "
                  f"with checkpoints: {ff['wall']:.1f} s (step {ff['t'] * 1e3:.1f} ms, load {ff['load']:.1f})",
                  flush=True)
        ns = [r[2]["step"] for r in rows]
        ref = launch(base / "reference", max(ns), 0, a.buckets, keep=ns)
        print(f"failure-free, no checkpoints: {ref['step']} steps in {ref['wall']:.1f} s (step {ref['t'] * 1e3:.1f} "
              f"ms, load {ref['load']:.1f})\n")
        print(f"{'MTBF s':>6} {'C':>4} {'faults':>6} {'steps':>5} {'wall s':>6} {'goodput':>7} {'(ref)':>5} "
              f"{'lost/fault s':>12} {'restart s':>9} {'redone/fault':>12} {'ckpt ovh':>8} {'(ref)':>5} {'equal':>7}")
        table = []
        for s, c, f, ff in rows:
            n, nf = f["step"], f["faults"] or math.nan
            table.append(dict(
                mtbf=s, every=c, faults=f["faults"], launches=f["launches"], steps=n, wall=f["wall"], t=f["t"],
                d=f["d"], goodput=n * f["t"] / f["wall"], goodput_ref=ref["rel"][n] / f["wall"],
                ref_time_to_n=ref["rel"][n], lost_per_fault=(f["wall"] - n * f["t"] - n // c * f["d"]) / nf,
                restart=f["restart"], redone=f["redone"], redone_per_fault=f["redone"] / nf,
                ckpt_ovh=1 + f["d"] / (c * f["t"]), ckpt_ovh_ref=ff["wall"] / ref["rel"][n],
                max_abs_diff=float(np.abs(f["params"][n] - ref["params"][n]).max()), load=f["load"],
                failure_free_ckpt=dict(wall=ff["wall"], t=ff["t"], load=ff["load"])))
            r, diff = table[-1], table[-1]["max_abs_diff"]
            print(f"{s:>6g} {c:>4} {r['faults']:>6} {n:>5} {r['wall']:>6.1f} {r['goodput']:>7.3f} "
                  f"{r['goodput_ref']:>5.2f} {r['lost_per_fault']:>12.2f} {r['restart']:>9.2f} "
                  f"{r['redone_per_fault']:>12.1f} {r['ckpt_ovh']:>8.3f} {r['ckpt_ovh_ref']:>5.2f} "
                  f"{'yes' if diff == 0 else f'{diff:.0e}':>7}")
        if a.json:
            write_json(a.json, {"buckets": a.buckets, "minutes": a.minutes, "seed": a.seed,
                                "calibration": {k: cal[k] for k in ("t", "d", "ck", "load")},
                                "reference": {k: ref[k] for k in ("step", "wall", "t", "load")}, "rows": table})
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
