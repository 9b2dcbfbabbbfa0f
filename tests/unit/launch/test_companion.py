"""The companion jobs' Slurm side (launch/companion.py) without Slurm: the sbatch command built from the main job's
``scontrol show job``, the states read back, and the watcher's driver over a stubbed sbatch/squeue/scancel.
The real thing runs in tests/slurm/test_slurm_companion.py."""
from __future__ import annotations

import os

import pytest

from deadpool_hpc.events import EventLog, read_events
from deadpool_hpc.launch import companion
from deadpool_hpc.launch.spare_policy import FAILED, GONE, PENDING, RUNNING

SHOW = ("JobId=41 JobName=deadpool UserId=ci(1000) GroupId=ci(1000) Priority=1 Account=physics QOS=normal "
        "JobState=RUNNING Reason=None TimeLimit=02:00:00 Partition=gpu Features=a100&ib Reservation=(null) "
        "NumNodes=3 Command=/x/job.sbatch\n")


def test_main_job_info_reads_what_a_companion_copies():
    info = companion.main_job_info("41", show=SHOW)
    assert info == {"partition": "gpu", "account": "physics", "qos": "normal", "constraint": "a100&ib",
                    "time_limit": "02:00:00"}
    with pytest.raises(RuntimeError, match="no such job"):
        companion.main_job_info("42", show=SHOW)


def test_sbatch_args_tie_the_companion_to_the_main_job(tmp_path):
    info = companion.main_job_info("41", show=SHOW)
    cmd = companion.sbatch_args("41", info, str(tmp_path), "/venv/bin/python", template="/t/companion.sbatch",
                                extra=["--qos=spares"])
    assert cmd[:2] == ["sbatch", "--parsable"] and cmd[-1] == "/t/companion.sbatch"
    for a in ("--job-name=deadpool-spare-41", "--nodes=1", "--exclusive", "--no-requeue", "--partition=gpu",
              "--account=physics", "--constraint=a100&ib", "--time=02:00:00", f"--chdir={tmp_path}",
              f"--output={tmp_path}/companions/slurm-%j.out",
              f"--export=ALL,DEADPOOL_MAIN_JOB=41,RUN_DIR={tmp_path},PYTHON=/venv/bin/python"):
        assert a in cmd, a
    assert cmd.index("--qos=spares") > cmd.index("--qos=normal")   # the site's options come last: they win
    bare = companion.sbatch_args("7", {"partition": "debug", "time_limit": "UNLIMITED"}, str(tmp_path), "py")
    assert not [a for a in bare if a.startswith(("--time", "--account", "--constraint"))]
    assert bare[-1] == companion.template_path() and os.path.isfile(bare[-1])


def test_policy_state_from_slurm_and_the_nodes_markers(tmp_path):
    d = tmp_path / "companions"
    d.mkdir()
    assert companion.policy_state("PENDING", str(tmp_path), "5") == PENDING
    assert companion.policy_state("RUNNING", str(tmp_path), "5") == RUNNING
    assert companion.policy_state("CONFIGURING", str(tmp_path), "5") == RUNNING
    assert companion.policy_state(None, str(tmp_path), "5") == GONE
    assert companion.policy_state("COMPLETING", str(tmp_path), "5") == GONE
    (d / "5.failed").write_text("node9 --health-check exited 1\n")
    assert companion.policy_state("RUNNING", str(tmp_path), "5") == FAILED


class FakeSlurm:
    """sbatch/squeue/scancel as the driver calls them (companion.submit/queued/cancel), answered from a dict."""

    def __init__(self, monkeypatch, run_dir):
        self.jobs: dict[str, str] = {}
        self.cancelled: list[str] = []
        self.next = 100
        monkeypatch.setattr(companion, "submit", self.submit)
        monkeypatch.setattr(companion, "queued", lambda main: dict(self.jobs))
        monkeypatch.setattr(companion, "cancel", self.cancel)

    def submit(self, main_job, run_dir, info, python=None, extra=None, now=None):
        os.makedirs(os.path.join(run_dir, "companions"), exist_ok=True)
        jid = str(self.next)
        self.next += 1
        self.jobs[jid] = "PENDING"
        return jid

    def cancel(self, jid):
        self.cancelled.append(jid)
        self.jobs.pop(jid, None)
        return True


def test_the_driver_submits_below_the_floor_cancels_after_the_wait_and_logs_it(tmp_path, monkeypatch):
    slurm = FakeSlurm(monkeypatch, tmp_path)
    log = EventLog(str(tmp_path / "events.jsonl"), role="watcher")
    c = companion.Companions(str(tmp_path), "41", floor=1, wait=10, initial_pool=1, log=log, info={"partition": "p"})
    assert c.tick(now=1000.0) == []
    c.pool_from([{"t": 5.0, "event": "spare_pool", "spares": 0}], since=0.0)
    assert c.tick(now=1001.0) == []                              # at most one look every TICK_S (2 s)
    assert [a.kind for a in c.tick(now=1002.0)] == ["submit"]
    assert [a.kind for a in c.tick(now=1006.0)] == []            # pending, within the wait
    assert [(a.kind, a.job_id) for a in c.tick(now=1012.0)] == [("cancel", "100")]
    assert c.tick(now=1030.0) == [] and slurm.cancelled == ["100"]
    kinds = [e["event"] for e in read_events(str(tmp_path / "events.jsonl"))]
    assert kinds == ["companion_submitted", "companion_cancelled"]


