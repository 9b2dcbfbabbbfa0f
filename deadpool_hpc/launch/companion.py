"""Replacement nodes as companion Slurm jobs: submitted, watched and cancelled by the main job (``--spare-floor``).

When the spare pool falls below ``--spare-floor``, the main job's keeper (launch/keeper.py: the batch host's, or
the task standing in for a dead batch host) asks Slurm for one node per missing spare, each as a separate one-node
job that the main job submits and owns: the companion template (templates/companion.sbatch) with the main job's
account, partition, constraints (``Features``) and time limit read from ``scontrol show job``, the name
``deadpool-spare-<main job id>``, ``--no-requeue``, and its output in RUN_DIR. ``spare_policy.SparePolicy``
decides; this module only acts:

- **submit**: ``sbatch --parsable`` (``sbatch_args``: pure, unit-tested); each job id is written to
  RUN_DIR/companions/jobs before anything else happens to it; the directory itself before sbatch runs, so
  that the batch script's exit trap knows there may be companions even when the watcher died inside sbatch;
- **state**: one ``squeue --name=deadpool-spare-<main> --user=<user>`` per tick (a job no longer listed is gone)
  and the marker files the companion's node writes in RUN_DIR/companions/ (``<id>.failed``: its checks failed;
  ``<id>.joined``: its agent is one of the run's spares; its job's end after that is a lost node: ``left``);
- **cancel**: ``scancel <job id>``, by id only; ``cancel_all`` (the batch script's exit trap, the headless
  finisher) cancels every id in RUN_DIR/companions/jobs and every job of the companion name still queued, once
  a joined node's job has had ``END_GRACE_S`` seconds to end with the run on its own.

It never outlives the main job: the companion script exits at once when the main job is not RUNNING, and its
node's agent (``join``, below) exits when the main job ends. ``DEADPOOL_COMPANION_SBATCH_ARGS`` (read by the
watcher, from the main job's environment) adds the site's own sbatch options (``--qos=...``; the tests use
``--hold`` for a cluster with no free node).

The job's secret reaches the companion the way it reaches the main job's tasks: in the environment Slurm gives the
job (the watcher submits with ``--export=ALL`` from the batch script, which holds ``DEADPOOL_JOB_SECRET``); never on
a command line, never in a file. The node's agent joins over TCP (control/joining.py).

Events (the run's event log, role "watcher"): ``companion_submitted``, ``companion_started``,
``companion_cancelled``, ``companion_ended``, ``companion_failed`` (sbatch refused); the node's own: ``companion_node``,
``companion_agent_ended``; its agent's: ``join_requested``, ``node_joined`` (agent/joindesk.py, node.py).
"""
from __future__ import annotations

import getpass
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from .spare_policy import FAILED, GONE, JOINED, LEFT, PENDING, RUNNING, Companion, SparePolicy

_log = logging.getLogger(__name__)

NAME_PREFIX = "deadpool-spare-"
DIR = "companions"                 # RUN_DIR/companions: the jobs file and the nodes' markers
JOBS_FILE = "jobs"                 # one "JOB_ID SUBMITTED_WALL_TIME" line per companion job
EXTRA_ENV = "DEADPOOL_COMPANION_SBATCH_ARGS"
TICK_S = 2.0                       # seconds between two looks at Slurm (one squeue) while companions live
END_GRACE_S = 20.0                 # seconds a joined companion gets to end with the run before the main job's end
                                   # cancels it (cancel_all)
SLURM_PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}
SLURM_STARTED = {"CONFIGURING", "RUNNING", "SUSPENDED", "STOPPED", "SIGNALING", "RESIZING"}


def job_name(main_job: str) -> str:
    """The companion jobs' name for main job ``main_job``: ``deadpool-spare-<id>``."""
    return f"{NAME_PREFIX}{main_job}"


