"""The control plane's scale study (issue 8): from the files the probes write to a table, fits, a model and plots.

The probes (study/probe.py) write, per run of N agents, ``steady-R.json``, ``fault-<crash|freeze>.json`` and
``recovery-R-G.json`` into one directory. ``row(out_dir)`` turns such a directory into one row of measures;
``report(rows, out)`` fits them, models a recovery with one agent per node, projects it to 512, 4,096 and 16,384
nodes (8 GPUs each), and writes ``scale.csv`` and one PNG per measure (matplotlib, the ``bench`` extra).
Used by benchmarks/control_plane_scale.py (probes started by mpiexec on one machine) and by
``python -m study.scale_study OUT_DIR`` (probes started by srun: sbatch/scaling.sbatch with MODE=control-plane).
docs/scaling.md explains every measure and the model's sources.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import re
import statistics
import sys


def _load(pattern: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as fh:
            out.append(json.load(fh))
    return out


def _phases(files: dict[int, dict], victim: int, t_fault: float) -> dict:
    knew = [f["knew"][str(victim)] for f in files.values() if str(victim) in f["knew"]]
    applied = [f["applied"] for f in files.values()]
    t_decided = statistics.median(f["t_decided"] for f in files.values())  # one coordinator: all equal
    first, last = min(knew), max(knew)
    return {"detect_s": first - t_fault, "disseminate_s": last - first, "agree_s": max(0.0, t_decided - last),
            "broadcast_s": max(applied) - t_decided, "total_s": max(applied) - t_fault,
            "agents": len(files), "knew": len(knew),
            "cpu_ms_per_agent": 1000 * statistics.median(f["recovery_cpu_s"] for f in files.values()),
            "cpu_s_all": sum(f["recovery_cpu_s"] for f in files.values()),
            "coordinator_cpu_ms": 1000 * next(f["recovery_cpu_s"] for f in files.values()
                                              if f["coordinator"] == f["mpi_rank"])}


def row(out_dir: str, cores: int | None = None) -> dict:
    """One row of measures from a probe run's directory (see the module docstring). Keys: n, topology, the
    steady state's sent_per_s / received_per_s / cpu_pct (median per agent) / cpu_total_pct / false_suspicions,
    and for each fault that ran, ``<fault>_<phase>`` (seconds, ms of CPU), or ``<fault>_error``.

    ``cores``: when every agent ran on one machine with that many cores, also ``<fault>_cpu_floor_s``, the least
    time the recovery could take there: the CPU all agents spent in it (``<fault>_cpu_s_all``, counted from when
    each agent's main thread saw the failure, so an underestimate) spread perfectly over the cores the idle agents
    leave free (``cores - cpu_total_pct / 100``). Where it is close to ``<fault>_total_s`` the run measured the
    cores, not the protocol (docs/scaling.md)."""
    steady = _load(os.path.join(out_dir, "steady-*.json"))
    if not steady:
        return {"dir": out_dir, "error": "no steady-state file: the probes never got through their window"}
    n = steady[0]["size"]
    r: dict = {"n": n, "topology": "all" if steady[0]["watch_k"] == 0 else "ring"}
    if len(steady) < n:
        r["error"] = f"only {len(steady)} of {n} agents finished the steady window"
    r["sent_per_s"] = statistics.median(s["sent_per_s"] for s in steady)
    r["received_per_s"] = statistics.median(s["received_per_s"] for s in steady)
    r["cpu_pct"] = 100 * statistics.median(s["cpu_per_s"] for s in steady)
    r["cpu_total_pct"] = 100 * sum(s["cpu_per_s"] for s in steady)
    r["false_suspicions"] = sum(len(s["suspected"]) for s in steady)
    lost: list[int] = []
    for gen, name in enumerate(("crash", "freeze"), start=1):
        faults = _load(os.path.join(out_dir, f"fault-{name}.json"))
        if not faults:
            continue
        (fault,) = faults
        lost.append(fault["rank"])
        files = {f["mpi_rank"]: f for f in _load(os.path.join(out_dir, f"recovery-*-{gen}.json"))}
        live = n - len(lost)
        if len(files) < live:
            r[f"{name}_error"] = f"{len(files)} of {live} agents applied generation {gen}"
            continue
        for key, v in _phases(files, fault["rank"], fault["t"]).items():
            r[f"{name}_{key}"] = v
        if cores:
            r[f"{name}_cpu_floor_s"] = r[f"{name}_cpu_s_all"] / max(0.1, cores - r["cpu_total_pct"] / 100)
    return r


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
    # replica restore: each GPU's unique state pushed to its replacement by one holder, all GPUs in parallel. A
    # 65B model with 16 B/param of state (bf16 weights + fp32 master + Adam) sharded over the job's GPUs, pushed at
    # 2 GB/s (one Python TCP stream with CRC-32C; a 400 Gb/s rail carries 50 GB/s at line rate)
    "state_bytes": 65e9 * 16,
    "restore_bytes_per_s": 2e9,
}


def critical_path(rows: list[dict]) -> dict:
    """The control plane's recovery as it runs on a real cluster, one agent per node, from what one machine can
    measure without the others' CPU in the way (docs/scaling.md, "Model"):

    - detect: the crash's detection (ring link EOF), median over sizes (it does not depend on N);
    - hop: one tree hop (a message, a wake-up, a decode), from the sizes whose agents all fit the cores (N <= 16):
      dissemination time / ceil(log2 N);
    - coordinator: its CPU for one recovery round, fitted to a + b*N over every size (its work is O(N): N reports
      in, one decision out).

    Control-plane time at N agents: detect + (2 ceil(log2 N) + 1) hops + the coordinator's CPU at N: the suspicion
    down a tree (ceil(log2 N) hops), each agent's report straight to the coordinator as soon as it knows (1 hop
    after the last agent knows; no collect round trip), the decision down a tree (ceil(log2 N) hops).
    """
    ring = [r for r in rows if r.get("topology") == "ring" and "crash_total_s" in r]
    small = [r for r in ring if r["n"] <= 16] or ring[:1]
    hop = statistics.median(r["crash_disseminate_s"] / math.ceil(math.log2(r["n"])) for r in small)
    detect = statistics.median(r["crash_detect_s"] for r in ring)
    coord = fit([r["n"] for r in ring], [r["crash_coordinator_cpu_ms"] / 1000 for r in ring], models=("a + b*N",))
    return {"detect_s": detect, "hop_s": hop, "coordinator_s": coord}


def control_plane_s(model: dict, n: int) -> float:
    return model["detect_s"] + (2 * math.ceil(math.log2(n)) + 1) * model["hop_s"] + predict(model["coordinator_s"], n)


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


def report(rows: list[dict], out: str) -> dict:
    """Fits, model and projection of ``rows`` (``row`` of each run); writes ``out``/scale.csv and the PNGs (none,
    with a note on stderr, when matplotlib is missing). Returns everything as one JSON-ready dict."""
    ring = [r for r in rows if r.get("topology") == "ring" and "crash_total_s" in r]
    fits, model = {}, None
    if len(ring) >= 2:
        ns = [r["n"] for r in ring]
        for phase in ("crash_detect_s", "crash_disseminate_s", "crash_agree_s", "crash_broadcast_s", "crash_total_s"):
            fits[phase] = fit(ns, [r[phase] for r in ring])
        model = critical_path(rows)
        for r in ring:
            r["modelled_control_plane_s"] = round(control_plane_s(model, r["n"]), 4)
    os.makedirs(out, exist_ok=True)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(out, "scale.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    try:
        plots = plot(rows, out)
    except ImportError:
        print("no plots: matplotlib is missing (pip install -e '.[bench]')", file=sys.stderr)
        plots = []
    return {"sizes": rows, "fits": fits, "model": model, "projection": project(model) if model else {},
            "plots": plots, "csv": os.path.join(out, "scale.csv")}


def sweep_dirs(root: str) -> list[str]:
    """The run directories under ``root`` (``ring-N``, ``all-N``, or the Slurm sweep's ``cp-nN``), by size."""
    found = [d for d in glob.glob(os.path.join(root, "*-*")) if os.path.isdir(d) and re.search(r"-n?\d+$", d)]
    return sorted(found, key=lambda d: (os.path.basename(d).startswith("all"), int(re.search(r"(\d+)$", d).group(1))))


def main(argv=None) -> int:
    """``python -m study.scale_study OUT_DIR``: the study of a Slurm sweep's probes (OUT_DIR/cp-n<N>, written by
    sbatch/scaling.sbatch with MODE=control-plane). Prints the report's JSON (``report``: scale.csv and the plots go
    to OUT_DIR); exits 0 when every size recovered from both faults, else 1."""
    ap = argparse.ArgumentParser(prog="python -m study.scale_study",
                                 description="the control plane scale study of a Slurm sweep's probes")
    ap.add_argument("out_dir")
    a = ap.parse_args(argv)
    probes = [d for d in sweep_dirs(a.out_dir) if os.path.basename(d).startswith("cp-n")]
    if not probes:
        print(f"no probe directories (cp-n<N>) under {a.out_dir}", file=sys.stderr)
        return 1
    rows = [row(d) for d in probes]
    print(json.dumps(report(rows, a.out_dir)))
    return 0 if all("crash_total_s" in r and "freeze_total_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
