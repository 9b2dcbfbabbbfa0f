"""Run options: the ``deadpool run``-style arguments and the RunConfig they make, derived from config.py's sections
(one option per setting: its flag, default, help and type come from the field; see config.opt).

Shared by the ``deadpool`` command (cli.py) and ``python -m deadpool_hpc.launch.slurm`` (slurm.py), so that both
accept the same options with the same checks. Owns parsing and checking a run's options (a bad one is a
ConfigError, or an argparse error: exit 2 either way); does not own what a RunConfig holds (config.py) nor
the run directory (rundir.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os

from ..agent.health import check_plugins
from ..config import BACKENDS, SECTIONS, FlatField, RunConfig, cli_flag, flat_fields, parse_train_arg
from ..errors import ConfigError
from ..faultinject.spec import parse_fault
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


# argparse ``type``s of the options whose text needs more than int()/float()
CLI_TYPES = {"hang_timeout": hang_timeout, "metrics_port": metrics_port, "crash_loop_limit": crash_loop_limit}


def _option(ff: FlatField) -> tuple[str, dict] | None:
    """The argparse option of one setting, from its field (config.opt): (flag, add_argument's keywords), or None
    for a setting without a flag."""
    f, md = ff.field, ff.field.metadata
    flag = cli_flag(f)
    if not flag:
        return None
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    kw: dict = {"help": md["help"]}
    if isinstance(default, bool):
        kw["action"] = "store_true"   # --no-X turns a True setting off; --X turns a False one on
    else:
        kw["default"] = default
        kw["type"] = CLI_TYPES.get(ff.name) or md.get("cli_type") or (type(default) if default is not None else str)
        if md.get("metavar"):
            kw["metavar"] = md["metavar"]
        if ff.name == "backend":
            kw["choices"] = BACKENDS
    return flag, kw


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Add the ``deadpool run`` / ``deadpool submit`` options to ``p``: one per setting of config.py's sections
    (``_option``), then the test fault flags (faultinject) and ``--train-arg`` with the demo's shorthands."""
    groups = {sec: p.add_argument_group(sec) for sec in SECTIONS if sec != "internal"}
    for ff in flat_fields():
        if (opt := _option(ff)) is not None:
            groups[ff.section].add_argument(opt[0], **opt[1])
    g = groups["train"]
    g.add_argument("--train-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of the training function (ctx.config.train.train_args; VALUE becomes an int, "
                        "float, true/false or string), e.g. n_layer=4 for the demo (repeatable)")
    for flag, kind in SHORTHANDS:
        g.add_argument(flag, type=kind, help=f"shorthand for --train-arg {flag[2:].replace('-', '_')}=VALUE")
    g = p.add_argument_group("fault injection (tests and demos)")
    g.add_argument("--kill", action="append", default=[], metavar="TARGET@WHEN",
                   help="SIGKILL nodeN or rankN when training reaches step WHEN, at a moment of the start-up "
                        "(startup, build, first), or when it reaches phase WHEN of a recovery (detect, agree, "
                        "decided, rebuild, restore, resume; #K: of the K-th recovery) (repeatable)")
    g.add_argument("--hang", action="append", default=[], metavar="TARGET@WHEN",
                   help="SIGSTOP nodeN or rankN, at a step or phase as for --kill (repeatable)")
    g.add_argument("--slow", action="append", default=[], metavar="nodeN@startup|build|STEP[:FACTOR]",
                   help="make node N's training processes FACTOR times slower (default 8) from their start, or from "
                        "when their model is built: what the start-up's pre-flight speed check catches; or from step "
                        "STEP on: what the straggler check catches (repeatable)")
    g.add_argument("--nic-down", action="append", default=[], metavar="nodeN[@STEP]",
                   help="node N's data-plane interface is down from its start (its gloo is given an interface that "
                        "does not exist): what the start-up's link check catches; an idle spare's from step STEP on: "
                        "what its re-check catches (repeatable)")


SHORTHANDS = (("--batch-size", int), ("--context", int), ("--lr", float), ("--seed", int))


def _from_args(a) -> dict:
    """{flat name: value} of every setting with a flag, read from parsed options."""
    out = {}
    for ff in flat_fields():
        opt = _option(ff)
        if opt is None:
            continue
        flag, kw = opt
        v = getattr(a, flag[2:].replace("-", "_"))
        if kw.get("action") == "store_true" and flag.startswith("--no-"):
            v = not v
        out[ff.name] = v
    if out["metrics_textfile"]:
        out["metrics_textfile"] = os.path.abspath(out["metrics_textfile"])
    return out


def options_markdown() -> str:
    """The README's options list, by section: each option, its default and its help (tests/unit/test_config.py keeps the
    README equal to it)."""
    lines = []
    for sec in SECTIONS:
        rows = []
        for ff in flat_fields():
            opt = _option(ff) if ff.section == sec else None
            if opt is None:
                continue
            flag, kw = opt
            meta = kw.get("metavar") or ("" if kw.get("action") else ff.name.upper())
            shown = kw.get("action") or "default" in kw["help"] or kw["default"] in (None, "")
            default = "" if shown else f" (default: {kw['default']})"
            rows.append(f"- `{flag}{' ' + meta if meta else ''}`{default}: {kw['help']}")
        if rows:
            lines.append(f"`{sec}`: {SECTIONS[sec].__doc__.splitlines()[0]}\n")
            lines.extend(rows)
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


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
    for name in (flag[2:].replace("-", "_") for flag, _ in SHORTHANDS):  # the demo's shorthands
        if getattr(a, name) is not None:
            train_args[name] = getattr(a, name)
    check_train_fn(a.train_fn, train_args)
    check_extensions(a.replica_transport)   # nothing starts with a plugin that is missing or broken
    if a.summary:
        from ..rundir import check_output_file

        check_output_file(a.summary, run_dir=a.run_dir)
    faults = [parse_fault("kill", s) for s in a.kill] + [parse_fault("hang", s) for s in a.hang] \
        + [parse_fault("slow", s) for s in a.slow] + [parse_fault("nic_down", s) for s in a.nic_down]
    return RunConfig(**_from_args(a), faults=faults, train_args=train_args).validate()
