"""Chaos driver: one job, faults from outside it at seeded Poisson times, then a failure-free run as long.

    .venv/bin/python benchmarks/chaos.py --minutes 1.5 --mtbf 20 --kinds kill-rank,kill-node --nodes 3 --spares 2
    .venv/bin/python benchmarks/chaos.py --minutes 1.5 --mtbf 20 --kinds hang-rank,kill-spare,kill-during-recovery \\
        --nodes 3 --spares 3 --replicas 2
    .venv/bin/python benchmarks/chaos.py --minutes 60 --mtbf 60 --kinds kill-rank,kill-node,hang-rank --requeue

Kinds (real signals to the run's own processes, by pid + start time from its event log's hellos): kill-rank (SIGKILL
a training process of a training node), kill-node (its agent and training processes), hang-rank (SIGSTOP a training
process: fenced after --hang-timeout), kill-spare (SIGKILL an idle spare's training process), kill-during-recovery
(kill-rank, then SIGKILL a training process of a second training node once the log shows the recovery started). Gaps: exponential, mean
--mtbf, at least --min-gap; a fault waits until the job trains again. A node whose agent survived (kill-rank,
hang-rank, kill-spare) comes back to the spare pool (agent/comeback.py; --quarantine, default 5 s here: faults come
--min-gap apart, so only a node failing by itself right after its return stays out); a whole node killed never does, and --max-node-kills bounds them (a
kill-node drawn past it becomes a kill-rank). A fault needs a spare left (kill-during-recovery: 2), else it is
``skipped: no spare left``; with --requeue a kill or hang with none left is injected anyway (checkpoint, requeue,
every node back). Faults stop --minutes after the first step; --steps defaults to
--minutes at a 20-step calibration run's median step. --out (new or empty; default benchmarks/out/chaos-TIME):
faults.jsonl (each fault, with its recovery from the run's summary), report.json, timeline.png, the run directories.
Exit 0: completed, bitwise equal to the failure-free run, every injected fault recovered, nothing left running.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import os
import random
import signal
import statistics
import threading
import time

from deadpool_hpc.config import RunConfig, parse_train_arg
from deadpool_hpc.errors import ConfigError
from deadpool_hpc.events import EventTail, read_events
from deadpool_hpc.launch import LocalExecutor
from deadpool_hpc.launch.options import check_train_fn
from deadpool_hpc.process.fence import is_alive

KINDS = ("kill-rank", "kill-node", "hang-rank", "kill-spare", "kill-during-recovery")
COLORS = dict(zip(KINDS, ("tab:red", "tab:purple", "tab:orange", "tab:green", "tab:blue")))
DISTURBANCES = ("decision", "suspect", "node_failed", "hang_detected", "requeued")
RECOVERED = ("hot swap", "spare lost", "checkpoint saved + requeue")


def refusal(a) -> str | None:
    """The first bad value and what is accepted, or None."""
    unknown = [k for k in a.kinds if k not in KINDS]
    if unknown or not a.kinds:
        return f"--kinds {','.join(unknown) or repr(a.kinds_text)}: unknown kind; accepted: {', '.join(KINDS)}"
    for flag, value, ok, accepted in (
            ("--minutes", a.minutes, a.minutes > 0, "> 0"), ("--mtbf", a.mtbf, a.mtbf > 0, "seconds > 0 (the mean "
             "time between faults)"), ("--min-gap", a.min_gap, a.min_gap >= 0, "seconds >= 0"),
            ("--hang-timeout", a.hang_timeout, a.hang_timeout > 0, "seconds > 0"), ("--steps", a.steps, a.steps is None
             or a.steps >= 1, "1 or more"), ("--max-requeues", a.max_requeues, a.max_requeues >= 0, "0 or more"),
            ("--quarantine", a.quarantine, a.quarantine >= 0, "seconds >= 0"),
            ("--max-node-kills", a.max_node_kills, a.max_node_kills is None or a.max_node_kills >= 0, "0 or more"),
            ("--nodes", a.nodes, a.nodes >= 2, "2 or more (a lost node's ranks come back from replicas on others)"),
            ("--replicas", a.replicas, 1 <= a.replicas < a.nodes, f"1..{a.nodes - 1} with --nodes {a.nodes}"),
            ("--spares", a.spares, a.spares >= 1 or a.requeue, "1 or more, or 0 with --requeue (each fault uses up a "
             "spare; with none, every fault would be skipped)")):
        if not ok:
            return f"{flag} {value}: accepted: {accepted}"
    if "kill-spare" in a.kinds and a.spares < 1:
        return "--kinds kill-spare with --spares 0: there is no spare to kill; accepted: --spares 1 or more"
    if "kill-during-recovery" in a.kinds and a.spares < 2:
        return (f"--kinds kill-during-recovery with --spares {a.spares}: it loses two training nodes, each takes a "
                f"spare; accepted: --spares 2 or more")
    if "kill-during-recovery" in a.kinds and a.replicas < 2 and a.nodes < 4:
        return (f"--kinds kill-during-recovery with --replicas 1 on --nodes {a.nodes}: with one replica two neighbours "
                f"on the replica ring cannot be lost together, and on {a.nodes} nodes every two are neighbours; "
                f"accepted: --replicas 2 (--nodes 3 or more) or --nodes 4 or more")
    if os.path.isdir(a.out) and os.listdir(a.out):
        return f"--out {a.out}: holds files (an earlier run?); accepted: a new or empty directory"
    return None


def config(a, steps: int, name: str, spares: int | None = None) -> RunConfig:
    return RunConfig(nodes=a.nodes, spares=a.spares if spares is None else spares, ranks_per_node=a.ranks_per_node,
                     steps=steps, replicas=a.replicas, hang_timeout=a.hang_timeout, requeue=a.requeue,
                     max_requeues=a.max_requeues, train_fn=a.train_fn, train_args=a.train_args,
                     spare_return=not a.no_spare_return, quarantine=a.quarantine,
                     run_dir=os.path.join(a.out, name))


class Job:
    """The chaos run as its event log shows it, attempt by attempt (a requeue starts every node again)."""

    def __init__(self, cfg: RunConfig):
        self.cfg, self.events = cfg, []
        self.tail = EventTail(os.path.join(cfg.output.run_dir, "events.jsonl"))
        self.hit, self.t_injected = set(), 0.0   # nodes this driver took out in this attempt; when it last did

    def poll(self) -> None:
        new = self.tail.poll()
        for e in new:
            if e["event"] == "requeued":
                self.hit.clear()
            elif e["event"] == "node_returned":   # back in the pool (agent/comeback.py): a target again
                self.hit.discard(e["node"])
        self.events += new

    def attempt(self) -> list[dict]:
        i = max((i for i, e in enumerate(self.events) if e["event"] == "requeued"), default=0)
        return self.events[i:]

    def layout(self) -> tuple[list[int], list[int]]:
        """(the physical node of each training slot, the idle spares in promotion order), from the decisions and the
        nodes back in the pool since (``node_returned``, in the order they came back)."""
        active, spares = list(range(self.cfg.layout.nodes)), list(range(self.cfg.layout.nodes, self.cfg.layout.total_nodes))
        cur = self.attempt()
        decided = {e["generation"]: e for e in cur if e["event"] == "decision"}  # the last one counts
        back = sorted((e for e in cur if e["event"] == "node_returned"), key=lambda e: e["t"])
        for g in sorted(decided):
            d = decided[g]
            spares += [e["node"] for e in back if e["generation"] == g - 1 and e["node"] not in spares]
            if d.get("error") or d.get("exhausted"):
                continue
            replaced = {int(k): int(v) for k, v in (d.get("replaced") or {}).items()}
            active = [replaced.get(n, n) for n in active]
            spares = [s for s in spares if s not in (d.get("failed_nodes") or []) and s not in replaced.values()]
        last = max(decided, default=0)
        spares += [e["node"] for e in back if e["generation"] == last and e["node"] not in spares]
        return active, [s for s in spares if s not in self.hit]

    def procs(self, node: int, local: int | None = None) -> list[dict]:
        """Identities (pid + start time) of node's agent and training processes (only local's, if given)."""
        found = {}
        for e in self.attempt():
            if e["event"] == "hello" and e.get("node") == node:
                found["agent" if e.get("role") == "agent" else e.get("local")] = e
        return [found[k] for k in (["agent"] + sorted(k for k in found if k != "agent") if local is None else [local])
                if k in found]

    def steady(self) -> bool:
        """Training again: every node taken out was handled by a decision, and 2 steps were logged since."""
        cur = self.attempt()
        handled = {n for e in cur if e["event"] == "decision" for n in e.get("failed_nodes") or []}
        since = max([self.t_injected] + [e["t"] for e in cur if e["event"] in DISTURBANCES])
        return self.hit <= handled and sum(e["event"] == "step" and e["t"] > since for e in cur) >= 2


def send(idents: list[dict], sig: int) -> list[int]:
    """Signal, back to back, each process alive as the same process (pid + start time) when looked up first (a node's
    training processes die with their agent: looked up after it, they would be gone); the pids signalled."""
    pids = [int(ident["pid"]) for ident in idents if is_alive(ident)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def inject(a, job: Job, kind: str, rng: random.Random) -> dict:
    active, spares = job.layout()
    rec = {"t": time.time(), "kind": kind, "attempt": sum(e["event"] == "requeued" for e in job.events),
           "spares_left": len(spares)}
    need = 2 if kind == "kill-during-recovery" else 1   # spares it uses up; with --requeue 0 left is a requeue
    if len(spares) < need and (kind in ("kill-spare", "kill-during-recovery") or not a.requeue):
        return dict(rec, skipped="no spare left")
    node = rng.choice(spares if kind == "kill-spare" else active)
    local = None if kind == "kill-node" else rng.randrange(a.ranks_per_node)   # None: the whole node
    sig = signal.SIGSTOP if kind == "hang-rank" else signal.SIGKILL
    n_seen = len(job.events)
    rec.update(node=node, local=local, signal=sig.name, pids=send(job.procs(node, local), sig))
    if not rec["pids"]:
        return dict(rec, skipped="target gone")
    job.hit.add(node)
    if kind == "kill-during-recovery":   # a second training node, as soon as the recovery of the first started
        while time.time() < rec["t"] + 10 and not any(e["event"] in ("suspect", "node_failed")
                                                     for e in job.events[n_seen:]):
            time.sleep(0.005)
            job.poll()
        slot, n = active.index(node), len(active)
        second = rng.choice([m for i, m in enumerate(active) if m != node
                             and (a.replicas >= 2 or (i - slot) % n not in (1, n - 1))])
        # a training process of it: its agent lives on and comes back too (a whole node lost is kill-node's)
        rec["second"] = {"node": second, "after_s": round(time.time() - rec["t"], 4), "signal": "SIGKILL",
                         "pids": send(job.procs(second, rng.randrange(a.ranks_per_node)), signal.SIGKILL)}
        job.hit.add(second)
    job.t_injected = time.time()
    return rec


def drive(a, cfg: RunConfig, rng: random.Random) -> tuple[dict, list[dict], list[dict]]:
    """Run the job in a thread, inject from here; (its summary, the faults, its events)."""
    job, out = Job(cfg), {}

    def run() -> None:
        try:
            out["summary"] = LocalExecutor(timeout=a.minutes * 180 + 600).run(cfg)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            out["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    faults, t_first = [], None
    due, kind = max(a.min_gap, rng.expovariate(1 / a.mtbf)), rng.choice(a.kinds)   # due: seconds after the first step
    while thread.is_alive():
        time.sleep(0.05)
        job.poll()
        t_first = t_first or next((e["t"] for e in job.events if e["event"] == "step"), None)
        now = time.time() - (t_first or math.inf)
        if not due <= now <= 60 * a.minutes or any(e["event"] == "finished" for e in job.events) or not job.steady():
            continue   # not due, past the window or the end, or the last recovery (a requeued start) is not over
        if kind == "kill-node" and a.max_node_kills is not None and \
                sum(f["kind"] == "kill-node" and not f.get("skipped") for f in faults) >= a.max_node_kills:
            kind = "kill-rank"   # a whole node lost never comes back: bounded by --max-node-kills
        faults.append(rec := inject(a, job, kind, rng))
        what = rec.get("skipped") or f"node{rec['node']} pids {rec['pids']} {rec['signal']}" + (
            f", then node{rec['second']['node']} +{rec['second']['after_s']:.3f} s" if "second" in rec else "")
        print(f"  {rec['t'] - t_first:7.1f} s  {kind:<21} {what}  (spares left {rec['spares_left']})", flush=True)
        due = max(due + max(a.min_gap, rng.expovariate(1 / a.mtbf)), time.time() - t_first + a.min_gap)
        kind = rng.choice(a.kinds)
    thread.join()
    job.poll()
    if "error" in out:
        raise out["error"]
    return out["summary"], faults, job.events


def attach(faults: list[dict], summary: dict, events: list[dict]) -> list[dict]:
    """Give each injected fault the summary's failures of its nodes decided after it (and before the next fault),
    and the seconds to the first step after it (``resumed``, or the first step of a requeued attempt). Returns the
    summary's failures no fault explains."""
    decided = {e["generation"]: e["t_decided"] for e in events if e["event"] == "decision"}
    back = sorted([e["t"] for e in events if e["event"] == "resumed"] + [
        next((s["t"] for s in events if s["event"] == "step" and s["t"] > e["t"]), math.inf)
        for e in events if e["event"] == "resumed_from_checkpoint"])
    injected, used = [f for f in faults if not f.get("skipped")], set()
    for i, f in enumerate(injected):
        t_next = injected[i + 1]["t"] if i + 1 < len(injected) else math.inf
        nodes = {f["node"]} | ({f["second"]["node"]} if "second" in f else set())
        mine = [j for j, x in enumerate(summary["failures"]) if j not in used and nodes & set(x["failed_nodes"])
                and f["t"] < decided.get(x["generation"], -1) < t_next]
        used |= set(mine)
        got = [summary["failures"][j] for j in mine]
        rec = [x["recovery_s"] for x in got]
        t_back = next((t for t in back if f["t"] < t < t_next), None)
        f.update(generations=[x["generation"] for x in got], outcome="; ".join(x["outcome"] for x in got) or None,
                 recovery_s=max(rec) if rec and None not in rec else None, phases=[x["phases"] for x in got],
                 recomputed_steps=sum(x["recomputed_steps"] or 0 for x in got),
                 requeued=any(x["requeued"] for x in got), resume_s=None if t_back is None else t_back - f["t"],
                 recovered=bool(got) and all(x["outcome"].startswith(RECOVERED) for x in got),
                 t_fault_source=[x["t_fault_source"] for x in got])
    return [x for j, x in enumerate(summary["failures"]) if j not in used]


