"""``deadpool plot``: a run's timeline as a picture (timeline.py says what is drawn and from which events).

Two panels over the same wall-time axis (seconds, minutes or hours since the run's first event): steps/s (rank 0's
``step`` events over a sliding window) with each failure's recovery phases shaded and each fault a red line; below
it, one lane per kind of mark (faults, decisions, swaps, returns and quarantines, straggler verdicts, checkpoints
persisted or saved, requeues). Drawn with matplotlib's object API (no pyplot: no global state, no display needed).

matplotlib is the ``plot`` extra (``pip install 'deadpool-hpc[plot]'``): a missing matplotlib raises
``MissingPackage`` (a ConfigError, so the command exits 2) naming it; nothing else of the package needs it.
"""
from __future__ import annotations

import os

from ..errors import ConfigError
from ..summary import PHASES
from .timeline import Timeline, from_run_dir

FORMATS = (".png", ".svg", ".pdf")
DEFAULT_NAME = "timeline.png"   # in the run directory, when no output file is given
PHASE_COLORS = dict(zip(PHASES, ("#fdae61", "#fee08b", "#abd9e9", "#74add1", "#a6d96a")))
# mark kind -> (lane, marker, colour)
STYLE = {
    "fault": ("faults", "X", "tab:red"),
    "decision": ("decisions", "D", "tab:gray"),
    "swap": ("swaps", "^", "tab:green"),
    "return": ("returns", "o", "tab:blue"),
    "quarantine": ("returns", "x", "black"),
    "straggler": ("stragglers", "s", "tab:orange"),
    "persist": ("checkpoints", "|", "tab:purple"),
    "checkpoint": ("checkpoints", "P", "tab:purple"),
    "requeue": ("checkpoints", ">", "tab:brown"),
}
LANES = ("faults", "decisions", "swaps", "returns", "stragglers", "checkpoints")
# kinds whose marks get their label
LABELLED = ("fault", "decision", "swap", "straggler", "quarantine", "checkpoint", "requeue")
MAX_LABELS = 30   # per kind: more marks than that are drawn without labels (they would overlap)


class MissingPackage(ConfigError):
    """An optional package a command needs is not installed."""


def require_matplotlib():
    """matplotlib's Figure class; MissingPackage naming the package and how to install it if it is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingPackage(f"drawing a run's timeline needs matplotlib, which is not installed ({exc}); install it "
                             f"with: pip install 'deadpool-hpc[plot]' (or pip install matplotlib)") from None
    return Figure


def check_output(path: str, option: str = "-o") -> str:
    """``path`` absolute, if a picture can be written there: a name ending in .png, .svg or .pdf, in an existing
    directory, not a directory itself. Raises ConfigError naming the value and what is accepted."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise ConfigError(f"{option} {path!r}: is a directory; accepted: a file name ending in {', '.join(FORMATS)}")
    if os.path.splitext(full)[1].lower() not in FORMATS:
        raise ConfigError(f"{option} {path!r}: unknown picture format; accepted: a file name ending in "
                          f"{', '.join(FORMATS)}")
    if not os.path.isdir(os.path.dirname(full)):
        raise ConfigError(f"{option} {path!r}: {os.path.dirname(full)} is not a directory; accepted: a file in an "
                          f"existing directory")
    return full


def _unit(span_s: float) -> tuple[float, str]:
    return (1.0, "s") if span_s <= 600 else (60.0, "min") if span_s <= 10 * 3600 else (3600.0, "h")


def draw(tl: Timeline, path: str, title: str | None = None) -> dict:
    """Draw ``tl`` to ``path`` (its suffix picks the format). Returns what was drawn, counted from the figure's own
    artists: {mark kind: markers drawn, "phases": {phase: spans shaded}, "points": points of the steps/s curve}."""
    Figure = require_matplotlib()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    unit, uname = _unit(tl.t_end - tl.t0)
    x = lambda t: (t - tl.t0) / unit   # noqa: E731
    fig = Figure(figsize=(12, 6.5), layout="constrained")
    ax, lanes = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    curve = ax.plot([x(t) for t in tl.times], tl.rates, color="black", lw=0.9)[0]
    spans = [(sp.phase, ax.axvspan(x(sp.t0), x(sp.t1), color=PHASE_COLORS[sp.phase], lw=0)) for sp in tl.spans]
    shaded = {p: sum(1 for q, patch in spans if q == p and patch in ax.patches) for p in PHASES}
    for m in tl.of("fault"):
        for axis in (ax, lanes):
            axis.axvline(x(m.t), color=STYLE["fault"][2], lw=0.8, alpha=0.7)
    s = tl.summary
    steps = f"{s['steps_completed']}" + (f" of {tl.config.train.steps}" if tl.config else "")
    ax.set_title(title or f"{tl.name or 'run'}: {steps} steps, {len(s['failures'])} failure(s), {s['swaps']} swap(s), "
                 f"{len(s['stragglers'])} straggler verdict(s)" + ("" if s["completed"] else " (not completed)"),
                 fontsize=10)
    ax.set_ylabel(f"steps/s (rank 0, over {tl.window_s:.3g} s)")
    ax.set_ylim(0, max(tl.rates, default=1.0) * 1.3 or 1.0)
    ax.legend([Line2D([], [], color="black"), Line2D([], [], color=STYLE["fault"][2])]
              + [Patch(color=PHASE_COLORS[p]) for p in PHASES],
              ["steps/s", "fault"] + [f"recovery: {p}" for p in PHASES],
              fontsize=7, loc="upper left", ncol=7)
    row = {lane: len(LANES) - 1 - i for i, lane in enumerate(LANES)}
    drawn = {}
    for kind, (lane, marker, color) in STYLE.items():
        ms = tl.of(kind)
        if not ms:
            drawn[kind] = 0
            continue
        coll = lanes.scatter([x(m.t) for m in ms], [row[lane]] * len(ms), marker=marker, color=color, s=36,
                             zorder=3, label=kind)
        drawn[kind] = len(coll.get_offsets())
        if kind in LABELLED and len(ms) <= MAX_LABELS:
            for i, m in enumerate(ms):
                right = x(m.t) > 0.8 * x(tl.t_end)   # near the right edge: the label to the left of its mark
                lanes.annotate(m.label, (x(m.t), row[lane]), xytext=(-4 if right else 4, 5 if i % 2 == 0 else -10),
                               textcoords="offset points", fontsize=6.5, color=color, ha="right" if right else "left")
    lanes.set_yticks(list(row.values()), list(row))
    lanes.set_ylim(-0.7, len(LANES) - 0.3)
    lanes.set_xlabel(f"{uname} since the run's first event")
    lanes.set_xlim(0, x(tl.t_end) * 1.02 or 1.0)
    lanes.grid(axis="y", color="#eeeeee")
    fig.savefig(path, dpi=100)
    return {**drawn, "phases": shaded, "points": len(curve.get_xdata())}


def plot_run(run_dir: str, out: str | None = None) -> tuple[str, Timeline, dict]:
    """Draw RUN_DIR's timeline to ``out`` (default RUN_DIR/timeline.png). Returns (the file written, the timeline,
    what ``draw`` drew). Raises ConfigError for a directory without an event log or a bad ``out``, MissingPackage
    without matplotlib; OSError if the file cannot be written."""
    path = check_output(out) if out is not None else os.path.join(os.path.abspath(run_dir), DEFAULT_NAME)
    tl = from_run_dir(run_dir)
    require_matplotlib()
    return path, tl, draw(tl, path)
