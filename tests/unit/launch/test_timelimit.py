"""The time limit and the signal lead (issue 46, launch/timelimit.py), without a cluster: Slurm's --time formats, the
lead checked against the limit at submission (refused with the reason, never shortened), and how an attempt that
was stopped before its first step ends (requeued from the same checkpoint, a bounded number of times in a row).

The --time values and what Slurm makes of them were read from sbatch 22.05 on the local cluster (``sbatch --hold
--time=X``, then scontrol's TimeLimit); tests/slurm/test_slurm_timelimit.py checks them against sbatch again, and
runs the refusal and the early signal on the cluster."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from deadpool_hpc.config import RunConfig
from deadpool_hpc.errors import ConfigError
from deadpool_hpc.launch import slurm, timelimit

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = paths.ROOT

# --time value -> seconds as Slurm applies it (None: no limit); each read from sbatch 22.05 (TimeLimit)
SLURM_TIMES = {
    "2": 120, "02": 120, "2:00": 120, "00:02:00": 120, "0:30": 60, "0:61": 120, "1:99": 180, "0:0:30": 60,
    "1-00:00:00": 86400, "1-0": 86400, "1-": 86400, "1-24": 172800, "1-2:30": 95400, "1-2:3:4": 93840,
    "1-0:0:1": 86460, "0": None, "0:00": None, "00:00:00": None, "0-0": None, "-1": None, "UNLIMITED": None,
    "infinite": None,
}
# refused by sbatch 22.05 too ("Invalid --time specification"), except "-2", which sbatch takes as a 2982614-day limit
BAD_TIMES = ["2:00:00:00", "abc", "1.5", " 2", "2m", "2:", ":2", "1-2:3:", "1-2-3", "+2", "1:2:3:4", "1-2:3:4:5",
             "0x10", "", "-2"]


@pytest.mark.parametrize("text, seconds", sorted(SLURM_TIMES.items()))
def test_slurm_time_formats(text, seconds):
    assert timelimit.parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", BAD_TIMES)
def test_a_bad_time_is_refused_naming_it(text):
    with pytest.raises(ConfigError) as info:
        timelimit.parse_time_limit(text)
    assert f"--time {text!r} is not a Slurm time limit; accepted (Slurm's --time formats): MINUTES" in str(info.value)


def test_signal_option():
    assert timelimit.parse_signal("USR2@120") == ("SIGUSR2", 120)
    assert timelimit.parse_signal("B:USR2@30") == ("SIGUSR2", 30)
    assert timelimit.parse_signal("SIGTERM") == ("SIGTERM", 60)  # Slurm's default lead
    assert timelimit.parse_signal("12@90") == ("SIGUSR2", 90)
    for bad in ("USR9@1", "B:@1", "USR2@x"):
        with pytest.raises(ConfigError, match=re.escape(f"--signal {bad!r}: accepted")):
            timelimit.parse_signal(bad)
    assert timelimit.sbatch_option(["-t", "5", "--time=7"], "time", "t") == "7"   # sbatch applies the last
    assert timelimit.sbatch_option(["-t5"], "time", "t") == "5"
    assert timelimit.sbatch_option(["--test-only", "--signal", "B:USR2@9"], "signal") == "B:USR2@9"
    assert timelimit.sbatch_option(["--partition=x"], "time", "t") is None


def test_the_lead_and_the_limit():
    """--time 2 with the template's 120 s: refused, with both ways out; the boundary (limit - lead = 90 s) holds."""
    with pytest.raises(ConfigError) as info:
        slurm.check_time_and_lead("2")
    msg = str(info.value)
    assert msg.startswith("--time 2 (120 s) leaves no time to train before the signal: --signal-lead 120 asks Slurm "
                          "for SIGUSR2 120 s before the time limit"), msg
    assert "would be told to stop as soon as it starts" in msg
    assert "accepted: --signal-lead 30 or less (at least 10) with --time 2, or --time 4 or more with " \
           "--signal-lead 120" in msg
    assert slurm.check_time_and_lead("2", 30) == (120, 30)
    assert slurm.check_time_and_lead("00:02:00", 30) == (120, 30)
    with pytest.raises(ConfigError, match=r"--signal-lead 31 asks .* stop 29 s after it starts, at the earliest"):
        slurm.check_time_and_lead("2:00", 31)
    assert slurm.check_time_and_lead("4") == (240, 120)
    with pytest.raises(ConfigError, match=r"accepted: --signal-lead 90 or less .* with --time 3, or --time 4"):
        slurm.check_time_and_lead("3")
    # a limit too short for any lead: only the longer time limit is offered
    with pytest.raises(ConfigError, match=r"accepted: --time 2 or more with --signal-lead 10 \("):
        slurm.check_time_and_lead("1", 10)
    assert slurm.check_time_and_lead("1-00:00:00") == (86400, 120)
    assert slurm.check_time_and_lead("UNLIMITED") == (None, 120) and slurm.check_time_and_lead(None) == (None, 120)
    with pytest.raises(ConfigError, match=r"--time 'bogus' is not a Slurm time limit"):
        slurm.check_time_and_lead("bogus", 30)


