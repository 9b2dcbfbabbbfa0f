"""Slurm launch: render and submit the batch template (``templates/train.sbatch``, shipped with the package), the
job's status, and the functions the job itself runs at its start and end (``python -m deadpool_hpc.launch.batch``,
batch.py, calls them: write_config, copy_config, prepare, end_attempt).

People submit with ``deadpool submit`` or ``SlurmExecutor`` (executors.py), which call ``submit`` here.

The ranks are launched by ``srun --no-kill --kill-on-bad-exit=0 --mpi=pmi2`` inside an allocation made with
``--no-kill`` (docs/slurm.md explains why, with measurements). What runs inside the job (task wrapper, watcher,
finisher when the batch host dies, drain, requeue or stop) is in slurm_job.py; what both sides read (config,
summary) in slurm_common.py; the run options in options.py.

Paths: a relative ``--run-dir``, ``--summary`` or ``CONFIG`` means the submitter's current directory on every
launch path (``deadpool submit`` makes them absolute before it submits; the templates resolve them against
``$SLURM_SUBMIT_DIR``; ``SubmititExecutor.submit`` against the directory it is called in).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
import sys
from importlib import resources

from ..config import RunConfig
from ..errors import ConfigError
from ..events import read_events
from .. import rundir
from ..rundir import RunDir, check_free
from . import slurm_job, timelimit
from .slurm_common import hosts_by_rank as hosts_by_rank
from .slurm_common import load_config as load_config
from .slurm_common import make_summary as make_summary
from .slurm_common import summary_out as summary_out
from .slurm_common import write_summary as write_summary

TEMPLATE_ENV = "DEADPOOL_SBATCH_TEMPLATE"
TEMPLATES = ("train.sbatch", "scaling.sbatch", "companion.sbatch")  # package data: deadpool_hpc/launch/templates/
#                                                   (companion.sbatch: submitted by the job itself, launch/companion.py)


# ---- config, template, submission ------------------------------------------------------------------------------
def template_path(name: str = "train.sbatch") -> str:
    """The path of the batch template ``name`` (one of TEMPLATES): $DEADPOOL_SBATCH_TEMPLATE for train.sbatch when
    it is set, else the copy shipped inside this package (deadpool_hpc/launch/templates/, package data), so that an
    installed wheel renders and submits the same script as a checkout; a checkout's sbatch/ holds links to it.

    A file-system path, because sbatch reads the file. Raises FileNotFoundError naming the template when the
    package has no such file (an unknown ``name``, or a package imported from a zip archive)."""
    env = os.environ.get(TEMPLATE_ENV)
    if env and name == "train.sbatch":
        return env
    found = resources.files(__package__) / "templates" / name
    path = os.fspath(found) if isinstance(found, os.PathLike) else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(f"batch template {name!r} not found in the installed package ({found}); accepted: "
                                f"{', '.join(TEMPLATES)}, or ${TEMPLATE_ENV} set to a train template")
    return path


def template_home(template: str) -> str:
    """The deadpool-hpc home that a batch template belongs to (its DEADPOOL_HOME, which the template itself derives
    the same way from its submitted path): the directory above the package for the package's own copy
    (``HOME/deadpool_hpc/launch/templates/NAME``: a checkout, or site-packages), else the parent of the template's
    directory (a checkout's ``HOME/sbatch/NAME``, or a copy kept as ``DIR/sbatch/NAME``)."""
    folder = os.path.dirname(os.path.abspath(template))
    inside = os.sep + os.path.join("deadpool_hpc", "launch", "templates")
    if folder.endswith(inside):
        return folder[: -len(inside)]
    return os.path.dirname(folder)


def write_config(cfg: RunConfig, run_dir: str | None = None) -> str:
    """Validate ``cfg`` and write it to RUN_DIR/config.json (run_dir defaults to cfg.run_dir). Returns the path.
    A relative run_dir, ``summary_path`` or ``metrics_textfile`` is made absolute against this process's current
    directory (the submitter's, on every launch path)."""
    run_dir = os.path.abspath(run_dir or cfg.output.run_dir)
    cfg.update(run_dir=run_dir)
    if cfg.output.summary_path:
        cfg.update(summary_path=os.path.abspath(cfg.output.summary_path))
    if cfg.output.metrics_textfile:
        cfg.update(metrics_textfile=os.path.abspath(cfg.output.metrics_textfile))
    cfg.validate()
    os.makedirs(run_dir, exist_ok=True)
    return rundir.write_config(run_dir, cfg)


def copy_config(config: str, run_dir: str) -> str:
    """Copy the config file ``config`` (a RunConfig's JSON: ``CONFIG`` of the batch template) to
    RUN_DIR/config.json atomically, unless it is that file. Raises ConfigError if it is not a RunConfig."""
    dest = RunDir(run_dir).config
    try:
        if os.path.exists(dest) and os.path.samefile(config, dest):
            return dest
        with open(config) as fh:
            text = fh.read()
        RunConfig.from_json(text)
    except OSError as exc:
        raise ConfigError(f"CONFIG {config!r}: cannot be read ({exc.strerror or exc})") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"CONFIG {config!r}: not a RunConfig ({exc}); accepted: a config.json written by "
                          f"`python -m deadpool_hpc.launch.batch write-config` or a run") from None
    return rundir.write_config(run_dir, text)