def plot(path: str, events: list[dict], faults: list[dict], t0: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from deadpool_hpc.report.timeline import step_rate

    grid, rate, _ = step_rate(events, t_start=t0, window_s=2.0)   # the steps done in the 2 s around each point
    fig, ax = plt.subplots(figsize=(11, 3.8))
    ax.plot([g - t0 for g in grid], rate, color="black", lw=0.8)
    for f in faults:
        x, c = f["t"] - t0, COLORS[f["kind"]]
        ax.axvline(x, color=c, lw=1.2, ls=":" if f.get("skipped") else "-")
        if f.get("resume_s"):
            ax.axvspan(x, x + f["resume_s"], color=c, alpha=0.25, lw=0)
    for e in events:
        if e["event"] == "requeued":
            ax.axvline(e["t"] - t0, color="gray", ls="--", lw=1)
    kinds = sorted({f["kind"] for f in faults}, key=KINDS.index)
    ax.legend([Line2D([], [], color=COLORS[k]) for k in kinds] + [Line2D([], [], color="gray", ls="--")],
              kinds + ["requeue"], loc="lower right", fontsize=8)
    ax.set(xlabel="seconds since the first step", ylabel="steps/s (rank 0, 2 s window)",
           ylim=(0, None), title="chaos run: faults (solid: injected, dotted: skipped), recoveries shaded to the "
                                 "first step after")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> int:  # noqa: C901
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="faults are injected this long after the first step")
    ap.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between faults")
    ap.add_argument("--kinds", dest="kinds_text", default="kill-rank,kill-node", metavar="K,...", help=", ".join(KINDS))
    ap.add_argument("--min-gap", type=float, default=10.0, help="seconds: no two faults closer (default 10)")
    for flag, default in (("--seed", 0), ("--nodes", 3), ("--spares", 2), ("--ranks-per-node", 1), ("--replicas", 1),
                          ("--max-requeues", 100)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--steps", type=int, help="default: --minutes of steps at a calibration run's median step time")
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="seconds before a frozen rank is fenced")
    ap.add_argument("--requeue", action="store_true", help="no spare left: checkpoint and start again from it")
    ap.add_argument("--quarantine", type=float, default=5.0,
                    help="seconds: a node failing again this soon after its return stays out (default 5: under "
                         "--min-gap less a return's seconds, so only a node that fails by itself is kept out)")
    ap.add_argument("--no-spare-return", action="store_true", help="a failed node never comes back (the old way)")
    ap.add_argument("--max-node-kills", type=int, help="at most this many kill-node faults (default: no bound)")
    ap.add_argument("--train-fn", default=RunConfig().train.train_fn)
    ap.add_argument("--train-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                                  time.strftime("chaos-%Y%m%d-%H%M%S")), help="new or empty directory")
    a = ap.parse_args()
    a.kinds = [k.strip() for k in a.kinds_text.split(",") if k.strip()]
    try:
        if (msg := refusal(a)) is not None:
            raise ConfigError(msg)
        a.train_args = dict(parse_train_arg(s) for s in a.train_arg)
        check_train_fn(a.train_fn, a.train_args)
        config(a, a.steps or 1, "chaos").validate()
    except ConfigError as exc:
        ap.error(str(exc))
    os.makedirs(a.out, exist_ok=True)
    if (steps := a.steps) is None:
        cal = LocalExecutor(timeout=300).run(config(a, 20, "calibration", spares=0))
        steps = math.ceil(60 * a.minutes / cal["median_step_s"])
        print(f"calibration: median step {cal['median_step_s']:.3f} s -> --steps {steps}", flush=True)
    print(f"chaos run: {a.nodes} nodes + {a.spares} spares, {steps} steps, kinds {','.join(a.kinds)}, mtbf "
          f"{a.mtbf:g} s, min gap {a.min_gap:g} s, seed {a.seed}, {a.minutes:g} min of faults", flush=True)
    summary, faults, events = drive(a, config(a, steps, "chaos"), random.Random(a.seed))
    left = sorted(set(summary["processes_left"]) | set(send([e for e in events if e["event"] == "hello"],
                                                            signal.SIGKILL)))   # ours: this run's own hellos
    unexplained = attach(faults, summary, events)
    print("failure-free run of the same steps ...", flush=True)
    base = LocalExecutor(timeout=a.minutes * 180 + 600).run(config(a, steps, "baseline"))
    with open(os.path.join(a.out, "faults.jsonl"), "w") as fh:
        fh.writelines(json.dumps(f) + "\n" for f in faults)
    t_first, t_end = span(events)
    b_events = list(read_events(os.path.join(a.out, "baseline", "events.jsonl")))
    b_first, b_end = span(b_events)
    ff_mean, own_mean = mean_step(b_events, []), mean_step(events, [f["t"] for f in faults if not f.get("skipped")])
    counted = summary["steps_completed"] if summary["completed"] else 0
    equal = summary["completed"] and summary["param_digest"] == base["param_digest"]
    rec = [f["recovery_s"] for f in faults if f.get("recovery_s") is not None]
    injected = sum(not f.get("skipped") for f in faults)
    table = {
        "steps": steps, "completed": summary["completed"], "wall_s_first_step_to_end": round(t_end - t_first, 2),
        "faults": {k: {"injected": sum(f["kind"] == k and not f.get("skipped") for f in faults),
                       "recovered": sum(f["kind"] == k and bool(f.get("recovered")) for f in faults),
                       "skipped": sum(f["kind"] == k and bool(f.get("skipped")) for f in faults)} for k in a.kinds},
        "requeues": summary["requeues"], "recovery_s_median": statistics.median(rec) if rec else None,
        "recovery_s_max": max(rec, default=None),
        "steps_recomputed": sum(f.get("recomputed_steps") or 0 for f in faults),
        "failures_not_injected": [{k: x[k] for k in ("target", "cause", "outcome", "generation")} for x in unexplained],
        "processes_left": left, "digest_equal": bool(equal), "chaos_digest": summary["param_digest"],
        "failure_free_digest": base["param_digest"], "failure_free_median_step_s": base["median_step_s"],
        "goodput": counted * base["median_step_s"] / (t_end - t_first) if base["median_step_s"] else None,
        # the load of a shared machine changes between the two runs: the same with the chaos run's own median step
        "goodput_at_own_median_step": counted * (summary["median_step_s"] or 0) / (t_end - t_first),
        "failure_free_goodput": steps * base["median_step_s"] / (b_end - b_first) if base["median_step_s"] else None,
        # step_s (the median's) is the step function's time; a step's wall time also has the snapshot after it.
        # The same three at a mean step's wall time (see mean_step): 1.0 for the failure-free run
        "failure_free_wall_s": round(b_end - b_first, 2), "failure_free_mean_step_s": ff_mean,
        "mean_step_s_between_faults": own_mean,
        "goodput_at_mean_step": counted * ff_mean / (t_end - t_first) if ff_mean else None,
        "goodput_at_own_mean_step": counted * own_mean / (t_end - t_first) if own_mean else None,
        # the wall time not explained by the counted steps at this run's own mean step, per injected fault
        "lost_s_per_fault": (t_end - t_first - counted * own_mean) / injected if injected and own_mean else None,
    }
    with open(os.path.join(a.out, "report.json"), "w") as fh:
        json.dump({"table": table, "faults": faults, "chaos": summary, "failure_free": base}, fh, indent=1)
    plot(os.path.join(a.out, "timeline.png"), events, faults, t_first)
    print(f"\n{'kind':<22}{'injected':>9}{'recovered':>10}{'skipped':>8}")
    for k, row in table["faults"].items():
        print(f"{k:<22}{row['injected']:>9}{row['recovered']:>10}{row['skipped']:>8}")
    for f in faults:
        if not f.get("skipped"):
            print(f"  {f['t'] - t_first:7.1f} s {f['kind']:<21} node{f['node']}: {f['outcome']}, recovery "
                  f"{_s(f['recovery_s'])} (to the first step: {_s(f['resume_s'])}), recomputed {f['recomputed_steps']}")
    for key, value in table.items():
        if key != "faults":
            print(f"{key:<28} {_s(value) if isinstance(value, float) else value}")
    ok = equal and not left and not unexplained and all(f.get("recovered") for f in faults if not f.get("skipped"))
    return 0 if ok else 1


def mean_step(events: list[dict], faults: list[float]) -> float | None:
    """Wall seconds per step between rank 0's step records (step_s plus the snapshot after it), leaving out an
    interval with a fault (a time in FAULTS) in it, one across a generation or a step not after the last (a recovery,
    a requeue, recomputed steps) and the 3 after either; None if none is left."""
    steps = [e for e in events if e["event"] == "step"]
    faults, spent, n, skip = sorted(faults), 0.0, 0, 0
    for e1, e2 in zip(steps, steps[1:]):
        if (e1.get("generation") != e2.get("generation") or e2["step"] <= e1["step"]
                or bisect.bisect_right(faults, e2["t"]) > bisect.bisect_right(faults, e1["t"])):
            skip = 4
        if skip:
            skip -= 1
            continue
        spent, n = spent + e2["t"] - e1["t"], n + e2["step"] - e1["step"]
    return spent / n if n else None


def span(events: list[dict]) -> tuple[float, float]:
    """(the first step's time, the run's end: its last step or ``finished``)."""
    return (min(e["t"] for e in events if e["event"] == "step"),
            max(e["t"] for e in events if e["event"] in ("finished", "step")))


def _s(v) -> str:
    return "-" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    raise SystemExit(main())