def test_where_the_limit_and_the_lead_come_from():
    """sbatch applies the last --time, and a --signal on its command line over the template's line: so does the
    check. No --time: the partition's DefaultTime, else its MaxTime."""
    with pytest.raises(ConfigError, match=r"^--sbatch-arg=--time=2 \(120 s\)"):
        slurm.check_time_and_lead("60", None, ["-t", "2"])
    with pytest.raises(ConfigError, match=r"--sbatch-arg=--signal=B:USR2@120 asks Slurm for SIGUSR2 .* accepted: "
                                          r"--sbatch-arg=--signal=B:USR2@30 or less"):
        slurm.check_time_and_lead("2", None, ["--signal=B:USR2@120"])
    assert slurm.check_time_and_lead("2", None, ["--signal=B:USR2@30"]) == (120, 30)
    with pytest.raises(ConfigError, match=r"--signal-lead 30 and --sbatch-arg=--signal=USR2@20 both set the warning "
                                          r"signal; accepted: one of them"):
        slurm.check_time_and_lead("2", 30, ["--signal=USR2@20"])
    part = {"partition": "debug", "default_time": "00:02:00", "max_time": "UNLIMITED"}
    with pytest.raises(ConfigError, match=r"^the time limit of partition 'debug' \(DefaultTime=00:02:00; no --time "
                                          r"given\) \(120 s\) .* accepted: --signal-lead 30 or less \(at least 10\) "
                                          r"with that time limit, or --time 4"):
        slurm.check_time_and_lead(None, None, None, part)
    assert slurm.check_time_and_lead(None, None, None, dict(part, default_time="NONE", max_time="1:00:00")) == \
        (3600, 120)
    assert slurm.check_time_and_lead(None, None, None, dict(part, default_time="NONE")) == (None, 120)


def test_signal_lead_values():
    assert timelimit.signal_lead("30") == 30
    for bad in ("5", "9", "x", "1.5", "65536", "-1"):
        with pytest.raises(ConfigError, match=re.escape(f"--signal-lead {bad!r}: accepted: whole seconds from 10")):
            timelimit.signal_lead(bad)


def test_the_template_lead_is_the_default_and_render_sets_it(tmp_path):
    assert slurm.template_lead() == timelimit.DEFAULT_SIGNAL_LEAD_S == 120
    cfg = RunConfig(nodes=2, spares=1, steps=5, run_dir=str(tmp_path / "r"))
    assert re.search(r"(?m)^#SBATCH --signal=USR2@120$", slurm.render(cfg))
    text = slurm.render(cfg, signal_lead=30)
    assert re.search(r"(?m)^#SBATCH --signal=USR2@30$", text) and "USR2@120\n" not in text


def _cli(capsys, *args):
    """``deadpool submit ARGS`` in this process: (exit status, stderr)."""
    from deadpool_hpc.launch import cli

    try:
        rc = cli.main(["submit", *args])
    except SystemExit as exc:   # argparse's refusal
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.e2e
def test_deadpool_submit_refuses_before_writing_anything(tmp_path, capsys):
    """Exit 2 with the reason, before any file is written or sbatch is run (the refusal comes before both; with or
    without a cluster: check_partition answers None where Slurm cannot be asked)."""
    run_dir = tmp_path / "r"
    rc, err = _cli(capsys, "--nodes", "2", "--spares", "1", "--steps", "100000", "--run-dir", str(run_dir),
                   "--time", "2")
    assert rc == 2 and "deadpool: error: --time 2 (120 s) leaves no time to train" in err, err
    assert not run_dir.exists()
    rc, err = _cli(capsys, "--run-dir", str(run_dir), "--time", "2", "--signal-lead", "5")
    assert rc == 2 and "argument --signal-lead: '5': accepted: whole seconds from 10" in err, err
    rc, err = _cli(capsys, "--run-dir", str(run_dir), "--time", "2 hours")
    assert rc == 2 and "--time '2 hours' is not a Slurm time limit" in err, err
    assert not run_dir.exists()


