"""A node lost before the node agents' MPI world exists: found within seconds, the step relaunched.

MPICH cannot survive a process lost inside ``MPI_Init`` or the start-up collectives that follow it (the identity
exchange, the wire-up, the start barrier: control/plane.py): every other agent waits there, holding the GIL, until
its start-up deadline (``--startup-timeout``, 300 s by default) ends it. Nothing inside the job's MPI world can
help, so the batch host watches from outside it:

- each task wrapper (``python -m deadpool_hpc.launch.batch task``, one per node) touches a *beacon*,
  ``RUN_DIR/starting/LAUNCH_ID/TASK``, every ``BEACON_PERIOD_S`` seconds while it lives (``Beacon``);
- the batch host's watcher (``BeaconCheck.poll``, called each second by ``slurm_job.keep_batch_host``) looks at the
  beacons of the current launch until some node agent of it has said ``hello`` (which each one does once the
  start-up collectives are done; a node lost after that is the control plane's to recover). A beacon whose mtime has not
  moved for ``STALE_S`` seconds, or one that never appeared while another did (for ``MISSING_S`` seconds, or
  at once when Slurm says its node is down or not responding), is a lost node: the watcher writes
  ``RUN_DIR/relaunch/LAUNCH_ID.json`` (the hosts), logs ``startup_node_lost`` and ends the step (``scancel --signal=KILL
  JOBID.STEPID``);
- the batch script (templates/train.sbatch) then calls ``relaunch``: one spare fewer in RUN_DIR/config.json and the
  lost hosts excluded, and starts srun again on the live nodes of the same allocation (event ``relaunched``). With
  no spare left it ends the attempt with the reason (exit 1 of ``relaunch``).

Only mtimes of the beacons are compared with each other, as ``keeper.batch_alive`` does, so the clocks of the
file server and of the nodes do not matter. LAUNCH_ID is ``ATTEMPT.LAUNCH``: the job's restart count
(SLURM_RESTART_COUNT) and the number of relaunches within this attempt (``DEADPOOL_LAUNCH``).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time

from ..events import EventLog
from ..rundir import RunDir

_log = logging.getLogger(__name__)

BEACON_PERIOD_S = 1.0   # a task's beacon is touched this often
STALE_S = 4.0           # seconds a beacon may stand still before its node counts as lost (4 missed touches)
MISSING_S = 15.0        # seconds a task's beacon may still not exist after the launch's first one appeared
LAUNCH_FILE = "launch.json"   # RUN_DIR/launch.json: the current launch (written by the batch script)


def launch_id() -> str:
    """``ATTEMPT.LAUNCH`` of this process's launch (environment of srun's tasks and of the batch script)."""
    return f"{os.environ.get('SLURM_RESTART_COUNT', '0')}.{os.environ.get('DEADPOOL_LAUNCH', '0')}"


class Beacon:
    """(task wrapper) Touches RUN_DIR/starting/LAUNCH_ID/TASK every ``period`` seconds from a daemon thread; the
    file holds this task's host name. ``start()`` returns self; the thread ends with the process."""

    def __init__(self, run_dir: str, task: int, period: float = BEACON_PERIOD_S):
        d = os.path.join(run_dir, "starting", launch_id())
        os.makedirs(d, exist_ok=True)
        self.path = os.path.join(d, str(task))
        with open(self.path, "w") as fh:
            fh.write(os.uname().nodename + "\n")
        self.period = period

    def start(self) -> "Beacon":
        threading.Thread(target=self._run, name="startup-beacon", daemon=True).start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(self.period)
            try:
                os.utime(self.path)
            except OSError:
                return   # the run directory is gone: nothing to tell


def step_nodes(total: int, exclude: str = "") -> list[str]:
    """The hosts srun's block distribution gives a step of ``total`` nodes in this allocation, in task order: the
    allocation's (SLURM_JOB_NODELIST, expanded by ``scontrol show hostnames``) less ``exclude`` (comma-separated),
    the first ``total``. A best guess, used only to name a task that never started (a live task names its host)."""
    out = subprocess.run(["scontrol", "show", "hostnames", os.environ.get("SLURM_JOB_NODELIST", "")],
                         capture_output=True, text=True, timeout=20).stdout.split()
    left = set(filter(None, exclude.split(",")))
    return [h for h in out if h not in left][:total]


def write_launch(run_dir: str, launch: str, nodes: list[str]) -> None:
    """(batch script, before each srun) Record the launch about to start: its id and its nodes in task order
    (srun's block distribution puts task i on the i-th node). Atomic."""
    tmp = os.path.join(run_dir, LAUNCH_FILE + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"launch": launch, "t": time.time(), "nodes": nodes}, fh)
    os.replace(tmp, os.path.join(run_dir, LAUNCH_FILE))


