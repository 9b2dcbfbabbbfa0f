"""The straggler check: a slowed node found and swapped out, and false positives in failure-free runs.

    .venv/bin/python benchmarks/stragglers.py                            # both parts
    .venv/bin/python benchmarks/stragglers.py --slow-run --steps 400 --png docs/stragglers-timeline.png
    .venv/bin/python benchmarks/stragglers.py --false-positives 10
    .venv/bin/python benchmarks/stragglers.py --slow-run --keep /tmp/stragglers   # keep the run directories

Both parts take about 8 minutes on a shared 2-core machine (14 runs of 25-40 s each, plus start-ups).

``--slow-run``: a failure-free run, then the same run with ``--slow node1@40:2`` (node1's training process runs half
of the time from step 40, SIGSTOP/SIGCONT), both 3 + 1 nodes with ``--straggler-window 10``. It prints whether the
final parameters equal the failure-free run's (they must: the straggler leaves by a planned swap) and the steps
recomputed (0); the seconds from the fault (``fault_injected``, kind slow) to ``straggler_detected`` and to the first
step after the swap; the job's steps/s (rank 0's ``step`` timestamps) before the slowdown (steps 6..39), during it
(fault to the swap's ``decision``) and after the swap (from ``resumed``), beside the failure-free run's steps/s over
the same step ranges; and a PNG timeline (``--png``): steps/s over time (over 1 s), and each node's own work per
step (``node_step_times``). The summary counts the slowed node's swap as a failure of kind "slow" whose outcome is
"planned swap" (``planned_swaps`` counts it).

``--false-positives N``: N failure-free runs of 300 steps, 3 + 1 nodes, the default factor (1.5) with
``--straggler-window 10`` (the default 60 s window is longer than such a run here, so it cannot fire), then 2 runs
with the defaults (window 60). Per run: ``straggler_detected`` events (any one is a false positive), planned swaps,
the largest ratio any node reached in a ``node_step_times`` event (its own work per step over the lower median of the
other nodes' in the same event, as the judge compares them) and the longest stretch any node stayed over 1.5
(seconds from its first event over the factor to its last one in an unbroken run of such events: what the judge
holds against the window).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

from deadpool_hpc.config import RunConfig
from deadpool_hpc.faultinject.spec import parse_fault
from deadpool_hpc.events import read_events
from deadpool_hpc.launch import LocalExecutor
from deadpool_hpc.report.timeline import step_rate

FACTOR = RunConfig().stragglers.factor


def run(run_dir: str, steps: int, window: float, faults=()) -> tuple[dict, list[dict]]:
    cfg = RunConfig(nodes=3, spares=1, steps=steps, run_dir=run_dir, straggler_window=window,
                    faults=[parse_fault("slow", f) for f in faults]).validate()
    s = LocalExecutor(timeout=900).run(cfg)
    assert s["completed"], s
    return s, list(read_events(f"{run_dir}/events.jsonl"))


def first(events: list[dict], name: str, **match) -> dict | None:
    return next((e for e in events if e["event"] == name and all(e.get(k) == v for k, v in match.items())), None)


def step_times(events: list[dict]) -> dict[int, float]:
    """{step: wall time rank 0 logged it} (a step logged twice: the later)."""
    return {e["step"]: e["t"] for e in events if e["event"] == "step"}


def rate(ts: dict[int, float], lo: int, hi: int) -> float:
    """Steps per second over steps lo..hi: (hi - lo) steps between step lo's and step hi's timestamps."""
    return (hi - lo) / (ts[hi] - ts[lo]) if hi > lo else float("nan")


def ratios(events: list[dict]):
    """Yield (t, generation, node, own_s / the lower median of the other nodes' own_s) for every node_step_times
    event: the ratio the judge compares with the factor (agent/stragglers.py; the figures are already its smoothed
    ones, the median of each node's last 3 summaries)."""
    for e in events:
        if e["event"] != "node_step_times":
            continue
        own = {n: f["own_s"] for n, f in e["nodes"].items()}
        for n, o in own.items():
            others = sorted(v for m, v in own.items() if m != n)
            ref = others[(len(others) - 1) // 2] if others else 0.0
            if ref > 0:
                yield e["t"], e["generation"], n, o / ref


def over_factor(events: list[dict]) -> tuple[float, float]:
    """(largest ratio, longest stretch in seconds any node stayed over FACTOR, event after event)."""
    best, longest, since = 0.0, 0.0, {}
    for t, g, n, r in ratios(events):
        best = max(best, r)
        if r > FACTOR:
            t0 = since.setdefault((g, n), t)
            longest = max(longest, t - t0)
        else:
            since.pop((g, n), None)
    return best, longest


def slow_run(a, tmp: str) -> None:
    base, ev0 = run(f"{tmp}/free", a.steps, 10)
    s, ev = run(f"{tmp}/slow", a.steps, 10, [a.slow])
    fault = first(ev, "fault_injected", kind="slow")
    det = first(ev, "straggler_detected")
    req = first(ev, "swap_requested", detector="straggler")
    dec = first(ev, "decision")
    assert fault and det and req and dec, "no fault, detection, straggler swap or decision in the slow run's events"
    res = min((e for e in ev if e["event"] == "resumed" and e["generation"] >= dec["generation"]), key=lambda e: e["t"])
    after = min((e for e in ev if e["event"] == "step" and e["generation"] >= dec["generation"]), key=lambda e: e["t"])
    ts, ts0 = step_times(ev), step_times(ev0)
    recomputed = sum(f["recomputed_steps"] for f in s["failures"])
    print(f"final param_digest equals the failure-free run's: {s['param_digest'] == base['param_digest']} "
          f"({s['param_digest'][:16]} vs {base['param_digest'][:16]})")
    print(f"steps recomputed: {recomputed}; failures: {[(f['kind'], f['target'], f['outcome']) for f in s['failures']]}"
          f"; straggler_detected in the failure-free run: {sum(e['event'] == 'straggler_detected' for e in ev0)}")
    print(f"fault (step {fault['step']}, x{fault['factor']:g}) -> straggler_detected: {det['t'] - fault['t']:.2f} s "
          f"(window {det['window_s']:g} s, slow for {det['slow_for_s']:.2f} s, ratio {det['ratio']:.2f}, "
          f"action {det['action']})")
    print(f"fault -> first step after the swap (step {after['step']}): {after['t'] - fault['t']:.2f} s "
          f"(swap boundary {req['boundary']}, detection -> resume {after['t'] - det['t']:.2f} s)")
    in_ = lambda t0, t1: [k for k, t in ts.items() if t0 <= t <= t1]   # noqa: E731
    phases = [("before (steps 6..39)", 6, fault["step"] - 1),
              ("during (fault -> decision)", fault["step"], max(in_(fault["t"], dec["t"]))),
              ("after (resumed ->)", min(in_(res["t"], float("inf"))), max(ts))]
    print(f"\n{'phase':<28} {'steps':>9} {'slow run':>9} {'no fault':>9} {'ratio':>6}   (steps/s)")
    for name, lo, hi in phases:
        r, r0 = rate(ts, lo, hi), rate(ts0, lo, hi)
        print(f"{name:<28} {f'{lo}..{hi}':>9} {r:9.2f} {r0:9.2f} {r / r0:6.2f}")
    plot(a.png, a.slow, ev, ev0, fault, det, dec, after)


def plot(path: str, spec: str, ev, ev0, fault, det, dec, after) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ts, ts0 = step_times(ev), step_times(ev0)
    t0, t00 = ts[1], ts0[1]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    x, y, _ = step_rate(ev, window_s=1.0)
    ax.plot([v - t0 for v in x], y, lw=1.2, label=f"--slow {spec}")
    x, y, _ = step_rate(ev0, window_s=1.0)
    ax.plot([v - t00 for v in x], y, lw=1, alpha=0.6, color="grey", label="failure-free")
    ax.set_ylabel("job steps/s (over 1 s)")
    ax.set_title(f"Straggler check (3 + 1 nodes, window 10 s): --slow {spec}, detected, swapped for the spare")
    marks = [(fault["t"], f"fault (step {fault['step']})", "red"), (det["t"], "straggler_detected", "orange"),
             (dec["t"], "swap decision", "green"), (after["t"], f"first step after swap ({after['step']})", "blue")]
    for axis in (ax, bx):
        for t, label, c in marks:
            axis.axvline(t - t0, color=c, ls="--", lw=1, label=label if axis is ax else None)
    ax.legend(fontsize=8, loc="lower right")
    nodes = sorted({n for e in ev if e["event"] == "node_step_times" for n in e["nodes"]}, key=int)
    for n in nodes:
        pts = [(e["t"] - t0, e["nodes"][n]["own_s"] * 1e3) for e in ev
               if e["event"] == "node_step_times" and n in e["nodes"]]
        bx.plot(*zip(*pts), marker=".", lw=1, label=f"node{n}")
    bx.set_ylabel("own work per step (ms)")
    bx.set_xlabel("seconds since the slow run's first step")
    bx.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\ntimeline: {path}")


def false_positives(a, tmp: str) -> None:
    plan = [("window 10", 10.0)] * a.false_positives + [("defaults", RunConfig().stragglers.window)] * 2
    rows = []
    for i, (name, window) in enumerate(plan):
        s, ev = run(f"{tmp}/fp{i}", 300, window)
        best, longest = over_factor(ev)
        rows.append((name, sum(e["event"] == "straggler_detected" for e in ev), s["planned_swaps"], best, longest))
        print(f"run {i} ({name}): straggler_detected {rows[-1][1]}, planned swaps {rows[-1][2]}, max ratio "
              f"{best:.2f}, longest over {FACTOR:g}x: {longest:.1f} s", flush=True)
    print(f"\n{'run':>3} {'settings':<10} {'detected':>8} {'swaps':>5} {'max ratio':>9} {f'over {FACTOR:g}x (s)':>13}")
    for i, (name, det, sw, best, longest) in enumerate(rows):
        print(f"{i:>3} {name:<10} {det:>8} {sw:>5} {best:>9.2f} {longest:>13.1f}")
    for name in ("window 10", "defaults"):
        sel = [r for r in rows if r[0] == name]
        print(f"total, {name} ({len(sel)} runs): false positives {sum(r[1] for r in sel)}, planned swaps "
              f"{sum(r[2] for r in sel)}, max ratio {max(r[3] for r in sel):.2f}, median of the runs' max ratios "
              f"{statistics.median(r[3] for r in sel):.2f}, longest over {FACTOR:g}x {max(r[4] for r in sel):.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slow-run", action="store_true", help="the slowed-node run and its failure-free twin")
    ap.add_argument("--false-positives", type=int, nargs="?", const=10, default=None, metavar="N",
                    help="N failure-free runs with window 10 (default 10), and 2 with the defaults")
    ap.add_argument("--steps", type=int, default=400, help="steps of the --slow-run runs")
    ap.add_argument("--slow", default="node1@40:2", help="the slow fault spec of --slow-run")
    ap.add_argument("--png", default="docs/stragglers-timeline.png")
    ap.add_argument("--keep", metavar="DIR", help="put the run directories under DIR and keep them (default: temp)")
    a = ap.parse_args()
    if not a.slow_run and a.false_positives is None:
        a.slow_run, a.false_positives = True, 10
    with tempfile.TemporaryDirectory() as tmp:
        tmp = a.keep or tmp
        if a.slow_run:
            slow_run(a, tmp)
        if a.false_positives:
            if a.slow_run:
                print()
            false_positives(a, tmp)


if __name__ == "__main__":
    main()
