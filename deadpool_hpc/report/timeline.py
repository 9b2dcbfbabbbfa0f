"""A run's timeline, from its run directory alone: steps/s over wall time, a mark for each event an operator asks
about, and the recovery phases of each failure. Pure (no matplotlib): what ``plot.py`` draws, and what a test can
check it drew. Works on a finished run and on one still running (the event log so far).

Marks (``Mark.kind``), each at a wall time (seconds since the epoch):

- ``fault``: each injected fault (``fault_injected``), and each failure no injection explains, at the summary's
  ``t_fault`` (``t_fault_source`` says how it was found: a process exit its agent saw, the last heartbeat heard, ...);
- ``decision``: each recovery decision of the coordinator (``decision``: hot swap, spare lost, no spare node left,
  preempted, or the error that made it impossible), at ``t_decided``; the last one of each generation counts;
- ``swap``: each failure a spare took over (a hot or planned swap: the summary's ``swaps``), when training resumed;
- ``return`` / ``quarantine``: a failed node back in the spare pool (``node_returned``) / kept out
  (``node_quarantined``);
- ``straggler``: each straggler verdict (``straggler_detected``, swapped or reported);
- ``persist``: each background checkpoint committed (``checkpoint_persisted``);
- ``checkpoint``: each checkpoint saved for a requeue or a preemption (``checkpoint_saved``);
- ``requeue``: each requeued attempt (``requeued``).

Spans: each failure's recovery phases (summary.PHASES: detect, agree, rebuild, restore, recompute), laid end to end
from its ``t_fault``; a phase the summary could not time (its round failed, the run ended first) ends that failure's
spans. Source of every number: summary.build_summary over the same events.
"""
from __future__ import annotations

import bisect
import os
import statistics
from dataclasses import dataclass, field

from ..config import RunConfig
from ..errors import ConfigError
from ..events import read_events
from ..rundir import RunDir
from ..summary import PHASES, build_summary

MARK_KINDS = ("fault", "decision", "swap", "return", "quarantine", "straggler", "persist", "checkpoint", "requeue")
POINTS = 2000   # grid points of the steps/s curve, at most (a run of weeks is drawn as finely as one of minutes)


@dataclass
class Mark:
    kind: str     # one of MARK_KINDS
    t: float      # wall time, seconds since the epoch
    label: str    # what happened, in a few words ("kill node1@20", "node2 back")


@dataclass
class Span:
    failure: int  # index in the summary's ``failures``
    phase: str    # one of summary.PHASES
    t0: float     # wall time, seconds since the epoch
    t1: float


@dataclass
class Timeline:
    t0: float                 # the run's first event (wall time, seconds since the epoch): x = 0 of the plot
    t_end: float              # its last event
    times: list[float]        # the steps/s curve: wall times ...
    rates: list[float]        # ... and the steps per second completed in the ``window_s`` seconds around each
    window_s: float
    marks: list[Mark]
    spans: list[Span]
    summary: dict             # summary.build_summary of the same events
    config: RunConfig | None = None
    name: str = ""            # the run directory's name
    counts: dict = field(default_factory=dict)   # marks per kind

    def of(self, kind: str) -> list[Mark]:
        return [m for m in self.marks if m.kind == kind]


def load(run_dir: str) -> tuple[list[dict], RunConfig | None]:
    """The run's events (RUN_DIR/events.jsonl, in time order) and its config (RUN_DIR/config.json; None if it is
    missing or unreadable). Raises ConfigError naming ``run_dir`` if it holds no event log, or one without an event."""
    rd = RunDir(run_dir)
    if not os.path.isdir(rd.path):
        raise ConfigError(f"{run_dir!r}: no such directory; accepted: a run directory (the --run-dir of deadpool run, "
                          f"the RUN_DIR of a Slurm job) holding the run's events.jsonl")
    if not os.path.isfile(rd.events):
        raise ConfigError(f"{run_dir!r} is not a run directory: it holds no events.jsonl; accepted: a run directory "
                          f"(the --run-dir of deadpool run, the RUN_DIR of a Slurm job) holding the run's event log")
    events = sorted(read_events(rd.events), key=lambda e: e.get("t", 0))
    if not events:
        raise ConfigError(f"{rd.events}: holds no event yet (the run has not started); accepted: an event log with "
                          f"at least one event")
    try:
        with open(rd.config) as fh:
            config = RunConfig.from_json(fh.read())
    except (OSError, ValueError, TypeError):
        config = None
    return events, config


