"""Embedded launch: N active + S spare emulated nodes as local processes under MPICH's hydra.

Each emulated node is one hydra proxy (``-launcher fork -hosts 127.0.0.1,127.0.0.2,...`` with
``-ppn`` ranks per node) and the rank processes under it; ``-disable-auto-cleanup`` keeps the
survivors alive when a node's processes die (notes/ft-probes.md 2a). The proxies and mpiexec are
the launcher: killing a proxy ends the job (hydra asserts on a lost proxy socket), so an emulated
node's death is the death of its rank processes, which is what a fault spec does. No other process
is special: the store of each generation lives in a worker.

``launch`` returns the run summary (summary.build_summary) after every process has exited; any
worker still alive then (there should be none) is killed by pid, after checking its start time.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

from ..config import RunConfig
from ..control.fence import fence, is_alive
from ..events import EventLog, EventTail, read_events
from ..replica import persist
from ..summary import build_summary


def mpiexec_path() -> str:
    """The hydra mpiexec of the MPICH wheel beside this Python (falls back to PATH)."""
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(cand):
        return cand
    found = shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("mpiexec not found; install the MPICH wheel: pip install mpich mpi4py")
    return found


def prepare_run_dir(cfg: RunConfig) -> str:
    """Make a fresh run directory (a previous run's events and checkpoints are removed)."""
    run_dir = os.path.abspath(cfg.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    for name in ("events.jsonl", "summary.json", "launcher.log"):
        try:
            os.remove(os.path.join(run_dir, name))
        except FileNotFoundError:
            pass
    shutil.rmtree(os.path.join(run_dir, "checkpoint"), ignore_errors=True)
    with open(os.path.join(run_dir, "config.json"), "w") as fh:
        fh.write(cfg.to_json())
    return run_dir


def emulated_node_env(cfg: RunConfig) -> dict[str, str]:
    """MPICH settings that make the emulated nodes separate nodes to MPI, as real ones are: ranks of one
    emulated node share memory, ranks of different ones talk through the network module (UCX).

    Measured (this machine, MPICH 5.0.2 wheel): with every rank in one shared-memory domain, a rank that
    keeps sending 1.8 MB eager messages to a SIGSTOPped peer stopped reaching a third, live rank for 2.3 s
    (its shared-memory send cells all sat in the frozen peer's queue), so the live ranks suspected each
    other after a hang or a kill. With one clique per emulated node the longest silence was 0.13-0.17 s.
    Real nodes never share memory, so this also makes the emulation faithful."""
    return {"MPIR_CVAR_NUM_CLIQUES": str(cfg.total_nodes), "MPIR_CVAR_CLIQUES_BY_BLOCK": "1"}


def command(cfg: RunConfig, run_dir: str) -> list[str]:
    hosts = ",".join(f"127.0.0.{i + 1}" for i in range(cfg.total_nodes))
    return [mpiexec_path(), "-disable-auto-cleanup", "-launcher", "fork", "-hosts", hosts,
            "-ppn", str(cfg.ranks_per_node), "-n", str(cfg.total_processes),
            sys.executable, "-m", "deadpool_hpc.worker.entry", run_dir]


def launch(cfg: RunConfig, on_poll=None, poll_s: float = 0.25, timeout: float | None = None) -> dict:
    """Run ``cfg`` on this machine and return its summary.

    on_poll(events) is called with the new events every ``poll_s`` seconds (the live console).
    timeout: seconds before the whole run is killed (None: no limit). Raises ConfigError first for
    a bad config; a run that fails still returns a summary (``completed`` False).
    """
    cfg.validate()
    _terminate_on_sigterm()
    from ..train.corpus import load_tokens

    if cfg.train_fn.startswith("deadpool_hpc.train."):
        load_tokens()  # build the corpus cache once, and fail here (clearly) if the corpus is missing
    run_dir = prepare_run_dir(cfg)
    env = dict(os.environ, DEADPOOL_JOB_SECRET=secrets.token_hex(32), DEADPOOL_STORE_HOST="127.0.0.1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **emulated_node_env(cfg))
    events_path = os.path.join(run_dir, "events.jsonl")
    start = time.monotonic()
    tail = EventTail(events_path)
    for attempt in range(cfg.max_requeues + 1 if cfg.requeue else 1):
        if attempt:
            EventLog(events_path).emit("requeued", attempt=attempt, checkpoint=persist.latest(os.path.join(run_dir, "checkpoint")))
        rc, new = _run_once(cfg, run_dir, env, events_path, tail, on_poll, poll_s, timeout, start)
        this = {e["event"] for e in new}
        if "finished" in this or "checkpoint_saved" not in this:
            break
    events = list(read_events(events_path)) if os.path.exists(events_path) else []
    summary = build_summary(events, cfg)
    summary["run_dir"] = run_dir
    summary["mpiexec_rc"] = rc  # non-zero whenever a rank was killed; "completed" says how the run went
    return summary


def _run_once(cfg, run_dir, env, events_path, tail, on_poll, poll_s, timeout, start):
    """One mpiexec of the whole job; returns (its exit status, the events it added)."""
    new: list[dict] = []
    with open(os.path.join(run_dir, "launcher.log"), "ab") as out:
        proc = subprocess.Popen(command(cfg, run_dir), env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            while True:
                done = proc.poll() is not None
                batch = tail.poll()
                new += batch
                if on_poll and batch:
                    on_poll(batch)
                if done:
                    break
                if timeout is not None and time.monotonic() - start > timeout:
                    raise TimeoutError(f"run exceeded {timeout} s")
                time.sleep(poll_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            _reap_workers(events_path)
    return proc.returncode, new


def _terminate_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so the ``finally`` that kills the job's processes runs."""
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _reap_workers(events_path: str) -> None:
    """Kill any worker of this run still alive (identified by pid + start time from its hello)."""
    if not os.path.exists(events_path):
        return
    hellos = [e for e in read_events(events_path) if e.get("event") == "hello"]
    for e in hellos:
        fence(e)
    end = time.monotonic() + 5.0
    while time.monotonic() < end and any(is_alive(e) for e in hellos):
        time.sleep(0.05)
