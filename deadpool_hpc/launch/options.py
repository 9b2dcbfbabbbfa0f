"""Run options: the ``deadpool run``-style arguments and the RunConfig they make.

Shared by the ``deadpool`` command (cli.py) and ``python -m deadpool_hpc.launch.slurm`` (slurm.py), so that both
accept the same options with the same checks. Owns parsing and checking a run's options (a bad one is a
ConfigError, or an argparse error: exit 2 either way); does not own what a RunConfig holds (config.py) nor
the run directory (rundir.py).
"""
from __future__ import annotations

import argparse
import math
import os

from ..agent.health import check_plugins
from ..config import RunConfig, parse_train_arg
from ..faultinject.spec import parse_fault
from ..errors import ConfigError
from ..replica.transports import check_transport


def hang_timeout(text: str) -> float:
    """``--hang-timeout``: seconds > 0, or ``off`` (no hang detection: RunConfig.hang_timeout 0.0). An argparse
    ``type``: anything else is an ArgumentTypeError naming the value, so the command exits 2 with it."""
    if text.strip().lower() == "off":
        return 0.0
    try:
        v = float(text)
    except ValueError:
        v = None
    if v is None or not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: accepted: seconds > 0 (e.g. 120), or off (no hang detection)")
    return v


def metrics_port(text: str) -> int:
    """``--metrics-port``: a TCP port 1..65535 (an argparse ``type``: anything else exits 2 naming the value)."""
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: accepted: a TCP port 1..65535 (the job's metrics endpoint; node "
                                         f"I's is that + 1 + I)")
    return v


def crash_loop_limit(text: str) -> int:
    """``--crash-loop-limit``: an integer >= 0. An argparse ``type``: anything else is an ArgumentTypeError naming
    the value, so the command exits 2 with it."""
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: accepted: an integer >= 0 (repeats on other nodes of the same "
                                         f"rank's crash at the same step before the run stops; 0: off)")
    return v


