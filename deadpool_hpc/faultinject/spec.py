"""The test fault grammar: what ``--kill``, ``--hang``, ``--slow`` and ``--nic-down`` name (``Fault``) and its parser.

Pure shapes, no process and no signal (those are inject.py); ``parse_fault`` raises ConfigError naming the spec and
what is accepted.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import ConfigError

# The moments of a job's start, before its first committed snapshot (``--kill node1@startup``), and a recovery's
# phases, in order, as a fault spec names them (``--kill node2@rebuild``); see Fault.
START_PHASES = ("startup", "build", "first")
RECOVERY_PHASES = ("detect", "agree", "decided", "rebuild", "restore", "resume")
PHASES = START_PHASES + RECOVERY_PHASES
_FAULT_RE = re.compile(r"^(node|rank)(\d+)@(?:(\d+)|(" + "|".join(PHASES) + r")(?:#(\d+))?)$")
_SLOW_RE = re.compile(r"^node(\d+)@(startup|build|\d+)(?::([0-9.]+))?$")
_NIC_RE = re.compile(r"^node(\d+)(?:@(startup|\d+))?$")
FAULT_KINDS = ("kill", "hang", "slow", "nic_down")
NIC_DOWN_IFNAME = "dp-nic-down"   # --nic-down: the interface gloo is told to use, which no machine has
SLOW_FACTOR = 8.0   # --slow nodeI@startup without :FACTOR


@dataclass(frozen=True)
class Fault:
    """One injected failure: ``kind`` ("kill" = SIGKILL, "hang" = SIGSTOP, "slow" = ``factor`` times slower) of
    ``target``. A slow node's training processes run 1/factor of the time: its agent stops and continues them
    (SIGSTOP/SIGCONT), a node whose device or CPU share is throttled: from ``startup`` or ``build``, what the
    start-up's pre-flight speed check is for (agent/preflight.py), or from ``step`` on, what the straggler check is
    for (agent/stragglers.py). "nic_down": node ``index``'s data-plane interface is
    down from its start (its training processes' gloo is given an interface that does not exist,
    ``GLOO_SOCKET_IFNAME`` = NIC_DOWN_IFNAME; its agent's control plane is untouched), what the start-up's link check
    is for (phase ``startup``); or, for an idle spare, from ``step`` on (its next re-check's link check finds it).

    ``target_kind`` is "node" (every process of emulated node ``index``, active or spare) or "rank"
    (the process that holds training rank ``index`` at that moment). It fires either at ``step`` (when
    training first reaches that step) or, when ``phase`` is set, at a moment of the job's start-up (once:
    ``nth`` is 1):

    - startup: its node agent's control plane is up and its training processes were just spawned (they are
               importing torch and the user's module);
    - build:   inside the user's function, once it has built its model and handed it to ``ctx.protect`` /
               ``ctx.zero_adamw`` (before ``ctx.run``); spares too;
    - first:   the first snapshot (step 0) is written and not yet committed at its holders: every rank's state
               is still only its initial one (a training node only);

    or when the target reaches that phase of the ``nth`` recovery it takes part in (1 = the first):

    - detect:  it has left the failed generation and is about to report to the coordinator;
    - agree:   it has sent its report (or, as coordinator, asked for the reports) and waits for the decision;
    - decided: it holds the decision and has not applied it yet;
    - rebuild: it passed the rebuild barrier and is joining the new process group;
    - restore: it sends a replica to a promoted rank, half-way through (a process that sends none: at the
               start of its own restore);
    - resume:  the first step after the recovery starts.
    """

    kind: str
    target_kind: str
    index: int
    step: int | None = None
    phase: str | None = None
    nth: int = 1
    factor: float | None = None

    @property
    def target(self) -> str:
        return f"{self.target_kind}{self.index}"

    @property
    def at_start(self) -> bool:
        """A fault at a moment of the job's start-up (START_PHASES), not of a recovery nor at a step."""
        return self.phase in START_PHASES

    @property
    def when(self) -> str:
        if self.phase is None:
            return str(self.step)
        return self.phase + (f"#{self.nth}" if self.nth != 1 else "")

    def __str__(self) -> str:
        if self.kind == "nic_down":
            return f"--nic-down {self.target}" + ("" if self.step is None else f"@{self.step}")
        return f"--{self.kind} {self.target}@{self.when}" + (f":{self.factor:g}" if self.factor is not None else "")


def parse_fault(kind: str, spec: str) -> Fault:
    """Parse ``node1@60`` / ``rank2@60`` (a step) or ``node2@rebuild`` / ``node2@agree#2`` (a phase of the
    first / second recovery) for ``kind`` in {"kill", "hang"}; ``node1@startup|build|STEP[:FACTOR]`` for "slow"
    (FACTOR > 1, default SLOW_FACTOR); ``node1`` for "nic_down". Raises ConfigError."""
    if kind not in FAULT_KINDS:
        raise ConfigError(f"fault kind {kind!r} is unknown; accepted: {', '.join(map(repr, FAULT_KINDS))}")
    if kind == "nic_down":
        m = _NIC_RE.match(spec.strip())
        if not m:
            raise ConfigError(f"--nic-down {spec!r} is not a node; accepted: nodeN (e.g. node1): node N's data-plane "
                              f"interface is down from its start, or nodeN@STEP for a spare: from step STEP on")
        if m.group(2) and m.group(2) != "startup":
            return Fault("nic_down", "node", int(m.group(1)), int(m.group(2)))
        return Fault("nic_down", "node", int(m.group(1)), None, "startup")
    if kind == "slow":
        m = _SLOW_RE.match(spec.strip())
        if not m:
            raise ConfigError(f"--slow {spec!r} is not a slow-node spec; accepted: nodeN@startup[:FACTOR], "
                              f"nodeN@build[:FACTOR] or nodeN@STEP[:FACTOR] (e.g. node1@startup:8, node1@40:2): node "
                              f"N's training processes run FACTOR times slower from their start, from when their "
                              f"model is built, or from step STEP on")
        try:
            factor = float(m.group(3)) if m.group(3) else SLOW_FACTOR
        except ValueError:
            factor = float("nan")
        if not (math.isfinite(factor) and factor > 1):
            raise ConfigError(f"--slow {spec!r}: factor {m.group(3)!r}: accepted: a number > 1 (how many times slower)")
        if m.group(2).isdigit():
            return Fault("slow", "node", int(m.group(1)), int(m.group(2)), None, 1, factor)
        return Fault("slow", "node", int(m.group(1)), None, m.group(2), 1, factor)
    m = _FAULT_RE.match(spec.strip())
    if not m:
        raise ConfigError(f"--{kind} {spec!r} is not a fault spec; accepted: nodeN@STEP or rankN@STEP (e.g. node1@60), "
                          f"or nodeN@PHASE[#K] with PHASE one of {', '.join(PHASES)} (e.g. node2@rebuild)")
    if m.group(3) is not None:
        return Fault(kind, m.group(1), int(m.group(2)), int(m.group(3)))
    nth = int(m.group(5) or 1)
    if nth < 1:
        raise ConfigError(f"--{kind} {spec!r}: the recovery number after # counts from 1")
    if m.group(4) in START_PHASES and nth != 1:
        raise ConfigError(f"--{kind} {spec!r}: the job starts once, so a start-up phase takes no recovery number; "
                          f"accepted: {m.group(1)}{m.group(2)}@{m.group(4)}")
    return Fault(kind, m.group(1), int(m.group(2)), None, m.group(4), nth)
