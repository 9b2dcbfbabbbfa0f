"""The control plane's scale study (issue 8): node agents with no training processes, 8 to 256 on one machine.

    .venv/bin/python benchmarks/control_plane_scale.py [--sizes 8,16,32,64,128,256] [--window 10] [--out DIR]

For each size N it starts N control-plane probes (deadpool_hpc/control/probe.py: a node agent's control plane and
ring watch, no training processes) under MPICH's hydra, one proxy per agent as the local launcher does, N - 2
active and 2 spares, and measures:

- steady state: control messages per second per agent (sent, heartbeats included) and CPU per agent (% of a
  core, all threads), medians over the agents, over ``--window`` seconds;
- a **crash** (SIGKILL of agent N/2) and then a **freeze** (SIGSTOP of agent 0, the coordinator): detect (fault
  -> first agent knows), disseminate (first -> last agent knows), agree (last agent knows -> the coordinator
  sends the decision), broadcast (decision sent -> last agent applied), and total (fault -> last agent applied).

``--topology all`` runs the old all-to-all heartbeats (every agent watches every other) for comparison: it is
run for the sizes in ``--all-sizes`` (it does not survive large N on 2 cores: that is the point).

It writes ``scale.csv`` and one PNG per measure under ``--out`` (default benchmarks/out/scale), fits each
phase to a + b*log2(N) and to a + b*N (least squares; the better is reported), projects 512, 4,096 and 16,384
nodes, and prints as its last line one JSON object with everything (docs/scaling.md explains the model).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _hosts(n: int) -> str:
    # one hydra proxy per agent (as launch/local.py does): a SIGKILLed agent then leaves the others alive
    return ",".join(f"127.0.{i // 250}.{i % 250 + 1}" for i in range(n))


def _wait_files(out: str, prefix: str, ranks, timeout: float, proc) -> dict[int, dict]:
    end = time.monotonic() + timeout
    got: dict[int, dict] = {}
    while time.monotonic() < end:
        for r in ranks:
            if r not in got:
                path = os.path.join(out, prefix.format(r=r))
                if os.path.exists(path):
                    with open(path) as fh:
                        got[r] = json.load(fh)
        if len(got) == len(ranks):
            break
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    return got


def _phases(files: dict[int, dict], victim: int, t_fault: float) -> dict:
    knew = [f["knew"][str(victim)] for f in files.values() if str(victim) in f["knew"]]
    applied = [f["applied"] for f in files.values()]
    t_decided = statistics.median(f["t_decided"] for f in files.values())  # one coordinator: all equal
    first, last = min(knew), max(knew)
    return {"detect_s": first - t_fault, "disseminate_s": last - first, "agree_s": max(0.0, t_decided - last),
            "broadcast_s": max(applied) - t_decided, "total_s": max(applied) - t_fault,
            "agents": len(files), "knew": len(knew),
            "cpu_ms_per_agent": 1000 * statistics.median(f["recovery_cpu_s"] for f in files.values()),
            "coordinator_cpu_ms": 1000 * next(f["recovery_cpu_s"] for f in files.values()
                                              if f["coordinator"] == f["mpi_rank"])}


def run_size(n: int, topology: str, window: float, out_root: str, faults: bool = True) -> dict:
    from deadpool_hpc.launch.local import mpiexec_path

    out = os.path.join(out_root, f"{topology}-{n}")
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        os.unlink(os.path.join(out, f))
    env = dict(os.environ, DEADPOOL_JOB_SECRET=secrets.token_hex(16), PYTHONPATH=ROOT,
               MPIR_CVAR_NUM_CLIQUES=str(n), MPIR_CVAR_CLIQUES_BY_BLOCK="1", OMP_NUM_THREADS="1")
    k = "0" if topology == "all" else "2"
    cmd = [mpiexec_path(), "-disable-auto-cleanup", "-launcher", "fork", "-hosts", _hosts(n), "-ppn", "1",
           "-n", str(n), sys.executable, "-m", "deadpool_hpc.control.probe", out, "--active", str(n - 2),
           "--watch-k", k, "--window", str(window), "--warmup", "3"]
    t0 = time.monotonic()
    log = open(os.path.join(out, "mpiexec.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    row: dict = {"n": n, "topology": topology}
    try:
        steady = _wait_files(out, "steady-{r}.json", range(n), 120 + 2 * n + window, proc)
        row["startup_and_window_s"] = round(time.monotonic() - t0, 1)
        if len(steady) < n:
            row["error"] = f"only {len(steady)} of {n} agents finished the steady window"
            return row
        row["sent_per_s"] = statistics.median(s["sent_per_s"] for s in steady.values())
        row["received_per_s"] = statistics.median(s["received_per_s"] for s in steady.values())
        row["cpu_pct"] = 100 * statistics.median(s["cpu_per_s"] for s in steady.values())
        row["cpu_total_pct"] = 100 * sum(s["cpu_per_s"] for s in steady.values())
        row["false_suspicions"] = sum(len(s["suspected"]) for s in steady.values())
        if not faults or row["false_suspicions"]:
            return row
        pids = {r: s["pid"] for r, s in steady.items()}
        time.sleep(1.0)
        for name, victim, sig, gen in (("crash", n // 2, signal.SIGKILL, 1), ("freeze", 0, signal.SIGSTOP, 2)):
            t_fault = time.time()
            os.kill(pids[victim], sig)
            live = [r for r in range(n) if r not in (n // 2, 0)[: gen]]
            got = _wait_files(out, "recovery-{r}-" + str(gen) + ".json", live, 60 + n / 4, proc)
            if len(got) < len(live):
                row[f"{name}_error"] = f"{len(got)} of {len(live)} agents applied generation {gen}"
                break
            for key, v in _phases(got, victim, t_fault).items():
                row[f"{name}_{key}"] = v
            time.sleep(1.0)
        return row
    finally:
        open(os.path.join(out, "stop"), "w").close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group: mpiexec, its proxies, the probes
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()


def fit(ns, ys, models=("a + b*log2(N)", "a + b*N")):
    """Least-squares fits of y = a + b*f(N) for f = log2 and f = identity (those named in ``models``). Returns the
    better (smaller squared error) as {"model", "a", "b", "rss"}."""
    best = None
    for model, f in (("a + b*log2(N)", math.log2), ("a + b*N", float)):
        if model not in models:
            continue
        xs = [f(n) for n in ns]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        a = my - b * mx
        rss = sum((a + b * x - y) ** 2 for x, y in zip(xs, ys))
        if best is None or rss < best["rss"]:
            best = {"model": model, "a": a, "b": b, "rss": rss}
    return best


def predict(m: dict, n: int) -> float:
    x = math.log2(n) if m["model"].startswith("a + b*log2") else float(n)
    return max(0.0, m["a"] + m["b"] * x)


# What one machine cannot show, per term of a recovery at scale; docs/scaling.md cites each source and its confidence.
NODES = (512, 4096, 16384)  # x 8 GPUs: 4,096, 32,768 and 131,072 GPUs
SOURCED = {
    # NCCL communicator init (the new generation's process group). MegaScale (NSDI '24): < 5 s at 2,048 GPUs after
    # its init fixes; NCCL >= 2.23 ncclCommInitRankScalable bootstraps from several roots. Larger: bracketed only.
    "nccl_init_s": {512: 5.0, 4096: 30.0, 16384: 100.0},
    # replica restore: each GPU's unique state pulled by its replacement from one holder, all GPUs in parallel. A
    # 65B model with 16 B/param of state (bf16 weights + fp32 master + Adam) sharded over the job's GPUs, pulled at
    # 2 GB/s (one Python TCP stream with CRC-32C; a 400 Gb/s rail carries 50 GB/s at line rate)
    "state_bytes": 65e9 * 16,
    "restore_bytes_per_s": 2e9,
}


def critical_path(rows: list[dict]) -> dict:
    """The control plane's recovery as it runs on a real cluster, one agent per node, from what one machine can
    measure without the others' CPU in the way (docs/scaling.md, "Model"):

    - detect: the crash's detection (ring watch EOF), median over sizes (it does not depend on N);
    - hop: one tree hop (a message, a wake-up, a decode), from the sizes whose agents all fit the cores (N <= 16):
      dissemination time / ceil(log2 N);
    - coordinator: its CPU for one recovery round, fitted to a + b*N over every size (its work is O(N): N reports
      in, one decision out to N agents).

    Control-plane time at N agents: detect + (ceil(log2 N) + 3) hops (dissemination, collect, ready, decision) +
    the coordinator's CPU at N.
    """
    ring = [r for r in rows if r["topology"] == "ring" and "crash_total_s" in r]
    small = [r for r in ring if r["n"] <= 16] or ring[:1]
    hop = statistics.median(r["crash_disseminate_s"] / math.ceil(math.log2(r["n"])) for r in small)
    detect = statistics.median(r["crash_detect_s"] for r in ring)
    coord = fit([r["n"] for r in ring], [r["crash_coordinator_cpu_ms"] / 1000 for r in ring], models=("a + b*N",))
    return {"detect_s": detect, "hop_s": hop, "coordinator_s": coord}


def control_plane_s(model: dict, n: int) -> float:
    return model["detect_s"] + (math.ceil(math.log2(n)) + 3) * model["hop_s"] + predict(model["coordinator_s"], n)


def project(model: dict) -> dict:
    """Kill -> the first step after the swap starts, per node count (8 GPUs per node): the control plane (modelled
    from measurements), NCCL init and the replica restore (sourced). The recomputed step itself is the user's."""
    out = {}
    for nodes in NODES:
        gpus = nodes * 8
        terms = {"control_plane_s": control_plane_s(model, nodes), "nccl_init_s": SOURCED["nccl_init_s"][nodes],
                 "restore_s": SOURCED["state_bytes"] / gpus / SOURCED["restore_bytes_per_s"]}
        terms["total_s"] = sum(terms.values())
        out[str(nodes)] = {"gpus": gpus, **{k: round(v, 3) for k, v in terms.items()}}
    return out


