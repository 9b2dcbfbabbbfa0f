"""Prometheus metrics of a run (``--metrics-port PORT``, ``--metrics-textfile DIR``; off by default).

Owns: the metric names and their meaning (``METRICS``: every metric a deadpool process exports, with its type,
labels and help); the job's view, derived from the event log through ``summary.build_summary`` (``JobView``), so
that the numbers a dashboard shows are the ones ``deadpool status`` and summary.json show; and the exporter
(``Exporter``): the HTTP endpoint (prometheus-client's ``start_http_server``) and node_exporter's textfile form
(``deadpool_<job>_<who>.prom``, written to a temporary file and renamed, so the collector never reads half a file).

Does not own: what a node agent knows of its node, nor which agent is the coordinator (agent/metrics.py gathers
that and hands it here as plain numbers); the event log (events.py); the summary (summary.py).

Where each view is served (docs/architecture.md, "Metrics"): the job's view by the coordinator (the lowest live node
agent; a new coordinator takes the endpoint over after a failure) on ``PORT``, each node agent's own on
``PORT + 1 + node index``; in the textfile form as ``deadpool_<job>_job.prom`` and ``deadpool_<job>_node<i>.prom``.
``<job>``: Slurm's job id, else the run directory's name. Every sample carries the label ``deadpool_job`` (that
name), a node's also ``node``.
"""
from __future__ import annotations

import math
import os
import re
import threading
import time

from .events import EventTail
from .summary import build_summary

# name -> (type, labels, help). Units in the names (Prometheus's conventions): seconds, bytes, _total for counters.
METRICS: dict[str, tuple[str, tuple, str]] = {
    # the job's view (the coordinator; from the event log and the summary, and the coordinator's own state)
    "deadpool_step": ("gauge", (), "newest training step completed (rank 0's step events)"),
    "deadpool_steps_target": ("gauge", (), "steps the run trains for (--steps)"),
    "deadpool_step_seconds": ("gauge", (), "wall seconds of the newest logged step (rank 0)"),
    "deadpool_steps_per_second": ("gauge", (), "steps completed per second over the last 30 s of wall time"),
    "deadpool_tokens_per_second": ("gauge", (), "tokens per second of the newest logged step, when the step "
                                                 "function returns {'tokens': N}"),
    "deadpool_generation": ("gauge", (), "the job's generation: one more per recovery decision"),
    "deadpool_failures_total": ("counter", ("cause", "outcome"), "failures (summary.json's failures) by the cause its "
                                                                 "agent saw and the outcome"),
    "deadpool_recovery_seconds": ("histogram", ("phase",), "seconds of each recovered failure's phases (detect, "
                                                           "agree, rebuild, restore, recompute) and in all (total)"),
    "deadpool_steps_recomputed_total": ("counter", (), "steps trained again after recoveries (cut step to the step "
                                                       "reached)"),
    "deadpool_spares_left": ("gauge", (), "spare nodes ready to take a failed node's place"),
    "deadpool_node_returns_total": ("counter", (), "nodes back in the spare pool after their training processes "
                                                   "failed"),
    "deadpool_node_quarantines_total": ("counter", (), "nodes kept out of the spare pool"),
    "deadpool_requeues_total": ("counter", (), "times the run was requeued from a checkpoint"),
    "deadpool_node_own_work_seconds": ("gauge", ("node",), "a training node's own work per step (its slowest rank's "
                                                           "step time less its waits on peers), seconds"),
    "deadpool_node_own_work_ratio": ("gauge", ("node",), "a training node's own work per step over the other "
                                                         "training nodes' (lower) median, as the straggler check "
                                                         "judges it"),
    "deadpool_persisted_step": ("gauge", (), "step of the newest checkpoint written in the background "
                                             "(--persist-every)"),
    "deadpool_persisted_age_seconds": ("gauge", (), "seconds since the newest background checkpoint was written"),
    "deadpool_goodput_ratio": ("gauge", (), "steps completed x the median step time / wall seconds since the first "
                                            "step (1: no time lost to failures or recomputation)"),
    "deadpool_run_completed": ("gauge", (), "1 once the run trained every step"),
    # a node's view (each node agent; from its own state)
    "deadpool_node_state": ("gauge", ("state",), "1 for the node agent's current state (training, spare, ...)"),
    "deadpool_node_generation": ("gauge", (), "the generation this node agent is in"),
    "deadpool_node_committed_step": ("gauge", ("rank",), "newest step whose snapshot every holder acknowledged, per "
                                                         "training rank of the node"),
    "deadpool_commit_lag_steps": ("gauge", ("rank",), "snapshots written by a training rank of the node and not yet "
                                                      "acknowledged by every holder (steps)"),
    "deadpool_replicated_bytes_total": ("counter", (), "snapshot bytes the node's ranks pushed and their holders "
                                                       "acknowledged"),
    "deadpool_replicated_bytes_per_second": ("gauge", (), "the same, per second, over the last refresh"),
    "deadpool_node_step_seconds": ("gauge", (), "the node's wall seconds per step over the straggler check's last "
                                                "interval"),
}
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, math.inf)
RATE_WINDOW_S = 30.0     # deadpool_steps_per_second's window
REFRESH_S = 5.0          # the textfile is rewritten this often; the HTTP view is refreshed at most once a second
KEEP_STEPS = 2000        # step events the job view keeps (the first one, and the newest ones): a long run's log
KEEP_TABLES = 50         # node_step_times events kept
_NAME_RE = re.compile(r"[^A-Za-z0-9_.-]")


