"""Run configuration and fault specs: parsing and validation, before any process starts.

Owns the shapes every other module reads (``RunConfig``, ``Fault``); owns no behaviour. A bad value
raises ``ConfigError`` naming the value and what would be accepted; the CLI turns that into exit 2.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field

from .errors import ConfigError

_FAULT_RE = re.compile(r"^(node|rank)(\d+)@(\d+)$")


@dataclass(frozen=True)
class Fault:
    """One injected failure: ``kind`` ("kill" = SIGKILL, "hang" = SIGSTOP) of ``target`` at ``step``.

    ``target_kind`` is "node" (every process of emulated node ``index``) or "rank" (the process that
    holds training rank ``index`` when step ``step`` starts).
    """

    kind: str
    target_kind: str
    index: int
    step: int

    @property
    def target(self) -> str:
        return f"{self.target_kind}{self.index}"

    def __str__(self) -> str:
        return f"--{self.kind} {self.target}@{self.step}"


def parse_fault(kind: str, spec: str) -> Fault:
    """Parse ``node1@60`` / ``rank2@60`` for ``kind`` in {"kill", "hang"}. Raises ConfigError."""
    if kind not in ("kill", "hang"):
        raise ConfigError(f"fault kind {kind!r} is unknown; accepted: 'kill', 'hang'")
    m = _FAULT_RE.match(spec.strip())
    if not m:
        raise ConfigError(f"--{kind} {spec!r} is not a fault spec; accepted: nodeN@STEP or rankN@STEP, e.g. node1@60")
    return Fault(kind, m.group(1), int(m.group(2)), int(m.group(3)))


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
    # model and data (the demo's micro GPT; see docs/worker-contract.md)
    batch_size: int = 8
    context: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    seed: int = 1337
    # fault tolerance
    replicate: bool = True
    requeue: bool = False          # no spare left: save a checkpoint and start again from it
    max_requeues: int = 3
    heartbeat_period: float = 0.1
    heartbeat_deadline: float = 1.0
    collective_timeout: float = 60.0
    # output
    run_dir: str = "deadpool-run"
    summary_path: str | None = None
    log_every: int = 1
    train_fn: str = "deadpool_hpc.train.demo:train"

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.spares

    @property
    def total_processes(self) -> int:
        return self.total_nodes * self.ranks_per_node

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
        need(self.total_processes <= 64, f"{self.total_processes} processes requested; the local launcher accepts at most 64")
        need(self.batch_size >= 1, f"--batch-size {self.batch_size!r}: accepted: 1 or more")
        need(self.context >= 2, f"--context {self.context!r}: accepted: 2 or more")
        need(self.d_model % self.n_head == 0, f"--d-model {self.d_model} is not divisible by --n-head {self.n_head}")
        need(isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and 0 < self.lr <= 1,
             f"--lr {self.lr!r}: accepted: a learning rate in (0, 1], e.g. 3e-3")
        need(isinstance(self.seed, int) and 0 <= self.seed < 2**64,
             f"--seed {self.seed!r}: accepted: an integer in 0..{2**64 - 1} (torch.manual_seed's range)")
        need(isinstance(self.max_requeues, int) and self.max_requeues >= 0,
             f"max_requeues {self.max_requeues!r}: accepted: 0 or more")
        need(self.heartbeat_period > 0, f"heartbeat period {self.heartbeat_period!r} s: must be > 0")
        need(self.heartbeat_deadline > 2 * self.heartbeat_period,
             f"heartbeat deadline {self.heartbeat_deadline!r} s: must exceed twice the period ({self.heartbeat_period} s)")
        need(self.log_every >= 1, f"--log-every {self.log_every!r}: accepted: 1 or more")
        for f in self.faults:
            if f.target_kind == "node":
                need(f.index < self.total_nodes,
                     f"{f}: unknown fault target node{f.index}; this layout has node0..node{self.total_nodes - 1}")
            else:
                need(f.index < self.world_size,
                     f"{f}: unknown fault target rank{f.index}; this layout has rank0..rank{self.world_size - 1}")
            need(f.step < self.steps, f"{f}: step {f.step} is past --steps {self.steps}; accepted: 0..{self.steps - 1}")
        need(self.spares == 0 or self.nodes >= 2,
             f"--nodes {self.nodes} with --spares {self.spares}: a rank's replica lives on another active node, "
             f"so hot-swap needs at least 2 active nodes")
        need(self.requeue or len(self.faults) <= self.spares,
             f"{len(self.faults)} node losses requested ({', '.join(map(str, self.faults))}) but only "
             f"{self.spares} spare node(s); accepted: at most --spares faults (or --requeue, which saves a "
             f"checkpoint and restarts when no spare is left)")
        return self

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["faults"] = [dataclasses.asdict(f) for f in self.faults]
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        d = json.loads(text)
        d["faults"] = [Fault(**f) for f in d.get("faults", [])]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config keys {sorted(unknown)}; accepted: {sorted(known)}")
        return cls(**d)
