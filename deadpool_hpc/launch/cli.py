"""The ``deadpool`` command.

- ``deadpool run ...``: the embedded launch (emulated nodes as local processes).
- ``deadpool submit ...``: the same run options plus Slurm ones; renders sbatch/train.sbatch and submits
  it; the last line printed is the Slurm job id.
- ``deadpool status JOBID|RUN_DIR``: steps, failures, swaps and recovery times, from the run's event log.

Exit 2 on bad input (a run directory in use by another run included), before any process starts or any
job is submitted; 1 if the run did not complete; 128 + N if signal N (SIGINT, SIGTERM, SIGHUP) stopped it.
"""
from __future__ import annotations

import argparse
import sys

from ..config import RunConfig, parse_fault, parse_train_arg
from ..errors import ConfigError


def add_run_options(p: argparse.ArgumentParser) -> None:
    d = RunConfig()
    p.add_argument("--nodes", type=int, default=d.nodes, help="active (training) nodes")
    p.add_argument("--spares", type=int, default=d.spares, help="spare nodes allocated with the job")
    p.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--kill", action="append", default=[], metavar="TARGET@WHEN",
                   help="SIGKILL nodeN or rankN when training reaches step WHEN, or when it reaches phase WHEN "
                        "(detect, agree, decided, rebuild, restore, resume; #K: of the K-th recovery) (repeatable)")
    p.add_argument("--hang", action="append", default=[], metavar="TARGET@WHEN",
                   help="SIGSTOP nodeN or rankN, at a step or phase as for --kill (repeatable)")
    p.add_argument("--replicas", type=int, default=d.replicas,
                   help="K: each rank's snapshot lives on the next K nodes, so any K node losses at once survive")
    p.add_argument("--hang-timeout", type=float, default=d.hang_timeout,
                   help="seconds without progress of a rank's training thread before it is fenced (0: off); "
                        "must exceed your longest step")
    p.add_argument("--rendezvous-timeout", type=float, default=d.rendezvous_timeout,
                   help="seconds to join a generation's process group before the recovery round is retried")
    p.add_argument("--collective-timeout", type=float, default=d.collective_timeout,
                   help="seconds a rank waits for its peers in one collective before the process group is rebuilt "
                        "(at least --hang-timeout + 2 heartbeat deadlines is used)")
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout,
                   help="seconds for MPI start-up and the first collectives; a process lost before training "
                        "starts ends the run with an error after this long")
    p.add_argument("--summary", metavar="PATH", help="write the run summary JSON here")
    p.add_argument("--run-dir", default=d.run_dir, help="event log, config and logs of the run")
    p.add_argument("--train-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of the training function (ctx.config.train_args; VALUE becomes an int, float, "
                        "true/false or string), e.g. n_layer=4 for the demo (repeatable)")
    for flag, kind in (("--batch-size", int), ("--context", int), ("--lr", float), ("--seed", int)):
        p.add_argument(flag, type=kind, help=f"shorthand for --train-arg {flag[2:].replace('-', '_')}=VALUE")
    p.add_argument("--heartbeat-deadline", type=float, default=d.heartbeat_deadline, help="seconds")
    p.add_argument("--heartbeat-period", type=float, default=d.heartbeat_period, help="seconds")
    p.add_argument("--requeue", action="store_true",
                   help="when no spare is left: save a checkpoint, then restart the job from it (as Slurm requeues)")
    p.add_argument("--no-replicate", action="store_true", help="turn the replica plane off (benchmarks only)")
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--train-fn", default=d.train_fn, help="module:function to train (default: the demo)")


def check_train_fn(spec: str, train_args: dict | None = None) -> None:
    """Import the --train-fn "package.module:function" here (worker.entry.load_train_fn, as each worker
    will), before any process starts, and check ``train_args`` with its ``check_args`` if it has one (the demo
    does). Raises ConfigError naming the spec, or the bad train arg, if that fails."""
    from ..worker.entry import load_train_fn

    try:
        fn = load_train_fn(spec)
    except ValueError:
        raise ConfigError(f"--train-fn {spec!r}: accepted: 'package.module:function'") from None
    except ImportError as exc:
        raise ConfigError(f"--train-fn {spec!r}: cannot import {spec.partition(':')[0]!r} ({exc}); accepted: an "
                          f"importable 'package.module:function'") from None
    except AttributeError:
        fn = None
    if not callable(fn):
        mod, _, name = spec.partition(":")
        raise ConfigError(f"--train-fn {spec!r}: {mod} has no function {name!r}")
    check = getattr(fn, "check_args", None)
    if callable(check):
        try:
            check(dict(train_args or {}))
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc)) from None


