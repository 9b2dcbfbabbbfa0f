"""Slurm launch: render and submit ``sbatch/train.sbatch``, and the small commands the job itself runs.

``python -m deadpool_hpc.launch.slurm`` sub-commands:

- ``write-config``  write RUN_DIR/config.json from ``deadpool run``-style options (the batch script uses it)
- ``submit``        write the config, render the template into RUN_DIR/job.sbatch, ``sbatch --parsable`` it
- ``render``        print the rendered batch script (nothing is submitted)
- ``status``        a job id or a run directory: Slurm's state plus the run's progress from its event log
- ``summary``       RUN_DIR/summary.json from the event log (exit 0 iff the run completed)
- ``task``          one Slurm task: run the worker, then, if the batch script died with its node, finish the job
- ``watch``         on the batch host: touch RUN_DIR/batch.alive every second; drain the nodes the run declares dead

The ranks are launched by ``srun --no-kill --kill-on-bad-exit=0 --mpi=pmi2`` inside an allocation made with
``--no-kill`` (docs/slurm.md explains why, with measurements). The batch host is an ordinary node of the
allocation (node of MPI rank 0 at the start): if it dies, the batch script and srun die with it but the ranks
train on. The tasks then finish the job themselves: the last one to exit writes summary.json and completes the job
through libslurm's ``slurm_complete_job`` (state COMPLETED when the run completed, FAILED otherwise), falling back
to ``scancel`` (state CANCELLED) if libslurm cannot be loaded.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from ..config import RunConfig
from ..errors import ConfigError
from ..events import read_events
from ..summary import build_summary

TEMPLATE_ENV = "DEADPOOL_SBATCH_TEMPLATE"
ALIVE_FILE = "batch.alive"
ALIVE_STALE_S = 10.0  # the batch host counts as dead when batch.alive has not been touched for this long


# ---- config, template, submission ------------------------------------------------------------------------------
def template_path(name: str = "train.sbatch") -> str:
    """The batch template: $DEADPOOL_SBATCH_TEMPLATE, else sbatch/<name> at the repository root."""
    env = os.environ.get(TEMPLATE_ENV)
    if env and name == "train.sbatch":
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.normpath(os.path.join(here, "..", "..", "sbatch", name))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found (set ${TEMPLATE_ENV} to the template of a source checkout)")
    return path


def write_config(cfg: RunConfig, run_dir: str | None = None) -> str:
    """Validate ``cfg`` and write it to RUN_DIR/config.json (run_dir defaults to cfg.run_dir). Returns the path."""
    run_dir = os.path.abspath(run_dir or cfg.run_dir)
    cfg.run_dir = run_dir
    cfg.validate()
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(cfg.to_json())
    os.replace(tmp, path)
    return path


def load_config(run_dir: str) -> RunConfig:
    with open(os.path.join(run_dir, "config.json")) as fh:
        return RunConfig.from_json(fh.read())


def render(cfg: RunConfig, template: str | None = None, python: str | None = None, job_name: str | None = None) -> str:
    """The batch script for ``cfg``: the template with ``--nodes`` set to nodes + spares and CONFIG/RUN_DIR/PYTHON
    pinned (the config must already be in RUN_DIR/config.json, see write_config)."""
    text = open(template or template_path()).read()
    run_dir = os.path.abspath(cfg.run_dir)
    text, n = re.subn(r"(?m)^#SBATCH --nodes=\d+$", f"#SBATCH --nodes={cfg.total_nodes}", text)
    if n != 1:
        raise ValueError("the template has no '#SBATCH --nodes=N' line")
    text = re.sub(r"(?m)^#SBATCH --output=.*$", f"#SBATCH --output={run_dir}/slurm-%j.out", text)
    if job_name:
        text = re.sub(r"(?m)^#SBATCH --job-name=.*$", f"#SBATCH --job-name={job_name}", text)
    pinned = ["", "# ---- pinned by deadpool_hpc.launch.slurm.render ----",
              f"CONFIG={shlex.quote(os.path.join(run_dir, 'config.json'))}",
              f"RUN_DIR={shlex.quote(run_dir)}",
              f"PYTHON=${{PYTHON:-{shlex.quote(python or sys.executable)}}}",
              f"SUMMARY=${{SUMMARY:-{shlex.quote(cfg.summary_path) if cfg.summary_path else ''}}}", ""]
    lines = text.split("\n")
    at = max(i for i, l in enumerate(lines) if l.startswith("#SBATCH")) + 1
    return "\n".join(lines[:at] + pinned + lines[at:])


def submit(cfg: RunConfig, partition: str | None = None, time: str | None = None, account: str | None = None,
           extra: list[str] | None = None, template: str | None = None) -> str:
    """Write the config, render the batch script into RUN_DIR/job.sbatch and submit it. Returns the job id."""
    write_config(cfg)
    run_dir = os.path.abspath(cfg.run_dir)
    script = os.path.join(run_dir, "job.sbatch")
    with open(script, "w") as fh:
        fh.write(render(cfg, template))
    cmd = ["sbatch", "--parsable", f"--chdir={run_dir}"]
    cmd += [f"--partition={partition}"] if partition else []
    cmd += [f"--time={time}"] if time else []
    cmd += [f"--account={account}"] if account else []
    cmd += list(extra or []) + [script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
    job_id = out.stdout.strip().split(";")[0]
    with open(os.path.join(run_dir, "slurm_job_id"), "w") as fh:
        fh.write(job_id + "\n")
    return job_id


# ---- status -------------------------------------------------------------------------------------------------------
def _run(cmd: list[str], timeout: float = 20) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def slurm_state(job_id: str) -> dict:
    """State, node list and exit code of a job: sacct (accounting), else scontrol (job still known to slurmctld)."""
    out = _run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobID,State,NodeList,ExitCode,Elapsed"])
    for line in out.splitlines():
        f = line.split("|")
        if len(f) >= 5 and f[0] == str(job_id):
            return {"job_id": str(job_id), "state": f[1].split()[0], "nodelist": f[2], "exit_code": f[3],
                    "elapsed": f[4], "source": "sacct"}
    out = _run(["scontrol", "show", "job", "-o", str(job_id)])
    if out:
        kv = dict(re.findall(r"(\w+)=(\S*)", out))
        return {"job_id": str(job_id), "state": kv.get("JobState"), "nodelist": kv.get("NodeList"),
                "exit_code": kv.get("ExitCode"), "batch_host": kv.get("BatchHost"), "source": "scontrol"}
    return {"job_id": str(job_id), "state": None}


def hosts_by_rank(events: list[dict], before: float | None = None) -> dict[int, str]:
    """MPI rank -> host, from the newest ``hello`` of each rank (written before ``before``, if given)."""
    return {e["mpi_rank"]: e["host"] for e in events
            if e["event"] == "hello" and (before is None or e["t"] < before)}


def run_progress(run_dir: str) -> dict:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return {"run_dir": run_dir, "events": 0}
    events = list(read_events(path))
    steps = [e for e in events if e["event"] == "step"]
    hosts = hosts_by_rank(events)
    out = {"run_dir": run_dir, "events": len(events), "step": max((e["step"] for e in steps), default=0),
           "loss": steps[-1].get("loss") if steps else None,
           "hosts": {str(k): v for k, v in sorted(hosts.items())},
           "failures": [{"generation": e["generation"], "failed_nodes": e["failed_nodes"], "promoted": e["promoted"],
                         "cut_step": e["cut_step"]} for e in events if e["event"] == "decision"],
           "finished": any(e["event"] == "finished" for e in events),
           "errors": [e.get("error") for e in events if e["event"] == "error"]}
    return out


def status(run_dir_or_jobid: str) -> dict:
    """Slurm's view of the job and the run's progress. Accepts a job id or a run directory."""
    arg = str(run_dir_or_jobid)
    run_dir, job_id = None, None
    if os.path.isdir(arg):
        run_dir = os.path.abspath(arg)
        try:
            job_id = open(os.path.join(run_dir, "slurm_job_id")).read().strip()
        except OSError:
            job_id = None
    elif arg.isdigit():
        job_id = arg
        out = _run(["scontrol", "show", "job", "-o", job_id])
        m = re.search(r"Command=(\S+)", out)
        if m and os.path.basename(m.group(1)) == "job.sbatch":
            run_dir = os.path.dirname(m.group(1))
    else:
        raise ValueError(f"{arg!r} is neither a run directory nor a job id")
    res = {"slurm": slurm_state(job_id) if job_id else None}
    if run_dir:
        res["run"] = run_progress(run_dir)
        try:
            res["summary"] = json.load(open(os.path.join(run_dir, "summary.json")))
        except (OSError, ValueError):
            pass
    return res


# ---- summary ------------------------------------------------------------------------------------------------------
def make_summary(run_dir: str) -> dict:
    """build_summary over RUN_DIR/events.jsonl, plus where each rank ran and which hosts the failures took."""
    cfg = load_config(run_dir)
    path = os.path.join(run_dir, "events.jsonl")
    events = list(read_events(path)) if os.path.exists(path) else []
    s = build_summary(events, cfg)
    hosts = hosts_by_rank(events)
    P = cfg.ranks_per_node
    decided = {e["generation"]: e["t"] for e in events if e["event"] == "decision"}
    for f in s["failures"]:
        at = hosts_by_rank(events, before=decided.get(f["generation"]))  # a requeued job runs elsewhere later
        f["failed_hosts"] = sorted({at.get(n * P + r) for n in f["failed_nodes"] for r in range(P)} - {None})
    s["run_dir"] = os.path.abspath(run_dir)
    s["hosts"] = {str(k): v for k, v in sorted(hosts.items())}
    try:
        s["slurm_job_id"] = open(os.path.join(run_dir, "slurm_job_id")).read().strip()
    except OSError:
        s["slurm_job_id"] = os.environ.get("SLURM_JOB_ID")
    return s


def write_summary(run_dir: str, out: str | None = None, extra: dict | None = None) -> dict:
    s = make_summary(run_dir)
    s.update(extra or {})
    for path in [os.path.join(run_dir, "summary.json")] + ([out] if out else []):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(s, fh, indent=1)
        os.replace(tmp, path)
    return s


# ---- inside the job: the task wrapper, the finisher, the watcher ------------------------------------------------
def run_worker(run_dir: str, env: dict | None = None) -> int:
    """Run ``python -m deadpool_hpc.worker.entry RUN_DIR`` as a child, passing on the PMI-2 descriptor that srun
    gave this task (close_fds would otherwise close it), and forwarding Slurm's signals. Returns its exit code."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    fds = tuple(int(env[k]) for k in ("PMI_FD",) if env.get(k, "").isdigit())
    proc = subprocess.Popen([sys.executable, "-m", "deadpool_hpc.worker.entry", run_dir], env=env, pass_fds=fds)
    old = {}

    def forward(sig, _frame):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCONT):  # not USR1/2: their default action would kill it
        old[sig] = signal.signal(sig, forward)
    try:
        return proc.wait()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _task_id() -> int:
    return int(os.environ.get("SLURM_PROCID", os.environ.get("PMI_RANK", "0")))