def step_rate(events: list[dict], t_start: float | None = None, t_end: float | None = None,
              points: int = POINTS, window_s: float | None = None) -> tuple[list[float], list[float], float]:
    """(grid of wall times, steps/s completed in the ``window_s`` seconds centred on each, window_s) from rank 0's
    ``step`` events, between ``t_start`` and ``t_end`` (default: the first and last step event) on at most
    ``points`` grid points (centred: a drop lines up with the fault that caused it). Each step event counts the steps
    since the one before (``--log-every``); a step done again after a recovery (recomputed) counts, as work done.
    ``window_s`` defaults to the larger of 10 x the median seconds between step events, 4 grid intervals and 0.5 s;
    near the last step the window ends there (at least half of it is kept)."""
    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["t"])
    if not steps:
        return [], [], window_s or 0.0
    # where training started again from an earlier step: a recovery's cut step, a checkpoint's step
    restarts = sorted([(e["t_decided"], e["cut_step"]) for e in events if e["event"] == "decision"
                       and e.get("t_decided") is not None and e.get("cut_step") is not None]
                      + [(e["t"], e["step"]) for e in events if e["event"] == "resumed_from_checkpoint"
                         and e.get("step") is not None])
    ts, done, prev = [], [0.0], None
    for e in steps:
        s = e["step"]
        if prev is None:
            inc = 1
        elif s > prev:
            inc = s - prev
        else:   # started again from an earlier step: the steps since the latest restart before it
            inc = s - max((c for t, c in restarts if t <= e["t"] and c < s), default=s - 1)
        ts.append(e["t"])
        done.append(done[-1] + max(inc, 1))
        prev = s
    lo = steps[0]["t"] if t_start is None else t_start
    hi = steps[-1]["t"] if t_end is None else t_end
    n = max(2, min(points, int((hi - lo) / 0.05) + 1))
    dt = (hi - lo) / (n - 1) if hi > lo else 0.0
    if window_s is None:
        gaps = [b - a for a, b in zip(ts, ts[1:]) if b > a]
        window_s = max(10 * statistics.median(gaps) if gaps else 0.0, 4 * dt, 0.5)
    grid = [lo + i * dt for i in range(n)]
    half = window_s / 2
    # near the last step the window ends there (what comes after it is not known yet in a live run)
    rates = [(done[bisect.bisect_right(ts, g + half)] - done[bisect.bisect_right(ts, g - half)])
             / max(min(g + half, ts[-1]) - (g - half), half) for g in grid]
    return grid, rates, window_s


def _node(n) -> str:
    return f"node{n}"


def marks(events: list[dict], summary: dict) -> list[Mark]:
    """Every mark of the run (see the module docstring), in time order."""
    out = []
    by: dict[str, list[dict]] = {}
    for e in events:
        by.setdefault(e["event"], []).append(e)
    for e in by.get("fault_injected", []):
        at = e.get("step") if e.get("step") is not None else e.get("phase")
        out.append(Mark("fault", e["t"], f"{e.get('kind')} {e.get('target')}@{at}"))
    for f in summary["failures"]:
        if f["kind"] == "not injected" and f.get("t_fault") is not None:
            out.append(Mark("fault", f["t_fault"], f"{f['target']} lost"))
        if f["promoted"] and f["recovery_s"] is not None:
            kind = "planned swap" if f["outcome"].startswith("planned swap") else "swap"
            lost, took = (",".join(map(_node, f[k])) for k in ("failed_nodes", "spare_nodes_used"))
            out.append(Mark("swap", f["t_fault"] + f["recovery_s"], f"{kind} {lost}->{took}"))
    decided = {e["generation"]: e for e in sorted(by.get("decision", []), key=lambda e: e["t_decided"])}
    for g, d in sorted(decided.items()):
        what = d.get("reason") or (f"error {d['error']}" if d.get("error") else "rebuild")
        out.append(Mark("decision", d["t_decided"], f"gen {g}: {what}"))
    out += [Mark("return", e["t"], f"{_node(e.get('node'))} back") for e in by.get("node_returned", [])]
    out += [Mark("quarantine", e["t"], f"{_node(e.get('node'))} kept out") for e in by.get("node_quarantined", [])]
    out += [Mark("straggler", e["t"], f"{_node(e.get('node'))} x{e.get('ratio') or 0:.1f} ({e.get('action')})")
            for e in by.get("straggler_detected", [])]
    out += [Mark("persist", e["t"], f"step {e.get('step')}") for e in by.get("checkpoint_persisted", [])]
    out += [Mark("checkpoint", e["t"], f"checkpoint step {e.get('step')}") for e in by.get("checkpoint_saved", [])]
    out += [Mark("requeue", e["t"], f"requeue {e.get('attempt', '')}".strip()) for e in by.get("requeued", [])]
    return sorted(out, key=lambda m: m.t)


def spans(summary: dict) -> list[Span]:
    """Each failure's recovery phases laid end to end from its ``t_fault`` (phases of 0 s or less take no span)."""
    out = []
    for i, f in enumerate(summary["failures"]):
        t = f.get("t_fault")
        for p in PHASES:
            d = f["phases"].get(p)
            if t is None or d is None:
                break
            if d > 0:
                out.append(Span(i, p, t, t + d))
            t += d
    return out


def build(events: list[dict], config: RunConfig | None = None, name: str = "") -> Timeline:
    """The timeline of a run from its events (at least one) and its config (None: the summary guesses without)."""
    events = sorted(events, key=lambda e: e.get("t", 0))
    s = build_summary(events, config)
    t0, t_end = events[0]["t"], events[-1]["t"]
    t_last = max((e["t"] for e in events if e["event"] == "step"), default=t_end)
    times, rates, window = step_rate(events, t0, t_last)
    ms = marks(events, s)
    return Timeline(t0=t0, t_end=t_end, times=times, rates=rates, window_s=window, marks=ms, spans=spans(s),
                    summary=s, config=config, name=name,
                    counts={k: sum(m.kind == k for m in ms) for k in MARK_KINDS})


def from_run_dir(run_dir: str) -> Timeline:
    """``build`` over RUN_DIR's event log and config (``load``: ConfigError if it is not a run directory)."""
    events, config = load(run_dir)
    return build(events, config, name=os.path.basename(os.path.abspath(run_dir)))