def add_run_options(p: argparse.ArgumentParser) -> None:
    d = RunConfig()
    p.add_argument("--nodes", type=int, default=d.nodes, help="active (training) nodes")
    p.add_argument("--spares", type=int, default=d.spares, help="spare nodes allocated with the job")
    p.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--kill", action="append", default=[], metavar="TARGET@WHEN",
                   help="SIGKILL nodeN or rankN when training reaches step WHEN, at a moment of the start-up "
                        "(startup, build, first), or when it reaches phase WHEN of a recovery (detect, agree, "
                        "decided, rebuild, restore, resume; #K: of the K-th recovery) (repeatable)")
    p.add_argument("--hang", action="append", default=[], metavar="TARGET@WHEN",
                   help="SIGSTOP nodeN or rankN, at a step or phase as for --kill (repeatable)")
    p.add_argument("--slow", action="append", default=[], metavar="nodeN@startup|build|STEP[:FACTOR]",
                   help="make node N's training processes FACTOR times slower (default 8) from their start, or from "
                        "when their model is built: what the start-up's pre-flight speed check catches; or from step "
                        "STEP on: what the straggler check catches (repeatable)")
    p.add_argument("--nic-down", action="append", default=[], metavar="nodeN[@STEP]",
                   help="node N's data-plane interface is down from its start (its gloo is given an interface that "
                        "does not exist): what the start-up's link check catches; an idle spare's from step STEP on: "
                        "what its re-check catches (repeatable)")
    p.add_argument("--replicas", type=int, default=d.replicas,
                   help="K: each rank's snapshot lives on the next K nodes, so any K node losses at once survive")
    p.add_argument("--replica-transport", default=d.replica_transport, metavar="NAME",
                   help="how replicas travel between node agents: tcp (default), unix (one machine only), or a "
                        "transport plugin's name (docs/plugins.md)")
    p.add_argument("--hang-timeout", type=hang_timeout, default=d.hang_timeout, metavar="SECONDS|off",
                   help="seconds without progress of a rank's training thread before it is fenced, or off (no hang "
                        "detection); must exceed your longest step")
    p.add_argument("--rendezvous-timeout", type=float, default=d.rendezvous_timeout,
                   help="seconds to join a generation's process group before the recovery round is retried")
    p.add_argument("--collective-timeout", type=float, default=d.collective_timeout,
                   help="seconds a rank waits for its peers in one collective before the process group is rebuilt "
                        "(at least --hang-timeout + 2 heartbeat deadlines is used)")
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout,
                   help="seconds for MPI start-up, a training process's import and model build, and the first "
                        "collectives; a training process not up by then is its node's failure (a spare takes it)")
    p.add_argument("--persist-every", type=float, default=d.persist_every, metavar="SECONDS",
                   help="the node agents write the newest committed snapshot of every rank to RUN_DIR/checkpoint "
                        "this often, in the background, so that a job killed outright resumes from at most that "
                        f"far back after a requeue (default {d.persist_every:.0f}; 0: never)")
    p.add_argument("--health-check", default=d.health_check, metavar="CMD",
                   help="a command each node runs at start-up (sh -c; exit 0: healthy); a node whose check fails or "
                        "outlasts --startup-timeout is replaced by a spare before training")
    p.add_argument("--preflight-factor", type=float, default=d.preflight_factor, metavar="FACTOR",
                   help="at start-up every node all-reduces with its neighbour nodes and times a small matmul on its "
                        "device; a node whose links all fail, or slower than FACTOR x the job's median, is replaced by "
                        f"a spare before training (default {d.preflight_factor:g}; 0: both checks off)")
    p.add_argument("--spare-check-every", type=float, default=d.spare_check_every, metavar="SECONDS",
                   help="an idle spare checks itself again this often (--health-check, the timed matmul, an "
                        "all-reduce with a training node); one that fails leaves the pool before a recovery needs it "
                        f"(default {d.spare_check_every:g}; 0: never)")
    p.add_argument("--straggler-factor", type=float, default=d.straggler_factor, metavar="FACTOR",
                   help="a training node whose ranks' own work per step (their step time less their waits on peers) "
                        "stays over FACTOR x the other nodes' median for --straggler-window seconds is a straggler "
                        f"(default {d.straggler_factor:g})")
    p.add_argument("--straggler-window", type=float, default=d.straggler_window, metavar="SECONDS",
                   help=f"how long a node must stay slow to be a straggler (default {d.straggler_window:g})")
    p.add_argument("--straggler-action", choices=("swap", "report", "off"), default=d.straggler_action,
                   help="swap: a straggler is taken out by a planned swap when a spare is free (0 steps recomputed), "
                        "else reported; report: the event only; off: not measured (default swap)")
    p.add_argument("--no-spare-return", action="store_true",
                   help="a node whose training processes failed leaves the job for good (default: its agent, alive, "
                        "ends them, checks the node and returns it to the spare pool for the next generation)")
    p.add_argument("--quarantine", type=float, default=d.quarantine, metavar="SECONDS",
                   help="a node that fails again within SECONDS of its return to the spare pool stays out "
                        f"(default {d.quarantine:g}; 0: never for that reason)")
    p.add_argument("--crash-loop-limit", type=crash_loop_limit, default=d.crash_loop_limit, metavar="N",
                   help="the same training rank ending the same way (signal or exit code) at the same step on N more "
                        "nodes after the first (a crash that follows the work, e.g. a bad batch, not the node) stops "
                        "the run: a checkpoint at the last common step, no more spares promoted into it, exit "
                        f"status 4 naming the rank, step and signal (default {d.crash_loop_limit}; 0: off)")
    p.add_argument("--health-check-timeout", type=float, default=d.health_check_timeout, metavar="SECONDS",
                   help="a returning node's --health-check still running after SECONDS is killed and the node stays "
                        f"out (default {d.health_check_timeout:g})")
    p.add_argument("--metrics-port", type=metrics_port, default=None, metavar="PORT",
                   help="serve Prometheus metrics over HTTP: the job's view on PORT (the coordinator: the lowest live "
                        "node agent), node I's on PORT + 1 + I (default: off)")
    p.add_argument("--metrics-textfile", default="", metavar="DIR",
                   help="write the same metrics in node_exporter's textfile form to DIR, every 5 s and at the end: "
                        "deadpool_<job>_job.prom and deadpool_<job>_node<I>.prom (<job>: Slurm's job id, else the "
                        "run directory's name); DIR must exist on every node (default: off)")
    p.add_argument("--summary", metavar="PATH", help="write the run summary JSON here")
    p.add_argument("--run-dir", default=d.run_dir, help="event log, config and logs of the run")
    p.add_argument("--train-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of the training function (ctx.config.train_args; VALUE becomes an int, float, "
                        "true/false or string), e.g. n_layer=4 for the demo (repeatable)")
    for flag, kind in (("--batch-size", int), ("--context", int), ("--lr", float), ("--seed", int)):
        p.add_argument(flag, type=kind, help=f"shorthand for --train-arg {flag[2:].replace('-', '_')}=VALUE")
    p.add_argument("--heartbeat-deadline", type=float, default=d.heartbeat_deadline, help="seconds")
    p.add_argument("--heartbeat-period", type=float, default=d.heartbeat_period, help="seconds")
    p.add_argument("--heartbeat-ceiling", type=float, default=d.heartbeat_ceiling, metavar="SECONDS",
                   help="the longest a frozen node may go unnoticed: a silent node is probed after the deadline and "
                        "suspected once other nodes confirm it (deadlines follow the observed load, up to this; "
                        f"default {d.heartbeat_ceiling:g}, at least 2 x --heartbeat-deadline)")
    p.add_argument("--requeue", action="store_true",
                   help="when no spare is left: save a checkpoint, then restart the job from it (as Slurm requeues)")
    p.add_argument("--no-fork-server", action="store_true",
                   help="local launcher: start each training process as a fresh interpreter (each imports torch) "
                        "instead of forking it from one that imported torch once for the run")
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