def test_the_pool_comes_from_this_attempts_events_only(tmp_path):
    c = companion.Companions(str(tmp_path), "41", 1, 10, initial_pool=2, log=None)
    events = [{"t": 1.0, "event": "spare_pool", "spares": 0}, {"t": 5.0, "event": "relaunched", "spares_left": 1},
              {"t": 6.0, "event": "spare_pool", "spares": 1}]
    assert c.pool_from(events[:1], since=2.0) == 2   # an earlier attempt's
    assert c.pool_from(events, since=2.0) == 1


def test_the_companion_job_of_a_slot_is_its_newest_agents():
    from deadpool_hpc.launch.slurm_common import companion_jobs_by_rank

    ev = [{"event": "hello", "t": 1.0, "mpi_rank": 1, "host": "node2"},
          {"event": "hello", "t": 5.0, "mpi_rank": 1, "host": "node5", "companion_job": "42"},   # joined slot 1
          {"event": "hello", "t": 1.0, "mpi_rank": 2, "host": "node3"}]
    assert companion_jobs_by_rank(ev) == {1: "42"}
    assert companion_jobs_by_rank(ev, before=4.0) == {}   # decided before it joined: the first node's loss


def test_the_jobs_end_gives_a_joined_companion_time_to_end_with_the_run(tmp_path, monkeypatch):
    """cancel_all (the batch script's exit trap): a pending companion is cancelled at once; a running one whose node
    joined is left to end on its own (its agent has the run's end: COMPLETED, not CANCELLED); one that outlives the
    grace is cancelled."""
    slurm = FakeSlurm(monkeypatch, tmp_path)
    d = tmp_path / "companions"
    d.mkdir()
    (d / "jobs").write_text("7 1.0\n8 2.0\n9 3.0\n")
    (d / "7.joined").write_text("node5\n")
    (d / "9.joined").write_text("node4\n")
    slurm.jobs.update({"7": "RUNNING", "8": "PENDING", "9": "RUNNING"})
    sleeps = []

    def sleep(s):   # job 7's agent ends with the run after the second look; job 9's never does
        sleeps.append(s)
        if len(sleeps) == 2:
            slurm.jobs.pop("7")

    monkeypatch.setattr(companion.time, "sleep", sleep)
    clock = iter(range(0, 1000, 1))
    monkeypatch.setattr(companion.time, "monotonic", lambda: float(next(clock)))
    assert companion.cancel_all(str(tmp_path), "41", grace=5.0, poll=0.5) == ["8", "9"]
    assert slurm.cancelled == ["8", "9"] and 4 <= len(sleeps) <= 6, sleeps   # 9 cancelled once the 5 s were over
    ev = [(e["event"], e["job_id"]) for e in read_events(str(tmp_path / "events.jsonl"))]
    assert ev == [("companion_cancelled", "8"), ("companion_ended", "7"), ("companion_cancelled", "9")], ev


def test_a_keeper_takes_on_the_companions_another_keeper_asked_for_and_resumes_its_pause(tmp_path, monkeypatch):
    """Companions(adopt_since=...) (the batch host's keeper and a task standing in for it, launch/keeper.py): the
    jobs recorded since the attempt's start by the other keeper, and still queued, count as asked for (no node is
    asked twice); ``resume`` takes up the pool and a given-up request's pause from the run's events."""
    slurm = FakeSlurm(monkeypatch, tmp_path)
    d = tmp_path / "companions"
    d.mkdir()
    (d / "jobs").write_text("3 50.0\n7 1000.0\n8 1001.0\n")    # 3: an earlier attempt's; 8: gone since
    (d / "7.joined").write_text("node5\n")
    slurm.jobs.update({"3": "PENDING", "7": "RUNNING"})
    c = companion.Companions(str(tmp_path), "41", floor=2, wait=60, initial_pool=0, log=None, info={},
                             adopt_since=900.0)
    c.pool = 2
    assert c.tick(now=1002.0) == [] and sorted(c.submitted) == ["7"] and c.states == {"7": "joined"}
    slurm.jobs["9"] = "PENDING"
    with open(d / "jobs", "a") as fh:
        fh.write("9 1003.0\n")                                # asked by the other keeper meanwhile
    c.pool = 1
    assert c.tick(now=1010.0) == [] and sorted(c.submitted) == ["7", "9"]   # one missing, one pending: no more
    ev = [{"event": "spare_pool", "t": 1000.0, "spares": 1},
          {"event": "companion_cancelled", "t": 1070.0, "reason": "not started within 60 s", "job_id": "9"}]
    fresh = companion.Companions(str(tmp_path), "41", floor=2, wait=60, initial_pool=2, log=None, info={})
    fresh.resume(ev, since=900.0)
    assert fresh.pool == 1 and fresh.tick(now=1080.0) == []          # given up at pool 1: not asked again at once
    log = EventLog(str(tmp_path / "events.jsonl"), role="watcher")
    other = companion.Companions(str(tmp_path), "41", floor=2, wait=60, initial_pool=2, log=log, info={})
    other.resume(ev + [{"event": "spare_pool", "t": 1075.0, "spares": 0}], since=900.0)
    assert [a.kind for a in other.tick(now=1080.0)] == ["submit", "submit"]   # the pool shrank since: ask


def test_a_companion_submitted_from_an_srun_task_does_not_inherit_its_step():
    env = {"SLURM_JOB_ID": "41", "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "PMI_FD": "5",
           "PMIX_RANK": "1", "SLURM_LOCALID": "0", "DEADPOOL_JOB_SECRET": "s" * 64, "PATH": "/bin"}
    assert companion.submit_env(env) == {"SLURM_JOB_ID": "41", "DEADPOOL_JOB_SECRET": "s" * 64, "PATH": "/bin"}