def template_path() -> str:
    """The installed companion template (package data, as slurm.template_path finds the others)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates", "companion.sbatch")


def parse_show_job(text: str) -> dict:
    """``scontrol show job -o`` of one job -> {Key: value} (the first record)."""
    line = next((l for l in text.splitlines() if l.strip()), "")
    return dict(re.findall(r"(\w+)=(\S*)", line))


def main_job_info(main_job: str, show=None) -> dict:
    """What a companion copies of the main job: partition, account, qos, constraint (Slurm's ``Features``),
    reservation and time limit (``scontrol show job``'s TimeLimit, e.g. "1:00:00" or "UNLIMITED"); a value Slurm
    shows as "(null)" or empty is left out. ``show``: the scontrol output (tests), else asked. Raises RuntimeError
    naming the job when Slurm does not know it."""
    if show is None:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(main_job)], capture_output=True, text=True,
                             timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"scontrol show job {main_job}: {out.stderr.strip() or 'exit ' + str(out.returncode)}")
        show = out.stdout
    d = parse_show_job(show)
    if d.get("JobId") != str(main_job):
        raise RuntimeError(f"scontrol show job {main_job}: no such job in {show[:120]!r}")
    keys = {"partition": "Partition", "account": "Account", "qos": "QOS", "constraint": "Features",
            "reservation": "Reservation", "time_limit": "TimeLimit"}
    return {k: d[v] for k, v in keys.items() if d.get(v) not in (None, "", "(null)")}


def sbatch_args(main_job: str, info: dict, run_dir: str, python: str, template: str | None = None,
                extra: list[str] | tuple = ()) -> list[str]:
    """The sbatch command of one companion job of ``main_job``: one exclusive node, never requeued, named
    ``deadpool-spare-<main>``, with the main job's ``info`` (main_job_info: partition, account, qos, constraint,
    reservation; its time limit unless UNLIMITED), its output and working directory in ``run_dir``, and
    DEADPOOL_MAIN_JOB / RUN_DIR / PYTHON exported to the script; ``extra``: the site's options, last (they win)."""
    run_dir = os.path.abspath(run_dir)
    cmd = ["sbatch", "--parsable", f"--job-name={job_name(main_job)}", "--nodes=1", "--exclusive", "--no-requeue",
           f"--chdir={run_dir}", f"--output={os.path.join(run_dir, DIR, 'slurm-%j.out')}",
           f"--export=ALL,DEADPOOL_MAIN_JOB={main_job},RUN_DIR={run_dir},PYTHON={python}"]
    for key, opt in (("partition", "--partition"), ("account", "--account"), ("qos", "--qos"),
                     ("constraint", "--constraint"), ("reservation", "--reservation")):
        if info.get(key):
            cmd.append(f"{opt}={info[key]}")
    if info.get("time_limit") and info["time_limit"] not in ("UNLIMITED", "INFINITE", "NONE"):
        cmd.append(f"--time={info['time_limit']}")
    return cmd + list(extra) + [template or template_path()]


# an srun task's own variables (its step, its rank, its PMI wire-up): a companion submitted by a task standing in for
# the batch host's keeper (launch/keeper.py) must not inherit them with --export=ALL
STEP_VARS = ("SLURM_STEP", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASK_PID", "SLURM_SRUN_COMM",
             "SLURM_LAUNCH_NODE_IPADDR", "SLURM_CPU_BIND", "SLURM_DISTRIBUTION", "SLURM_GTIDS", "PMI_", "PMIX_")


def submit_env(env: dict | None = None) -> dict:
    """The environment sbatch runs with (and, by --export=ALL, the companion job gets): ``env`` (this process's)
    without an srun task's step variables (STEP_VARS); the job's own (SLURM_JOB_ID...) are Slurm's to replace."""
    return {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith(STEP_VARS)}


def _dir(run_dir: str) -> str:
    return os.path.join(run_dir, DIR)


def recorded(run_dir: str) -> list[tuple[str, float]]:
    """(job id, submitted wall time) of every companion job recorded in RUN_DIR/companions/jobs."""
    try:
        with open(os.path.join(_dir(run_dir), JOBS_FILE)) as fh:
            rows = [l.split() for l in fh if l.strip()]
    except OSError:
        return []
    return [(r[0], float(r[1])) for r in rows if len(r) == 2]


def submit(main_job: str, run_dir: str, info: dict, python: str | None = None, extra: list[str] | None = None,
           now: float | None = None) -> str:
    """Submit one companion job (sbatch_args), record its id, return it. Raises RuntimeError with sbatch's own
    message when sbatch refuses it."""
    os.makedirs(_dir(run_dir), exist_ok=True)   # first: the exit trap looks for this directory
    extra = shlex.split(os.environ.get(EXTRA_ENV, "")) if extra is None else extra
    cmd = sbatch_args(main_job, info, run_dir, python or sys.executable, extra=extra)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=submit_env())
    if out.returncode != 0:
        raise RuntimeError(f"sbatch refused the companion job (exit {out.returncode}): {out.stderr.strip()[:300]}")
    job_id = out.stdout.strip().split(";")[0]
    with open(os.path.join(_dir(run_dir), JOBS_FILE), "a") as fh:
        fh.write(f"{job_id} {time.time() if now is None else now:.3f}\n")
    return job_id


