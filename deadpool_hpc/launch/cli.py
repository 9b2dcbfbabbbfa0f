"""The ``deadpool`` command: the launch vocabulary of executors.py on the command line.

- ``deadpool run ...``: the embedded launch (emulated nodes as local processes; LocalExecutor).
- ``deadpool submit ...``: the same run options plus Slurm ones; renders the batch template (templates/train.sbatch)
  and submits it (SlurmExecutor); the last line printed is the Slurm job id. ``--dry-run``: print the batch
  script instead, nothing written nor submitted.
- ``deadpool status JOBID|RUN_DIR [--png FILE] [--json]``: steps, failures, swaps and recovery times, from the run's
  event log (``--png``: its timeline too, as ``deadpool plot`` draws it; ``--json``: Slurm's state and the run's
  progress as JSON, the raw view).
- ``deadpool plot RUN_DIR [-o FILE]``: the run's timeline as a picture (deadpool_hpc/report/: steps/s over wall
  time, every fault, decision, swap, return, straggler verdict and checkpoint, each failure's recovery phases).
- ``deadpool swap JOBID|RUN_DIR NODE``: a planned swap of NODE at the next step boundary (launch/swap.py).
- ``deadpool cancel JOBID|RUN_DIR``: stop the run (``scancel`` of a Slurm job; SIGTERM to a local run's launcher).
- ``deadpool summary RUN_DIR [--out FILE]``: write RUN_DIR/summary.json again from the event log (exit 0 iff the
  run completed).
- ``deadpool scaling OUT_DIR``: the table of a scaling sweep's summaries (templates/scaling.sbatch's OUT_DIR).

What the batch script runs on its nodes is not here: ``python -m deadpool_hpc.launch.batch`` (batch.py).

Exit 2 on bad input (a run directory in use by another run included), before any process starts or any
job is submitted; 1 if the run did not complete; 3 if its summary could not be written (a full or read-only run
directory: the summary is printed to stdout in full instead, between marker lines); 4 if a crash loop stopped it
(errors.CRASH_LOOP_EXIT: the same rank's crash at the same step on several nodes); 128 + N if signal N (SIGINT,
SIGTERM, SIGHUP) stopped it (the summary printed too if it could not be written).
"""
from __future__ import annotations

import argparse
import sys

from ..errors import CRASH_LOOP_EXIT, ConfigError
from .options import add_run_options as add_run_options
from .options import check_train_fn as check_train_fn
from .options import config_from_args as config_from_args
from ..rundir import RunDir
from .timelimit import signal_lead_arg


def cmd_run(a) -> int:
    import signal

    from ..rundir import check_output_file, check_run_dir

    check_run_dir(a.run_dir)  # paths first: a bad one fails before torch and --train-fn are imported
    if a.summary is not None:
        check_output_file(a.summary, run_dir=a.run_dir)
    cfg = config_from_args(a)
    from rich.console import Console

    from .console import LiveView, print_summary
    from .executors import LocalExecutor
    from .local import Interrupted, check_resume

    saved = check_resume(a.run_dir, cfg.layout.world_size) if a.resume else None
    console = Console()
    say = _sayer(console)
    say(f"[bold]deadpool run[/]: {cfg.layout.nodes} nodes x {cfg.layout.ranks_per_node} ranks + {cfg.layout.spares} "
        f"spare node(s), {cfg.train.steps} steps, faults: {', '.join(map(str, cfg.internal.faults)) or 'none'}; "
        f"run dir {cfg.output.run_dir}"
        + (f"; resuming from its checkpoint at step {saved['step']}" if saved else ""))
    try:
        with LiveView(cfg, console) as view:
            summary = LocalExecutor(on_poll=view.update).run(cfg, resume=a.resume)
    except Interrupted as exc:
        say(f"\ninterrupted ({exc}) before the run started: no process ran; {cfg.output.run_dir} is as it was")
        return 128 + exc.signum
    except KeyboardInterrupt:  # Ctrl-C before the launcher took SIGINT over: nothing had started
        say(f"\ninterrupted before the run started: no process ran; {cfg.output.run_dir} is as it was")
        return 130
    try:
        print_summary(summary, console)
    except OSError:  # the terminal is gone (SIGHUP): the summary files are written already
        pass
    where = f"{summary['run_dir']}/summary.json" + (f" and {cfg.output.summary_path}"
                                                     if cfg.output.summary_path else "")
    unwritten = not summary.get("summary_written", True)
    if unwritten:   # a full or read-only run directory: the summary in full on stdout, and exit 3 says so
        where = "the JSON above (stdout)"
        _print_summary_json(summary)
        say(f"[bold red]the summary could not be written ({summary.get('summary_error')}): it is printed above, in "
            f"full; exit status {SUMMARY_UNWRITTEN}[/]")
    if summary.get("processes_left"):
        say(f"[bold red]processes of the run still alive after SIGKILL: {summary['processes_left']}[/]")
    if summary.get("interrupted"):
        sig = summary["interrupted"]
        stopped = "some processes of the run survived SIGKILL" if summary.get("processes_left") else \
            "every process of the run was stopped"
        say(f"\ninterrupted by {sig} at step {summary['steps_completed']}: {stopped}; "
            f"summary in {where}, events in {summary['run_dir']}/events.jsonl")
        return 128 + int(signal.Signals[sig])
    if unwritten:
        return SUMMARY_UNWRITTEN
    if summary.get("crash_loop") and not summary["completed"]:
        return CRASH_LOOP_EXIT
    return 0 if summary["completed"] else 1


