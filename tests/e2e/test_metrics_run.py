"""A live local run with --metrics-port and --metrics-textfile (deadpool_hpc/metrics.py, agent/metrics.py), scraped
over HTTP while it trains, through a node kill and its recovery, and its textfiles read at the end: the numbers are
the run's summary.json's. One run of about 25 s (3 + 1 nodes, 48 paced steps, node1 killed at step 16)."""
from __future__ import annotations

import os
import random
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deadpool_hpc.config import RunConfig
from runs import faults, launch_reaped

pytestmark = pytest.mark.e2e   # every test launches a run (tests/README.md)

STEPS = 48


def _free_ports(n: int) -> int:
    """A port P with P..P+n-1 all free on this machine now."""
    for _ in range(200):
        base = random.randint(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


def _parse(text: str) -> dict:
    """{(sample name, frozenset(labels without deadpool_job)): value}"""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "deadpool_job"))] = s.value
    return out


def _scrape(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return _parse(r.read().decode())
    except OSError:
        return None


def _one(m: dict, name: str, **labels) -> float | None:
    """The value of the sample ``name`` with exactly ``labels`` (besides deadpool_job; a node's view has ``node``)."""
    return m.get((name, frozenset((k, str(v)) for k, v in labels.items())))


def test_live_run_is_scraped_and_its_metrics_match_the_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("DEADPOOL_TEST_STEP_S", "0.15")
    port = _free_ports(5)
    textdir = tmp_path / "textfiles"
    textdir.mkdir()
    cfg = RunConfig(nodes=3, spares=1, steps=STEPS, run_dir=str(tmp_path / "run"), faults=faults("kill node1@16"),
                    train_fn="trainfns:paced", persist_every=1.0, rendezvous_timeout=4.0, metrics_port=port,
                    metrics_textfile=str(textdir)).validate()
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(summary=launch_reaped(cfg, 150)))
    t.start()
    job, nodes = [], {}
    try:
        while t.is_alive():
            m = _scrape(port)
            if m is not None:
                job.append((time.time(), m))
            for i in (0, 2, 3):   # node1 is killed
                n = _scrape(port + 1 + i)
                if n is not None and _one(n, "deadpool_node_state", node=i, state="training"):
                    nodes[i] = n
            time.sleep(0.2)
    finally:
        t.join()
    s = result["summary"]
    assert s["completed"] and s["steps_completed"] == STEPS, s
    (f,) = s["failures"]
    # a whole node lost (its agent too): no agent saw a cause; the label says "unknown"
    assert f["outcome"] == "hot swap" and f["cause"] is None and f["recovery_s"] > 0
    # while it ran: the job's endpoint counted the steps up, and saw the failure and its recovery
    assert len(job) >= 10, f"only {len(job)} scrapes of the job's endpoint answered"
    steps = [_one(m, "deadpool_step") for _, m in job]
    assert steps == sorted(steps) and steps[0] < STEPS // 2 and max(steps) >= STEPS - 8, steps
    before = [m for _, m in job if _one(m, "deadpool_step") < 16]
    assert before and _one(before[0], "deadpool_spares_left") == 1 and _one(before[0], "deadpool_generation") == 0
    assert _one(before[0], "deadpool_failures_total", cause="unknown", outcome="hot swap") is None
    assert any((_one(m, "deadpool_steps_per_second") or 0) > 0 for _, m in job)
    assert any(_one(m, "deadpool_tokens_per_second") for _, m in job), "the demo's step returns tokens"
    # near the end: the last answer of the job's endpoint agrees with summary.json
    last = job[-1][1]
    assert _one(last, "deadpool_failures_total", cause="unknown", outcome="hot swap") == 1
    assert _one(last, "deadpool_spares_left") == s["spares_left"] == 0
    assert _one(last, "deadpool_generation") == f["generation"] == 1
    assert _one(last, "deadpool_recovery_seconds_count", phase="total") == 1
    assert abs(_one(last, "deadpool_recovery_seconds_sum", phase="total") - f["recovery_s"]) < 1e-6
    assert _one(last, "deadpool_steps_recomputed_total") == f["recomputed_steps"]
    assert STEPS - 8 <= _one(last, "deadpool_step") <= s["steps_completed"]
    # each training node's own endpoint: its ranks' replicas committed, bytes acknowledged
    assert set(nodes) >= {0, 2}, sorted(nodes)
    for i, n in nodes.items():
        assert _one(n, "deadpool_replicated_bytes_total", node=i) > 0, i
        committed = [v for (name, _), v in n.items() if name == "deadpool_node_committed_step"]
        assert committed and min(committed) > 0, (i, committed)
    # the textfiles, as the agents left them at their exit: exactly the summary's numbers
    files = sorted(f for f in os.listdir(textdir) if f.endswith(".prom"))   # (a killed agent may leave a temporary)
    assert files == ["deadpool_run_job.prom"] + [f"deadpool_run_node{i}.prom" for i in range(4)], files
    end = _parse((textdir / "deadpool_run_job.prom").read_text())
    assert _one(end, "deadpool_step") == s["steps_completed"] == STEPS
    assert _one(end, "deadpool_run_completed") == 1
    assert _one(end, "deadpool_failures_total", cause="unknown", outcome="hot swap") == 1
    assert _one(end, "deadpool_spares_left") == s["spares_left"]
    assert _one(end, "deadpool_generation") == f["generation"]
    for phase, secs in f["phases"].items():
        assert abs(_one(end, "deadpool_recovery_seconds_sum", phase=phase) - secs) < 1e-6, phase
    assert _one(end, "deadpool_steps_recomputed_total") == f["recomputed_steps"]
    assert _one(end, "deadpool_node_returns_total") == len(s["returns"])
    assert _one(end, "deadpool_node_quarantines_total") == len(s["quarantined"])
    assert s["persist"]["committed"], "--persist-every 1 persisted nothing"
    assert _one(end, "deadpool_persisted_step") == s["persist"]["committed"][-1]
    assert 0 < _one(end, "deadpool_goodput_ratio") < 1
    node0 = _parse((textdir / "deadpool_run_node0.prom").read_text())
    assert _one(node0, "deadpool_node_generation", node=0) == f["generation"]
    assert _one(node0, "deadpool_replicated_bytes_total", node=0) > 0