def queued(main_job: str) -> dict[str, str] | None:
    """{job id: Slurm state} of the companion jobs of ``main_job`` still known to squeue; None when squeue fails
    (Slurm not answering: nothing is concluded from it)."""
    try:
        out = subprocess.run(["squeue", "-h", f"--name={job_name(main_job)}", f"--user={getpass.getuser()}",
                              "-o", "%i %T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return dict(l.split()[:2] for l in out.stdout.splitlines() if len(l.split()) >= 2)


def policy_state(slurm_state: str | None, run_dir: str, job_id: str) -> str:
    """The policy's state of one companion: its node's marker (failed, joined) first, then Slurm's state (None:
    no longer queued: gone, or left once its node had joined)."""
    base = os.path.join(_dir(run_dir), job_id)
    if os.path.exists(base + ".failed"):
        return FAILED if slurm_state else GONE
    if os.path.exists(base + ".joined"):
        return JOINED if slurm_state else LEFT
    if slurm_state in SLURM_PENDING:
        return PENDING
    if slurm_state in SLURM_STARTED:
        return RUNNING
    return GONE


def cancel(job_id: str) -> bool:
    """``scancel JOB_ID``; True when scancel accepted it (a job already gone is not an error to scancel)."""
    try:
        return subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cancel_all(run_dir: str, main_job: str, grace: float = END_GRACE_S, poll: float = 0.5) -> list[str]:
    """Cancel every companion job of ``main_job``: each id recorded in RUN_DIR/companions/jobs and each job of the
    companion name still queued (one submitted by a watcher killed before it recorded the id). By job id.

    A companion whose node joined the run (``<id>.joined``) and still runs is given up to ``grace`` seconds
    (``poll``: seconds between two squeue) to end on its own first: its agent has the run's end (``finish`` or
    ``abort``, relayed by its sponsor) and stops its training processes, and the job ends COMPLETED rather than
    CANCELLED (event ``companion_ended``, ``reason`` "the run ended"). The others (pending, still checking or
    joining) are cancelled at once. Returns the ids cancelled."""
    from ..events import EventLog
    from ..rundir import RunDir

    live = queued(main_job)
    ids = {j for j, _ in recorded(run_dir)} | set(live or {})
    log = EventLog(RunDir(run_dir).events, role="watcher")
    waiting = {j for j, st in (live or {}).items() if st in SLURM_STARTED and policy_state(st, run_dir, j) == JOINED}
    done = _cancel(sorted(ids - waiting), live, log)
    end = time.monotonic() + grace
    while waiting and time.monotonic() < end:
        time.sleep(poll)
        now = queued(main_job)
        if now is None:   # Slurm not answering: nothing concluded; cancel what is left when the grace is over
            continue
        for j in sorted(waiting - set(now)):
            log.emit("companion_ended", job_id=j, previous=JOINED, reason="the run ended")
        waiting &= set(now)
        live = now
    return done + _cancel(sorted(waiting), live, log)


def _cancel(ids: list[str], live: dict[str, str] | None, log) -> list[str]:
    """scancel each of ``ids``; log ``companion_cancelled`` for each still in ``live`` (squeue's view; None: Slurm
    did not answer). The ids scancel accepted."""
    done = []
    for j in ids:
        ok = cancel(j)
        if live is None or j in live:   # (a job already gone is cancelled again, silently)
            log.emit("companion_cancelled", job_id=j, reason="the job ends", accepted=ok,
                     state=None if live is None else live[j])
        if ok:
            done.append(j)
    return done


class Companions:
    """The watcher's side: each ``tick`` reads the pool size from the run's events, asks Slurm for the companions'
    states, runs the policy and carries out its actions, logging each (``log``: the run's EventLog). ``main_job``:
    the main job's id; ``info``: main_job_info (asked at the first submit when None); ``adopt_since``: each look
    also takes on the jobs recorded in RUN_DIR/companions/jobs at or after this wall time by another keeper (the
    batch host's and a task standing in for it, launch/keeper.py) that Slurm still has: no node is asked twice."""

    def __init__(self, run_dir: str, main_job: str, floor: int, wait: float, initial_pool: int, log,
                 python: str | None = None, info: dict | None = None, adopt_since: float | None = None) -> None:
        self.run_dir, self.main_job, self.log = run_dir, main_job, log
        self.adopt_since = adopt_since        # wall time: jobs recorded since by another keeper are taken on too
        self.policy = SparePolicy(floor, wait)
        self.pool = initial_pool
        self.python = python or sys.executable
        self.info = info
        self.states: dict[str, str] = {}       # job id -> the policy state last seen
        self.submitted: dict[str, float] = {}  # this attempt's (an earlier one's: cancelled by its exit trap)
        self._next = 0.0

    def resume(self, events: list[dict], since: float) -> None:
        """(a keeper standing in for a dead batch host, launch/keeper.py) Take up where the attempt's requests stand:
        the pool from ``events`` at or after ``since`` (wall time, seconds), and the policy's pause if the last
        request was given up (``companion_cancelled`` "not started within ...") with no change of the pool since."""
        self.pool_from(events, since)
        gave_up = [e["t"] for e in events if e.get("event") == "companion_cancelled" and e.get("t", 0) >= since
                   and str(e.get("reason", "")).startswith("not started within")]
        changed = [e["t"] for e in events if e.get("event") in ("spare_pool", "relaunched") and e.get("t", 0) >= since]
        if gave_up and max(gave_up) > max(changed, default=0.0):
            self.policy.pause(self.pool)

    def pool_from(self, events: list[dict], since: float) -> int:
        """The pool size the events of this attempt (``t >= since``) last reported: a ``spare_pool`` event's
        ``spares`` (agent/sparepool.py), or a start-up relaunch's ``spares_left``; else what it was."""
        for e in events:
            if e.get("t", 0) < since:
                continue
            if e.get("event") == "spare_pool" and isinstance(e.get("spares"), int):
                self.pool = e["spares"]
            elif e.get("event") == "relaunched" and isinstance(e.get("spares_left"), int):
                self.pool = e["spares_left"]
        return self.pool

    def _look(self) -> list[Companion]:
        others = [] if self.adopt_since is None else [
            (j, t) for j, t in recorded(self.run_dir) if t >= self.adopt_since and j not in self.submitted]
        live = [j for j in self.submitted if self.states.get(j) not in (GONE, LEFT)]
        slurm = queued(self.main_job) if live or others else {}
        if slurm is None:   # Slurm did not answer: keep what was seen
            return [Companion(j, t, self.states.get(j, PENDING)) for j, t in self.submitted.items()]
        for j, t in others:
            if j in slurm:   # asked by another keeper, still queued: this one's now (gone ones: not ours to judge)
                self.submitted[j] = t
                _log.info("companion job %s (submitted by another keeper) taken on", j)
        out = []
        for j, t in self.submitted.items():
            old = self.states.get(j, PENDING)
            new = old if old in (GONE, LEFT) else policy_state(slurm.get(j), self.run_dir, j)
            if new != old:
                if new == RUNNING:
                    self.log.emit("companion_started", job_id=j, after_s=round(time.time() - t, 3))
                elif new in (GONE, LEFT):
                    self.log.emit("companion_ended", job_id=j, previous=old)
            self.states[j] = new
            out.append(Companion(j, t, new))
        return out

    def tick(self, now: float | None = None, ending: bool = False) -> list:
        """One look (at most every TICK_S seconds unless ``ending``): the policy's actions, carried out. Returns
        them. Never raises for Slurm's refusals (logged as ``companion_failed``)."""
        now = time.time() if now is None else now
        if not ending and now < self._next:
            return []
        self._next = now + TICK_S
        comps = self._look()
        actions = self.policy.decide(now, self.pool, comps, ending=ending)
        for a in actions:
            if a.kind == "cancel":
                ok = cancel(a.job_id)
                self.log.emit("companion_cancelled", job_id=a.job_id, reason=a.reason, accepted=ok,
                              state=self.states.get(a.job_id))
                if ok:
                    self.states[a.job_id] = GONE
            else:
                try:
                    if self.info is None:
                        self.info = main_job_info(self.main_job)
                    j = submit(self.main_job, self.run_dir, self.info, self.python, now=now)
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                    self.log.emit("companion_failed", reason=a.reason, error=str(exc)[:300])
                    _log.warning("companion job not submitted: %s", exc)
                    continue
                self.submitted[j] = now
                self.states[j] = PENDING
                self.log.emit("companion_submitted", job_id=j, reason=a.reason, pool=self.pool,
                              floor=self.policy.floor, wait_s=self.policy.wait, name=job_name(self.main_job))
        return actions


# ---- the companion's node -----------------------------------------------------------------------------------------
def main_job_running(main_job: str) -> bool | None:
    """Whether ``main_job`` is RUNNING (squeue); None when Slurm does not answer."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(main_job), "-o", "%T"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return False if "Invalid job id" in out.stderr else None
    return out.stdout.split()[:1] == ["RUNNING"]


def join(run_dir: str, main_job: str, poll_s: float = 5.0, health_timeout: float | None = None) -> int:
    """What a companion's node runs (``python -m deadpool_hpc.launch.batch join RUN_DIR --main-job J``): the node's
    checks (the site's ``--health-check`` from RUN_DIR/config.json, if any, within ``--health-check-timeout``),
    ``RUN_DIR/companions/<own id>.checked`` or ``.failed``, the event ``companion_node``; then, checks passed, this
    node's agent (``python -m deadpool_hpc.agent RUN_DIR --join``), which asks the running job to admit it as a spare
    (control/joining.py) and serves until the run ends. It gets the job's secret from this job's environment (the
    main job's, which its batch host submitted this one with: launch/spare_policy.py). The agent is ended (its
    process group: SIGTERM, then SIGKILL after 10 s) within ``poll_s`` seconds of the main job leaving RUNNING.
    Returns the agent's exit code, 1 when the checks failed (the job ends: the node is released), or 2 without the
    job's secret."""
    from ..events import EventLog
    from ..rundir import RunDir
    from .slurm_common import load_config

    me = os.environ.get("SLURM_JOB_ID", "?")
    host = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    log = EventLog(RunDir(run_dir).events, role="companion")
    cfg = load_config(run_dir)
    cmd = cfg.preflight.health_check
    ok, why = True, "no --health-check configured"
    if cmd:
        timeout = health_timeout or cfg.comeback.health_check_timeout
        try:
            rc = subprocess.run(["sh", "-c", cmd], capture_output=True, timeout=timeout).returncode
            ok, why = rc == 0, f"--health-check exited {rc}"
        except subprocess.TimeoutExpired:
            ok, why = False, f"--health-check still running after {timeout:g} s"
    os.makedirs(_dir(run_dir), exist_ok=True)
    with open(os.path.join(_dir(run_dir), f"{me}.{'checked' if ok else 'failed'}"), "w") as fh:
        fh.write(f"{host} {why}\n")
    log.emit("companion_node", job_id=me, host=host, checks_passed=ok, checks=why)
    if not ok:
        return 1
    if len(os.environ.get("DEADPOOL_JOB_SECRET", "")) < 32:
        log.emit("companion_node", job_id=me, host=host, checks_passed=True,
                 error="DEADPOOL_JOB_SECRET is not in this job's environment: cannot join")
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    agent = subprocess.Popen([sys.executable, "-m", "deadpool_hpc.agent", run_dir, "--join"], env=env,
                             start_new_session=True)
    try:
        while True:
            try:
                return agent.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
            if main_job_running(main_job) is False:
                log.emit("companion_agent_ended", job_id=me, reason=f"the main job {main_job} is not running")
                return _end_group(agent)
    finally:
        if agent.poll() is None:
            _end_group(agent)


def _end_group(proc: subprocess.Popen, grace: float = 10.0) -> int:
    """End ``proc``'s process group (it leads one): SIGTERM, SIGKILL after ``grace`` seconds. Its exit code."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()
