"""Inside a Slurm job: the task wrapper, the batch-host watcher, the finisher, and what ends an attempt.

``python -m deadpool_hpc.launch.batch task|watch|end`` run these (templates/train.sbatch).
The batch host is an ordinary node of the allocation: if it dies, the batch script and srun die with
it but the ranks train on; each task then checks whether the watcher still touches RUN_DIR/batch.alive,
and the last one to exit writes summary.json and completes the job itself (docs/slurm.md).

Signals (docs/slurm.md, "Signals"): SIGUSR2 and SIGTERM mean "save and leave" to a worker. When an attempt
ended with a checkpoint saved, ``settle`` decides: requeue the job if Slurm is not ending it (a signal to a
running job: ``--signal``, preemption's notice, ``scancel -s``), or if it hit its time limit after making
progress; otherwise (``scancel``, the end of a preemption's grace time) log ``stopped`` and requeue nothing.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

from ..events import EventLog, read_events
from ..rundir import RunDir, emit_requeued
from ..rundir import latest_checkpoint as _latest_checkpoint  # without torch: settle runs within KillWait
from .nodestate import drain
from .slurm_common import load_config, summary_out, write_summary
from .slurm_startup import Beacon, BeaconCheck
from .keeper import ALIVE_FILE, Keeper, StandIn, batch_alive, companions_for, drain_wanted, write_alive

_log = logging.getLogger(__name__)  # diagnostics; ``log`` below is a run's event log



# ---- inside the job: the task wrapper, the finisher, the watcher ------------------------------------------------
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGCONT, signal.SIGUSR2)
STAND_IN_JOIN_S = 70.0  # the stand-in's last tick may be in sbatch (60 s at most): waited for at the task's end
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)  # "save a checkpoint at the next agreed step and leave" (worker.entry)


def run_worker(run_dir: str, env: dict | None = None, forward_signals=FORWARDED, on_start=None) -> int:
    """Run the node agent (``python -m deadpool_hpc.agent RUN_DIR``) as a child, passing on the PMI descriptor that
    srun gave this task (close_fds would otherwise close it), and forwarding ``forward_signals`` to it (SIGUSR2 and
    SIGTERM: the worker saves a checkpoint at the next agreed step and exits 75).
    ``on_start(proc)`` is called once the child runs and the forwarders are in place. Returns its exit code."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    fds = tuple(int(env[k]) for k in ("PMI_FD",) if env.get(k, "").isdigit())
    # SIGUSR2 and SIGTERM are blocked across the spawn: here until the forwarder is installed, and in the worker
    # (which inherits the mask) until its handler is (worker/entry.py unblocks them); otherwise their default
    # action would kill either process. A signal that arrives meanwhile stays pending and is delivered then.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    old = {}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "deadpool_hpc.agent", run_dir], env=env, pass_fds=fds)

        def forward(sig, _frame):
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass

        for sig in forward_signals:
            old[sig] = signal.signal(sig, forward)
        if on_start is not None:
            on_start(proc)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        return proc.wait()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _task_id() -> int:
    return int(os.environ.get("SLURM_PROCID", os.environ.get("PMI_RANK", "0")))


def _attempt_dir(run_dir: str, what: str) -> str:
    """RUN_DIR/WHAT/ATTEMPT, or WHAT/ATTEMPT.LAUNCH after a start-up relaunch (launch/slurm_startup.py)."""
    launch = os.environ.get("DEADPOOL_LAUNCH", "0")
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    return os.path.join(run_dir, what, attempt if launch == "0" else f"{attempt}.{launch}")


def _exited_dir(run_dir: str) -> str:
    """RUN_DIR/exited/ATTEMPT: one marker per task that has exited, per attempt of the job (a requeued job keeps
    its id and run directory; Slurm numbers its attempts with SLURM_RESTART_COUNT)."""
    return _attempt_dir(run_dir, "exited")