def config_from_args(a) -> RunConfig:

    train_args = dict(parse_train_arg(s) for s in a.train_arg)
    for name in ("batch_size", "context", "lr", "seed"):  # the demo's shorthands
        if getattr(a, name) is not None:
            train_args[name] = getattr(a, name)
    check_train_fn(a.train_fn, train_args)
    if a.summary:
        from ..rundir import check_output_file

        check_output_file(a.summary, run_dir=a.run_dir)
    faults = [parse_fault("kill", s) for s in a.kill] + [parse_fault("hang", s) for s in a.hang]
    return RunConfig(nodes=a.nodes, spares=a.spares, ranks_per_node=a.ranks_per_node, steps=a.steps, faults=faults,
                     train_args=train_args,
                     heartbeat_deadline=a.heartbeat_deadline, heartbeat_period=a.heartbeat_period,
                     replicas=a.replicas, hang_timeout=a.hang_timeout, rendezvous_timeout=a.rendezvous_timeout,
                     startup_timeout=a.startup_timeout, collective_timeout=a.collective_timeout,
                     replicate=not a.no_replicate, requeue=a.requeue, run_dir=a.run_dir, summary_path=a.summary,
                     log_every=a.log_every, train_fn=a.train_fn).validate()


def cmd_run(a) -> int:
    import signal

    from ..rundir import check_output_file, check_run_dir

    check_run_dir(a.run_dir)  # paths first: a bad one fails before torch and --train-fn are imported
    if a.summary is not None:
        check_output_file(a.summary, run_dir=a.run_dir)
    cfg = config_from_args(a)
    from rich.console import Console

    from .console import LiveView, print_summary
    from .local import Interrupted, launch

    console = Console()
    say = _sayer(console)
    say(f"[bold]deadpool run[/]: {cfg.nodes} nodes x {cfg.ranks_per_node} ranks + {cfg.spares} spare node(s), "
        f"{cfg.steps} steps, faults: {', '.join(map(str, cfg.faults)) or 'none'}; run dir {cfg.run_dir}")
    try:
        with LiveView(cfg, console) as view:
            summary = launch(cfg, on_poll=view.update)
    except Interrupted as exc:
        say(f"\ninterrupted ({exc}) before the run started: no process ran; {cfg.run_dir} is as it was")
        return 128 + exc.signum
    except KeyboardInterrupt:  # Ctrl-C before the launcher took SIGINT over: nothing had started
        say(f"\ninterrupted before the run started: no process ran; {cfg.run_dir} is as it was")
        return 130
    try:
        print_summary(summary, console)
    except OSError:  # the terminal is gone (SIGHUP): the summary files are written already
        pass
    where = f"{summary['run_dir']}/summary.json" + (f" and {cfg.summary_path}" if cfg.summary_path else "")
    if summary.get("processes_left"):
        say(f"[bold red]processes of the run still alive after SIGKILL: {summary['processes_left']}[/]")
    if summary.get("interrupted"):
        sig = summary["interrupted"]
        stopped = "some processes of the run survived SIGKILL" if summary.get("processes_left") else \
            "every process of the run was stopped"
        say(f"\ninterrupted by {sig} at step {summary['steps_completed']}: {stopped}; "
            f"summary in {where}, events in {summary['run_dir']}/events.jsonl")
        return 128 + int(signal.Signals[sig])
    return 0 if summary["completed"] else 1


def _sayer(console):
    """console.print that survives a terminal that is gone (after SIGHUP a write fails with EIO)."""
    def say(text: str) -> None:
        try:
            console.print(text)
        except OSError:
            pass
    return say


def cmd_submit(a) -> int:
    from .slurm import submit

    cfg = config_from_args(a)
    job_id = submit(cfg, partition=a.partition, time=a.time, account=a.account, extra=a.sbatch_arg)
    print(f"submitted: {cfg.nodes} active + {cfg.spares} spare node(s), run dir {cfg.run_dir}; "
          f"follow it with: deadpool status {job_id}")
    print(job_id)
    return 0


def cmd_status(a) -> int:
    import os

    from rich.console import Console

    from .console import print_summary
    from .slurm import make_summary, status

    st = status(a.target)
    console = Console()
    if st.get("slurm"):
        console.print(f"slurm: {st['slurm']}")
    run = st.get("run")
    if not run:
        console.print(f"no run directory found for {a.target!r}: pass the run directory instead (a submitit job, "
                      f"or a template job whose RUN_DIR was set by hand)")
        return 1
    summary = make_summary(run["run_dir"]) if os.path.exists(os.path.join(run["run_dir"], "config.json")) else None
    if summary is None:
        console.print(run)
        return 1
    print_summary(summary, console)
    state = (st.get("slurm") or {}).get("state")
    if not summary["completed"] and state in ("PENDING", "RUNNING", "REQUEUED", "RESIZING", "COMPLETING"):
        console.print(f"job {state}: at step {run.get('step', 0)} of {summary.get('steps_completed') or '?'} so far "
                      "(the table above is the run until now)")
        return 0
    return 0 if summary["completed"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="deadpool", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="train on this machine: emulated nodes as local processes")
    add_run_options(run)
    run.set_defaults(fn=cmd_run)
    sm = sub.add_parser("submit", help="submit the same run to Slurm (sbatch/train.sbatch); prints the job id last")
    add_run_options(sm)
    sm.add_argument("--partition")
    sm.add_argument("--time", help="Slurm time limit, e.g. 2:00:00")
    sm.add_argument("--account")
    sm.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch argument (repeatable)")
    sm.set_defaults(fn=cmd_submit)
    st = sub.add_parser("status", help="summarise a run from its event log: a Slurm job id or a run directory")
    st.add_argument("target", metavar="JOBID|RUN_DIR")
    st.set_defaults(fn=cmd_status)
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