def prepare(run_dir: str, resume: bool = False) -> dict | None:
    """The batch template's set-up of RUN_DIR (rundir.prepare_run_dir; the batch shell holds run.lock): a fresh
    run, or with ``resume`` the resumed run, if RUN_DIR has a checkpoint. Says which; returns the checkpoint's
    LATEST when resuming."""
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    path = RunDir(run_dir).events
    keep = False
    if resume and restart > 0 and rundir.latest_checkpoint(run_dir) is None and os.path.exists(path):
        # the previous attempt was stopped before its first step with no checkpoint yet (slurm_job.settle: requeued
        # ``idle``): this attempt starts at step 0 again, but the log keeps counting such requeues (their bound)
        requeues = [e for e in read_events(path) if e["event"] == "requeued"]
        keep = bool(requeues) and bool(requeues[-1].get("idle"))
    latest = rundir.prepare_run_dir(run_dir, resume=resume, keep_events=keep)
    if latest is not None:
        print(f"[deadpool] resuming from {json.dumps(latest)} (restart {os.environ.get('SLURM_RESTART_COUNT', '0')})")
    if restart > 0 and os.path.exists(path):
        # a requeue this run did not ask for (``scontrol requeue``, a job killed outright and requeued, a lost
        # allocation): counted like the run's own, with what it resumes from (the agents' newest persisted or saved
        # checkpoint: agent/persister.py)
        if sum(1 for e in read_events(path) if e["event"] == "requeued") < restart:
            from ..events import EventLog

            rundir.emit_requeued(EventLog(path), restart, slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                                 reason="requeued by Slurm, not by this run (scontrol requeue, an outright kill, a "
                                        "lost node of the batch step)", checkpoint=latest)
    return latest


def render(cfg: RunConfig, template: str | None = None, python: str | None = None, job_name: str | None = None,
           signal_lead: int | None = None) -> str:
    """The batch script for ``cfg``: the template with ``--nodes`` set to nodes + spares and CONFIG/RUN_DIR/PYTHON/
    SUMMARY/DEADPOOL_HOME pinned (the config must already be in RUN_DIR/config.json, see write_config); with
    ``signal_lead`` (seconds), its ``#SBATCH --signal=USR2@120`` line says that lead instead."""
    template = template or template_path()
    text = open(template).read()
    run_dir = os.path.abspath(cfg.output.run_dir)
    text, n = re.subn(r"(?m)^#SBATCH --nodes=\d+$", f"#SBATCH --nodes={cfg.layout.total_nodes}", text)
    if n != 1:
        raise ValueError("the template has no '#SBATCH --nodes=N' line")
    if signal_lead is not None:
        text, n = re.subn(r"(?m)^#SBATCH --signal=(\w+)@\d+$", lambda m: f"#SBATCH --signal={m.group(1)}@{signal_lead}",
                          text)
        if n != 1:
            raise ValueError("the template has no '#SBATCH --signal=SIG@SECONDS' line")
    text = re.sub(r"(?m)^#SBATCH --output=.*$", f"#SBATCH --output={run_dir}/slurm-%j.out", text)
    if job_name:
        text = re.sub(r"(?m)^#SBATCH --job-name=.*$", f"#SBATCH --job-name={job_name}", text)
    summary = shlex.quote(os.path.abspath(cfg.output.summary_path)) if cfg.output.summary_path else ""
    pinned = ["", "# ---- pinned by deadpool_hpc.launch.slurm.render ----",
              f"CONFIG={shlex.quote(os.path.join(run_dir, 'config.json'))}",
              f"RUN_DIR={shlex.quote(run_dir)}",
              f"PYTHON=${{PYTHON:-{shlex.quote(python or sys.executable)}}}",
              f"SUMMARY=${{SUMMARY:-{summary}}}",
              f"DEADPOOL_HOME=${{DEADPOOL_HOME:-{shlex.quote(template_home(template))}}}",
              ""]
    lines = text.split("\n")
    at = max(i for i, l in enumerate(lines) if l.startswith("#SBATCH")) + 1
    return "\n".join(lines[:at] + pinned + lines[at:])