def _mark(run_dir: str, what: str, text: str) -> None:
    d = _attempt_dir(run_dir, what)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, str(_task_id())), "w") as fh:
        fh.write(f"{text} {os.uname().nodename} {time.time()}\n")


def mark_exited(run_dir: str, rc: int) -> None:
    _mark(run_dir, "exited", str(rc))


def mark_ready(run_dir: str, pid: int) -> None:
    """RUN_DIR/ready/ATTEMPT/TASK: this task's worker runs and signals reach it safely (they are forwarded, and
    blocked in the worker until its handler is in place). The batch script waits for every task's marker
    before it passes a signal of its own on to the ranks: a rank killed by a signal before that point would
    leave the others waiting in MPI_Init."""
    _mark(run_dir, "ready", str(pid))


def exited_tasks(run_dir: str) -> set[int]:
    return {int(os.path.basename(p)) for p in glob.glob(os.path.join(_exited_dir(run_dir), "*"))
            if os.path.basename(p).isdigit()}


def expected_survivors(run_dir: str) -> set[int]:
    """MPI ranks that should still exit by themselves: every rank that said hello, less those on nodes the run
    declared failed. (The ranks of a node that died without being noticed, e.g. at the very end, are waited for
    only up to the finisher's timeout.)"""
    events = list(read_events(RunDir(run_dir).events))
    failed = {n for e in events if e["event"] == "decision" for n in (e.get("failed_nodes") or [])}
    return {e["mpi_rank"] for e in events
            if e["event"] == "hello" and e.get("role", "agent") == "agent" and e["mpi_rank"] not in failed}


_COMPLETE_SNIPPET = """
import ctypes, ctypes.util, sys
job, rc = int(sys.argv[1]), int(sys.argv[2])
for name in ("/usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so", "/usr/lib64/slurm/libslurmfull.so",
             "/usr/lib/slurm/libslurmfull.so", ctypes.util.find_library("slurmfull"),
             ctypes.util.find_library("slurm")):
    if not name:
        continue
    try:
        lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)  # GLOBAL: the auth plugin it dlopens needs its symbols
    except OSError:
        continue
    if hasattr(lib, "slurm_init"):
        lib.slurm_init(None)
    err = lib.slurm_complete_job(ctypes.c_uint32(job), ctypes.c_uint32(rc))
    print(name, err)
    sys.exit(0 if err == 0 else 1)
sys.exit(3)
"""


