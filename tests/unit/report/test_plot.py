"""``deadpool plot`` and ``deadpool status --png`` (deadpool_hpc/report/, issue 46): a run's timeline drawn from a
real run's event log, and checked against that run's own summary and events.

One 3 + 2 run with a kill, a hang and a straggler (``--kill node1@8 --hang rank2@16 --slow node0@24:4``, straggler
window 1 s, a background persist every second) is drawn by the command itself; the marks it drew are counted from
the figure's artists and compared with the summary (failures, swaps, returns, straggler verdicts, persisted
checkpoints) and with the faults injected. The pure parts (the steps/s curve, the phase spans) are checked on
hand-made event lists."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deadpool_hpc.report import timeline
from deadpool_hpc.summary import PHASES
from runs import run_events, run_faults

KHS = ("kill node1@8", "hang rank2@16", "slow node0@24:4")   # the run's faults: one of each
KHS_SETTINGS = dict(steps=40, hang_timeout=2.0, straggler_factor=2.0, straggler_window=1.0, persist_every=1.0)


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def khs_run(tmp_path_factory):
    """(run directory, summary) of the 3 + 2 run with a kill, a hang and a straggler."""
    tmp = tmp_path_factory.mktemp("plot")
    s = run_faults(tmp, "khs", *KHS, **KHS_SETTINGS)
    return tmp / "khs", s


@pytest.mark.e2e
def test_the_timeline_of_a_run_with_a_kill_a_hang_and_a_straggler(khs_run, tmp_path):
    run_dir, s = khs_run
    assert s["completed"], s
    events = run_events(run_dir)
    injected = [e for e in events if e["event"] == "fault_injected"]
    assert sorted(e["kind"] for e in injected) == ["hang", "kill", "slow"], injected
    out = tmp_path / "timeline.png"
    p = cli("plot", str(run_dir), "-o", str(out))
    assert p.returncode == 0, p.stderr
    # the picture exists and decodes to an image of the figure's size (12 x 6.5 in at 100 dpi)
    import matplotlib.image

    img = matplotlib.image.imread(str(out))
    assert img.shape[:2] == (650, 1200) and img.std() > 0.05, img.shape
    # what was drawn, counted from the figure's artists (the same function the command ran)
    from deadpool_hpc.report.plot import plot_run

    path, tl, drawn = plot_run(str(run_dir), str(tmp_path / "again.svg"))
    assert os.path.getsize(path) > 10_000
    assert drawn["fault"] == len(injected) == 3, (drawn, [m.label for m in tl.marks])
    assert {m.label for m in tl.of("fault")} == {"kill node1@8", "hang rank2@16", "slow node0@24"}
    # every failure a spare took over (the kill's and the hang's hot swaps, the straggler's planned swap if a
    # spare was free for it) is a swap mark, at the moment training resumed
    assert drawn["swap"] == s["swaps"] >= 2, (drawn, s["failures"])
    assert drawn["decision"] == len({e["generation"] for e in events if e["event"] == "decision"}) >= 2
    assert drawn["return"] == len(s["returns"]) >= 1, s["returns"]   # node2, whose rank hung, came back
    assert drawn["straggler"] == len(s["stragglers"]) >= 1, s["stragglers"]
    assert {x["node"] for x in s["stragglers"]} >= {0}, s["stragglers"]
    # (a background persist round is committed only when every node gets to it before its ranks move on: in so short a
    # run on shared cores there may be none)
    assert drawn["persist"] == len(s["persist"]["committed"]) == sum(e["event"] == "checkpoint_persisted"
                                                                     for e in events), s["persist"]
    # each failure's recovery phases, end to end from its fault: as many spans as phases of more than 0 s, and
    # together as long as the failure's recovery
    recovered = [f for f in s["failures"] if f["recovery_s"] is not None]
    assert len(recovered) >= 2
    assert sum(drawn["phases"].values()) == sum(1 for f in recovered for p in PHASES if f["phases"][p] > 0)
    for i, f in enumerate(s["failures"]):
        mine = [sp for sp in tl.spans if sp.failure == i]
        if f["recovery_s"] is None:
            continue
        assert mine[0].t0 == pytest.approx(f["t_fault"]) and all(a.t1 <= b.t0 + 1e-9 for a, b in zip(mine, mine[1:]))
        assert mine[-1].t1 - mine[0].t0 == pytest.approx(f["recovery_s"], abs=1e-6), (f, mine)
    # the curve: training before the first fault, stopped (0 steps/s) somewhere in the hang's detection (it lasts
    # --hang-timeout, 2 s), and as many steps under it as the run did (its steps and those recomputed)
    t_first = min(e["t"] for e in events if e["event"] == "step")
    before = [r for t, r in zip(tl.times, tl.rates) if t_first <= t <= min(e["t"] for e in injected)]
    hang = next(f for f in s["failures"] if f["kind"] == "hang")
    during = [r for t, r in zip(tl.times, tl.rates) if hang["t_fault"] < t < hang["t_fault"] + hang["phases"]["detect"]]
    assert before and max(before) > 0 and during and min(during) == 0, (before, during)
    done = KHS_SETTINGS["steps"] + sum(f["recomputed_steps"] or 0 for f in s["failures"])
    assert sum(tl.rates) * (tl.times[1] - tl.times[0]) == pytest.approx(done, rel=0.1), done
    # each fault's mark sits at its fault_injected time, within the drawn span of the run
    assert sorted(m.t for m in tl.of("fault")) == sorted(e["t"] for e in injected)
    assert all(tl.t0 <= m.t <= tl.t_end for m in tl.marks)
    # deadpool status --png: the summary table, and the same picture (a Slurm job's run directory is found from
    # its id by the same command: tests/slurm exercise that lookup)
    p = cli("status", str(run_dir), "--png", str(tmp_path / "status.png"))
    assert p.returncode == 0 and "recoveries (seconds)" in p.stdout and "timeline of khs" in p.stdout, p
    assert matplotlib.image.imread(str(tmp_path / "status.png")).shape[:2] == (650, 1200)


@pytest.mark.e2e
def test_plot_refuses_what_is_not_a_run_directory(tmp_path):
    """Exit 2 naming the directory and what is expected, before anything is drawn or written."""
    (tmp_path / "notarun").mkdir()
    (tmp_path / "notarun" / "config.json").write_text("{}")
    p = cli("plot", str(tmp_path / "notarun"))
    assert p.returncode == 2, p.stderr
    assert f"{str(tmp_path / 'notarun')!r} is not a run directory: it holds no events.jsonl" in p.stderr, p.stderr
    assert os.listdir(tmp_path / "notarun") == ["config.json"]
    p = cli("plot", str(tmp_path / "missing"))
    assert p.returncode == 2 and "no such directory" in p.stderr, p.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "events.jsonl").write_text("")
    p = cli("plot", str(empty))
    assert p.returncode == 2 and "holds no event yet" in p.stderr, p.stderr
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps({"t": 1.0, "event": "hello", "pid": 1}) + "\n")
    for bad, why in (("x.jpg", "unknown picture format"), (str(tmp_path), "is a directory"),
                     (str(tmp_path / "no" / "x.png"), "is not a directory")):
        p = cli("plot", str(run), "-o", bad, cwd=tmp_path)
        assert p.returncode == 2 and f"-o {bad!r}: " in p.stderr and why in p.stderr, p.stderr
    p = cli("status", str(run), "--png", "x.gif", cwd=tmp_path)
    assert p.returncode == 2 and "--png 'x.gif': unknown picture format" in p.stderr, p.stderr


def test_a_missing_matplotlib_is_named_with_its_install_command(tmp_path, monkeypatch, capsys):
    """matplotlib is the ``plot`` extra: without it the command says so and how to install it (exit 2)."""
    from deadpool_hpc.launch.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps({"t": 1.0, "event": "hello", "pid": 1}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)   # what an environment without it imports
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib, which is not installed" in err and "pip install 'deadpool-hpc[plot]'" in err, err
    assert not (run / "timeline.png").exists()


def steps(*pairs, gen=0):
    return [{"t": t, "event": "step", "step": s, "generation": gen} for t, s in pairs]


def test_steps_per_second_counts_the_steps_between_logged_steps_and_recomputed_ones():
    # 10 steps/s for 10 s, logged every 2nd step (--log-every 2): 10 steps/s, not 5
    ev = steps(*((0.2 * i, 2 * i + 1) for i in range(51)))
    times, rates, w = timeline.step_rate(ev, window_s=2.0)
    mid = [r for t, r in zip(times, rates) if 2 < t < 8]
    # (a window holds 10 or 11 logged steps, as its edges fall on them or between)
    assert w == 2.0 and mid and all(9.0 <= r <= 11.0 for r in mid) and sum(mid) / len(mid) == pytest.approx(10, 0.05)
    # a recovery at t=5 back to step 20 (its cut): the steps after it count from the cut, as work done
    ev = steps(*((0.1 * i, i + 1) for i in range(50)))   # steps 1..50 up to t=4.9
    ev += [{"t": 5.5, "event": "decision", "generation": 1, "t_decided": 5.5, "cut_step": 20}]
    ev += steps(*((6.0 + 0.1 * i, 21 + i) for i in range(40)), gen=1)
    times, rates, w = timeline.step_rate(ev, window_s=1.0)
    at = lambda x: rates[min(range(len(times)), key=lambda i: abs(times[i] - x))]   # noqa: E731
    assert 9 <= at(3.0) <= 11 and at(5.45) == 0.0 and 9 <= at(8.0) <= 11, (at(3), at(8))
    # the default window: 10 x the median gap between step events (0.1 s), at least 0.5 s
    assert timeline.step_rate(ev)[2] == pytest.approx(1.0)


def test_phase_spans_are_laid_end_to_end_and_stop_at_a_phase_not_timed():
    s = {"failures": [
        {"t_fault": 100.0, "phases": {"detect": 1.0, "agree": 0.5, "rebuild": 0.25, "restore": 0.0, "recompute": 2.0}},
        {"t_fault": 200.0, "phases": {"detect": 3.0, "agree": 1.0, "rebuild": None, "restore": None, "recompute": 1.0}},
    ]}
    got = [(sp.failure, sp.phase, sp.t0, sp.t1) for sp in timeline.spans(s)]
    assert got == [(0, "detect", 100.0, 101.0), (0, "agree", 101.0, 101.5), (0, "rebuild", 101.5, 101.75),
                   (0, "recompute", 101.75, 103.75),   # restore took 0 s: no span, the next starts where it ended
                   (1, "detect", 200.0, 203.0), (1, "agree", 203.0, 204.0)]