def _partition_of(extra: list[str] | None) -> str | None:
    """The partition named in extra sbatch arguments (``--partition=P``, ``--partition P``, ``-pP``, ``-p P``)."""
    args = list(extra or [])
    found = None
    for i, a in enumerate(args):
        if a.startswith("--partition="):
            found = a.split("=", 1)[1]
        elif a in ("--partition", "-p") and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith("-p") and len(a) > 2 and not a.startswith("--"):
            found = a[2:]
    return found


def check_partition(cfg: RunConfig, partition: str | None = None) -> dict | None:
    """Refuse a job that could never start: raises ConfigError, naming the numbers, when the partition (default:
    Slurm's default partition) has fewer nodes than ``nodes + spares``, allows fewer per job (MaxNodes), or has
    fewer than that many nodes with ``ranks_per_node`` CPUs. (Slurm would accept such a job and leave it pending
    for ever, reason PartitionNodeLimit.) Down or drained nodes do not count against the job: they may come back.
    Returns what was checked, or None when Slurm does not know the partition or cannot be asked (sbatch then
    says why)."""
    out = _run(["scontrol", "show", "partition", "-o"] + ([partition] if partition else []))
    parts = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]
    part = next((p for p in parts if (p.get("PartitionName") == partition if partition else p.get("Default") == "YES")),
                None)
    if part is None:
        return None
    name = part["PartitionName"]
    need = cfg.layout.total_nodes
    total = int(part.get("TotalNodes", "0") or 0)
    max_nodes = part.get("MaxNodes", "UNLIMITED")
    what = f"the job needs {need} nodes ({cfg.layout.nodes} active + {cfg.layout.spares} spare)"
    if total and need > total:
        raise ConfigError(f"{what} but partition {name!r} has {total}: it could never start (Slurm would leave it "
                          f"pending for ever, PartitionNodeLimit); accepted: --nodes + --spares <= {total}, or "
                          f"another --partition")
    if max_nodes.isdigit() and need > int(max_nodes):
        raise ConfigError(f"{what} but partition {name!r} allows at most {max_nodes} per job (MaxNodes): it could "
                          f"never start; accepted: --nodes + --spares <= {max_nodes}, or another --partition")
    cpus = [int(c) for c in _run(["sinfo", "-h", "-N", "-p", name, "-o", "%c"]).split() if c.isdigit()]
    fit = sum(1 for c in cpus if c >= cfg.layout.ranks_per_node)
    if cpus and fit < need:
        raise ConfigError(f"--ranks-per-node {cfg.layout.ranks_per_node} needs {cfg.layout.ranks_per_node} CPUs on "
                          f"each of {need} "
                          f"nodes, but partition {name!r} has {fit} node(s) with that many (CPUs per node: "
                          f"{', '.join(map(str, sorted(set(cpus))))}): it could never start; accepted: "
                          f"--ranks-per-node <= {sorted(cpus, reverse=True)[min(need, len(cpus)) - 1]}")
    return {"partition": name, "nodes": total, "max_nodes": max_nodes, "cpus_per_node": sorted(set(cpus)),
            "default_time": part.get("DefaultTime"), "max_time": part.get("MaxTime")}


