"""Embedded launch: N active + S spare emulated nodes as local processes under MPICH's hydra.

Each emulated node is one hydra proxy (``-launcher fork -hosts 127.0.0.1,127.0.0.2,...`` with
``-ppn`` ranks per node) and the rank processes under it; ``-disable-auto-cleanup`` keeps the
survivors alive when a node's processes die (notes/ft-probes.md 2a). The proxies and mpiexec are
the launcher: killing a proxy ends the job (hydra asserts on a lost proxy socket), so an emulated
node's death is the death of its rank processes, which is what a fault spec does. No other process
is special: the store of each generation lives in a worker.

The run's own lifecycle:

- One run per run directory: ``launch`` locks it (rundir.RunDir) before touching anything in it; a
  second run is refused with RunDirBusy (exit 2 from the CLI).
- Every run has a random run id (``DEADPOOL_RUN_ID``); workers log it in every event, and the
  launcher only ever signals processes it started: mpiexec's process tree as read from /proc, and
  the ``hello`` identities of its own run id, each checked by pid + start time.
- SIGTERM, SIGHUP and SIGINT stop the run: every process is killed, an ``interrupted`` event is
  logged, and the summary (``interrupted``: the signal's name) is written as at a normal end.
- The launcher's death by any signal, SIGKILL included, ends the run within seconds: mpiexec gets a
  parent-death signal (SIGKILL), and every node agent runs a lifeline (process/lifeline.py) that watches
  the launcher's pid and, when it is gone, kills the run's processes and itself.

``launch`` returns the run summary (summary.build_summary) after every process has exited.
"""
from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import closing, contextmanager

from ..config import RunConfig, only_under_slurm_batch
from ..dataplane.backend import SHARED_GPUS_ENV
from ..process.fence import descendants, fence, is_alive
from ..errors import ConfigError
from ..events import EventLog, EventSpill, EventTail, merge, read_events
from ..rundir import RunDir, check_output_file, check_run_dir, discard_uncommitted, emit_requeued, latest_checkpoint
from .options import check_extensions
from .outpump import OutputPump
from ..summary import build_summary, event_log_health
from ..process import forkserver
from ..process.lifeline import launcher_env

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


LOCAL_MAX_PROCESSES = 64  # training processes one machine runs in the embedded default (a Slurm job has no cap)


def mpiexec_path() -> str:
    """The hydra mpiexec of the MPICH wheel beside this Python (falls back to PATH)."""
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(cand):
        return cand
    found = shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("mpiexec not found; install the MPICH wheel: pip install mpich mpi4py")
    return found


def emulated_node_env(cfg: RunConfig) -> dict[str, str]:
    """MPICH settings that make the emulated nodes separate nodes to MPI, as real ones are: ranks of one
    emulated node share memory, ranks of different ones talk through the network module (UCX).

    Measured (this machine, MPICH 5.0.2 wheel): with every rank in one shared-memory domain, a rank that
    keeps sending 1.8 MB eager messages to a SIGSTOPped peer stopped reaching a third, live rank for 2.3 s
    (its shared-memory send cells all sat in the frozen peer's queue), so the live ranks suspected each
    other after a hang or a kill. With one clique per emulated node the longest silence was 0.13-0.17 s.
    Real nodes never share memory, so this also makes the emulation faithful."""
    return {"MPIR_CVAR_NUM_CLIQUES": str(cfg.layout.total_nodes), "MPIR_CVAR_CLIQUES_BY_BLOCK": "1",
            SHARED_GPUS_ENV: "1"}   # and they share this machine's GPUs (dataplane/backend.py device_index)


def command(cfg: RunConfig, run_dir: str) -> list[str]:
    hosts = ",".join(f"127.0.0.{i + 1}" for i in range(cfg.layout.total_nodes))
    return [mpiexec_path(), "-disable-auto-cleanup", "-launcher", "fork", "-hosts", hosts,
            "-ppn", "1", "-n", str(cfg.layout.total_nodes),
            sys.executable, "-m", "deadpool_hpc.agent", run_dir]


