"""The metrics' pure parts (deadpool_hpc/metrics.py): the dashboard names only metrics the code defines, the
exporter's exposition and textfile, the straggler ratio's rule, and bad --metrics-* values refused (exit 2) before
anything starts. The live run that is scraped over HTTP is tests/e2e/test_metrics_run.py."""
from __future__ import annotations

import json
import os
import re
import stat

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deadpool_hpc import metrics

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = paths.ROOT
DASHBOARD = os.path.join(ROOT, "docs", "grafana-dashboard.json")
# PromQL words that look like metric names but are not (functions, keywords, label names in by/without)
_NAME = re.compile(r"\b(deadpool_[a-z0-9_]+)\b")
_SUFFIX = {"histogram": ("_bucket", "_sum", "_count")}


def _queries(dash: dict) -> list[tuple[str, str]]:
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            out.append((f"variable {v['name']}", q["query"]))
    return out


def _defined(name: str) -> str | None:
    """The METRICS entry a series name in a query belongs to (a histogram's _bucket/_sum/_count), or None."""
    if name in metrics.METRICS:
        return name
    for base, (kind, _, _) in metrics.METRICS.items():
        if any(name == base + s for s in _SUFFIX.get(kind, ())):
            return base
    return None


def test_dashboard_queries_name_only_defined_metrics_and_show_them_all():
    """Every series name in every panel's PromQL (and the job variable's query) is a metric the code defines
    (label names such as deadpool_job are not series names: they sit in braces or by(...)); and every defined
    metric is shown by some panel."""
    with open(DASHBOARD) as fh:
        dash = json.load(fh)
    assert dash["panels"] and all(p.get("targets") for p in dash["panels"])
    used = set()
    for title, expr in _queries(dash):
        bare = re.sub(r"\{[^}]*\}", "", expr)                   # label matchers
        bare = re.sub(r"\b(by|without)\s*\([^)]*\)", "", bare)  # grouping labels
        bare = re.sub(r"\blabel_values\(([^,]+),\s*\w+\)", r"\1", bare)   # Grafana's label_values(metric, label)
        names = _NAME.findall(bare)
        assert names, f"panel {title!r}: no deadpool metric in {expr!r}"
        for n in names:
            base = _defined(n)
            assert base is not None, f"panel {title!r} queries {n!r}, which deadpool_hpc/metrics.py does not define"
            used.add(base)
    assert set(metrics.METRICS) - used == set(), "metrics no panel shows"
    assert "deadpool_job" in dash["templating"]["list"][1]["query"]["query"]


def test_collect_yields_only_defined_names_and_the_textfile_is_atomic(tmp_path):
    """The exporter turns a view's samples into families with the view's own labels on each sample; the textfile
    is replaced whole (no temporary file left beside it) and parses back to the same values."""
    rows = {"deadpool_step": [((), 7)],
            "deadpool_failures_total": [(("exit", "hot swap"), 2)],
            "deadpool_recovery_seconds": [(("detect",), [(b, 1 if b >= 0.5 else 0) for b in metrics.RECOVERY_BUCKETS],
                                          0.4, 1)],
            "deadpool_commit_lag_steps": [(("3",), 1)]}
    path = str(tmp_path / "deadpool_x_job.prom")
    ex = metrics.Exporter(lambda: rows, {"deadpool_job": "x"}, textfile=path)
    try:
        ex.write()
    finally:
        ex.close(final=False)   # (joins the refresh thread: its own write may be in flight until then)
    text = open(path).read()
    assert [p for p in os.listdir(tmp_path)] == ["deadpool_x_job.prom"]
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(fams) == {"deadpool_step", "deadpool_failures", "deadpool_recovery_seconds", "deadpool_commit_lag_steps"}
    (s,) = fams["deadpool_step"].samples
    assert s.value == 7 and s.labels == {"deadpool_job": "x"}
    (f,) = fams["deadpool_failures"].samples
    assert f.name == "deadpool_failures_total" and f.value == 2 and f.labels["cause"] == "exit"
    h = {(x.name, x.labels.get("le")): x.value for x in fams["deadpool_recovery_seconds"].samples}
    assert h[("deadpool_recovery_seconds_bucket", "0.25")] == 0 and h[("deadpool_recovery_seconds_bucket", "0.5")] == 1
    assert h[("deadpool_recovery_seconds_count", None)] == 1 and h[("deadpool_recovery_seconds_sum", None)] == 0.4
    assert fams["deadpool_commit_lag_steps"].samples[0].labels == {"deadpool_job": "x", "rank": "3"}


def test_own_work_ratio_is_the_straggler_checks_rule():
    """Against the *other* nodes' lower median, as agent/stragglers.py's StragglerJudge: with two healthy nodes
    (0.1 s) and a slow one (0.3 s) the slow one is 3 x, each healthy one 1 x (the lower of 0.1 and 0.3)."""
    from deadpool_hpc.agent.stragglers import StragglerJudge

    r = metrics.lower_median_ratio({0: 0.1, 1: 0.3, 2: 0.1})
    assert r == pytest.approx({0: 1.0, 1: 3.0, 2: 1.0})
    j = StragglerJudge(2.0, 1.0, interval=1.0)
    for t in range(3):
        for n, s in ((0, 0.1), (1, 0.3), (2, 0.1)):
            v = j.add(n, 0, s, s, (n,), now=float(t))
    assert v is None and j.add(1, 0, 0.3, 0.3, (1,), now=3.0).ratio == pytest.approx(r[1])


@pytest.mark.parametrize("args, needle", [
    (["--metrics-port", "0"], "argument --metrics-port: '0': accepted: a TCP port 1..65535"),
    (["--metrics-port", "70000"], "argument --metrics-port: '70000': accepted: a TCP port 1..65535"),
    (["--metrics-port", "http"], "argument --metrics-port: 'http': accepted: a TCP port 1..65535"),
    (["--metrics-port", "65534"], "--metrics-port 65534: accepted: a TCP port 1..65531"),   # 4 nodes above it
    (["--metrics-textfile", "/nonexistent/textfile"], "--metrics-textfile '/nonexistent/textfile': no such directory"),
])
def test_bad_metrics_options_exit_2_before_anything_starts(tmp_path, capsys, args, needle):
    from deadpool_hpc.launch.cli import main

    run_dir = tmp_path / "run"
    try:
        code = main(["run", "--run-dir", str(run_dir), "--nodes", "3", "--spares", "1", "--steps", "10", *args])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err, err
    assert not run_dir.exists()


def test_textfile_dir_that_is_a_file_or_read_only_is_refused(tmp_path, capsys):
    from deadpool_hpc.launch.cli import main

    f = tmp_path / "afile"
    f.write_text("")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    cases = [(str(f), "not a directory")] + ([] if os.geteuid() == 0 else [(str(ro), "not writable by this user")])
    for path, why in cases:
        code = main(["run", "--run-dir", str(tmp_path / "run"), "--nodes", "2", "--spares", "0", "--steps", "5",
                     "--metrics-textfile", path])
        err = capsys.readouterr().err
        assert code == 2 and f"--metrics-textfile {path!r}: {why}; accepted: a directory" in err, err
    assert not (tmp_path / "run").exists()


def test_job_name_is_slurms_job_id_or_the_run_dirs_name(monkeypatch):
    monkeypatch.delenv("DEADPOOL_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert metrics.job_name("/x/runs/a b") == "4242"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert metrics.job_name("/x/runs/a b") == "a_b"