def check_time_and_lead(time: str | None = None, signal_lead: int | None = None, extra: list[str] | None = None,
                        partition: dict | None = None, template: str | None = None) -> tuple[int | None, int]:
    """The job's time limit and signal lead, checked before anything is submitted (launch/timelimit.py says what is
    accepted and why). The time limit is the last ``--time``/``-t`` of ``extra`` (sbatch applies the last), else
    ``time``, else the partition's (``partition``: check_partition's answer; DefaultTime, else MaxTime). The lead
    is that of a ``--signal`` in ``extra``, else ``signal_lead``, else the template's ``#SBATCH --signal`` (120 s).
    Returns (limit in seconds or None for no limit, lead in seconds). Raises ConfigError naming the value, for a
    time limit Slurm does not accept, a lead set twice, or a lead that leaves no time to train before its signal."""
    t_extra = timelimit.sbatch_option(extra, "time", "t")
    if t_extra is not None:
        limit = timelimit.parse_time_limit(t_extra, "--sbatch-arg=--time")
        time_what, time_opt = f"--sbatch-arg=--time={t_extra}", "--sbatch-arg=--time={}"
    elif time is not None:
        limit = timelimit.parse_time_limit(time, "--time")
        time_what, time_opt = f"--time {time}", "--time {}"
    else:
        part = partition or {}
        raw = next((v for v in (part.get("default_time"), part.get("max_time")) if v and v != "NONE"), None)
        limit = timelimit.parse_time_limit(raw, "the partition's time limit") if raw else None
        which = "DefaultTime" if raw == part.get("default_time") else "MaxTime"
        time_what = f"the time limit of partition {part.get('partition')!r} ({which}={raw}; no --time given)"
        time_opt = "--time {}"
    sig_extra = timelimit.sbatch_option(extra, "signal")
    if sig_extra is not None:
        if signal_lead is not None:
            raise ConfigError(f"--signal-lead {signal_lead} and --sbatch-arg=--signal={sig_extra} both set the "
                              f"warning signal; accepted: one of them")
        sig, lead = timelimit.parse_signal(sig_extra)
        prefix = sig_extra.split(":", 1)[0] + ":" if ":" in sig_extra else ""
        lead_opt = f"--sbatch-arg=--signal={prefix}{sig.removeprefix('SIG')}@{{}}"
    else:
        lead = timelimit.signal_lead(signal_lead) if signal_lead is not None else template_lead(template)
        sig, lead_opt = "SIGUSR2", "--signal-lead {}"
    timelimit.check_lead(limit, lead, time_what, lead_opt=lead_opt, time_opt=time_opt, sig=sig,
                         time_with=None if t_extra is not None or time is not None else "with that time limit")
    return limit, lead


def template_lead(template: str | None = None) -> int:
    """The lead (s) of the template's ``#SBATCH --signal=SIG@SECONDS`` line (templates/train.sbatch: 120)."""
    m = re.search(r"(?m)^#SBATCH --signal=\w+@(\d+)$", open(template or template_path()).read())
    return int(m.group(1)) if m else timelimit.DEFAULT_SIGNAL_LEAD_S


