"""The batch host's keeper: what is done for the run each second outside its ranks, and the task that stands in for
it when the batch host dies.

The batch host's ``watch`` (slurm_job.keep_batch_host; the subcommand keeps its old name) keeps
RUN_DIR/batch.alive fresh from a thread of its own (its lines: the batch host's name and the keeper's start) and
runs a ``Keeper``. Each tick, for every decision of this attempt: the companion job of a lost joined node is
cancelled (its node is fenced so), Slurm's view of each lost host is recorded (nodestate.NodeStates) and each lost
host drained; then the replacement nodes (``--spare-floor``: companion.Companions) are looked after.

The batch host is an ordinary node of the allocation. When it dies its keeper dies with it and the ranks train on
(docs/slurm.md); without a stand-in, nobody would drain the next lost host nor ask Slurm for a replacement node for
the rest of the job. So each task wrapper (slurm_job.task_main) runs a ``StandIn`` thread. Once the batch host is
dead (batch.alive untouched for ``ALIVE_STALE_S`` seconds, or for ``QUIET_S`` seconds after a decision of this
attempt declared its host dead), the task with the lowest id that no decision of this attempt declared dead and
that has not exited runs the same ``Keeper`` (event ``keeper_stand_in``: ``task``, ``host``, ``batch_host``,
``why``), and only while it is that task (``keeper_stand_in_ended``). Every task decides alone, from the run's own
files (the events, the exit markers), so they all decide alike; the stand-in's own loss passes the role on to the
next task. Each keeper takes on the companion jobs this attempt asked for through another keeper and Slurm still
has (no node asked twice), and a stand-in resumes the policy's pause (a request given up is not asked again at
once). The run's end (``finished``, ``stopped``, ``preempt_requested``) ends the stand-in.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

from ..events import EventLog, EventTail
from ..rundir import RunDir
from .companion import cancel as cancel_companion
from .nodestate import NodeStates, drain
from .slurm_common import companion_jobs_by_rank, hosts_by_rank, load_config

_log = logging.getLogger(__name__)

ALIVE_FILE = "batch.alive"
ALIVE_STALE_S = 10.0  # the batch host counts as dead when batch.alive has not been touched for this long
QUIET_S = 5.0         # a decision that declares the batch host dead counts once batch.alive has been still this
                      # long (seconds): it is touched every second, and NFS caches a file's attributes for 3 s
# what a stand-in keeps of the run's events: what the keeper acts on, and the run's end
ENDING_EVENTS = frozenset({"finished", "stopped", "preempt_requested"})
KEEPER_EVENTS = frozenset({"decision", "hello", "spare_pool", "relaunched", "companion_cancelled"}) | ENDING_EVENTS


def batch_alive(run_dir: str, stale_s: float = ALIVE_STALE_S) -> bool:
    """Whether the batch host's keeper still runs: True as soon as RUN_DIR/batch.alive is touched again
    (it is touched every second), False once its mtime has not moved for ``stale_s`` seconds. Only the file's
    own mtime values are compared, so the clocks of the file server and of this node do not matter."""
    path = os.path.join(run_dir, ALIVE_FILE)
    first = _mtime(path)
    end = time.monotonic() + stale_s
    while time.monotonic() < end:
        time.sleep(0.25)
        m = _mtime(path)
        if m is not None and m != first:
            return True
    return False


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None


def write_alive(run_dir: str, t_start: float) -> None:
    """(the batch host's keeper, at its start) RUN_DIR/batch.alive: this host's name (as the agents' ``hello`` says
    it: socket.gethostname()) and the keeper's start (wall time, seconds)."""
    with open(os.path.join(run_dir, ALIVE_FILE), "w") as fh:
        fh.write(f"{socket.gethostname()}\n{t_start:.3f}\n")


def read_alive(run_dir: str) -> tuple[str | None, float | None]:
    """(the batch host's name, its keeper's start) as RUN_DIR/batch.alive says; None for what it does not say."""
    try:
        with open(os.path.join(run_dir, ALIVE_FILE)) as fh:
            lines = fh.read().split("\n")
    except OSError:
        return None, None
    host = lines[0].strip() or None
    try:
        return host, float(lines[1])
    except (IndexError, ValueError):
        return host, None


def drain_wanted() -> bool:
    """``DRAIN_FAILED`` (the batch script's; default on): drain the hosts the run declares dead."""
    return os.environ.get("DRAIN_FAILED", "1") not in ("0", "no", "false", "")


def companions_for(run_dir: str, log: EventLog, adopt_since: float | None = None):
    """The companion jobs' driver (companion.Companions) when the run asks for replacement nodes (``--spare-floor``
    > 0) and this is a Slurm job; else None. ``adopt_since``: it also takes on the jobs recorded since then by
    another keeper (companion.Companions)."""
    from .companion import Companions

    job_id = os.environ.get("SLURM_JOB_ID")
    try:
        cfg = load_config(run_dir)
    except (OSError, ValueError) as exc:
        _log.warning("watch: no config, no replacement nodes: %s", exc)
        return None
    if not job_id or cfg.replacement.spare_floor <= 0:
        return None
    return Companions(run_dir, job_id, cfg.replacement.spare_floor, cfg.replacement.spare_wait, cfg.layout.spares,
                      log, adopt_since=adopt_since)


class Keeper:
    """One tick a second of the batch host's keeper (the module's docstring). ``t_start``: this attempt's start (wall
    time, seconds): earlier decisions were an earlier attempt's; ``states_since``: Slurm's view is asked only of
    hosts lost at or after this wall time (a stand-in: what the batch host's keeper may not have asked yet);
    ``do_drain``: drain lost hosts; ``spares``: companion.Companions, or None."""

    def __init__(self, run_dir: str, log: EventLog, t_start: float, do_drain: bool = True, spares=None,
                 states_since: float | None = None) -> None:
        self.run_dir, self.log, self.t_start, self.do_drain, self.spares = run_dir, log, t_start, do_drain, spares
        self.states_since = t_start if states_since is None else states_since
        self.drained: set[str] = set()
        self.released: set[str] = set()   # companion jobs of lost joined nodes, cancelled (their node is fenced so)
        self.states = NodeStates(log)

    def drain_once(self, host: str, reason: str, what: str = "") -> None:
        """Drain ``host`` (once) with Slurm reason "deadpool job J: ``reason``", if draining is on."""
        if self.do_drain and host not in self.drained:
            self.drained.add(host)
            ok = drain(host, f"deadpool job {os.environ.get('SLURM_JOB_ID', '?')}: {reason}")
            _log.info("%s %s (%s)", "drained" if ok else "could not drain", host, what or reason)

    def tick(self, events: list[dict]) -> None:
        """Act on ``events`` (the run's whole event log, read now). Never raises for Slurm's refusals."""
        try:
            for e in events:
                if e["event"] != "decision" or e["t"] < self.t_start:
                    continue
                hosts = hosts_by_rank(events, before=e["t"])  # where the ranks ran when it was decided
                joined = companion_jobs_by_rank(events, before=e["t"])   # slots held by joined nodes
                for n in e.get("failed_nodes") or []:
                    if n in joined and joined[n] not in self.released:   # a joined node's fence: its job ends
                        self.released.add(joined[n])
                        ok = cancel_companion(joined[n])
                        _log.info("companion job %s of lost node%s %s", joined[n], n,
                                  "cancelled" if ok else "could not be cancelled")
                    h = hosts.get(n)  # MPI rank n is node n's agent
                    if h and h not in self.states.asked and e["t"] >= self.states_since:
                        self.states.lost(h, n, e["generation"])   # Slurm's view first, before our drain
                    if h:   # (the reason as before: the run's summaries and cause.py read it)
                        self.drain_once(h, "declared dead", f"node{n} of the run, generation {e['generation']}")
        except (OSError, ValueError, KeyError) as exc:
            _log.warning("watch: %s", exc)
        self.states.poll()
        if self.spares is not None:
            try:
                self.spares.pool_from(events, self.t_start)
                self.spares.tick()
            except Exception as exc:  # noqa: BLE001 - asking for replacements must never end the keeper
                _log.warning("watch (companion jobs): %s", exc)


def dead_tasks(events: list[dict], since: float) -> set[int]:
    """Task ids (= node ids: MPI rank n is task n's agent) that a decision at or after ``since`` declared dead."""
    return {n for e in events if e.get("event") == "decision" and e.get("t", 0) >= since
            for n in (e.get("failed_nodes") or [])}


def batch_host_declared_dead(events: list[dict], since: float, host: str | None) -> bool:
    """Whether a decision at or after ``since`` declared dead the node that ran on ``host`` (the batch host)."""
    if not host:
        return False
    for e in events:
        if e.get("event") == "decision" and e.get("t", 0) >= since:
            at = hosts_by_rank(events, before=e["t"])
            if any(at.get(n) == host for n in e.get("failed_nodes") or []):
                return True
    return False


def stand_in(tasks: int, dead: set[int], exited: set[int]) -> int | None:
    """The task that stands in for a dead batch host: the lowest of ``range(tasks)`` neither dead nor exited."""
    return next((t for t in range(tasks) if t not in dead and t not in exited), None)


class StandIn(threading.Thread):
    """(a daemon thread of each task wrapper) Watch the batch host; once it is dead, run the ``Keeper`` here while
    this task is the stand-in (``stand_in``), every ``period`` seconds, until ``stop`` is set or the run ends
    (``finished``, ``stopped``, ``preempt_requested``). ``task``: this task's id; ``tasks``: the step's task count;
    ``exited()``: the ids of the tasks that have exited; ``t_start``: this task's start (wall time, seconds).

    The run's event log is read incrementally, and only the kinds the keeper acts on are kept (KEEPER_EVENTS)."""

    def __init__(self, run_dir: str, task: int, tasks: int, exited, t_start: float, period: float = 1.0,
                 stale_s: float = ALIVE_STALE_S) -> None:
        super().__init__(name="deadpool-stand-in", daemon=True)
        self.run_dir, self.task, self.tasks, self.exited = run_dir, task, tasks, exited
        self.t_start, self.period, self.stale_s = t_start, period, stale_s
        self.stop = threading.Event()
        self.keeper: Keeper | None = None
        self.events: list[dict] = []
        self._alive = os.path.join(run_dir, ALIVE_FILE)
        self._tail = EventTail(RunDir(run_dir).events)

    def run(self) -> None:
        last, changed = _mtime(self._alive), time.monotonic()
        while not self.stop.wait(self.period):
            try:
                self.events += [e for e in self._tail.poll() if e.get("event") in KEEPER_EVENTS]
                m = _mtime(self._alive)
                if m != last:
                    last, changed = m, time.monotonic()
                    if self.keeper is not None:   # the batch host's keeper is back (a stalled file system)
                        self.stand_down("the batch host's keeper touches batch.alive again")
                    continue
                quiet = time.monotonic() - changed
                if self.keeper is None and quiet < QUIET_S:   # touched every second: alive
                    continue
                self.step(self.events, quiet)
            except Exception as exc:  # noqa: BLE001 - the stand-in must never end the task wrapper
                _log.warning("stand-in: %s", exc)

    def stand_down(self, why: str) -> None:
        if self.keeper is not None:
            self.keeper.log.emit("keeper_stand_in_ended", task=self.task, why=why)
            self.keeper = None

    def step(self, events: list[dict], quiet: float) -> None:
        """One look: take the role, keep it, or leave it (to the batch host's keeper, back, or to another task),
        and tick while held. ``events``: the run's events (KEEPER_EVENTS at least); ``quiet``: seconds since
        batch.alive last moved."""
        if any(e.get("event") in ENDING_EVENTS and e.get("t", 0) >= self.t_start for e in events):
            self.stand_down("the run is ending")   # nothing to drain or ask for: the job's end cancels companions
            return
        me = stand_in(self.tasks, dead_tasks(events, self.t_start), self.exited()) == self.task
        if not me:
            self.stand_down("another task is the stand-in now")
            return
        host, keeper_start = read_alive(self.run_dir)
        if self.keeper is None:
            declared = quiet >= QUIET_S and batch_host_declared_dead(events, self.t_start, host)
            if not (declared or quiet >= self.stale_s):
                return
            since = min(self.t_start, keeper_start) if keeper_start else self.t_start   # the attempt's requests
            log = EventLog(RunDir(self.run_dir).events, role="watcher")
            spares = companions_for(self.run_dir, log, adopt_since=since)
            if spares is not None:
                spares.resume(events, since)
            self.keeper = Keeper(self.run_dir, log, self.t_start, drain_wanted(), spares,
                                 states_since=time.time() - quiet - 2.0)   # its last tick, and a margin
            log.emit("keeper_stand_in", task=self.task, host=socket.gethostname(), batch_host=host,
                     why="a decision declared the batch host dead" if declared else
                     f"batch.alive untouched for {self.stale_s:g} s")
        self.keeper.tick(events)