def complete_job(job_id: str, rc: int) -> str:
    """End the job as srun does for its own allocation: libslurm's slurm_complete_job (state COMPLETED for rc 0,
    else FAILED). Runs in a child process (libslurm may exit() on a fatal error). Falls back to scancel
    (CANCELLED). Returns what was done."""
    try:
        out = subprocess.run([sys.executable, "-c", _COMPLETE_SNIPPET, str(job_id), str(rc)],
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return f"slurm_complete_job({job_id}, {rc}): {out.stdout.strip()}"
        why = (out.stdout + out.stderr).strip()[-300:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = str(exc)
    subprocess.run(["scancel", str(job_id)], timeout=30)
    return f"scancel {job_id} (slurm_complete_job failed: {why})"


def finish_headless(run_dir: str, wait_s: float = 60.0) -> dict | None:
    """Called by each task after its worker exited. If the batch script is gone (its node died), one task (the
    first to take RUN_DIR/finisher.lock) waits for the other survivors, writes summary.json (and the run's
    ``--summary`` path, see slurm_common.summary_out) and ends the job. Returns the summary if this task finished the
    job, else None."""
    if batch_alive(run_dir):
        return None
    try:
        fd = os.open(os.path.join(run_dir, "finisher.lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    os.write(fd, f"{_task_id()} {os.uname().nodename} {time.time()}\n".encode())
    os.close(fd)
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        if expected_survivors(run_dir) <= exited_tasks(run_dir):
            break
        time.sleep(0.5)
    s = write_summary(run_dir, out=summary_out(run_dir),
                      extra={"finished_by": f"task {_task_id()} on {os.uname().nodename} (batch host dead)"})
    if drain_wanted():  # the keeper died with the batch host (its stand-in, if any, drained what it saw)
        for f in s["failures"]:
            for h in f.get("failed_hosts", []):
                drain(h, f"deadpool job {os.environ.get('SLURM_JOB_ID', '?')}: declared dead")
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id and os.path.isdir(os.path.join(run_dir, "companions")):   # the exit trap died with the batch host
        from .companion import cancel_all

        cancel_all(run_dir, job_id)
    if job_id:
        with open(os.path.join(run_dir, "finisher.log"), "a") as fh:
            fh.write(f"{time.time()} task {_task_id()} on {os.uname().nodename}: batch host dead, ending job "
                     f"{job_id}\n")
            fh.flush()
            how = complete_job(job_id, 0 if s["completed"] else 1)  # may kill this very task: log first
            fh.write(f"{time.time()} {how}\n")
    return s


def task_main(run_dir: str, finisher: bool = True) -> int:
    """One srun task: its node's agent (run_worker), a beacon until the agents' MPI world exists, and (in a Slurm
    job) the keeper's stand-in thread (launch/keeper.py StandIn: this task runs the keeper if the batch
    host dies and it is the lowest live task); then its exit marker and, the batch host dead, the job's end
    (finish_headless). Returns the agent's exit code."""
    Beacon(run_dir, _task_id()).start()   # the batch host sees this task live until its agent's MPI world exists
    standin = None
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_NTASKS", "").isdigit():
        standin = StandIn(run_dir, _task_id(), int(os.environ["SLURM_NTASKS"]), lambda: exited_tasks(run_dir),
                          time.time())
        standin.start()
    rc = run_worker(run_dir, on_start=lambda proc: mark_ready(run_dir, proc.pid))
    if standin is not None:
        standin.stop.set()
    # the job may be ending (scancel, time limit: SIGTERM now, SIGKILL after KillWait): the exit marker and the
    # finisher's work must not be cut short by a second signal
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if standin is not None:   # before the exit marker: a request it makes now is recorded before the job's end
        standin.join(STAND_IN_JOIN_S)
    mark_exited(run_dir, rc)
    if finisher and os.environ.get("SLURM_JOB_ID"):
        finish_headless(run_dir)
    return rc


def keep_batch_host(run_dir: str, do_drain: bool = True, period: float = 1.0) -> None:
    """Run on the batch host while the batch script lives: keep RUN_DIR/batch.alive fresh (its first line: this
    host's Slurm name) and run the keeper (launch/keeper.py Keeper: drain each node the run declares dead,
    record Slurm's State and Reason of each, cancel a lost joined node's companion job, ask for replacement nodes),
    and end the start-up of a node lost before the agents' MPI world exists (slurm_startup.BeaconCheck).
    SIGTERM, SIGUSR2, SIGINT and SIGHUP are ignored (``scancel --full``, a cancel or the time limit signal every
    process of the batch step; the watcher must outlive the ranks' save, or the tasks would take the batch host for
    dead): the batch script ends it with SIGKILL, and it ends by itself when the batch script (its parent) is
    gone."""
    alive = os.path.join(run_dir, ALIVE_FILE)
    events_path = RunDir(run_dir).events
    parent = os.getppid()
    # a node lost before the MPI world exists: the step is ended, and the batch shell (SIGUSR1) stops waiting for srun
    beacons = BeaconCheck(run_dir, os.environ.get("SLURM_JOB_ID"), on_lost=lambda: os.kill(parent, signal.SIGUSR1))
    log = EventLog(events_path, role="watcher")
    t_start = time.time()   # decisions of earlier attempts (a requeued job) were acted on by their own keeper
    keeper = Keeper(run_dir, log, t_start, do_drain, companions_for(run_dir, log, adopt_since=t_start))
    write_alive(run_dir, t_start)
    for sig in STOP_SIGNALS + (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)

    def touch() -> None:   # its own thread: a tick that waits on Slurm (sbatch, scontrol) must not look like death
        while os.getppid() == parent:
            with open(alive, "a"):
                os.utime(alive)
            time.sleep(period)

    threading.Thread(target=touch, name="deadpool-batch-alive", daemon=True).start()
    while os.getppid() == parent:
        try:
            events = list(read_events(events_path)) if os.path.exists(events_path) else []
            for h in beacons.poll(events):
                _log.info("%s lost during the start-up: the step is ended and relaunched without it", h)
                keeper.drain_once(h, "lost during the start-up")
        except (OSError, ValueError, KeyError) as exc:
            _log.warning("watch (start-up): %s", exc)
            events = []
        keeper.tick(events)
        time.sleep(period)


# ---- how an attempt ends: requeue, or stop ------------------------------------------------------------------------
def job_state(job_id: str | None) -> tuple[str | None, str | None]:
    """Slurm's (JobState, Reason) of a job, from ``scontrol show job``; (None, None) when unknown. While Slurm ends
    a job (scancel, the time limit, the end of a preemption's grace time) its JobState is COMPLETING (measured,
    Slurm 22.05); Reason is TimeLimit for the time limit."""
    if not job_id:
        return None, None
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    state = re.search(r"\bJobState=(\S+)", out.stdout)
    reason = re.search(r"\bReason=(\S+)", out.stdout)
    return (state.group(1) if state else None), (reason.group(1) if reason else None)


def _accounted_state(job_id: str) -> str | None:
    """sacct's state of a job being ended (CANCELLED, PREEMPTED, ...): the words for the ``stopped`` event."""
    try:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobID,State"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [line.split("|") for line in out.splitlines() if line.split("|")[0] == str(job_id)]
    return rows[-1][1].strip() if rows and len(rows[-1]) > 1 else None


def _this_attempt(events: list[dict], since: float | None) -> list[dict]:
    """The events of the attempt that started at ``since`` (default: after the last ``requeued``)."""
    if since is None:
        starts = [i for i, e in enumerate(events) if e["event"] == "requeued"]
        return events[starts[-1] + 1:] if starts else events
    return [e for e in events if e["t"] >= since]


ENDING_STATES = ("COMPLETING", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "FAILED", "DEADLINE")
# attempts in a row that were stopped before any rank trained a step (``checkpoint_skipped``: a warning signal or
# a lost node with no spare, right after the start) that are still requeued; the next such attempt ends the job with
# the reason instead of looping (a time limit shorter than the signal lead re-sends the signal at once)
MAX_IDLE_REQUEUES = 2


def idle_streak(events: list[dict]) -> int:
    """How many of the last ``requeued`` events, in a row, requeued an attempt that made no step (``idle``)."""
    n = 0
    for e in reversed([e for e in events if e["event"] == "requeued"]):
        if not e.get("idle"):
            break
        n += 1
    return n


def idle_stop_reason(streak: int, step: int, time_limit: str | None = None, checkpoint: bool = True) -> str:
    """The ``stopped`` reason of a job whose ``streak + 1``-th attempt in a row made no step (at step ``step``);
    ``time_limit``: Slurm's TimeLimit (named unless None or UNLIMITED); ``checkpoint``: whether RUN_DIR holds one."""
    limit = f" in its time limit of {time_limit}" if time_limit and time_limit != "UNLIMITED" else ""
    kept = (f"the checkpoint of step {step} is kept (a new job with RESUME=1 and this RUN_DIR resumes there)"
            if checkpoint else "there is no checkpoint yet (a new job starts at step 0)")
    return (f"{streak + 1} attempts in a row were stopped before their first step (each at step {step}): the job "
            f"makes no progress{limit} (a time limit that leaves no time to train before the warning signal, "
            f"--signal-lead or --signal, re-sends it at once after each requeue; or it is preempted or signalled as "
            f"soon as it starts); {kept}; accepted: a longer --time or a shorter --signal-lead (docs/slurm.md, "
            f"\"Signals\")")


def time_limit_of(job_id: str | None) -> str | None:
    """Slurm's TimeLimit of a job (e.g. 00:02:00), or None."""
    if not job_id:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bTimeLimit=(\S+)", out.stdout)
    return m.group(1) if m else None


def settle(run_dir: str, since: float | None = None, srun_rc: int | None = None) -> dict:
    """Decide how this attempt of the job ends, once its ranks have exited (the batch script after srun, task 0
    under submitit). ``since``: when the attempt started (wall time, s). Returns {"action": ...}:

    - ``requeued``: a checkpoint was saved in this attempt and the job goes on: a signal to a running job
      (``--signal``, a preemption's notice, ``scancel -s USR2|TERM``), no spare left (at most ``max_requeues``
      times), or the time limit (only if this attempt got past the step it resumed from). ``requeued`` is
      logged and ``scontrol requeue`` run; the requeued job resumes from the checkpoint. Also when the attempt
      was stopped before any rank trained a step (``checkpoint_skipped``: nothing new to save): the checkpoint it
      resumed from (or step 0) is untouched and the job resumes there again (``requeued`` with ``idle``), at
      most MAX_IDLE_REQUEUES times in a row; the next such attempt is ``stopped`` with the reason
      (idle_stop_reason), not requeued for ever.
    - ``stopped``: a checkpoint was saved but the job is not requeued: Slurm is ending it (``scancel``, the end
      of a preemption's grace time; Slurm itself requeues a preempted job if its PreemptMode says so), or
      ``max_requeues`` was reached, or ``scontrol requeue`` was refused, or a crash loop stopped the run
      (``crash_loop``: the same rank's crash at the same step on several nodes; a requeue would resume into it). Or the
      batch shell was signalled and the
      ranks ended without saving (srun answers a SIGTERM of its own by killing its step) and the agents had
      persisted nothing in this attempt (else: ``requeued``, from that checkpoint). ``stopped`` is logged.
    - ``none``: nothing to decide (the run finished, or ended without a checkpoint and without a signal).
    """
    from ..events import EventLog

    path = RunDir(run_dir).events
    events = list(read_events(path)) if os.path.exists(path) else []
    mine = _this_attempt(events, since)
    last = {e["event"]: i for i, e in enumerate(mine)}
    finished = "finished" in last
    saved = [e for e in mine if e["event"] == "checkpoint_saved"]
    skipped = [e for e in mine if e["event"] == "checkpoint_skipped"]
    if not saved and skipped:
        # stopped (a signal; a lost node with no spare) before any rank trained a step: nothing new to save, and the
        # checkpoint this attempt resumed from (or step 0) is untouched: the job goes on from there, as after a save
        saved = [dict(skipped[-1], idle=True)]
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        try:
            job_id = open(os.path.join(run_dir, "slurm_job_id")).read().strip()
        except OSError:
            job_id = None
    if finished and last["finished"] > last.get("checkpoint_saved", -1):
        return {"action": "none"}
    if not saved:
        signals = [e["signal"] for e in mine if e["event"] == "batch_signal"]
        if not signals or finished:
            return {"action": "none"}
    log = EventLog(path)
    state, slurm_reason = job_state(job_id)
    if not saved:
        why = (f"the batch shell got SIG{'/SIG'.join(dict.fromkeys(signals))} and the ranks ended without saving"
               f"{f' (srun exit {srun_rc})' if srun_rc is not None else ''}")
        if "TERM" in signals and srun_rc is not None and srun_rc >= 128:
            why += ": srun answers a SIGTERM of its own by killing its step (SIGKILL), e.g. `scancel --full -s TERM`"
        persisted = [e for e in mine if e["event"] == "checkpoint_persisted"]
        if not persisted or state in ENDING_STATES or not job_id:
            log.emit("stopped", reason=why, slurm_job_id=job_id, checkpoint=_latest_checkpoint(run_dir))
            return {"action": "stopped", "reason": why, "killed": True}
        # the job goes on (a signal is not a cancel): resume from the agents' newest persisted checkpoint
        # (agent/persister.py), at most --persist-every seconds back
        saved = [dict(persisted[-1], reason=f"{why}; resumed from the checkpoint the agents persisted at step "
                                            f"{persisted[-1]['step']}")]
    ckpt = saved[-1]
    reason = ckpt.get("reason", "no spare node left")
    idle = bool(ckpt.get("idle"))
    ending = state in ENDING_STATES
    resumed = [e["step"] for e in mine if e["event"] == "resumed_from_checkpoint"]
    why_not = None
    loops = [e for e in mine if e["event"] == "crash_loop"]
    if loops:   # the run stopped itself (control/crashloop.py): a requeue would resume into the same crash
        why_not = f"a crash loop: {loops[-1].get('error')}"
    elif ending and slurm_reason != "TimeLimit":
        acct = _accounted_state(job_id) if job_id else None
        why_not = (f"Slurm is ending the job ({acct or state}"
                   f"{f', {slurm_reason}' if slurm_reason not in (None, 'None') else ''})")
    elif ending and idle:
        why_not = ("time limit, and this attempt made no progress (stopped before its first step, at step "
                   f"{ckpt['step']})")
    elif ending and resumed and ckpt["step"] <= max(resumed):
        why_not = f"time limit, and this attempt made no progress (resumed at step {max(resumed)})"
    elif idle and idle_streak(events) >= MAX_IDLE_REQUEUES:
        why_not = idle_stop_reason(idle_streak(events), ckpt["step"], time_limit_of(job_id),
                                   checkpoint=_latest_checkpoint(run_dir) is not None)
    if why_not is None and reason != "preempted":
        # max_requeues caps requeues after lost nodes; a signal (preemption, time limit) is routine for a long
        # job and is not counted
        lost = sum(1 for e in events if e["event"] == "requeued" and e.get("reason") != "preempted")
        if lost >= load_config(run_dir).persistence.max_requeues:
            why_not = f"{lost} requeues after lost nodes already (max_requeues)"
    if why_not is None and job_id:
        emit_requeued(log, slurm_job_id=job_id, reason=reason, idle=idle or None,
                      time_limit=slurm_reason == "TimeLimit" or None, checkpoint=_latest_checkpoint(run_dir))
        # the requeue makes slurmd SIGTERM every process of the job's steps, this scontrol included: ignored here
        # (SIG_IGN survives exec), or scontrol may die before it reports the requeue it already made
        out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60,
                             preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
        if out.returncode == 0:
            return {"action": "requeued", "reason": reason, **({"idle": True} if idle else {})}
        why_not = f"scontrol requeue {job_id} failed: {out.stderr.strip()}"
    why_not = why_not or "no Slurm job id"
    _log.warning("not requeued: %s; checkpoint of step %s in %s/checkpoint (a new job with RESUME=1 and this "
                 "RUN_DIR resumes there)", why_not, ckpt["step"], run_dir)
    log.emit("stopped", reason=why_not, slurm_job_id=job_id, job_state=state, checkpoint_step=ckpt["step"],
             checkpoint=_latest_checkpoint(run_dir))
    return {"action": "stopped", "reason": why_not, "checkpoint_step": ckpt["step"]}


def requeue_if_needed(run_dir: str) -> bool:
    """settle() for callers that only ask "was the job requeued?" (the batch scripts of jobs rendered before
    ``end`` existed)."""
    return settle(run_dir)["action"] == "requeued"