# ---- how an attempt stopped before its first step ends (slurm_job.settle; Slurm is faked: pure logic) -------------
def _settle(tmp_path, monkeypatch, events, state=("RUNNING", "None"), since=10.0):
    from deadpool_hpc.events import EventLog
    from deadpool_hpc.launch import slurm_job

    slurm.write_config(RunConfig(nodes=2, spares=1, steps=500, run_dir=str(tmp_path)))
    (tmp_path / "checkpoint").mkdir(exist_ok=True)
    (tmp_path / "checkpoint" / "LATEST").write_text('{"step": 88}')
    log = EventLog(str(tmp_path / "events.jsonl"))
    for e in events:
        log.emit(e.pop("event"), **e)
    log.close()
    ran = []
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(slurm_job, "job_state", lambda job: state)
    monkeypatch.setattr(slurm_job, "time_limit_of", lambda job: "00:02:00")
    monkeypatch.setattr(slurm_job.subprocess, "run",
                        lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    how = slurm_job.settle(str(tmp_path), since=since)
    from deadpool_hpc.events import read_events
    return how, ran, list(read_events(str(tmp_path / "events.jsonl")))


SKIPPED = {"event": "checkpoint_skipped", "t": 11.0, "step": 88, "generation": 1, "reason": "preempted",
           "fresh": [0, 1], "why": "no rank has trained a step yet"}


def test_an_attempt_stopped_before_its_first_step_is_requeued_from_the_same_checkpoint(tmp_path, monkeypatch):
    """Issue 46: the requeued attempt got SIGUSR2 before its first step, skipped its (empty) checkpoint, and the job
    ended FAILED. Now: requeued (``idle``), LATEST untouched, so it resumes at step 88 again."""
    how, ran, ev = _settle(tmp_path, monkeypatch, [
        {"event": "checkpoint_saved", "t": 1.0, "step": 88, "reason": "preempted"},
        {"event": "requeued", "t": 2.0, "attempt": 1, "reason": "preempted"}, dict(SKIPPED)])
    assert how == {"action": "requeued", "reason": "preempted", "idle": True}
    assert ran == [["scontrol", "requeue", "42"]]
    req = [e for e in ev if e["event"] == "requeued"][-1]
    assert (req["attempt"], req["idle"], req["checkpoint"]) == (2, True, {"step": 88})
    assert json.loads((tmp_path / "checkpoint" / "LATEST").read_text()) == {"step": 88}


def test_idle_attempts_in_a_row_are_bounded(tmp_path, monkeypatch):
    """After MAX_IDLE_REQUEUES idle requeues in a row, the next idle attempt ends the job with the reason (not
    requeued for ever); a requeue that made progress in between resets the count."""
    from deadpool_hpc.launch import slurm_job

    idle = [{"event": "requeued", "t": 2.0 + i, "attempt": 2 + i, "reason": "preempted", "idle": True}
            for i in range(slurm_job.MAX_IDLE_REQUEUES)]
    how, ran, ev = _settle(tmp_path, monkeypatch, [
        {"event": "requeued", "t": 1.0, "attempt": 1, "reason": "preempted"}, *idle, dict(SKIPPED, t=20.0)],
        since=19.0)
    assert how["action"] == "stopped" and ran == [], how
    stopped = [e for e in ev if e["event"] == "stopped"][-1]
    assert stopped["reason"].startswith(f"{slurm_job.MAX_IDLE_REQUEUES + 1} attempts in a row were stopped before "
                                        f"their first step (each at step 88): the job makes no progress in its time "
                                        f"limit of 00:02:00"), stopped
    assert "the checkpoint of step 88 is kept (a new job with RESUME=1" in stopped["reason"]
    assert "accepted: a longer --time or a shorter --signal-lead" in stopped["reason"]
    assert stopped["checkpoint"] == {"step": 88}


def test_idle_count_is_reset_by_progress(tmp_path, monkeypatch):
    from deadpool_hpc.launch import slurm_job

    idle = [{"event": "requeued", "t": 2.0 + i, "attempt": 2 + i, "reason": "preempted", "idle": True}
            for i in range(slurm_job.MAX_IDLE_REQUEUES)]
    how, ran, _ev = _settle(tmp_path, monkeypatch, [
        *idle, {"event": "requeued", "t": 9.0, "attempt": 9, "reason": "preempted"}, dict(SKIPPED, t=20.0)],
        since=19.0)
    assert how["action"] == "requeued" and how.get("idle") and ran == [["scontrol", "requeue", "42"]], how


def test_an_idle_attempt_at_the_time_limit_is_not_requeued(tmp_path, monkeypatch):
    how, ran, ev = _settle(tmp_path, monkeypatch, [dict(SKIPPED)], state=("COMPLETING", "TimeLimit"))
    assert how["action"] == "stopped" and ran == [], how
    assert [e for e in ev if e["event"] == "stopped"][-1]["reason"] == \
        "time limit, and this attempt made no progress (stopped before its first step, at step 88)"


def test_submitit_checkpoint_requeues_an_attempt_stopped_before_its_first_step(tmp_path, monkeypatch):
    """HotSwapJob.checkpoint() (submitit's hook on SIGUSR2) waited for a checkpoint_saved that never comes when the
    signal beats the first step, then let submitit end the job. Now a new checkpoint_skipped requeues it (``idle``),
    MAX_IDLE_REQUEUES times in a row; the next one is ``stopped`` with the reason and not requeued (None)."""
    pytest.importorskip("submitit")
    from submitit.helpers import DelayedSubmission

    from deadpool_hpc.events import EventLog, read_events
    from deadpool_hpc.launch import slurm_job
    from deadpool_hpc.launch.submitit_job import HotSwapJob

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(slurm_job, "time_limit_of", lambda job: "00:02:00")
    job = HotSwapJob(RunConfig(nodes=2, spares=1, steps=500, run_dir=str(tmp_path)), checkpoint_wait_s=2.0)
    path = str(tmp_path / "events.jsonl")
    # checkpoint() ignores SIGTERM from the requeue on (submitit's scontrol must outlive it): not in this process
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)
    for i in range(slurm_job.MAX_IDLE_REQUEUES + 1):
        job._saved_before = len([e for e in read_events(path) if e["event"] == "checkpoint_saved"]) \
            if os.path.exists(path) else 0
        job._skipped_before = len([e for e in read_events(path) if e["event"] == "checkpoint_skipped"]) \
            if os.path.exists(path) else 0
        log = EventLog(path)
        log.emit("checkpoint_skipped", step=88, generation=3, reason="preempted")
        log.close()
        got = job.checkpoint()
        ev = list(read_events(path))
        if i < slurm_job.MAX_IDLE_REQUEUES:
            assert isinstance(got, DelayedSubmission) and ev[-1]["event"] == "requeued" and ev[-1]["idle"] is True
        else:
            assert got is None and ev[-1]["event"] == "stopped", ev[-1]
            assert ev[-1]["reason"].startswith(f"{i + 1} attempts in a row were stopped before their first step")


