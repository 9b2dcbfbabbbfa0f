"""Inside a Slurm job: the task wrapper, the batch-host watcher, the finisher, drain and requeue.

``python -m deadpool_hpc.launch.slurm task|watch|requeue-if-needed`` run these (sbatch/train.sbatch).
The batch host is an ordinary node of the allocation: if it dies, the batch script and srun die with
it but the ranks train on; each task then checks whether the watcher still touches RUN_DIR/batch.alive,
and the last one to exit writes summary.json and completes the job itself (docs/slurm.md).
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

from ..events import read_events
from .slurm import hosts_by_rank, load_config, write_summary

ALIVE_FILE = "batch.alive"
ALIVE_STALE_S = 10.0  # the batch host counts as dead when batch.alive has not been touched for this long


# ---- inside the job: the task wrapper, the finisher, the watcher ------------------------------------------------
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGCONT, signal.SIGUSR2)


def run_worker(run_dir: str, env: dict | None = None, forward_signals=FORWARDED, on_start=None) -> int:
    """Run ``python -m deadpool_hpc.worker.entry RUN_DIR`` as a child, passing on the PMI descriptor that srun
    gave this task (close_fds would otherwise close it), and forwarding ``forward_signals`` to it (SIGUSR2 is
    Slurm's warning before preemption or the time limit: the worker saves a checkpoint and exits 75).
    ``on_start(proc)`` is called once the child runs. Returns its exit code."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    fds = tuple(int(env[k]) for k in ("PMI_FD",) if env.get(k, "").isdigit())
    # SIGUSR2 is blocked across the spawn: here until the forwarder is installed, and in the worker (which
    # inherits the mask) until its handler is (worker/entry.py unblocks it); otherwise its default action
    # would kill either process. A signal that arrives meanwhile stays pending and is delivered then.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    old = {}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "deadpool_hpc.worker.entry", run_dir], env=env, pass_fds=fds)
        if on_start is not None:
            on_start(proc)

        def forward(sig, _frame):
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass

        for sig in forward_signals:
            old[sig] = signal.signal(sig, forward)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        return proc.wait()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _task_id() -> int:
    return int(os.environ.get("SLURM_PROCID", os.environ.get("PMI_RANK", "0")))


def _exited_dir(run_dir: str) -> str:
    """RUN_DIR/exited/ATTEMPT: one marker per task that has exited, per attempt of the job (a requeued job keeps
    its id and run directory; Slurm numbers its attempts with SLURM_RESTART_COUNT)."""
    return os.path.join(run_dir, "exited", os.environ.get("SLURM_RESTART_COUNT", "0"))


def mark_exited(run_dir: str, rc: int) -> None:
    d = _exited_dir(run_dir)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, str(_task_id())), "w") as fh:
        fh.write(f"{rc} {os.uname().nodename} {time.time()}\n")


def exited_tasks(run_dir: str) -> set[int]:
    return {int(os.path.basename(p)) for p in glob.glob(os.path.join(_exited_dir(run_dir), "*"))
            if os.path.basename(p).isdigit()}


def expected_survivors(run_dir: str) -> set[int]:
    """MPI ranks that should still exit by themselves: every rank that said hello, less those on nodes the run
    declared failed. (The ranks of a node that died without being noticed, e.g. at the very end, are waited for
    only up to the finisher's timeout.)"""
    cfg = load_config(run_dir)
    events = list(read_events(os.path.join(run_dir, "events.jsonl")))
    failed = {n for e in events if e["event"] == "decision" for n in e["failed_nodes"]}
    return {e["mpi_rank"] for e in events if e["event"] == "hello" and e["mpi_rank"] // cfg.ranks_per_node not in failed}


def batch_alive(run_dir: str, stale_s: float = ALIVE_STALE_S) -> bool:
    """Whether the batch script's watcher still runs: True as soon as RUN_DIR/batch.alive is touched again
    (it is touched every second), False once its mtime has not moved for ``stale_s`` seconds. Only the file's
    own mtime values are compared, so the clocks of the file server and of this node do not matter."""
    path = os.path.join(run_dir, ALIVE_FILE)

    def mtime():
        try:
            return os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return None

    first = mtime()
    end = time.monotonic() + stale_s
    while time.monotonic() < end:
        time.sleep(0.25)
        m = mtime()
        if m is not None and m != first:
            return True
    return False


_COMPLETE_SNIPPET = """
import ctypes, ctypes.util, sys
job, rc = int(sys.argv[1]), int(sys.argv[2])
for name in ("/usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so", "/usr/lib64/slurm/libslurmfull.so",
             "/usr/lib/slurm/libslurmfull.so", ctypes.util.find_library("slurmfull"), ctypes.util.find_library("slurm")):
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
    first to take RUN_DIR/finisher.lock) waits for the other survivors, writes summary.json and ends the job.
    Returns the summary if this task finished the job, else None."""
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
    s = write_summary(run_dir, extra={"finished_by": f"task {_task_id()} on {os.uname().nodename} (batch host dead)"})
    if os.environ.get("DRAIN_FAILED", "1") not in ("0", "no", "false", ""):  # the watcher died with the batch host
        for f in s["failures"]:
            for h in f.get("failed_hosts", []):
                drain(h, f"deadpool job {os.environ.get('SLURM_JOB_ID', '?')}: declared dead")
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id:
        with open(os.path.join(run_dir, "finisher.log"), "a") as fh:
            fh.write(f"{time.time()} task {_task_id()} on {os.uname().nodename}: batch host dead, ending job {job_id}\n")
            fh.flush()
            how = complete_job(job_id, 0 if s["completed"] else 1)  # may kill this very task: log first
            fh.write(f"{time.time()} {how}\n")
    return s


def task_main(run_dir: str, finisher: bool = True) -> int:
    rc = run_worker(run_dir)
    mark_exited(run_dir, rc)
    if finisher and os.environ.get("SLURM_JOB_ID"):
        finish_headless(run_dir)
    return rc


def drain(node: str, reason: str) -> bool:
    """``scontrol update nodename=NODE state=drain``: needs SlurmUser/admin (or root). False if refused."""
    try:
        out = subprocess.run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"[deadpool] drain {node}: {exc}", file=sys.stderr)
        return False
    if out.returncode != 0:
        print(f"[deadpool] drain {node} refused (needs SlurmUser/admin): {out.stderr.strip()}", file=sys.stderr)
    return out.returncode == 0