def check_extensions(transport: str) -> None:
    """The pre-flight check of what a run loads by name, done by every launcher before anything starts: the node
    health detector plugins (each importable) and the replica transport ``transport`` (installed and importable).
    Raises PluginError (a ConfigError) naming the plugin, and for an unknown transport the installed ones."""
    check_plugins()
    check_transport(transport)


def config_from_args(a) -> RunConfig:
    """The RunConfig of parsed run options (validated); ConfigError names a bad value."""
    train_args = dict(parse_train_arg(s) for s in a.train_arg)
    for name in ("batch_size", "context", "lr", "seed"):  # the demo's shorthands
        if getattr(a, name) is not None:
            train_args[name] = getattr(a, name)
    check_train_fn(a.train_fn, train_args)
    check_extensions(a.replica_transport)   # nothing starts with a plugin that is missing or broken
    if a.summary:
        from ..rundir import check_output_file

        check_output_file(a.summary, run_dir=a.run_dir)
    faults = [parse_fault("kill", s) for s in a.kill] + [parse_fault("hang", s) for s in a.hang] \
        + [parse_fault("slow", s) for s in a.slow] + [parse_fault("nic_down", s) for s in a.nic_down]
    return RunConfig(nodes=a.nodes, spares=a.spares, ranks_per_node=a.ranks_per_node, steps=a.steps, faults=faults,
                     train_args=train_args,
                     heartbeat_deadline=a.heartbeat_deadline, heartbeat_period=a.heartbeat_period,
                     heartbeat_ceiling=a.heartbeat_ceiling,
                     replicas=a.replicas, replica_transport=a.replica_transport, hang_timeout=a.hang_timeout,
                     rendezvous_timeout=a.rendezvous_timeout,
                     startup_timeout=a.startup_timeout, collective_timeout=a.collective_timeout,
                     persist_every=a.persist_every, health_check=a.health_check,
                     preflight_factor=a.preflight_factor, spare_check_every=a.spare_check_every,
                     straggler_factor=a.straggler_factor, straggler_window=a.straggler_window,
                     straggler_action=a.straggler_action, spare_return=not a.no_spare_return,
                     quarantine=a.quarantine, crash_loop_limit=a.crash_loop_limit,
                     health_check_timeout=a.health_check_timeout,
                     metrics_port=a.metrics_port or 0,
                     metrics_textfile=os.path.abspath(a.metrics_textfile) if a.metrics_textfile else "",
                     replicate=not a.no_replicate, requeue=a.requeue, fork_server=not a.no_fork_server,
                     run_dir=a.run_dir, summary_path=a.summary, log_every=a.log_every, train_fn=a.train_fn).validate()