def test_a_requeue_after_an_idle_attempt_without_a_checkpoint_keeps_the_event_log(tmp_path, monkeypatch):
    """An attempt 0 stopped before its first step has no checkpoint: the requeued attempt starts at step 0 again, and
    the batch template's prepare used to wipe the event log with it, so the idle requeues were never counted and
    the job looped (seen on the cluster: 4 idle requeues in a row). The log now stays after an idle requeue; after
    any other requeue without a checkpoint the run starts afresh as before."""
    from deadpool_hpc.events import EventLog, read_events

    slurm.write_config(RunConfig(nodes=2, spares=1, steps=80, run_dir=str(tmp_path)))
    path = str(tmp_path / "events.jsonl")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    log = EventLog(path)
    log.emit("checkpoint_skipped", step=0, generation=1, reason="preempted")
    log.emit("requeued", attempt=1, reason="preempted", idle=True, checkpoint=None)
    log.close()
    assert slurm.prepare(str(tmp_path), resume=True) is None
    assert [e["event"] for e in read_events(path)] == ["checkpoint_skipped", "requeued"]
    log = EventLog(path)
    log.emit("requeued", attempt=2, reason="preempted", idle=None, checkpoint=None)
    log.close()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    slurm.prepare(str(tmp_path), resume=True)
    assert not os.path.exists(path)   # afresh, as before this change


def test_the_stop_reason_without_a_checkpoint_or_a_time_limit():
    from deadpool_hpc.launch import slurm_job

    why = slurm_job.idle_stop_reason(2, 0, "UNLIMITED", checkpoint=False)
    assert why.startswith("3 attempts in a row were stopped before their first step (each at step 0): the job makes "
                          "no progress (a time limit") and "there is no checkpoint yet (a new job starts at step 0)" in why
