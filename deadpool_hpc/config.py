"""Run configuration: one frozen dataclass per section, composed into ``RunConfig``; parsing and validation, before
any process starts.

Each setting is written once, as a field of its section (``layout``, ``train``, ``replication``, ``timeouts``,
``preflight``, ``stragglers``, ``comeback`` (spares that return), ``persistence``, ``replacement`` (nodes asked of
Slurm), ``output``, and ``internal`` for what tests and benchmarks set): its default, its help text, the check
of its value and what is accepted (the field's metadata, ``opt``). The ``deadpool run`` / ``deadpool submit``
options (launch/options.py), the submitit executor's parameters (``run_parameters``) and the README's options list
are derived from these fields. Every setting also has a *flat name* (``heartbeat_deadline``, ``straggler_factor``):
the CLI option without its dashes and the submitit parameter; ``RunConfig(**flat)`` builds a config from flat
names, ``cfg.flat()`` gives them back.

Owns the shapes every other module reads; owns no behaviour. A bad value raises ``ConfigError`` naming the value
and what would be accepted; the CLI turns that into exit 2. The test fault grammar lives in ``faultinject``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field

from .errors import ConfigError

STRAGGLER_ACTIONS = ("swap", "report", "off")   # --straggler-action
BACKENDS = ("auto", "nccl", "gloo")             # --backend


def parse_train_arg(spec: str) -> tuple[str, object]:
    """Parse ``--train-arg KEY=VALUE``: VALUE becomes an int ("8"), a float ("3e-3"), a bool ("true"/"false",
    any case) or else stays a string. Raises ConfigError naming the spec."""
    key, sep, text = spec.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ConfigError(f"--train-arg {spec!r}: accepted: KEY=VALUE with KEY a Python identifier (e.g. n_layer=4)")
    if text.lower() in ("true", "false"):
        return key, text.lower() == "true"
    for conv in (int, float):
        try:
            return key, conv(text)
        except ValueError:
            pass
    return key, text


def textfile_dir_problem(path) -> str | None:
    """Why ``--metrics-textfile`` ``path`` cannot be used, or None: it must be a directory this user may write."""
    import os

    if not isinstance(path, str) or not path:
        return "not a path"
    if not os.path.isdir(path):
        return "not a directory" if os.path.exists(path) else "no such directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return "not writable by this user"
    return None


def cuda_available() -> bool:
    """Whether this machine can run NCCL: torch sees CUDA and at least one GPU (imports torch)."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)


