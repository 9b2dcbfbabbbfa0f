"""Run configuration: parsing and validation, before any process starts.

Owns the shape every other module reads (``RunConfig``; the faults' ``Fault`` is faultinject's); owns no behaviour. A bad value
raises ``ConfigError`` naming the value and what would be accepted; the CLI turns that into exit 2.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from .errors import ConfigError

STRAGGLER_ACTIONS = ("swap", "report", "off")   # --straggler-action


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


@dataclass
class RunConfig:
    """Everything one run needs. Times are in seconds, sizes in tokens unless named otherwise.

    Layout: ``nodes`` active emulated nodes x ``ranks_per_node`` ranks train (world size =
    nodes * ranks_per_node); ``spares`` extra nodes wait, pre-initialised, to take a lost node's place.
    """

    nodes: int = 3
    spares: int = 1
    ranks_per_node: int = 1
    steps: int = 200
    faults: list = field(default_factory=list)
    # the training function's own settings (``--train-arg KEY=VALUE``), read by it as ``ctx.config.train_args``:
    # str keys, str/int/float/bool values (JSON-safe: config.json carries them to every process). The demo's
    # model and data sizes live here (train/demo.py, DemoConfig).
    train_args: dict = field(default_factory=dict)
    # fault tolerance
    replicate: bool = True
    replicas: int = 1              # K: each rank's snapshot is held by the next K nodes (any K node losses survive)
    # benchmark only (benchmarks/overhead.py): K > 0 alternates blocks of K steps with replication on and off within
    # one run (steps 0..K-1 on, K..2K-1 off, ...), so that both halves see the same machine at the same time. A fault
    # in an off block would recompute up to K steps, so faults are refused with it
    interleave_replication: int = 0
    replica_transport: str = "tcp"  # replica/transports.py: an entry point of deadpool_hpc.transports (tcp, unix, ...)
    requeue: bool = False          # no spare left: save a checkpoint and start again from it
    max_requeues: int = 3
    heartbeat_period: float = 0.2    # seconds; 5 per deadline (an idle agent's CPU cost is its heartbeat rate)
    heartbeat_deadline: float = 1.0  # seconds of silence after which a watched peer is probed (control/suspicion.py)
    # seconds: the longest a frozen node may go unnoticed. A silent peer is suspected only after a confirmation (a
    # direct ping and indirect ones through other agents, unanswered); its deadline and the confirmation's window
    # follow the jitter and load each watcher observes, up to this ceiling. At least 2 x heartbeat_deadline
    heartbeat_ceiling: float = 4.0
    collective_timeout: float = 60.0
    hang_timeout: float = 60.0       # a rank whose training thread makes no progress this long is fenced (0: off)
    # seconds between two background writes of every rank's newest committed snapshot to RUN_DIR/checkpoint by the
    # node agents (agent/persister.py): what a job killed outright resumes from after a requeue. 0: never
    persist_every: float = 300.0
    # a site's command each node agent runs at start-up (``sh -c``; exit 0: healthy): a node whose check fails, or
    # is still running at the start-up deadline, is replaced by a spare before training (agent/preflight.py)
    health_check: str = ""
    # the start-up's pre-flight speed check (agent/preflight.py): a node whose timed matmul takes more than this many
    # times the job's median is replaced by a spare before training (0: no speed check, and no link check: the
    # all-reduce with each neighbour node, in the same step)
    preflight_factor: float = 3.0
    # an idle spare's agent checks its node again this often (the site's --health-check and the timed matmul against
    # the start-up's median), so that a spare that went bad is dropped before a recovery needs it (0: never)
    spare_check_every: float = 60.0
    # the straggler check (agent/stragglers.py): a training node whose ranks' own work per step stays over
    # straggler_factor x the other training nodes' median for straggler_window seconds is a straggler; "swap" takes
    # it out by a planned swap when a spare is free (else, and with "report", the event only); "off": not measured
    straggler_factor: float = 1.5
    straggler_window: float = 60.0
    straggler_action: str = "swap"
    # spares that come back (agent/comeback.py): a node whose training processes failed (an exit, a hang)
    # while its agent lives on ends them, checks itself (the detectors, --health-check within health_check_timeout
    # seconds) and returns to the spare pool for the next generation; one that fails its check, or fails again within
    # ``quarantine`` seconds of its return, stays out. False: a failed node leaves the job for good
    spare_return: bool = True
    quarantine: float = 300.0
    # crash loops (control/crashloop.py): the same training rank ending the same way (signal or exit code) at the
    # same step on more than this many other nodes stops the run: a checkpoint at the cut step, no more promotions,
    # exit CRASH_LOOP_EXIT with the rank, step and signal named. 0: off (every such failure is swapped)
    crash_loop_limit: int = 2
    health_check_timeout: float = 60.0
    rendezvous_timeout: float = 10.0 # joining a generation's process group (store connect + gloo full mesh)
    # MPI start-up, a training process's import and model build, and the first collectives: a training process not up
    # by then is a failure of its node (cause "startup_timeout"); an agent lost inside MPI_Init ends the run
    startup_timeout: float = 300.0
    # the local launcher forks the training processes from one process that imported torch once (worker/forkserver.py)
    # instead of starting a fresh interpreter for each; Slurm launches ignore it
    fork_server: bool = True
    # Prometheus metrics (deadpool_hpc/metrics.py), off by default: the job's view on an HTTP endpoint of the
    # coordinator at ``metrics_port``, each node agent's own at ``metrics_port + 1 + node index`` (0: no endpoint);
    # ``metrics_textfile``: a directory where the same views are written in node_exporter's textfile form ("": none)
    metrics_port: int = 0
    metrics_textfile: str = ""
    # output
    run_dir: str = "deadpool-run"
    summary_path: str | None = None
    log_every: int = 1
    train_fn: str = "deadpool_hpc.train.demo:train"

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def replica_holders(self) -> int:
        """K as placed: how many nodes hold each rank's snapshot (0 without replication or with one node)."""
        return min(self.replicas, self.nodes - 1) if self.replicate else 0

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.spares

    @property
    def total_processes(self) -> int:
        return self.total_nodes * self.ranks_per_node

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

    def validate(self) -> "RunConfig":
        """Check the layout and every fault against it. Returns self; raises ConfigError."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(isinstance(self.nodes, int) and self.nodes >= 1, f"--nodes {self.nodes!r}: need at least 1 active node")
        need(isinstance(self.spares, int) and self.spares >= 0, f"--spares {self.spares!r}: accepted: 0 or more")
        need(isinstance(self.ranks_per_node, int) and self.ranks_per_node >= 1,
             f"--ranks-per-node {self.ranks_per_node!r}: accepted: 1 or more")
        need(isinstance(self.steps, int) and self.steps >= 1, f"--steps {self.steps!r}: accepted: 1 or more")
        need(isinstance(self.train_args, dict), f"train_args {self.train_args!r}: accepted: a dict")
        for k, v in self.train_args.items():
            need(isinstance(k, str) and k.isidentifier(),
                 f"--train-arg {k!r}: accepted: a key that is a Python identifier (e.g. n_layer)")
            need(isinstance(v, (str, int, float, bool)) and (not isinstance(v, float) or math.isfinite(v)),
                 f"--train-arg {k}={v!r}: accepted: a string, integer, finite float or boolean")
        need(isinstance(self.max_requeues, int) and self.max_requeues >= 0,
             f"max_requeues {self.max_requeues!r}: accepted: 0 or more")
        need(self.heartbeat_period > 0, f"heartbeat period {self.heartbeat_period!r} s: must be > 0")
        need(self.heartbeat_deadline > 2 * self.heartbeat_period,
             f"heartbeat deadline {self.heartbeat_deadline!r} s: must exceed twice the period ({self.heartbeat_period} s)")
        need(isinstance(self.heartbeat_ceiling, (int, float)) and math.isfinite(self.heartbeat_ceiling)
             and self.heartbeat_ceiling >= 2 * self.heartbeat_deadline,
             f"--heartbeat-ceiling {self.heartbeat_ceiling!r}: accepted: seconds >= 2 x the heartbeat deadline "
             f"({2 * self.heartbeat_deadline:g} s: the deadline, then as long again for the confirmation)")
        need(isinstance(self.metrics_port, int) and not isinstance(self.metrics_port, bool)
             and (self.metrics_port == 0 or 1 <= self.metrics_port <= 65535 - self.total_nodes),
             f"--metrics-port {self.metrics_port!r}: accepted: a TCP port 1..{65535 - self.total_nodes} (the job's "
             f"endpoint; node I's is that + 1 + I, for {self.total_nodes} nodes)")
        if self.metrics_textfile:
            why = textfile_dir_problem(self.metrics_textfile)
            need(why is None, f"--metrics-textfile {self.metrics_textfile!r}: {why}; accepted: a directory this user "
                              f"may write (node_exporter's --collector.textfile.directory)")
        need(self.log_every >= 1, f"--log-every {self.log_every!r}: accepted: 1 or more")
        need(isinstance(self.replicas, int) and self.replicas >= 0,
             f"--replicas {self.replicas!r}: accepted: 0 or more")
        need(not self.replicate or self.nodes == 1 or self.replicas < self.nodes,
             f"--replicas {self.replicas} with --nodes {self.nodes}: each replica lives on another active node; "
             f"accepted: --replicas 0..{self.nodes - 1}")
        need(isinstance(self.interleave_replication, int) and self.interleave_replication >= 0,
             f"interleave_replication {self.interleave_replication!r}: accepted: 0 (off) or a block of K >= 1 steps")
        need(not self.interleave_replication or (self.replicate and not self.faults),
             "interleave_replication (a benchmark's on/off blocks) needs replication on and no faults: a fault in an "
             "off block would recompute up to a block of steps")
        for name in ("hang_timeout", "rendezvous_timeout", "collective_timeout", "startup_timeout"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 and (v > 0 or name == "hang_timeout"),
                 f"--{name.replace('_', '-')} {v!r}: accepted: seconds > 0" + (" (0 or --hang-timeout off: no hang detection)" if name == "hang_timeout" else ""))
        need(isinstance(self.health_check, str) and "\0" not in self.health_check,
             f"--health-check {self.health_check!r}: accepted: a shell command (a string), or empty for none")
        need(isinstance(self.preflight_factor, (int, float)) and math.isfinite(self.preflight_factor)
             and (self.preflight_factor == 0 or self.preflight_factor > 1),
             f"--preflight-factor {self.preflight_factor!r}: accepted: a number > 1 (times the job's median), or 0: off")
        need(isinstance(self.spare_check_every, (int, float)) and math.isfinite(self.spare_check_every)
             and self.spare_check_every >= 0,
             f"--spare-check-every {self.spare_check_every!r}: accepted: seconds >= 0 (0: never)")
        need(isinstance(self.straggler_factor, (int, float)) and math.isfinite(self.straggler_factor)
             and self.straggler_factor > 1,
             f"--straggler-factor {self.straggler_factor!r}: accepted: a number > 1 (times the other nodes' median "
             f"own work per step, e.g. 1.5)")
        need(isinstance(self.straggler_window, (int, float)) and math.isfinite(self.straggler_window)
             and self.straggler_window > 0,
             f"--straggler-window {self.straggler_window!r}: accepted: seconds > 0 (how long a node must stay slow)")
        need(isinstance(self.spare_return, bool), f"spare_return {self.spare_return!r}: accepted: True or False")
        need(isinstance(self.quarantine, (int, float)) and math.isfinite(self.quarantine) and self.quarantine >= 0,
             f"--quarantine {self.quarantine!r}: accepted: seconds >= 0 (a node that fails again this soon after its "
             f"return stays out; 0: never quarantined for that)")
        need(isinstance(self.crash_loop_limit, int) and not isinstance(self.crash_loop_limit, bool)
             and self.crash_loop_limit >= 0,
             f"--crash-loop-limit {self.crash_loop_limit!r}: accepted: an integer >= 0 (repeats of the same rank's "
             f"crash at the same step on other nodes before the run stops; 0: off)")
        need(isinstance(self.health_check_timeout, (int, float)) and math.isfinite(self.health_check_timeout)
             and self.health_check_timeout > 0,
             f"--health-check-timeout {self.health_check_timeout!r}: accepted: seconds > 0 (a returning node's "
             f"--health-check still running then is killed and counts as unhealthy)")
        need(self.straggler_action in STRAGGLER_ACTIONS,
             f"--straggler-action {self.straggler_action!r}: accepted: {', '.join(STRAGGLER_ACTIONS)}")
        need(isinstance(self.persist_every, (int, float)) and math.isfinite(self.persist_every)
             and self.persist_every >= 0, f"--persist-every {self.persist_every!r}: accepted: seconds >= 0 (0: never)")
        need(not self.hang_timeout or self.hang_timeout >= self.heartbeat_deadline,
             f"--hang-timeout {self.hang_timeout!r}: accepted: off, or at least the heartbeat deadline "
             f"({self.heartbeat_deadline} s) and more than your longest step")
        for f in self.faults:
            if f.target_kind == "node":
                need(f.index < self.total_nodes,
                     f"{f}: unknown fault target node{f.index}; this layout has node0..node{self.total_nodes - 1}")
            else:
                need(f.index < self.world_size,
                     f"{f}: unknown fault target rank{f.index}; this layout has rank0..rank{self.world_size - 1}")
            if f.kind == "nic_down":
                need(bool(self.preflight_factor), f"{f} with --preflight-factor 0: the pre-flight's link check is what "
                     f"finds a node whose data plane is down; accepted: --preflight-factor > 1 (the default, 3)")
                # a training node's interface going down while it trains would be found by its next rebuild, which
                # the fault plan cannot place: a step is for an idle spare, whose re-check finds it
                need(f.step is None or (f.index >= self.nodes and self.spare_check_every > 0),
                     f"{f}: from a step on, only an idle spare's interface goes down (its re-check every "
                     f"--spare-check-every seconds finds it); accepted: node{self.nodes}..node{self.total_nodes - 1} "
                     f"with --spare-check-every > 0, or node{f.index} (down from its start)")
            if f.phase is None:
                need(isinstance(f.step, int) and 0 <= f.step < self.steps,
                     f"{f}: step {f.step} is past --steps {self.steps}; accepted: 0..{self.steps - 1}")
        need(self.spares == 0 or self.nodes >= 2,
             f"--nodes {self.nodes} with --spares {self.spares}: a rank's replica lives on another active node, "
             f"so hot-swap needs at least 2 active nodes")
        from .faultinject import plan

        plan.check(self)
        return self

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["faults"] = [dataclasses.asdict(f) for f in self.faults]
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        d = json.loads(text)
        from .faultinject.spec import Fault

        d["faults"] = [Fault(**f) for f in d.get("faults", [])]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config keys {sorted(unknown)}; accepted: {sorted(known)}")
        return cls(**d)
