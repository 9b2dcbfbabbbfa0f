"""What the submit side (slurm.py) and the in-job side (slurm_job.py) of a Slurm run both read: the run's
config, where each rank ran, and the run summary built from the event log.

Owns reading RUN_DIR/config.json and summary.json from the event log for Slurm jobs (sbatch template, submitit);
does not own how a job is submitted (slurm.py) nor what happens inside it (slurm_job.py). Imports no launch
module, so both of those can import it.
"""
from __future__ import annotations

import errno
import json
import os

from ..config import RunConfig
from ..events import read_events
from ..rundir import RunDir, latest_checkpoint, write_json
from ..summary import build_summary


def load_config(run_dir: str) -> RunConfig:
    with open(RunDir(run_dir).config) as fh:
        return RunConfig.from_json(fh.read())


def hosts_by_rank(events: list[dict], before: float | None = None) -> dict[int, str]:
    """MPI rank -> host, from the newest ``hello`` of each rank (written before ``before``, if given)."""
    return {e["mpi_rank"]: e["host"] for e in events
            if e["event"] == "hello" and e.get("role", "agent") == "agent" and (before is None or e["t"] < before)}


def companion_jobs_by_rank(events: list[dict], before: float | None = None) -> dict[int, str]:
    """MPI rank (node id) -> the companion job of the joined node that holds its slot (control/joining.py), from the
    newest ``hello`` of each rank written before ``before``; ranks whose newest agent started with the job are left
    out."""
    newest = {e["mpi_rank"]: e.get("companion_job") for e in events
              if e["event"] == "hello" and e.get("role", "agent") == "agent" and (before is None or e["t"] < before)}
    return {n: str(j) for n, j in newest.items() if j}


def make_summary(run_dir: str) -> dict:
    """build_summary over RUN_DIR/events.jsonl, plus where each rank ran and which hosts the failures took."""
    cfg = load_config(run_dir)
    path = RunDir(run_dir).events
    events = list(read_events(path)) if os.path.exists(path) else []
    s = build_summary(events, cfg)
    hosts = hosts_by_rank(events)
    decided = {e["generation"]: e["t"] for e in events if e["event"] == "decision"}
    for f in s["failures"]:
        at = hosts_by_rank(events, before=decided.get(f["generation"]))  # a requeued job runs elsewhere later
        f["failed_hosts"] = sorted({at.get(n) for n in f["failed_nodes"]} - {None})  # MPI rank n = node n's agent
    s["run_dir"] = os.path.abspath(run_dir)
    s["hosts"] = {str(k): v for k, v in sorted(hosts.items())}
    try:
        s["slurm_job_id"] = open(os.path.join(run_dir, "slurm_job_id")).read().strip()
    except OSError:
        s["slurm_job_id"] = os.environ.get("SLURM_JOB_ID")
    # signals that reached the batch shell, and why the run stopped short (slurm_job.settle), if it did
    s["signals"] = [{"signal": e.get("signal"), "t": e["t"], "host": e.get("host")} for e in events
                    if e["event"] == "batch_signal"]
    t_fin = max((e["t"] for e in events if e["event"] == "finished"), default=None)
    stops = [e for e in events if e["event"] == "stopped" and (t_fin is None or e["t"] > t_fin)]
    s["stopped"] = ({k: stops[-1].get(k) for k in ("t", "reason", "job_state", "checkpoint_step")}
                    if stops else None)
    s["checkpoint"] = latest_checkpoint(run_dir)  # what a requeue, or a new job with RESUME=1, resumes from
    return s


def summary_out(run_dir: str) -> str | None:
    """Where the run's summary goes besides RUN_DIR/summary.json: $DEADPOOL_SUMMARY (set by the batch script
    from SUMMARY, absolute), else the config's ``summary_path`` (made absolute when the config was written)."""
    out = os.environ.get("DEADPOOL_SUMMARY")
    if out:
        return out
    try:
        return load_config(run_dir).output.summary_path or None
    except (OSError, ValueError):
        return None


def write_summary(run_dir: str, out: str | None = None, extra: dict | None = None) -> dict:
    """make_summary (plus ``extra``) to RUN_DIR/summary.json and, if given, ``out``; both written atomically.
    A file that cannot be written (a full or read-only run directory) does not raise: the summary gets
    ``summary_written`` False and ``summary_error``, and is printed in full on stdout (the job's output) between
    the same marker lines as ``deadpool run``'s."""
    s = make_summary(run_dir)
    s.update(extra or {})
    s["summary_written"] = True
    for path in [RunDir(run_dir).summary] + ([out] if out else []):
        try:
            write_json(path, s)
        except OSError as exc:
            s["summary_written"] = False
            s.setdefault("summary_error", f"{path}: {errno.errorcode.get(exc.errno or 0, 'EIO')}: "
                                          f"{exc.strerror or exc}")
    if not s["summary_written"]:
        try:
            print("--- deadpool summary (not written: see summary_error) ---\n" + json.dumps(s, indent=1) +
                  "\n--- end of deadpool summary ---", flush=True)
        except (OSError, ValueError):
            pass
    return s