# ---- checks of one value: each returns True when the value is accepted ------------------------------------------
def _int(lo: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _num(lo: float, strict: bool = False, zero: bool = False):
    """A finite number >= lo (> lo when strict); ``zero``: 0 is accepted too (off)."""
    def check(v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        return (zero and v == 0) or (v > lo if strict else v >= lo)
    return check


def _bool(v) -> bool:
    return isinstance(v, bool)


def _str(v) -> bool:
    return isinstance(v, str) and "\0" not in v


def _train_args(v) -> bool:
    return isinstance(v, dict)


def opt(default=dataclasses.MISSING, *, help: str, accepted: str, check=None, flag: str | None = None,
        flat: str | None = None, metavar: str | None = None, cli_type=None, factory=None, public: bool = True):
    """A setting: a dataclass field whose metadata says how it is offered and checked.

    ``help``: its help text (CLI, README); ``accepted``: what a valid value is (error messages, submitit);
    ``check(value) -> bool``: the value's own check (rules between settings are the section's ``_check``);
    ``flag``: its CLI option (default ``--`` + the flat name with dashes; "" for none; a bool's ``--no-...`` flag
    turns it off); ``flat``: its flat name when not the field's; ``metavar`` and ``cli_type``: argparse's; ``public``:
    False for a setting that is not a user's (no submitit parameter)."""
    md = dict(help=help, accepted=accepted, check=check, flag=flag, flat=flat, metavar=metavar, cli_type=cli_type,
              public=public)
    if factory is not None:
        return field(default_factory=factory, metadata=md)
    return field(default=default, metadata=md)


class Section:
    """What every section shares: the check of each field (its ``opt`` metadata), then the section's own rules
    between settings (``_check``, given the whole RunConfig)."""

    def validate(self, run: "RunConfig") -> None:
        """Raise ConfigError naming the first bad value of this section and what is accepted."""
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            v = getattr(self, f.name)
            if check is not None and not check(v):
                raise ConfigError(f"{label(f)} {v!r}: accepted: {f.metadata['accepted']}")
        self._check(run)

    def _check(self, run: "RunConfig") -> None:
        pass


def flat_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flat") or f.name


def cli_flag(f: dataclasses.Field) -> str:
    """The field's CLI option ("" for none)."""
    flag = f.metadata.get("flag")
    return "--" + flat_name(f).replace("_", "-") if flag is None else flag


def label(f: dataclasses.Field) -> str:
    """How an error message names the field: its CLI option, else its flat name."""
    flag = cli_flag(f)
    return flag if flag and not flag.startswith("--no-") else flat_name(f)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class Layout(Section):
    """Which processes train, and how they talk.

    ``nodes`` active nodes x ``ranks_per_node`` ranks train (world size = nodes * ranks_per_node); ``spares`` more
    nodes wait, pre-initialised, to take a lost node's place."""

    nodes: int = opt(3, metavar="N", help="active (training) nodes", accepted="1 or more (active nodes)", check=_int(1))
    spares: int = opt(1, metavar="S", help="spare nodes allocated with the job", accepted="0 or more", check=_int(0))
    # 0 is resolved before any process starts, where the node is known (launch/batch.py on a Slurm allocation, where
    # it is the batch template's and ``deadpool submit``'s default; launch/local.py): never seen by an agent or worker
    ranks_per_node: int = opt(1, metavar="P", check=_int(0),
                              help="training processes per node (deadpool run: 1); 0: one per GPU of the node "
                                   "(1 without a GPU), what deadpool submit and the batch template take when not told",
                              accepted="1 or more, or 0 (one per GPU of the node)")
    backend: str = opt("auto", metavar="auto|nccl|gloo",
                       help="the training processes' torch.distributed backend: auto (nccl where torch sees CUDA "
                            "and the node has a GPU, else gloo), nccl or gloo (default auto)",
                       accepted="auto, nccl or gloo (nccl only where CUDA is available)",
                       check=lambda v: v in BACKENDS)
    fork_server: bool = opt(True, flag="--no-fork-server", check=_bool, accepted="True or False",
                            help="local launcher: start each training process as a fresh interpreter (each imports "
                                 "torch) instead of forking it from one that imported torch once for the run",
                            public=False)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.spares

    @property
    def total_processes(self) -> int:
        return self.total_nodes * self.ranks_per_node

    def _check(self, run: "RunConfig") -> None:
        _need(self.spares == 0 or self.nodes >= 2,
              f"--nodes {self.nodes} with --spares {self.spares}: a rank's replica lives on another active node, "
              f"so hot-swap needs at least 2 active nodes")
        if self.backend == "nccl":
            try:
                ok = cuda_available()
            except ImportError:
                ok = False
            _need(ok, "--backend 'nccl': CUDA is not available here (torch.cuda.is_available() is False or no GPU "
                      "is visible); accepted: auto (gloo here) or gloo")


@dataclass(frozen=True)
class Train(Section):
    """The training function and its own settings."""

    steps: int = opt(200, metavar="K", help="training steps", accepted="1 or more", check=_int(1))
    train_fn: str = opt("deadpool_hpc.train.demo:train", metavar="MODULE:FUNCTION", help="module:function to train "
                                                                                         "(default: the demo)",
                        accepted="'package.module:function'", check=lambda v: isinstance(v, str) and ":" in v,
                        public=False)
    # read by the training function as ``ctx.config.train.train_args``: str keys, str/int/float/bool values
    # (JSON-safe: config.json carries them to every process). The demo's model and data sizes live here
    train_args: dict = opt(factory=dict, flag="", check=_train_args, accepted="a dict",
                           help="the training function's own settings (--train-arg KEY=VALUE, repeatable: VALUE "
                                "becomes an int, float, true/false or string; ctx.config.train.train_args)")

    def _check(self, run: "RunConfig") -> None:
        for k, v in self.train_args.items():
            _need(isinstance(k, str) and k.isidentifier(),
                  f"--train-arg {k!r}: accepted: a key that is a Python identifier (e.g. n_layer)")
            _need(isinstance(v, (str, int, float, bool)) and (not isinstance(v, float) or math.isfinite(v)),
                  f"--train-arg {k}={v!r}: accepted: a string, integer, finite float or boolean")


@dataclass(frozen=True)
class Replication(Section):
    """The replica plane: each rank's snapshot is held by the next ``replicas`` nodes."""

    replicate: bool = opt(True, flag="--no-replicate", check=_bool, accepted="True or False",
                          help="turn the replica plane off (benchmarks only)")
    replicas: int = opt(1, metavar="K", check=_int(0), accepted="0 or more, less than --nodes",
                        help="K: each rank's snapshot lives on the next K nodes, so any K node losses at once survive")
    replica_transport: str = opt("tcp", metavar="NAME", check=lambda v: isinstance(v, str) and v != "",
                                 accepted="a replica transport's name: tcp, unix or a plugin's (docs/plugins.md)",
                                 help="how replicas travel between node agents: tcp (default), unix (one machine "
                                      "only), or a transport plugin's name (docs/plugins.md)")

    def _check(self, run: "RunConfig") -> None:
        n = run.layout.nodes
        _need(not self.replicate or n == 1 or self.replicas < n,
              f"--replicas {self.replicas} with --nodes {n}: each replica lives on another active node; "
              f"accepted: --replicas 0..{n - 1}")


@dataclass(frozen=True)
class Timeouts(Section):
    """Heartbeats and every deadline, in seconds."""

    heartbeat_period: float = opt(0.2, metavar="SECONDS", check=_num(0, strict=True), accepted="seconds > 0",
                                  help="seconds between two heartbeats (5 per deadline: an idle agent's CPU cost)")
    heartbeat_deadline: float = opt(1.0, metavar="SECONDS", check=_num(0, strict=True),
                                    accepted="seconds > 0, more than twice --heartbeat-period",
                                    help="seconds of silence after which a watched peer is probed")
    heartbeat_ceiling: float = opt(4.0, metavar="SECONDS", check=_num(0, strict=True),
                                   accepted="seconds >= 2 x the heartbeat deadline",
                                   help="the longest a frozen node may go unnoticed: a silent node is probed after the "
                                        "deadline and suspected once other nodes confirm it (deadlines follow the "
                                        "observed load, up to this; default 4, at least 2 x --heartbeat-deadline)")
    collective_timeout: float = opt(60.0, metavar="SECONDS", check=_num(0, strict=True), accepted="seconds > 0",
                                    help="seconds a rank waits for its peers in one collective before the process "
                                         "group is rebuilt (at least --hang-timeout + 2 heartbeat deadlines is used)")
    hang_timeout: float = opt(60.0, metavar="SECONDS|off", check=_num(0),
                              accepted="seconds > 0 (0 or --hang-timeout off: no hang detection)",
                              help="seconds without progress of a rank's training thread before it is fenced, or off "
                                   "(no hang detection); must exceed your longest step")
    rendezvous_timeout: float = opt(10.0, metavar="SECONDS", check=_num(0, strict=True), accepted="seconds > 0",
                                    help="seconds to join a generation's process group (store connect + gloo full "
                                         "mesh) before the recovery round is retried")
    startup_timeout: float = opt(300.0, metavar="SECONDS", check=_num(0, strict=True), accepted="seconds > 0",
                                 help="seconds for MPI start-up, a training process's import and model build, and the "
                                      "first collectives; a training process not up by then is its node's failure "
                                      "(a spare takes it)")

    @property
    def wait_timeout(self) -> float:
        """Seconds a rank waits for its peers in one collective or replica commit before it gives up (and the run
        rebuilds its process group): ``--collective-timeout``, but never less than a peer's step may legitimately
        take (``--hang-timeout``) plus two heartbeat deadlines, so a slow step is waited for, not replayed."""
        return max(self.collective_timeout, self.hang_timeout + self.heartbeat_ceiling)

    @property
    def ready_timeout(self) -> float:
        """Seconds the recovery coordinator waits for a live process's report before it suspects it: a process
        whose heartbeats go on but whose training thread never reaches the recovery is stuck; its own watchdog
        (``hang_timeout``) or, without one, the collective timeout bounds how long it may legitimately take."""
        return (self.hang_timeout or self.wait_timeout) + self.heartbeat_ceiling

    @property
    def recovery_timeout(self) -> float:
        """Seconds a process waits for the decision of one recovery round before it gives up (clear exit)."""
        return 2 * self.ready_timeout + self.rendezvous_timeout

    def _check(self, run: "RunConfig") -> None:
        _need(self.heartbeat_deadline > 2 * self.heartbeat_period,
              f"heartbeat deadline {self.heartbeat_deadline!r} s: must exceed twice the period "
              f"({self.heartbeat_period} s)")
        _need(self.heartbeat_ceiling >= 2 * self.heartbeat_deadline,
              f"--heartbeat-ceiling {self.heartbeat_ceiling!r}: accepted: seconds >= 2 x the heartbeat deadline "
              f"({2 * self.heartbeat_deadline:g} s: the deadline, then as long again for the confirmation)")
        _need(not self.hang_timeout or self.hang_timeout >= self.heartbeat_deadline,
              f"--hang-timeout {self.hang_timeout!r}: accepted: off, or at least the heartbeat deadline "
              f"({self.heartbeat_deadline} s) and more than your longest step")


@dataclass(frozen=True)
class Preflight(Section):
    """The start-up's checks of each node (agent/preflight.py), and an idle spare's re-checks."""

    health_check: str = opt("", metavar="CMD", check=_str,
                            accepted="a shell command (a string), or empty for none",
                            help="a command each node runs at start-up (sh -c; exit 0: healthy); a node whose check "
                                 "fails or outlasts --startup-timeout is replaced by a spare before training")
    factor: float = opt(3.0, flat="preflight_factor", metavar="FACTOR", check=_num(1, strict=True, zero=True),
                        accepted="a number > 1 (times the job's median), or 0: off",
                        help="at start-up every node all-reduces with its neighbour nodes and times a small matmul on "
                             "its device; a node whose links all fail, or slower than FACTOR x the job's median, is "
                             "replaced by a spare before training (default 3; 0: both checks off)")
    spare_check_every: float = opt(60.0, metavar="SECONDS", check=_num(0),
                                   accepted="seconds >= 0 (0: never)",
                                   help="an idle spare checks itself again this often (--health-check, the timed "
                                        "matmul, an all-reduce with a training node); one that fails leaves the pool "
                                        "before a recovery needs it (default 60; 0: never)")


@dataclass(frozen=True)
class Stragglers(Section):
    """The straggler check (agent/stragglers.py)."""

    factor: float = opt(1.5, flat="straggler_factor", metavar="FACTOR", check=_num(1, strict=True),
                        accepted="a number > 1 (times the other nodes' median own work per step, e.g. 1.5)",
                        help="a training node whose ranks' own work per step (their step time less their waits on "
                             "peers) stays over FACTOR x the other nodes' median for --straggler-window seconds is a "
                             "straggler (default 1.5)")
    window: float = opt(60.0, flat="straggler_window", metavar="SECONDS", check=_num(0, strict=True),
                        accepted="seconds > 0 (how long a node must stay slow)",
                        help="how long a node must stay slow to be a straggler (default 60)")
    action: str = opt("swap", flat="straggler_action", metavar="swap|report|off",
                      check=lambda v: v in STRAGGLER_ACTIONS, accepted=", ".join(STRAGGLER_ACTIONS),
                      help="swap: a straggler is taken out by a planned swap when a spare is free (0 steps "
                           "recomputed), else reported; report: the event only; off: not measured (default swap)")


@dataclass(frozen=True)
class Comeback(Section):
    """Spares that come back (agent/comeback.py), and crash loops (control/crashloop.py)."""

    enabled: bool = opt(True, flat="spare_return", flag="--no-spare-return", check=_bool,
                        accepted="True or False",
                        help="a node whose training processes failed leaves the job for good (default: its agent, "
                             "alive, ends them, checks the node and returns it to the spare pool for the next "
                             "generation)")
    quarantine: float = opt(300.0, metavar="SECONDS", check=_num(0),
                            accepted="seconds >= 0 (a node that fails again this soon after its return stays out; "
                                     "0: never quarantined for that)",
                            help="a node that fails again within SECONDS of its return to the spare pool stays out "
                                 "(default 300; 0: never for that reason)")
    health_check_timeout: float = opt(60.0, metavar="SECONDS", check=_num(0, strict=True),
                                      accepted="seconds > 0 (a returning node's --health-check still running then is "
                                               "killed and counts as unhealthy)",
                                      help="a returning node's --health-check still running after SECONDS is killed "
                                           "and the node stays out (default 60)")
    crash_loop_limit: int = opt(2, metavar="N", check=_int(0),
                                accepted="an integer >= 0 (repeats of the same rank's crash at the same step on other "
                                         "nodes before the run stops; 0: off)",
                                help="the same training rank ending the same way (signal or exit code) at the same "
                                     "step on N more nodes after the first (a crash that follows the work, e.g. a bad "
                                     "batch, not the node) stops the run: a checkpoint at the last common step, no "
                                     "more spares promoted into it, exit status 4 naming the rank, step and signal "
                                     "(default 2; 0: off)")


@dataclass(frozen=True)
class Persistence(Section):
    """Checkpoints on the shared filesystem, and requeues."""

    persist_every: float = opt(300.0, metavar="SECONDS", check=_num(0), accepted="seconds >= 0 (0: never)",
                               help="the node agents write the newest committed snapshot of every rank to "
                                    "RUN_DIR/checkpoint this often, in the background, so that a job killed outright "
                                    "resumes from at most that far back after a requeue (default 300; 0: never)")
    requeue: bool = opt(False, check=_bool, accepted="True or False",
                        help="when no spare is left: save a checkpoint, then restart the job from it (as Slurm "
                             "requeues)")
    max_requeues: int = opt(3, flag="", check=_int(0), accepted="0 or more", help="requeues at most")


@dataclass(frozen=True)
class Replacement(Section):
    """Replacement nodes: when the spare pool falls below a floor, a Slurm job asks for more.

    ``spare_floor`` > 0: whenever fewer than that many spares are left, the batch host submits small companion jobs
    (one node each, the main job's account, partition, constraints and time limit; launch/companion.py) and
    cancels each one that has not started within ``spare_wait`` seconds, and all of them when the job ends; each
    companion's node joins the running job as a spare (control/joining.py). Slurm only (the batch template:
    ``deadpool submit``, ``SlurmExecutor``); docs/replacement-nodes.md."""

    spare_floor: int = opt(0, metavar="K", check=_int(0),
                           accepted="an integer >= 0 (spares below which replacement nodes are asked of Slurm; 0: off)",
                           help="when fewer than K spares are left, ask Slurm for replacement nodes, which join the "
                                "running job as spares: one companion job of one node per missing spare, at most K "
                                "at a time (Slurm batch jobs only; docs/replacement-nodes.md; default 0: off)")
    spare_wait: float = opt(600.0, metavar="SECONDS", check=_num(0, strict=True), accepted="seconds > 0",
                            help="a companion job not started within SECONDS is cancelled and the job goes on with "
                                 "the spares it has (default 600)")


def only_under_slurm_batch(cfg: "RunConfig", launcher: str) -> None:
    """Refuse ``--spare-floor`` > 0 for a launcher that cannot ask Slurm for nodes (``launcher``: its name, e.g.
    "deadpool run (local)"): replacement nodes are companion Slurm jobs that the batch template's watcher submits
    and its exit trap cancels. Raises ConfigError naming the value and what is accepted."""
    k = cfg.replacement.spare_floor
    _need(k == 0, f"--spare-floor {k} with {launcher}: replacement nodes are Slurm jobs that the batch template "
                  f"submits and cancels (docs/replacement-nodes.md); accepted: --spare-floor 0 here, or a Slurm "
                  f"batch job (deadpool submit, SlurmExecutor, sbatch/train.sbatch)")

@dataclass(frozen=True)
class Output(Section):
    """Where a run's results go: its directory, summary, logs and metrics."""

    run_dir: str = opt("deadpool-run", metavar="DIR", check=lambda v: isinstance(v, str) and v != "",
                       accepted="a directory path", help="event log, config and logs of the run")
    summary_path: str | None = opt(None, flag="--summary", metavar="PATH",
                                   check=lambda v: v is None or (isinstance(v, str) and v != ""),
                                   accepted="None or a file path", help="write the run summary JSON here")
    log_every: int = opt(1, metavar="STEPS", check=_int(1), accepted="1 or more",
                         help="steps between two step events")
    metrics_port: int = opt(0, metavar="PORT", check=_int(0), accepted="a TCP port 1..65535, or 0: off",
                            help="serve Prometheus metrics over HTTP: the job's view on PORT (the coordinator: the "
                                 "lowest live node agent), node I's on PORT + 1 + I (default: off)")
    metrics_textfile: str = opt("", metavar="DIR", check=lambda v: isinstance(v, str),
                                accepted="a directory this user may write (node_exporter's "
                                         "--collector.textfile.directory)",
                                help="write the same metrics in node_exporter's textfile form to DIR, every 5 s and "
                                     "at the end: deadpool_<job>_job.prom and deadpool_<job>_node<I>.prom (<job>: "
                                     "Slurm's job id, else the run directory's name); DIR must exist on every node "
                                     "(default: off)")

    def _check(self, run: "RunConfig") -> None:
        top = 65535 - run.layout.total_nodes
        _need(self.metrics_port == 0 or 1 <= self.metrics_port <= top,
              f"--metrics-port {self.metrics_port!r}: accepted: a TCP port 1..{top} (the job's endpoint; node I's "
              f"is that + 1 + I, for {run.layout.total_nodes} nodes)")
        if self.metrics_textfile:
            why = textfile_dir_problem(self.metrics_textfile)
            _need(why is None, f"--metrics-textfile {self.metrics_textfile!r}: {why}; accepted: a directory this "
                               f"user may write (node_exporter's --collector.textfile.directory)")


@dataclass(frozen=True)
class Internal(Section):
    """For tests and benchmarks, not a user's setting: injected faults (faultinject/; ``--kill`` and the other test
    flags) and a benchmark's replication blocks."""

    faults: list = opt(factory=list, flag="", check=lambda v: isinstance(v, (list, tuple)),
                        accepted="a list of faultinject.Fault", public=False,
                        help="injected faults (--kill, --hang, --slow, --nic-down)")
    # benchmarks/overhead.py: K > 0 alternates blocks of K steps with replication on and off within one run (steps
    # 0..K-1 on, K..2K-1 off, ...), so that both halves see the same machine at the same time. A fault in an off
    # block would recompute up to K steps, so faults are refused with it
    interleave_replication: int = opt(0, flag="", check=_int(0), public=False,
                                      accepted="0 (off) or a block of K >= 1 steps",
                                      help="a benchmark's on/off replication blocks of K steps (0: off)")

    def _check(self, run: "RunConfig") -> None:
        from .faultinject import plan

        _need(not self.interleave_replication or (run.replication.replicate and not self.faults),
              "interleave_replication (a benchmark's on/off blocks) needs replication on and no faults: a fault in "
              "an off block would recompute up to a block of steps")
        lay = run.layout
        for f in self.faults:
            if f.target_kind == "node":
                _need(f.index < lay.total_nodes,
                      f"{f}: unknown fault target node{f.index}; this layout has node0..node{lay.total_nodes - 1}")
            else:
                _need(f.index < lay.world_size,
                      f"{f}: unknown fault target rank{f.index}; this layout has rank0..rank{lay.world_size - 1}")
            if f.kind == "nic_down":
                _need(bool(run.preflight.factor), f"{f} with --preflight-factor 0: the pre-flight's link check is "
                      f"what finds a node whose data plane is down; accepted: --preflight-factor > 1 (the default, 3)")
                # a training node's interface going down while it trains would be found by its next rebuild, which
                # the fault plan cannot place: a step is for an idle spare, whose re-check finds it
                _need(f.step is None or (f.index >= lay.nodes and run.preflight.spare_check_every > 0),
                      f"{f}: from a step on, only an idle spare's interface goes down (its re-check every "
                      f"--spare-check-every seconds finds it); accepted: node{lay.nodes}..node{lay.total_nodes - 1} "
                      f"with --spare-check-every > 0, or node{f.index} (down from its start)")
            if f.phase is None:
                _need(isinstance(f.step, int) and 0 <= f.step < run.train.steps,
                      f"{f}: step {f.step} is past --steps {run.train.steps}; accepted: 0..{run.train.steps - 1}")
        plan.check(run)


SECTIONS: dict[str, type] = {"layout": Layout, "train": Train, "replication": Replication, "timeouts": Timeouts,
                             "preflight": Preflight, "stragglers": Stragglers, "comeback": Comeback,
                             "persistence": Persistence, "replacement": Replacement, "output": Output,
                             "internal": Internal}


class FlatField(typing.NamedTuple):
    """A setting by its flat name: its ``section`` and the dataclass ``field`` there (metadata: see ``opt``)."""

    name: str
    section: str
    field: dataclasses.Field


def flat_fields() -> list[FlatField]:
    """Every setting, in section order, by flat name."""
    return [FlatField(flat_name(f), sec, f) for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


FLAT: dict[str, FlatField] = {ff.name: ff for ff in flat_fields()}
# values computed from a section, readable by their flat name too
DERIVED = {"world_size": "layout", "total_nodes": "layout", "total_processes": "layout",
           "wait_timeout": "timeouts", "ready_timeout": "timeouts", "recovery_timeout": "timeouts"}


@dataclass(init=False)
class RunConfig:
    """Everything one run needs, by section. Times are in seconds, sizes in tokens unless named otherwise.

    Sections are frozen; ``update(**flat)`` replaces the sections that hold the named settings (in place),
    ``replace(**flat)`` returns a changed copy. A flat name read on a RunConfig (``cfg.steps``) is the section's
    value, and on the class its default (``_FlatName``: the CLI's and submitit's vocabulary, for training functions
    written against it); the package itself reads the sections. Raises ConfigError for an unknown setting."""

    layout: Layout = field(default_factory=Layout)
    train: Train = field(default_factory=Train)
    replication: Replication = field(default_factory=Replication)
    timeouts: Timeouts = field(default_factory=Timeouts)
    preflight: Preflight = field(default_factory=Preflight)
    stragglers: Stragglers = field(default_factory=Stragglers)
    comeback: Comeback = field(default_factory=Comeback)
    persistence: Persistence = field(default_factory=Persistence)
    replacement: Replacement = field(default_factory=Replacement)
    output: Output = field(default_factory=Output)
    internal: Internal = field(default_factory=Internal)

    def __init__(self, **settings) -> None:
        """Sections by name (``layout=Layout(nodes=4)``) and/or settings by flat name (``nodes=3``,
        ``straggler_factor=2.0``); every other setting its default. Raises ConfigError naming an unknown name."""
        for sec, cls in SECTIONS.items():
            object.__setattr__(self, sec, settings.pop(sec, None) or cls())
        self.update(**settings)

    def update(self, **settings) -> "RunConfig":
        """Set settings by flat name, in place (each section replaced). Returns self; ConfigError for an unknown
        name."""
        by_section: dict[str, dict] = {}
        for k, v in settings.items():
            ff = FLAT.get(k)
            if ff is None:
                raise ConfigError(f"unknown setting {k!r}; accepted: {', '.join(FLAT)}")
            by_section.setdefault(ff.section, {})[ff.field.name] = v
        for sec, changes in by_section.items():
            object.__setattr__(self, sec, dataclasses.replace(getattr(self, sec), **changes))
        return self

    def replace(self, **settings) -> "RunConfig":
        """A copy with settings changed by flat name."""
        return dataclasses.replace(self).update(**settings)

    def flat(self) -> dict:
        """{flat name: value} of every setting."""
        return {ff.name: getattr(getattr(self, ff.section), ff.field.name) for ff in FLAT.values()}

    @staticmethod
    def flat_fields() -> list[FlatField]:
        """Every setting by flat name (``flat_fields``): ``.name``, ``.section``, ``.field``."""
        return flat_fields()

    @property
    def replica_holders(self) -> int:
        """K as placed: how many nodes hold each rank's snapshot (0 without replication or with one node)."""
        r = self.replication
        return min(r.replicas, self.layout.nodes - 1) if r.replicate else 0

    def validate(self) -> "RunConfig":
        """Check every section, in order, and every fault against the layout. Returns self; raises ConfigError
        naming the first bad value and what is accepted."""
        for sec in SECTIONS:
            getattr(self, sec).validate(self)
        return self

    def to_json(self) -> str:
        """The nested form: {section: {field: value}}, faults as objects (what config.json carries)."""
        d = dataclasses.asdict(self)
        d["internal"]["faults"] = [dataclasses.asdict(f) for f in self.internal.faults]
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        """The RunConfig of ``to_json``'s text; ConfigError names an unknown section or setting."""
        from .faultinject.spec import Fault

        d = json.loads(text)
        if isinstance(d, dict) and set(d) - set(SECTIONS):
            raise ConfigError(f"unknown config sections {sorted(set(d) - set(SECTIONS))}; accepted: "
                              f"{sorted(SECTIONS)}")
        if not isinstance(d, dict) or not all(isinstance(b, dict) for b in d.values()):
            raise ConfigError(f"config {text[:80]!r}: accepted: {{section: {{setting: value}}}} (RunConfig.to_json)")
        sections = {}
        for sec, body in d.items():
            known = {f.name for f in dataclasses.fields(SECTIONS[sec])}
            unknown = set(body) - known
            if unknown:
                raise ConfigError(f"unknown config keys {sorted(unknown)} in {sec}; accepted: {sorted(known)}")
            if sec == "internal" and "faults" in body:
                body = dict(body, faults=[Fault(**f) for f in body["faults"]])
            sections[sec] = SECTIONS[sec](**body)
        return cls(**sections)


class _FlatName:
    """``RunConfig.<flat name>``: on a config, the section's value (assigning it replaces the section, ``update``);
    on the class, the default (``RunConfig.train_fn``). A derived value (``world_size``) is read-only."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj, cls=None):
        if self.name in DERIVED:
            return getattr(getattr(obj if obj is not None else RunConfig(), DERIVED[self.name]), self.name)
        ff = FLAT[self.name]
        if obj is None:
            f = ff.field
            return f.default if f.default is not dataclasses.MISSING else f.default_factory()
        return getattr(getattr(obj, ff.section), ff.field.name)

    def __set__(self, obj, value) -> None:
        if self.name in DERIVED:
            raise AttributeError(f"{self.name} is computed from the {DERIVED[self.name]} section")
        obj.update(**{self.name: value})


for _name in [*FLAT, *DERIVED]:
    setattr(RunConfig, _name, _FlatName(_name))
del _name


def run_parameters() -> dict[str, tuple]:
    """The submitit executor's run parameters, derived from the sections: {flat name: (check(value) -> bool, what
    is accepted)} for every public setting except ``nodes`` (submitit's own generic parameter)."""
    params = {ff.name: (ff.field.metadata["check"], ff.field.metadata["accepted"]) for ff in FLAT.values()
              if ff.field.metadata["public"] and ff.name != "nodes"}
    # ranks_per_node 0 (one per GPU) is resolved by the batch template on the allocation, which submitit's job has not
    params["ranks_per_node"] = (_int(1), "1 or more")
    return params