def submit(cfg: RunConfig, partition: str | None = None, time: str | None = None, account: str | None = None,
           extra: list[str] | None = None, template: str | None = None, signal_lead: int | None = None) -> str:
    """Write the config, render the batch script into RUN_DIR/job.sbatch and submit it. Returns the job id.
    A relative run directory or summary path means this process's current directory (the submitter's), which
    is also put first on the job's PYTHONPATH (a ``--train-fn`` module found from here is found by the job).
    ``signal_lead``: seconds before the time limit at which Slurm sends SIGUSR2 (the ranks save a checkpoint, the
    job is requeued); None: the template's (120 s).

    Raises ConfigError (before writing anything) if the partition can never run the job (check_partition), if the
    time limit is not one Slurm accepts or leaves no time to train before the signal lead (check_time_and_lead:
    refused, never shortened), if RUN_DIR belongs to a job that is still pending or running (it reads
    RUN_DIR/config.json when it starts), and if sbatch refuses the job (partition, account, ...)."""
    run_dir = os.path.abspath(cfg.output.run_dir)
    if cfg.output.summary_path:
        cfg.update(summary_path=os.path.abspath(cfg.output.summary_path))
    part = check_partition(cfg, _partition_of(extra) or partition)
    check_time_and_lead(time, signal_lead, extra, part, template)
    try:
        with open(os.path.join(run_dir, "slurm_job_id")) as fh:
            previous = fh.read().strip()
    except OSError:
        previous = ""
    if previous:
        live = _run(["squeue", "-h", "-j", previous, "-o", "%T"]).split()
        if live:
            raise ConfigError(f"--run-dir {run_dir} belongs to job {previous}, which is still {live[0]}; accepted: "
                              f"another --run-dir, or `scancel {previous}` first")
    check_free(run_dir)  # a run in progress there (a local one, or a job's batch shell) keeps its files
    write_config(cfg)
    script = os.path.join(run_dir, "job.sbatch")
    with open(script, "w") as fh:
        fh.write(render(cfg, template, signal_lead=signal_lead))
    cmd = ["sbatch", "--parsable", f"--chdir={run_dir}"]
    cmd += [f"--partition={partition}"] if partition else []
    cmd += [f"--time={time}"] if time else []
    cmd += [f"--account={account}"] if account else []
    cmd += list(extra or []) + [script]
    # the job runs in RUN_DIR (--chdir), but --train-fn was found from here (check_train_fn imported it, as deadpool
    # run's workers do from their current directory): sbatch exports this environment, so put this directory on
    # the job's PYTHONPATH (examples.ddp_gpt:train from the repository root)
    old = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.getcwd() + (os.pathsep + old if old else ""))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    if out.returncode != 0:
        raise ConfigError(f"sbatch refused the job (exit {out.returncode}): {out.stderr.strip()}")
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
    out = _run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobID,State,NodeList,ExitCode,Elapsed,WorkDir"])
    # --no-kill leaves RESIZING records before the job's final one: the last record is the state
    rows = [f for f in (line.split("|") for line in out.splitlines()) if len(f) >= 6 and f[0] == str(job_id)]
    if rows:
        f = rows[-1]
        return {"job_id": str(job_id), "state": f[1].split()[0], "nodelist": f[2], "exit_code": f[3],
                "elapsed": f[4], "work_dir": f[5], "source": "sacct"}
    out = _run(["scontrol", "show", "job", "-o", str(job_id)])
    if out:
        kv = dict(re.findall(r"(\w+)=(\S*)", out))
        return {"job_id": str(job_id), "state": kv.get("JobState"), "nodelist": kv.get("NodeList"),
                "exit_code": kv.get("ExitCode"), "batch_host": kv.get("BatchHost"), "source": "scontrol"}
    return {"job_id": str(job_id), "state": None}


def run_progress(run_dir: str) -> dict:
    path = RunDir(run_dir).events
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
        raise ConfigError(f"{arg!r} is neither a run directory nor a Slurm job id; accepted: JOBID or RUN_DIR")
    res = {"slurm": slurm_state(job_id) if job_id else None}
    if run_dir is None and res["slurm"] and res["slurm"].get("work_dir"):
        # slurmctld forgets a job MinJobAge after it ends; accounting keeps its working directory, which is
        # RUN_DIR for `deadpool submit` (--chdir) and holds deadpool-run-JOBID for the template's default
        wd = res["slurm"]["work_dir"]
        for cand in (wd, os.path.join(wd, f"deadpool-run-{job_id}")):
            if os.path.exists(RunDir(cand).config):
                run_dir = cand
                break
    if run_dir:
        res["run"] = run_progress(run_dir)
        try:
            res["summary"] = json.load(open(RunDir(run_dir).summary))
        except (OSError, ValueError):
            pass
    return res