SUMMARY_UNWRITTEN = 3   # deadpool run's exit status when summary.json (or --summary) could not be written


def _print_summary_json(summary: dict) -> None:
    """The whole summary as one JSON document between marker lines on stdout (a closed stdout: nothing to do)."""
    import json

    try:
        print("--- deadpool summary (not written: see summary_error) ---", flush=True)
        print(json.dumps(summary, indent=1), flush=True)
        print("--- end of deadpool summary ---", flush=True)
    except (OSError, ValueError):
        pass


def _sayer(console):
    """console.print that survives a terminal that is gone (after SIGHUP a write fails with EIO)."""
    def say(text: str) -> None:
        try:
            console.print(text)
        except OSError:
            pass
    return say


def cmd_submit(a) -> int:
    from .executors import SlurmExecutor

    cfg = config_from_args(a)
    ex = SlurmExecutor(partition=a.partition, time=a.time, account=a.account, sbatch_args=a.sbatch_arg,
                       signal_lead=a.signal_lead)
    if a.dry_run:
        print(ex.render(cfg))
        return 0
    job_id = ex.submit(cfg).job_id
    print(f"submitted: {cfg.layout.nodes} active + {cfg.layout.spares} spare node(s), run dir {cfg.output.run_dir}; "
          f"follow it with: deadpool status {job_id}")
    print(job_id)
    return 0


def cmd_status(a) -> int:
    import os

    from rich.console import Console

    from .console import print_summary
    from .slurm import make_summary, status

    if a.json:
        import json

        print(json.dumps(status(a.target), indent=1))
        return 0
    if a.png is not None:   # a bad file name or no matplotlib: exit 2 before Slurm is asked anything
        from ..report.plot import check_output, require_matplotlib

        a.png = check_output(a.png, "--png")
        require_matplotlib()
    st = status(a.target)
    console = Console()
    if st.get("slurm"):
        console.print(f"slurm: {st['slurm']}")
    run = st.get("run")
    if not run:
        console.print(f"no run directory found for {a.target!r}: pass the run directory instead (a submitit job, "
                      f"or a template job whose RUN_DIR was set by hand)")
        return 1
    summary = make_summary(run["run_dir"]) if os.path.exists(RunDir(run["run_dir"]).config) else None
    if summary is None:
        console.print(run)
        return 1
    print_summary(summary, console)
    if a.png is not None and _plot(run["run_dir"], a.png):
        return 1
    state = (st.get("slurm") or {}).get("state")
    if not summary["completed"] and state in ("PENDING", "RUNNING", "REQUEUED", "RESIZING", "COMPLETING"):
        console.print(f"job {state}: at step {run.get('step', 0)} of {summary.get('steps_completed') or '?'} so far "
                      "(the table above is the run until now)")
        return 0
    return 0 if summary["completed"] else 1


def cmd_plot(a) -> int:
    return _plot(a.run_dir, a.output)


def _plot(run_dir: str, out: str | None) -> int:
    """Draw RUN_DIR's timeline (report/plot.py) and say where, and what it marks; 1 if the file cannot be written."""
    from ..report.plot import plot_run

    try:
        path, tl, drawn = plot_run(run_dir, out)
    except FileNotFoundError:   # (main's exit 2)
        raise
    except OSError as exc:   # a read-only or full directory
        print(f"deadpool: error: the timeline could not be written: {exc}", file=sys.stderr)
        return 1
    kinds = ", ".join(f"{n} {k}" for k, n in drawn.items() if k not in ("phases", "points") and n)
    print(f"timeline of {tl.name or run_dir}: {path} ({kinds or 'no mark'}; "
          f"{sum(drawn['phases'].values())} recovery phase span(s))")
    return 0


def cmd_swap(a) -> int:
    from .executors import attach

    r = attach(a.target).swap(a.node, a.reason)
    print(f"swap of {r['node']} (node{r['index']}) requested: it leaves at its next step boundary and a spare "
          f"takes its place; follow it in {r['run_dir']}/events.jsonl (swap_requested, decision, resumed)")
    return 0


def cmd_cancel(a) -> int:
    from .executors import attach

    job = attach(a.target)
    job.cancel()
    what = f"job {job.job_id}" if job.job_id else f"the run in {job.run_dir}"
    print(f"{what}: stop requested; the ranks save a checkpoint where they can, and the summary says why it stopped "
          f"(deadpool status {a.target})")
    return 0


