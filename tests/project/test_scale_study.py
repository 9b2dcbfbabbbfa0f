"""The scale study (study/, beside the package): its analysis (study/scale_study.py) on files written as the probes
write them, pure logic; and what its probe (study/probe.py) imports."""
import json
import math
import os
import subprocess
import sys

import pytest

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = paths.ROOT
sys.path.insert(0, ROOT)  # study/ is not installed with the package: it runs from the checkout

from study import scale_study  # noqa: E402


def _write(path, obj):
    path.write_text(json.dumps(obj))


def _run(d, n, t0=1000.0, hop=0.01, coord_ms=2.0):
    d.mkdir()
    for r in range(n):
        _write(d / f"steady-{r}.json", {"mpi_rank": r, "pid": 1, "size": n, "watch_k": 2, "window_s": 10.0,
                                        "sent_per_s": 10.0, "received_per_s": 10.0, "cpu_per_s": 0.002,
                                        "suspected": []})
    for gen, (name, victim, lag) in enumerate((("crash", n // 2, 0.005), ("freeze", 0, 1.0)), start=1):
        t = t0 + 100 * gen
        _write(d / f"fault-{name}.json", {"fault": name, "rank": victim, "t": t, "signal": "SIGKILL"})
        live = [r for r in range(n) if r not in (n // 2, 0)[:gen]]
        depth = math.ceil(math.log2(n))
        for i, r in enumerate(live):
            knew = t + lag + hop * (i % (depth + 1))
            _write(d / f"recovery-{r}-{gen}.json", {
                "mpi_rank": r, "generation": gen, "knew": {str(victim): knew}, "t_decided": t + lag + 0.1,
                "applied": t + lag + 0.12, "coordinator": live[0], "recovery_cpu_s": (coord_ms if r == live[0] else 1) / 1e3})


def test_a_run_directory_becomes_one_row_of_phases(tmp_path):
    _run(tmp_path / "ring-16", 16)
    row = scale_study.row(str(tmp_path / "ring-16"))
    assert row["n"] == 16 and row["topology"] == "ring" and row["false_suspicions"] == 0
    assert row["sent_per_s"] == 10.0 and row["cpu_pct"] == pytest.approx(0.2) and row["cpu_total_pct"] == pytest.approx(3.2)
    assert row["crash_detect_s"] == pytest.approx(0.005) and row["crash_disseminate_s"] == pytest.approx(0.04)
    assert row["crash_total_s"] == pytest.approx(0.125) and row["crash_agents"] == 15
    assert row["freeze_detect_s"] == pytest.approx(1.0) and row["freeze_agents"] == 14
    assert row["crash_coordinator_cpu_ms"] == pytest.approx(2.0)


def test_missing_recoveries_are_named_not_guessed(tmp_path):
    _run(tmp_path / "ring-8", 8)
    (tmp_path / "ring-8" / "recovery-3-2.json").unlink()
    row = scale_study.row(str(tmp_path / "ring-8"))
    assert row["freeze_error"] == "5 of 6 agents applied generation 2" and "crash_total_s" in row


def test_fits_model_and_projection(tmp_path):
    rows = []
    for n in (8, 16, 32, 64):
        _run(tmp_path / f"ring-{n}", n, coord_ms=1.0 + 0.1 * n)
        rows.append(scale_study.row(str(tmp_path / f"ring-{n}")))
    out = scale_study.report(rows, str(tmp_path / "out"))
    coord = out["model"]["coordinator_s"]
    assert coord["model"] == "a + b*N" and coord["b"] == pytest.approx(1e-4) and coord["a"] == pytest.approx(1e-3)
    assert out["model"]["hop_s"] == pytest.approx(0.01)
    p = out["projection"]["512"]
    assert p["gpus"] == 4096 and p["total_s"] == pytest.approx(p["control_plane_s"] + p["nccl_init_s"] + p["restore_s"], abs=2e-3)
    assert (tmp_path / "out" / "scale.csv").read_text().count("\n") == 5
    assert [r["n"] for r in rows] == [int(d.rsplit("-", 1)[1]) for d in scale_study.sweep_dirs(str(tmp_path))]
    assert scale_study.fit([1, 2, 4, 8], [3, 4, 5, 6])["model"] == "a + b*log2(N)"


def test_the_slurm_sweeps_study_reads_the_probe_directories(tmp_path, capsys):
    """``python -m study.scale_study OUT_DIR`` (sbatch/scaling.sbatch, MODE=control-plane): the cp-n<N> directories
    of the sweep; exit 0 when every size recovered from both faults, 1 when there is nothing to study."""
    assert scale_study.main([str(tmp_path)]) == 1
    _run(tmp_path / "cp-n8", 8)
    capsys.readouterr()
    assert scale_study.main([str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["n"] for r in out["sizes"]] == [8] and (tmp_path / "scale.csv").exists()


@pytest.mark.e2e
def test_the_control_plane_probe_does_not_import_torch():
    """256 probes share one machine in the scale study: torch in each (~150 MB) does not fit its memory (the
    kernel's OOM killer ended a 128-agent run when the probe imported torch through dataplane.groups)."""
    code = ("import sys, study.probe, study.scale_study, deadpool_hpc.control.plane; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