def check_resume(run_dir: str, world_size: int) -> dict:
    """``--resume``: the checkpoint of ``run_dir`` (checkpoint/LATEST) that a run of ``world_size`` ranks can resume
    from. Raises ConfigError naming the directory when it has none, or one saved by another world size."""
    saved = latest_checkpoint(run_dir)
    if saved is None:
        raise ConfigError(f"--resume: {run_dir} has no checkpoint (checkpoint/LATEST); accepted: the run directory "
                          f"of a run that saved one (leave --resume out to start from step 0)")
    if saved.get("world_size") != world_size:
        raise ConfigError(f"--resume: the checkpoint in {run_dir} (step {saved.get('step')}) was saved by world size "
                          f"{saved.get('world_size')}; this run's is {world_size} (--nodes x --ranks-per-node): "
                          f"accepted: the same layout")
    return saved


class Interrupted(KeyboardInterrupt):
    """A stop signal (``signum``) arrived before the run started: nothing ran, the run directory is as it was."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def launch(cfg: RunConfig, on_poll=None, poll_s: float = 0.25, timeout: float | None = None,
           resume: bool = False, stop: "StopRequest | None" = None) -> dict:
    """Run ``cfg`` on this machine and return its summary (also written to RUN_DIR/summary.json and to
    ``cfg.summary_path`` if set).

    on_poll(events) is called with the new events every ``poll_s`` seconds (the live console).
    timeout: seconds before the whole run is killed (None: no limit; TimeoutError). Raises ConfigError
    first, before any process starts, for a bad config or a run directory or summary path that cannot be
    used, and RunDirBusy (a ConfigError) if another run holds the run directory. A run that fails still
    returns a summary (``completed`` False); so does a run stopped by SIGTERM, SIGHUP or SIGINT (when
    ``launch`` runs in the main thread): its processes are killed, ``interrupted`` (the signal's name) is
    logged and set in the summary. Such a signal before any process started raises Interrupted.
    ``resume``: start from the run directory's checkpoint (checkpoint/LATEST: a run that a crash loop, a lost node with
    no spare left or a signal stopped) instead of step 0; its event log is kept and appended to. ConfigError, before
    anything starts, when there is no checkpoint there or it was saved by another world size.
    ``stop``: a StopRequest whose ``request(signum)`` stops the run from another thread as that signal would
    (executors.LocalJob.cancel(), for a run launched in a thread).

    This is the blocking engine under ``LocalExecutor`` (launch/executors.py), the public way to start a local run.
    """
    cfg.validate()
    only_under_slurm_batch(cfg, "deadpool run (local)")
    if cfg.layout.ranks_per_node == 0:   # one per GPU of this machine (1 without a GPU): every emulated node's
        from ..dataplane.backend import BackendError, node_gpus, resolve_ranks_per_node

        try:
            cfg.update(ranks_per_node=resolve_ranks_per_node(0, cfg.layout.backend, node_gpus()))
        except BackendError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.layout.total_processes > LOCAL_MAX_PROCESSES:
        raise ConfigError(f"{cfg.layout.total_processes} training processes requested ({cfg.layout.total_nodes} "
                          f"nodes x {cfg.layout.ranks_per_node} ranks per node); the local launcher (deadpool run) "
                          f"runs at most {LOCAL_MAX_PROCESSES} on one machine: use fewer --nodes / --spares / "
                          f"--ranks-per-node, or "
                          f"Slurm (deadpool submit, SlurmExecutor or SubmititExecutor), which has no "
                          f"such cap")
    check_extensions(cfg.replication.replica_transport)   # a missing or broken plugin named before anything starts
    run_dir = check_run_dir(cfg.output.run_dir)
    if resume:
        check_resume(run_dir, cfg.layout.world_size)
    if cfg.output.summary_path:
        check_output_file(cfg.output.summary_path, run_dir=cfg.output.run_dir)
    from ..train.corpus import load_tokens

    run_id = secrets.token_hex(8)
    rd = RunDir(run_dir)
    # spill: the lines a process could not write to events.jsonl (a full, read-only or hung run directory) come here
    with (stop or StopRequest()) as stop, rd.locked(run_id), closing(EventSpill(f"deadpool-events-{run_id}")) as spill:
        # (the lock comes before anything in the directory is touched)
        if cfg.train.train_fn.startswith("deadpool_hpc.train."):
            try:
                with stop.raising():  # the first build of the corpus cache takes a while: stop at once there
                    load_tokens()  # build the corpus cache once, and fail here (clearly) if the corpus is missing
            except _Interrupted:
                pass
        if stop.signum:
            raise Interrupted(stop.signum)
        rd.prepare(resume=resume)
        rd.write_config(cfg)
        env = dict(os.environ, DEADPOOL_JOB_SECRET=secrets.token_hex(32), DEADPOOL_STORE_HOST="127.0.0.1",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **emulated_node_env(cfg),
                   **launcher_env(run_id), **spill.env())
        log = EventLog(rd.events, spill=spill.name, run=run_id)
        start = time.monotonic()
        tail = _Tail(rd.events, spill, run_id)
        rc, left, output = None, [], []   # output: each attempt's launcher.log figures (outpump.py)
        for attempt in range(cfg.persistence.max_requeues + 1 if cfg.persistence.requeue else 1):
            if stop.signum:
                break
            if attempt:
                emit_requeued(log, attempt, checkpoint=latest_checkpoint(rd.path))
            rc, new, left = _run_once(cfg, rd, env, tail, on_poll, poll_s, timeout, start, stop, run_id, log, output)
            this = {e["event"] for e in new}
            if "finished" in this or "checkpoint_saved" not in this or "crash_loop" in this:
                break   # (a crash loop: a requeue would resume into the same crash, control/crashloop.py)
        signum = stop.signum  # what came later (while the summary is written) changes nothing
        tail.poll()   # the last spilled lines
        events = merge(_read_run(rd.events, run_id), tail.spilled)
        summary = build_summary(events, cfg)
        summary["run_dir"] = run_dir
        summary["mpiexec_rc"] = rc  # non-zero whenever a rank was killed; "completed" says how the run went
        summary["processes_left"] = [int(i["pid"]) for i in left]  # alive 5 s after SIGKILL: should never happen
        # (a crash loop: every agent had saved and left on its own before mpiexec's end; hydra's mpiexec was seen to
        # die by SIGPIPE after its processes exited, completed runs' too, which says nothing about the run)
        if rc is not None and rc < 0 and not summary["completed"] and not signum and not summary.get("crash_loop"):
            summary["errors"].append(f"mpiexec (the launcher's process manager) was killed by "
                                     f"{signal.Signals(-rc).name}; the run's processes were ended with it")
        elif rc and not summary["completed"] and not summary["errors"] and not signum and \
                not any(e["event"] in ("started", "recovered") for e in events):
            failed = [e for e in events if e["event"] == "startup_failed" and e.get("error")]
            if failed:   # the training function raised before ctx.run (e.g. a bad setting in the model's build)
                nodes = sorted({e.get("node") for e in failed if e.get("node") is not None})
                summary["errors"].append(f"the job ended before training started (mpiexec exit status {rc}): the "
                                         f"training function failed at start-up on node(s) {nodes}: "
                                         f"{failed[0]['error']} (events: {rd.events})")
            else:
                summary["errors"].append(f"the job ended before training started (mpiexec exit status {rc}): a "
                                         f"process died during MPI start-up; see {rd.launcher_log}")
        if signum and not summary["completed"]:
            name = signal.Signals(signum).name
            log.emit("interrupted", signal=name, step=summary["steps_completed"])
            summary["interrupted"] = name
        log.close()
        spill.close()
        if log.failed or log.dropped:   # the launcher's own lines, with the workers' reports (their largest counts)
            summary["event_log"] = event_log_health(
                [e for e in events if e["event"] == "event_log_failed"] +
                [{"pid": os.getpid(), "path": log.path, "error": log.last_error, **log.counts()}])
        summary["launcher_log"] = {"dropped_bytes": sum(o["dropped_bytes"] for o in output),
                                   "error": next((o["error"] for o in output if o["error"]), None)}
        discard_uncommitted(rd.path)   # what cut-short or failed persist rounds left (room for the summary)
        summary["summary_written"] = True
        try:
            rd.write_summary(summary, also=cfg.output.summary_path)
        except OSError as exc:   # a full or read-only run directory: the caller prints it (deadpool run: exit 3)
            summary["summary_written"] = False
            summary["summary_error"] = f"{exc.filename or rd.summary}: {errno.errorcode.get(exc.errno, 'EIO')}: " \
                                       f"{exc.strerror or exc}"
    return summary


def _read_run(path: str, run_id: str) -> list[dict]:
    """The records of run ``run_id`` in the event log at ``path`` ([] if it cannot be read)."""
    try:
        return [e for e in read_events(path) if e.get("run", run_id) == run_id]
    except OSError:
        return []


class _Tail:
    """The launcher's view of the run's events: the new lines of events.jsonl (EventTail) and those spilled to its
    socket (EventSpill: lines a process could not write), each once, of this run only. ``spilled``: every
    spilled record so far (the summary merges them with the file)."""

    def __init__(self, path: str, spill: EventSpill, run_id: str):
        self.file, self.spill, self.run_id = EventTail(path), spill, run_id
        self.spilled: list[dict] = []
        self._keys: set = set()

    def poll(self) -> list[dict]:
        mine = lambda e: e.get("run", self.run_id) == self.run_id   # noqa: E731
        got = [e for e in self.spill.poll() if mine(e)]
        self.spilled += got
        keys = {(e.get("t"), e.get("pid"), e.get("event")) for e in got}
        self._keys |= keys
        return [e for e in self.file.poll() if mine(e) and (e.get("t"), e.get("pid"), e.get("event"))
                not in self._keys] + got


class _Interrupted(BaseException):
    """Raised by the stop-signal handler inside ``StopRequest.raising()``."""


class StopRequest:
    """SIGTERM, SIGHUP and SIGINT stop the run: ``signum`` records the first one (``request(signum)`` records one
    from another thread, as the signal would). The handler only
    records (the launcher's loop sees it within ``poll_s`` and kills the run's processes), except inside
    ``raising()``, where it raises _Interrupted at once. The previous handlers come back on exit. A signal
    the launcher inherited as ignored (``nohup``: SIGHUP; a background job of a script: SIGINT) stays
    ignored. Main thread only (elsewhere Python cannot install handlers; the signals keep their action)."""

    def __init__(self):
        self.signum: int | None = None
        self._raise = False
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) != signal.SIG_IGN:  # ignored on purpose (nohup, a background job): keep
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False

    @contextmanager
    def raising(self):
        if self.signum:
            raise _Interrupted()
        self._raise = True
        try:
            yield
        finally:
            self._raise = False

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Stop the run as signal ``signum`` would (from any thread; no handler runs: the loop sees it within
        ``poll_s``, or, before any process started, ``launch`` raises Interrupted)."""
        if self.signum is None:
            self.signum = signum

    def _handle(self, signum, _frame):
        if self.signum is None:
            self.signum = signum
        if self._raise:
            self._raise = False
            raise _Interrupted()