# ---- summary ------------------------------------------------------------------------------------------------------
def scaling_table(out_dir: str) -> list[dict]:
    """One row per OUT_DIR/summary-n<size>.json of templates/scaling.sbatch, by active-node count: world size,
    median step time (s) and throughput (tokens/s), and ``speedup`` / ``efficiency`` against the smallest size
    (throughput ratio, and that ratio divided by the ratio of world sizes). Raises FileNotFoundError if OUT_DIR
    holds no summary."""
    rows = []
    for path in glob.glob(os.path.join(out_dir, "summary-n*.json")):
        m = re.fullmatch(r"summary-n(\d+)\.json", os.path.basename(path))
        if m is None:
            continue
        with open(path) as fh:
            s = json.load(fh)
        rows.append({"nodes": int(m.group(1)), "world_size": s["world_size"],
                     "completed": s["completed"], "median_step_s": s.get("median_step_s"),
                     "median_tokens_per_s": s.get("median_tokens_per_s"), "swaps": s["swaps"],
                     "param_digest": s["param_digest"]})
    if not rows:
        raise FileNotFoundError(f"no summary-n<size>.json in {out_dir!r} (the scaling template writes them; a "
                                f"MODE=control-plane sweep's study is python -m study.scale_study {out_dir})")
    rows.sort(key=lambda r: r["nodes"])
    base = rows[0]
    for r in rows:
        if r["median_tokens_per_s"] and base["median_tokens_per_s"]:
            r["speedup"] = r["median_tokens_per_s"] / base["median_tokens_per_s"]
            r["efficiency"] = r["speedup"] / (r["world_size"] / base["world_size"])
    return rows



def end_attempt(run_dir: str, out: str | None = None, since: float | None = None, srun_rc: int | None = None) -> int:
    """The batch script's last word (after srun returned): slurm_job.settle decides whether the job is requeued;
    if it is not, write the summary (RUN_DIR/summary.json and ``out``). Returns the batch script's exit status:
    0 when the run completed or the job was requeued, 143 when a SIGTERM ended the ranks before they could save,
    1 otherwise (a run stopped with a checkpoint ends its job CANCELLED or PREEMPTED whatever this says)."""
    how = slurm_job.settle(run_dir, since=since, srun_rc=srun_rc)
    if how["action"] == "requeued":
        if how.get("idle"):
            print(f"[deadpool] stopped before the first step ({how['reason']}): nothing new to save, job "
                  f"{os.environ.get('SLURM_JOB_ID', '')} requeued, it resumes from the same checkpoint")
        else:
            print(f"[deadpool] checkpoint saved ({how['reason']}), job {os.environ.get('SLURM_JOB_ID', '')} requeued")
        return 0
    s = write_summary(run_dir, out)
    f = s["failures"]
    print(f"[deadpool] summary: completed={s['completed']} steps={s['steps_completed']} final_loss={s['final_loss']} "
          f"swaps={s['swaps']} recovery_s={[round(x['recovery_s'], 2) if x['recovery_s'] else None for x in f]} "
          f"digest={s['param_digest']}" + (f" stopped: {s['stopped']['reason']}" if s["stopped"] else ""))
    if s["completed"]:
        return 0
    return 143 if how.get("killed") else 1


# ---- the old command line ---------------------------------------------------------------------------------------
BATCH_COMMANDS = ("write-config", "copy-config", "prepare", "watch", "launch", "task", "relaunch", "end",
                  "requeue-if-needed", "cancel-companions", "join")


def _moved(argv: list[str]) -> int:
    """``python -m deadpool_hpc.launch.slurm CMD``, as batch scripts rendered by an older deadpool-hpc call it (a job
    requeued after an upgrade runs the script it was submitted with): the batch script's commands go on in
    ``python -m deadpool_hpc.launch.batch`` (exec'd, same arguments); the others are ``deadpool`` sub-commands now,
    which this names (exit 2)."""
    cmd = argv[0] if argv else ""
    if cmd in BATCH_COMMANDS:
        os.execv(sys.executable, [sys.executable, "-m", "deadpool_hpc.launch.batch", *argv])
    now = {"submit": "deadpool submit", "render": "deadpool submit --dry-run", "status": "deadpool status --json",
           "summary": "deadpool summary", "scaling": "deadpool scaling"}.get(cmd)
    print(f"deadpool: error: `python -m deadpool_hpc.launch.slurm {cmd}` is no longer a command"
          + (f"; use `{now}`" if now else f"; accepted: the sub-commands of `deadpool --help`, or in a batch script "
                                          f"{', '.join(BATCH_COMMANDS)} (python -m deadpool_hpc.launch.batch)"),
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_moved(sys.argv[1:]))