def cmd_summary(a) -> int:
    from .slurm import write_summary

    s = write_summary(a.run_dir, a.out)
    f = s["failures"]
    print(f"[deadpool] summary: completed={s['completed']} steps={s['steps_completed']} "
          f"final_loss={s['final_loss']} swaps={s['swaps']} "
          f"recovery_s={[round(x['recovery_s'], 2) if x['recovery_s'] else None for x in f]} "
          f"digest={s['param_digest']}")
    if not s.get("summary_written", True):
        return SUMMARY_UNWRITTEN   # printed above in full: the run directory refused it
    return 0 if s["completed"] else 1


def cmd_scaling(a) -> int:
    import json

    from .slurm import scaling_table

    rows = scaling_table(a.out_dir)
    print(json.dumps(rows, indent=1))
    return 0 if rows and all(r["completed"] for r in rows) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="deadpool", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="train on this machine: emulated nodes as local processes")
    add_run_options(run)
    run.add_argument("--resume", action="store_true",
                     help="start from RUN_DIR's checkpoint (one a crash loop, a lost node with no spare left or a "
                          "signal saved) instead of step 0, e.g. once the bad batch is fixed")
    run.set_defaults(fn=cmd_run)
    sm = sub.add_parser("submit", help="submit the same run to Slurm (the batch template, train.sbatch); "
                        "prints the job id last")
    add_run_options(sm)
    sm.set_defaults(ranks_per_node=0)   # one per GPU of each node, resolved on the allocation (launch/batch.py)
    sm.add_argument("--partition")
    sm.add_argument("--time", help="Slurm time limit, e.g. 2:00:00 (it must exceed --signal-lead by 90 s)")
    sm.add_argument("--signal-lead", type=signal_lead_arg, metavar="SECONDS",
                    help="SIGUSR2 this long before the time limit: the ranks save a checkpoint and the job is "
                         "requeued (default: the template's, 120; the save of your model must fit in it)")
    sm.add_argument("--account")
    sm.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch argument (repeatable)")
    sm.add_argument("--dry-run", action="store_true", help="print the batch script that would be submitted; nothing "
                                                           "is written nor submitted")
    sm.set_defaults(fn=cmd_submit)
    st = sub.add_parser("status", help="summarise a run from its event log: a Slurm job id or a run directory")
    st.add_argument("target", metavar="JOBID|RUN_DIR")
    st.add_argument("--png", metavar="FILE", help="also draw the run's timeline to FILE (.png, .svg or .pdf; needs "
                                                  "matplotlib: pip install 'deadpool-hpc[plot]')")
    st.add_argument("--json", action="store_true", help="print Slurm's view of the job and the run's progress as "
                                                        "JSON (the raw view)")
    st.set_defaults(fn=cmd_status)
    pl = sub.add_parser("plot", help="draw a run's timeline: steps/s over wall time, faults, decisions, swaps, "
                                     "returns, straggler verdicts, checkpoints and recovery phases (needs matplotlib)")
    pl.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holding events.jsonl)")
    pl.add_argument("-o", "--output", metavar="FILE", help="the picture: .png, .svg or .pdf (default "
                                                           "RUN_DIR/timeline.png)")
    pl.set_defaults(fn=cmd_plot)
    sw = sub.add_parser("swap", help="planned swap: NODE leaves the running job at its next step boundary, a spare "
                                     "takes its place, no step recomputed")
    sw.add_argument("target", metavar="JOBID|RUN_DIR")
    sw.add_argument("node", metavar="NODE", help="Slurm's node name (a Slurm job) or node<index> (a local run)")
    sw.add_argument("--reason", default="deadpool swap", help="recorded in the event log and the summary")
    sw.set_defaults(fn=cmd_swap)
    ca = sub.add_parser("cancel", help="stop a run: scancel of a Slurm job, SIGTERM to a local run's launcher (the "
                                       "ranks save a checkpoint where they can)")
    ca.add_argument("target", metavar="JOBID|RUN_DIR")
    ca.set_defaults(fn=cmd_cancel)
    su = sub.add_parser("summary", help="write RUN_DIR/summary.json again from its event log (exit 0 iff the run "
                                        "completed)")
    su.add_argument("run_dir", metavar="RUN_DIR")
    su.add_argument("--out", metavar="FILE", help="also write the summary here")
    su.set_defaults(fn=cmd_summary)
    sc = sub.add_parser("scaling", help="table of a scaling sweep's summaries (scaling.sbatch's OUT_DIR); a "
                                        "MODE=control-plane sweep is the scale study's: python -m study.scale_study")
    sc.add_argument("out_dir", metavar="OUT_DIR")
    sc.set_defaults(fn=cmd_scaling)
    a = parser.parse_args(argv)
    from ..logs import setup as setup_logging

    setup_logging("launcher")
    try:
        return a.fn(a)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"deadpool: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