def job_name(run_dir: str) -> str:
    """The ``<job>`` of a textfile's name and the ``deadpool_job`` label: Slurm's job id when the run is a Slurm
    job (not a ``deadpool run`` inside an allocation), else the run directory's name (characters other than letters,
    digits, ``_.-`` become ``_``)."""
    from .process.lifeline import RUN_ENV   # set by the local launcher, whose runs may sit inside an allocation

    jid = os.environ.get("SLURM_JOB_ID") if not os.environ.get(RUN_ENV) else None
    return _NAME_RE.sub("_", jid or os.path.basename(os.path.abspath(run_dir)) or "run")


def _outcome(text: str) -> str:
    """A failure's outcome as a label: its first words (summary.py's outcome may carry a message after ':' or '(')."""
    return re.split(r"[:(]", text or "none", maxsplit=1)[0].strip() or "none"


def lower_median_ratio(own: dict) -> dict:
    """node -> its own work over the other nodes' lower median (the straggler check's rule, agent/stragglers.py's
    StragglerJudge); a node alone: 1.0. ``own``: node -> own seconds per step."""
    out = {}
    for n, s in own.items():
        others = sorted(v for m, v in own.items() if m != n)
        med = others[(len(others) - 1) // 2] if others else 0.0
        out[n] = s / med if med > 0 else 1.0
    return out


class JobView:
    """The job's view, from ``RUN_DIR/events.jsonl`` read incrementally and ``summary.build_summary`` over it.
    ``refresh(live)`` returns the samples: {metric: [(labels, value)]}, and for a histogram [(labels, buckets, sum,
    count)]. ``live``: what the coordinator knows better than its log (``spares_left``, ``generation``,
    ``own_work``: node -> own seconds per step, the straggler check's fresh figures; ``running``: True while the run
    goes on, so that a failure whose recovery has not resumed training yet is "recovering", not the summary's "not
    recovered"), each optional."""

    def __init__(self, cfg):
        from .rundir import RunDir

        self.cfg = cfg
        self.tail = EventTail(RunDir(cfg.output.run_dir).events)
        self.events: list[dict] = []
        self.first_step: dict | None = None
        self.steps: list[dict] = []
        self.tables: list[dict] = []

    def _read(self) -> None:
        for e in self.tail.poll():
            kind = e.get("event")
            if kind == "step":
                self.first_step = self.first_step or e
                self.steps.append(e)
            elif kind == "node_step_times":
                self.tables.append(e)
            else:
                self.events.append(e)
        del self.steps[:-KEEP_STEPS]
        del self.tables[:-KEEP_TABLES]

    def refresh(self, live: dict | None = None, now: float | None = None) -> dict:
        live = live or {}
        now = time.time() if now is None else now
        self._read()
        steps = ([self.first_step] if self.first_step and self.first_step is not self.steps[0] else []) + self.steps
        s = build_summary(self.events + self.tables + steps, self.cfg)
        out: dict = {}
        last = steps[-1] if steps else {}
        out["deadpool_step"] = [((), s["steps_completed"] or 0)]
        out["deadpool_steps_target"] = [((), self.cfg.train.steps)]
        if last.get("step_s") is not None:
            out["deadpool_step_seconds"] = [((), last["step_s"])]
        recent = [e for e in self.steps if e["t"] >= now - RATE_WINDOW_S]
        if len(recent) >= 2 and recent[-1]["t"] > recent[0]["t"]:
            rate = max(0, recent[-1]["step"] - recent[0]["step"]) / (now - recent[0]["t"])
        else:
            rate = 0.0
        out["deadpool_steps_per_second"] = [((), rate)]
        if last.get("tokens_per_s") is not None:
            out["deadpool_tokens_per_second"] = [((), last["tokens_per_s"])]
        gens = [e.get("generation", 0) for e in self.events if e.get("event") == "decision"]
        out["deadpool_generation"] = [((), live.get("generation", max(gens, default=0)))]
        by: dict = {}
        for f in s["failures"]:
            outcome = _outcome(f.get("outcome"))
            if outcome == "not recovered" and live.get("running"):   # the summary's word for a run that ended there
                outcome = "recovering"
            key = (f.get("cause") or "unknown", outcome)
            by[key] = by.get(key, 0) + 1
        out["deadpool_failures_total"] = [(k, v) for k, v in sorted(by.items())]
        hist = []
        for phase in ("detect", "agree", "rebuild", "restore", "recompute", "total"):
            vals = [f["recovery_s"] if phase == "total" else f["phases"][phase] for f in s["failures"]
                    if f["recovery_s"] is not None]
            vals = [v for v in vals if v is not None]
            hist.append(((phase,), [(b, sum(1 for v in vals if v <= b)) for b in RECOVERY_BUCKETS], sum(vals),
                         len(vals)))
        out["deadpool_recovery_seconds"] = hist
        recomputed = {f["generation"]: f.get("recomputed_steps") or 0 for f in s["failures"]}
        out["deadpool_steps_recomputed_total"] = [((), sum(recomputed.values()))]
        spares = live.get("spares_left", s["spares_left"])
        if spares is not None:
            out["deadpool_spares_left"] = [((), spares)]
        out["deadpool_node_returns_total"] = [((), len(s["returns"]))]
        out["deadpool_node_quarantines_total"] = [((), len(s["quarantined"]))]
        out["deadpool_requeues_total"] = [((), s["requeues"])]
        own = live.get("own_work")
        if own is None and self.tables:   # not the coordinator's memory: its newest logged table
            own = {int(n): f["own_s"] for n, f in self.tables[-1]["nodes"].items()}
        if own:
            out["deadpool_node_own_work_seconds"] = [((str(n),), v) for n, v in sorted(own.items())]
            out["deadpool_node_own_work_ratio"] = [((str(n),), v) for n, v in sorted(lower_median_ratio(own).items())]
        persisted = [e for e in self.events if e.get("event") == "checkpoint_persisted"]
        if persisted:
            out["deadpool_persisted_step"] = [((), persisted[-1]["step"])]
            out["deadpool_persisted_age_seconds"] = [((), max(0.0, now - persisted[-1]["t"]))]
        if self.first_step is not None and s["median_step_s"] and now > self.first_step["t"]:
            done = max(0, (s["steps_completed"] or 0) - self.first_step["step"] + 1)
            wall = (last["t"] if s["completed"] else now) - self.first_step["t"] + self.first_step.get("step_s", 0)
            out["deadpool_goodput_ratio"] = [((), min(1.0, done * s["median_step_s"] / wall) if wall > 0 else 0.0)]
        out["deadpool_run_completed"] = [((), 1 if s["completed"] else 0)]
        return out


def node_samples(node: dict) -> dict:
    """A node's view from what its agent gathered (agent/metrics.py): ``state``, ``generation``, ``committed``
    (rank -> step), ``written`` (rank -> step), ``bytes_total``, ``bytes_per_s``, ``step_s``."""
    out: dict = {"deadpool_node_state": [((node["state"],), 1)],
                 "deadpool_node_generation": [((), node["generation"])],
                 "deadpool_replicated_bytes_total": [((), node["bytes_total"])],
                 "deadpool_replicated_bytes_per_second": [((), node["bytes_per_s"])]}
    committed, written = node.get("committed", {}), node.get("written", {})
    if committed:
        out["deadpool_node_committed_step"] = [((str(r),), c) for r, c in sorted(committed.items())]
        out["deadpool_commit_lag_steps"] = [((str(r),), max(0, written.get(r, c) - c)) for r, c in
                                            sorted(committed.items())]
    if node.get("step_s") is not None:   # (its own work per step is the job's view: deadpool_node_own_work_*)
        out["deadpool_node_step_seconds"] = [((), node["step_s"])]
    return out


def _require():
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise RuntimeError("--metrics-port / --metrics-textfile need the package prometheus-client "
                           "(pip install prometheus-client)") from None
    return prometheus_client


class Exporter:
    """Serves one view: ``source()`` returns its samples (as JobView.refresh / node_samples). ``labels``: added to
    every sample (``deadpool_job``, and ``node`` for a node's view). ``port``: the HTTP endpoint's port (None: none;
    ``start_http`` opens it, so the job's view can move to a new coordinator); ``textfile``: the file to write, in
    full, every REFRESH_S seconds from a thread and at ``close`` (None: none). Raises RuntimeError naming
    prometheus-client when it is missing; OSError when the port cannot be bound."""

    def __init__(self, source, labels: dict, port: int | None = None, textfile: str | None = None):
        pc = _require()
        from prometheus_client.registry import CollectorRegistry

        self.source, self.labels, self.port, self.textfile = source, dict(labels), port, textfile
        self._lock = threading.Lock()
        self._samples: dict = {}
        self._t = 0.0
        self._pc = pc
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.server = None
        self._stop = threading.Event()
        self._thread = None
        if textfile:
            self._thread = threading.Thread(target=self._write_loop, name="deadpool-metrics", daemon=True)
            self._thread.start()

    def start_http(self) -> None:
        if self.server is None and self.port:
            self.server, _ = self._pc.start_http_server(self.port, registry=self.registry)

    def samples(self, max_age: float = 1.0) -> dict:
        with self._lock:
            if time.monotonic() - self._t > max_age:
                self._samples = self.source()
                self._t = time.monotonic()
            return self._samples

    def collect(self):
        """(prometheus-client's Collector) The view's metric families."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        names = list(self.labels)
        for name, rows in self.samples().items():
            kind, labels, doc = METRICS[name]
            cls = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
                   "histogram": HistogramMetricFamily}[kind]
            fam = cls(name, doc, labels=names + list(labels))
            for row in rows:
                values = list(self.labels.values()) + [str(v) for v in row[0]]
                if kind == "histogram":
                    buckets = [("+Inf" if math.isinf(b) else repr(b), n) for b, n in row[1]]
                    fam.add_metric(values, buckets, row[2])
                else:
                    fam.add_metric(values, float(row[1]))
            yield fam

    def write(self) -> None:
        """The textfile, now: written to a temporary file beside it and renamed (prometheus-client's
        write_to_textfile). A failed write (or a view that raised) is tried again at the next refresh."""
        if self.textfile:
            try:
                self.samples(max_age=0.0)
                self._pc.write_to_textfile(self.textfile, self.registry)
            except Exception:  # noqa: BLE001 - a full disk, or a view that failed: the next refresh tries again
                pass

    def _write_loop(self) -> None:
        while not self._stop.wait(0 if not self._t else REFRESH_S):
            self.write()

    def close(self, final: bool = True, timeout: float = 5.0) -> None:
        """Stop the endpoint and the refresh thread; ``final``: write the textfile once more. Waits at most about
        2 x ``timeout`` seconds: a run directory or textfile directory that stopped answering (a blocked read or
        write) leaves a daemon thread behind, never a process that cannot exit."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        if final and self.textfile:
            last = threading.Thread(target=self.write, name="deadpool-metrics-last", daemon=True)
            last.start()
            last.join(timeout=timeout)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