class BeaconCheck:
    """(batch host) One launch's start-up, watched from outside MPI: ``poll(events)`` each second returns the hosts
    found lost (and acts on them, once), or [] (nothing lost, not started yet, or the MPI world exists)."""

    def __init__(self, run_dir: str, job_id: str | None, stale_s: float = STALE_S, missing_s: float = MISSING_S,
                 on_lost=None):
        self.run_dir, self.job_id = run_dir, job_id
        self.on_lost = on_lost   # on_lost(): called once the step was ended (the batch shell stops waiting for srun)
        self.stale_s, self.missing_s = stale_s, missing_s
        self._seen: dict[tuple[str, int], tuple[float, float]] = {}   # (launch, task) -> (mtime, when it last moved)
        self._done: set[str] = set()   # launches acted on, or whose MPI world exists
        self._lid: str | None = None       # the launch watched now
        self._first: float | None = None   # when its first beacon was seen (monotonic)
        self._asked = 0.0                  # when Slurm's node states were last asked for

    def _not_responding(self, nodes: list[str]) -> dict[str, str]:
        """{host: Slurm state} of ``nodes`` that slurmctld marks down or not responding (a ``*`` suffix), asked at
        most every 2 s. Slurm's own timeout (SlurmdTimeout) decides when it sees that: seconds on the test
        cluster, minutes on many real ones, so the beacons are the first signal."""
        if time.monotonic() - self._asked < 2.0:
            return {}
        self._asked = time.monotonic()
        try:
            out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"], capture_output=True,
                                 text=True, timeout=10).stdout.split("\n")
        except (OSError, subprocess.TimeoutExpired):
            return {}
        states = dict(line.split(None, 1) for line in out if len(line.split()) == 2)
        return {h: st for h, st in states.items() if st.endswith("*") or st.startswith("down")}

    def poll(self, events: list[dict]) -> list[str]:
        try:
            with open(os.path.join(self.run_dir, LAUNCH_FILE)) as fh:
                launch = json.load(fh)
        except (OSError, ValueError):
            return []
        lid, t0, nodes = launch["launch"], float(launch["t"]), list(launch["nodes"])
        if lid in self._done:
            return []
        if lid != self._lid:
            self._lid, self._first = lid, None
        if any(e["event"] == "hello" and e.get("role") == "agent" and e["t"] >= t0 for e in events):
            self._done.add(lid)   # the agents' MPI world exists: the control plane recovers what is lost now
            return []
        now = time.monotonic()
        d = os.path.join(self.run_dir, "starting", lid)
        lost, present = [], 0
        for task, host in enumerate(nodes):
            path = os.path.join(d, str(task))
            try:
                m = os.stat(path).st_mtime
                with open(path) as fh:
                    host = fh.read().strip() or host   # where the task really runs
            except OSError:
                continue
            present += 1
            prev = self._seen.get((lid, task))
            if prev is None or prev[0] != m:
                self._seen[(lid, task)] = (m, now)
            elif now - prev[1] > self.stale_s:
                lost.append((task, host, f"its task's beacon stood still for {now - prev[1]:.1f} s"))
        if present and self._first is None:
            self._first = now
        if present < len(nodes) and self._first is not None:
            down = self._not_responding(nodes)
            for task, host in enumerate(nodes):
                if os.path.exists(os.path.join(d, str(task))):
                    continue
                if host in down:
                    lost.append((task, host, f"its task never started, and Slurm says {host} is {down[host]}"))
                elif now - self._first > self.missing_s:
                    lost.append((task, host, f"its task never started ({self.missing_s:.0f} s after the first task "
                                             f"of the launch did)"))
        if not lost:
            return []
        self._done.add(lid)
        hosts = _record(self.run_dir, lid, t0, lost)
        self._end_steps()
        if self.on_lost is not None:
            self.on_lost()
        return hosts

    def _end_steps(self) -> None:
        """SIGKILL the job's steps (not the batch step): the agents left waiting in MPI_Init with them."""
        if not self.job_id:
            return
        try:
            out = subprocess.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i"], capture_output=True,
                                 text=True, timeout=20).stdout.split()
            for step in out:
                if step.rpartition(".")[2].isdigit():
                    subprocess.run(["scancel", "--signal=KILL", step], capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            _log.warning("startup watch: could not end the step: %s", exc)


def _record(run_dir: str, lid: str, t0: float, lost: list[tuple]) -> list[str]:
    """Write RUN_DIR/relaunch/LAUNCH_ID.json for ``lost`` [(task, host, why)] and log ``startup_node_lost``."""
    hosts = sorted({h for _, h, _ in lost})
    why = "; ".join(f"{h} (task {t}): {w}" for t, h, w in lost)
    os.makedirs(os.path.join(run_dir, "relaunch"), exist_ok=True)
    tmp = os.path.join(run_dir, "relaunch", lid + ".json.tmp")
    with open(tmp, "w") as fh:
        json.dump({"launch": lid, "lost_hosts": hosts, "why": why, "t": time.time()}, fh)
    os.replace(tmp, os.path.join(run_dir, "relaunch", lid + ".json"))
    EventLog(RunDir(run_dir).events).emit(
        "startup_node_lost", launch=lid, hosts=hosts, why=why, startup_s=round(time.time() - t0, 3))
    return hosts


def after_failed_step(run_dir: str, launch: str, events: list[dict]) -> bool:
    """(batch script, srun failed and the watcher found nothing) srun may end a step itself when it cannot launch a
    task on a node ("Task launch ... failed on node X: Communication connection failure", then every task killed):
    if no node agent of this launch said hello and some tasks' beacons never appeared while others did, those nodes
    are the lost ones (recorded as the watcher does). Returns whether a relaunch is recorded now."""
    try:
        with open(os.path.join(run_dir, LAUNCH_FILE)) as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return False
    if rec["launch"] != launch:
        return False
    t0, nodes = float(rec["t"]), list(rec["nodes"])
    if any(e["event"] == "hello" and e.get("role") == "agent" and e["t"] >= t0 for e in events):
        return False
    d = os.path.join(run_dir, "starting", launch)
    missing = [(t, h, "its task never started (srun could not launch it)") for t, h in enumerate(nodes)
               if not os.path.exists(os.path.join(d, str(t)))]
    if not missing or len(missing) == len(nodes):
        return False
    _record(run_dir, launch, t0, missing)
    return True


def relaunch(run_dir: str, launch: str) -> tuple[int, int, list[str]]:
    """(batch script, after srun failed) Apply RUN_DIR/relaunch/LAUNCH.json (the watcher's, or ``after_failed_step``'s):
    one spare fewer per lost host in RUN_DIR/config.json (atomically), and log ``relaunched``. Raises LookupError
    when no node was lost before the MPI world existed (nothing to relaunch: the attempt ends as it would). Returns
    (nodes + spares now, spares now, every host excluded in this attempt so far). Raises ConfigError, with the reason,
    when fewer spares are left than hosts
    were lost (the attempt ends: nothing has trained, nothing is saved)."""
    from ..errors import ConfigError
    from .. import rundir
    from .slurm_common import load_config

    path = os.path.join(run_dir, "relaunch", launch + ".json")
    if not os.path.exists(path):
        from ..events import read_events

        ev = RunDir(run_dir).events
        if not after_failed_step(run_dir, launch, list(read_events(ev)) if os.path.exists(ev) else []):
            raise LookupError(f"launch {launch}: no node was lost before the agents' MPI world existed")
    with open(path) as fh:
        lost = json.load(fh)
    attempt = launch.partition(".")[0]
    excluded: list[str] = []
    for p in sorted(os.listdir(os.path.join(run_dir, "relaunch"))):
        if p.endswith(".json") and p.partition(".")[0] == attempt:
            with open(os.path.join(run_dir, "relaunch", p)) as fh:
                excluded += [h for h in json.load(fh)["lost_hosts"] if h not in excluded]
    cfg = load_config(run_dir)
    n = len(lost["lost_hosts"])
    if n > cfg.layout.spares:
        EventLog(RunDir(run_dir).events).emit(
            "error", error=f"StartupNodeLost: {', '.join(lost['lost_hosts'])} lost during the start-up with "
                           f"{cfg.layout.spares} spare(s) left: the job cannot start ({lost['why']})")
        raise ConfigError(f"{', '.join(lost['lost_hosts'])} lost during the start-up ({lost['why']}), before the node "
                          f"agents' MPI world existed, and only {cfg.layout.spares} spare node(s) are left: the job "
                          f"cannot start on the nodes that are left; nothing was trained, so nothing is saved "
                          f"(submit again)")
    cfg.update(spares=cfg.layout.spares - n)
    cfg.validate()
    rundir.write_config(run_dir, cfg)
    EventLog(RunDir(run_dir).events).emit(
        "relaunched", launch=launch, lost_hosts=lost["lost_hosts"], excluded=excluded, spares_left=cfg.layout.spares,
        why=lost["why"])
    return cfg.layout.nodes + cfg.layout.spares, cfg.layout.spares, excluded