def _die_with_parent(sig: int = signal.SIGKILL):
    """A ``preexec_fn`` that gives the child a parent-death signal (prctl PR_SET_PDEATHSIG): when the
    launcher dies, even by SIGKILL, the kernel sends ``sig`` to mpiexec. (It fires when the thread that
    spawned the child ends: ``launch`` waits for mpiexec in that thread.) Resolved before the fork, so the
    child only makes two system calls."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def _run_once(cfg, rd, env, tail, on_poll, poll_s, timeout, start, stop, run_id, log, output):
    """One mpiexec of the whole job; returns (its exit status, the events it added, the processes of the
    run still alive after they were killed). Returns early, with every process of the run killed, once
    ``stop`` has recorded a signal."""
    new: list[dict] = []
    # the run's output reaches launcher.log through the launcher (outpump.py): a full, read-only or hung run
    # directory drops output, it never fails nor blocks a process of the run (hydra ended the job on ENOSPC)
    pump = OutputPump(rd.launcher_log)
    try:
        out = pump.fd
        t_spawn = time.monotonic()
        server = None
        # torch imported once for every training process of this attempt (worker/forkserver.py)
        if cfg.layout.fork_server:
            server, name = forkserver.start(env, stdout=out, preexec_fn=_die_with_parent())
            env = dict(env, **{forkserver.ENV: name})
        try:
            proc = subprocess.Popen(command(cfg, rd.path), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent())
        except BaseException:
            _stop_server(server)
            raise
        pump.handed_over()
        t_error = None
        started = False
        try:
            while True:
                done = proc.poll() is not None
                batch = tail.poll()
                new += batch
                started = started or any(e["event"] in ("started", "spare_ready") for e in batch)
                if not started and time.monotonic() - t_spawn > cfg.timeouts.startup_timeout + 10:
                    log.emit(
                        "error", error="StartupTimeout: the job did not start within "
                                       f"{cfg.timeouts.startup_timeout:.0f} s "
                                       f"(--startup-timeout): a process died or froze during MPI start-up; the stacks "
                                       f"where each one waited are in {rd.launcher_log}")
                    break
                if server is not None and server.poll() is not None:   # only this launcher kills it, after the loop
                    # every training process it forked died with it (parent-death signal): name the cause, or the
                    # summary would only see the agents' failures and mpiexec's end
                    log.emit(
                        "error", error=f"ForkServerLost: the fork server (pid {server.pid}) exited with status "
                                       f"{server.returncode}; every training process of this attempt died with it "
                                       f"(worker/forkserver.py; --no-fork-server starts them without it)")
                    server = _stop_server(server)
                if t_error is None and any(e["event"] == "error" for e in batch):
                    t_error = time.monotonic()  # the job is ending: a process that cannot (frozen) is ended below
                if on_poll and batch:
                    try:
                        on_poll(batch)
                    except OSError:  # the terminal is gone (SIGHUP): the run goes on, unseen
                        on_poll = None
                if done or stop.signum:
                    break
                if t_error is not None and time.monotonic() - t_error > 5 + 2 * cfg.timeouts.heartbeat_deadline:
                    break  # a process of the job reported an error and the others told to stop; some did not
                if timeout is not None and time.monotonic() - start > timeout:
                    raise TimeoutError(f"run exceeded {timeout} s")
                time.sleep(poll_s)
        finally:
            left = _stop_run(proc, rd.events, run_id, also=tail.spilled)
            _stop_server(server)   # after the run's processes: it kills nothing itself
    finally:
        pump.close()
        output.append(pump.stats())
    return proc.returncode, new, left


def _stop_server(server: subprocess.Popen | None) -> None:
    """SIGKILL the attempt's fork server (if any) and reap it; its children die with it (parent-death signal)."""
    if server is not None:
        server.kill()
        server.wait()


def _stop_run(proc: subprocess.Popen, events_path: str, run_id: str, wait_s: float = 5.0,
              also: list[dict] = ()) -> list[dict]:
    """Kill what is left of one mpiexec's run: mpiexec's process tree (the hydra proxies are in sessions
    of their own, so its process group is not enough) and the workers of this run id that logged hello
    (a worker whose proxy died is no longer in the tree). Each process is checked by pid + start time
    before it is signalled. Waits up to ``wait_s`` seconds; returns the processes still alive then."""
    tree = descendants(proc.pid) if proc.poll() is None else []
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    targets = tree + _hellos(events_path, run_id) + [e for e in also if e.get("event") == "hello"]
    for ident in targets:
        fence(ident)
    end = time.monotonic() + wait_s
    while time.monotonic() < end and any(is_alive(i) for i in targets):
        time.sleep(0.05)
    return [i for i in targets if is_alive(i)]


def _hellos(events_path: str, run_id: str) -> list[dict]:
    """The identities in the ``hello`` events of run ``run_id`` (other runs' processes are never ours)."""
    return [e for e in _read_run(events_path, run_id) if e.get("event") == "hello" and e.get("run") == run_id]