def watch(run_dir: str, do_drain: bool = True, period: float = 1.0) -> None:
    """Run on the batch host until killed: keep RUN_DIR/batch.alive fresh, drain each node the run declares dead."""
    alive = os.path.join(run_dir, ALIVE_FILE)
    events_path = os.path.join(run_dir, "events.jsonl")
    drained: set[str] = set()
    t_start = time.time()  # decisions of earlier attempts (a requeued job) were drained by their own watcher
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        with open(alive, "a"):
            os.utime(alive)
        if do_drain and os.path.exists(events_path):
            try:
                events = list(read_events(events_path))
                P = load_config(run_dir).ranks_per_node
                for e in events:
                    if e["event"] != "decision" or e["t"] < t_start:
                        continue
                    hosts = hosts_by_rank(events, before=e["t"])  # where the ranks ran when it was decided
                    for n in e["failed_nodes"]:
                        for r in range(P):
                            h = hosts.get(n * P + r)
                            if h and h not in drained:
                                drained.add(h)
                                ok = drain(h, f"deadpool job {os.environ.get('SLURM_JOB_ID', '?')}: declared dead")
                                print(f"[deadpool] {'drained' if ok else 'could not drain'} {h} "
                                      f"(node{n} of the run, generation {e['generation']})", flush=True)
            except (OSError, ValueError, KeyError) as exc:
                print(f"[deadpool] watch: {exc}", file=sys.stderr)
        time.sleep(period)


# ---- no spare left: requeue ---------------------------------------------------------------------------------------
def requeue_if_needed(run_dir: str) -> bool:
    """If this attempt ended with a saved checkpoint and no finish, log ``requeued`` and ``scontrol requeue``
    the job (it resumes from RUN_DIR/checkpoint). True if the job was requeued."""
    from ..events import EventLog
    from ..replica import persist

    path = os.path.join(run_dir, "events.jsonl")
    events = list(read_events(path)) if os.path.exists(path) else []
    names = [e["event"] for e in events]
    last_ckpt = max((i for i, n in enumerate(names) if n == "checkpoint_saved"), default=-1)
    last_fin = max((i for i, n in enumerate(names) if n == "finished"), default=-1)
    if last_ckpt < 0 or last_fin > last_ckpt:
        return False
    attempts = names.count("requeued")
    reason = events[last_ckpt].get("reason", "no spare node left")
    # max_requeues caps requeues after lost nodes; a time limit or a preemption (SIGUSR2) is routine for a
    # long job and is not counted
    lost = sum(1 for e in events if e["event"] == "requeued" and e.get("reason") != "preempted")
    if reason != "preempted" and lost >= load_config(run_dir).max_requeues:
        print(f"[deadpool] not requeued: {lost} requeues after lost nodes already (max_requeues)", file=sys.stderr)
        return False
    job_id = os.environ.get("SLURM_JOB_ID") or open(os.path.join(run_dir, "slurm_job_id")).read().strip()
    EventLog(path).emit("requeued", attempt=attempts + 1, slurm_job_id=job_id, reason=reason,
                        checkpoint=persist.latest(os.path.join(run_dir, "checkpoint")))
    out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        print(f"[deadpool] scontrol requeue {job_id} failed: {out.stderr.strip()}", file=sys.stderr)
        return False
    return True