def mark_exited(run_dir: str, rc: int) -> None:
    d = os.path.join(run_dir, "exited")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, str(_task_id())), "w") as fh:
        fh.write(f"{rc} {os.uname().nodename} {time.time()}\n")


def exited_tasks(run_dir: str) -> set[int]:
    return {int(os.path.basename(p)) for p in glob.glob(os.path.join(run_dir, "exited", "*"))
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
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        with open(alive, "a"):
            os.utime(alive)
        if do_drain and os.path.exists(events_path):
            try:
                events = list(read_events(events_path))
                P = load_config(run_dir).ranks_per_node
                hosts = hosts_by_rank(events)
                for e in events:
                    if e["event"] != "decision":
                        continue
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
    if attempts >= load_config(run_dir).max_requeues:
        print(f"[deadpool] not requeued: {attempts} requeues already (max_requeues)", file=sys.stderr)
        return False
    job_id = os.environ.get("SLURM_JOB_ID") or open(os.path.join(run_dir, "slurm_job_id")).read().strip()
    EventLog(path).emit("requeued", attempt=attempts + 1, slurm_job_id=job_id,
                        checkpoint=persist.latest(os.path.join(run_dir, "checkpoint")))
    out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        print(f"[deadpool] scontrol requeue {job_id} failed: {out.stderr.strip()}", file=sys.stderr)
        return False
    return True


# ---- CLI ----------------------------------------------------------------------------------------------------------
def _config_from(a) -> RunConfig:
    from .cli import config_from_args

    return config_from_args(a)


def main(argv=None) -> int:
    from .cli import add_run_options

    p = argparse.ArgumentParser(prog="python -m deadpool_hpc.launch.slurm", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    wc = sub.add_parser("write-config", help="write RUN_DIR/config.json")
    add_run_options(wc)
    sm = sub.add_parser("submit", help="write the config, render the template, sbatch it; prints the job id")
    add_run_options(sm)
    rd = sub.add_parser("render", help="print the batch script for these options")
    add_run_options(rd)
    for q in (sm,):
        q.add_argument("--partition")
        q.add_argument("--time")
        q.add_argument("--account")
        q.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch argument (repeatable)")
    st = sub.add_parser("status", help="job id or run dir")
    st.add_argument("target")
    su = sub.add_parser("summary", help="write RUN_DIR/summary.json")
    su.add_argument("run_dir")
    su.add_argument("--out")
    tk = sub.add_parser("task", help="(inside srun) run one worker, finish the job if the batch host died")
    tk.add_argument("run_dir")
    tk.add_argument("--no-finisher", action="store_true")
    rq = sub.add_parser("requeue-if-needed", help="(batch script) requeue the job if no spare was left")
    rq.add_argument("run_dir")
    wt = sub.add_parser("watch", help="(on the batch host) heartbeat file + drain dead nodes")
    wt.add_argument("run_dir")
    wt.add_argument("--drain", default="1")
    a = p.parse_args(argv)
    try:
        if a.cmd == "write-config":
            print(write_config(_config_from(a)))
        elif a.cmd == "render":
            cfg = _config_from(a)
            print(render(cfg))
        elif a.cmd == "submit":
            print(submit(_config_from(a), a.partition, a.time, a.account, a.sbatch_arg))
        elif a.cmd == "status":
            print(json.dumps(status(a.target), indent=1))
        elif a.cmd == "summary":
            s = write_summary(a.run_dir, a.out)
            f = s["failures"]
            print(f"[deadpool] summary: completed={s['completed']} steps={s['steps_completed']} "
                  f"final_loss={s['final_loss']} swaps={s['swaps']} "
                  f"recovery_s={[round(x['recovery_s'], 2) if x['recovery_s'] else None for x in f]} "
                  f"digest={s['param_digest']}")
            return 0 if s["completed"] else 1
        elif a.cmd == "task":
            return task_main(a.run_dir, finisher=not a.no_finisher)
        elif a.cmd == "requeue-if-needed":
            return 0 if requeue_if_needed(a.run_dir) else 1
        elif a.cmd == "watch":
            watch(a.run_dir, do_drain=a.drain not in ("0", "no", "false", ""))
    except ConfigError as exc:
        print(f"deadpool: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