def plot(rows: list[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for key, label in (("sent_per_s", "control messages sent per second per agent"),
                       ("cpu_pct", "CPU per idle agent (% of one core)"),
                       ("crash_total_s", "crash -> decision applied everywhere (s)"),
                       ("freeze_total_s", "freeze -> decision applied everywhere (s)")):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for topo in ("ring", "all"):
            pts = [(r["n"], r[key]) for r in rows if r["topology"] == topo and key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label="ring, k=2 + tree" if topo == "ring" else "all-to-all")
        if key == "crash_total_s":
            pts = [(r["n"], r["modelled_control_plane_s"]) for r in rows if "modelled_control_plane_s" in r]
            if pts:
                ax.plot(*zip(*pts), linestyle="--", label="model: one agent per node")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("node agents")
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, f"{key}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,16,32,64,128,256")
    ap.add_argument("--all-sizes", default="8,16,32,64", help="sizes at which the all-to-all topology is also run")
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "scale"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for n in [int(x) for x in a.sizes.split(",")]:
        rows.append(run_size(n, "ring", a.window, a.out))
        print(json.dumps(rows[-1]), flush=True)
    for n in [int(x) for x in a.all_sizes.split(",") if x]:
        rows.append(run_size(n, "all", a.window, a.out))
        print(json.dumps(rows[-1]), flush=True)
    ring = [r for r in rows if r["topology"] == "ring" and "crash_total_s" in r]
    fits, model = {}, None
    if len(ring) >= 2:
        ns = [r["n"] for r in ring]
        for phase in ("crash_detect_s", "crash_disseminate_s", "crash_agree_s", "crash_broadcast_s", "crash_total_s"):
            fits[phase] = fit(ns, [r[phase] for r in ring])
        model = critical_path(rows)
        for r in ring:
            r["modelled_control_plane_s"] = round(control_plane_s(model, r["n"]), 4)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(a.out, "scale.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    try:
        plots = plot(rows, a.out)
    except ImportError:
        print("no plots: matplotlib is missing (pip install -e '.[bench]')", file=sys.stderr)
        plots = []
    result = {"sizes": rows, "fits": fits, "model": model, "projection": project(model) if model else {}, "plots": plots,
              "csv": os.path.join(a.out, "scale.csv")}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
