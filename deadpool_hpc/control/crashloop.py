"""Crash loops: a failure that follows the work, not the node.

A training process that ends the same way at the same step of the same training rank on every node that takes that
rank over (a native crash on a bad batch, an allocation the OOM killer ends every time) is not a node's fault: a
spare, or a node back from the spare pool, promoted into it fails the same way, and a run that kept swapping would
burn its whole spare pool and its returning nodes into the same crash. This module owns the pure rule that tells
such a loop apart (``find_loop``) and the typed record of one failure it reads (``WorkFailure``, and its wire form:
it travels in the ``suspect`` notice of the node that failed, control/plane.py ``declare_failed``). It does not own
what a loop does to the run (agreement.decide stops it: a checkpoint at the cut step, no promotion; agent/recovery.py
saves it and exits ``CRASH_LOOP_EXIT``) nor how a process's end is seen (agent/node.py, agent/supervisor.py).

The rule: the newest failure, and every earlier one of the same training rank, with the same end (the same signal,
or the same exit code) at a step within ``STEP_WINDOW`` steps of it. When those happened on more than ``limit``
distinct nodes (the first, then ``limit`` repeats on other nodes), it is a loop. A node that fails again and again
is not (only distinct nodes count: that failure follows the node, which quarantine handles, agent/comeback.py); nor
are failures at different steps, of different ranks, or with different ends.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ipc.schema import Message

# steps: how far apart two failures of the same rank may be and still be "the same step". A restore resumes at the
# cut step, so a crash on a batch recurs at that batch's step exactly; an allocation that grows over a few steps may
# be ended a step or two apart on nodes with a little more or less free memory
STEP_WINDOW = 2
# repeats on other nodes before the run stops (--crash-loop-limit). 2: a single repeat may still be chance (two bad
# nodes in a row, or the same exit of a process that a job-wide event at that step ended, a file system stall that
# timed its loader out); a second repeat on a third node rules the nodes out. It costs at most 2 promotions into the
# crash (in a 3 + 2 layout both spares, and no returning node), where 1 would cost one and 3 a returning node too
DEFAULT_LIMIT = 2


def end_of(rc: int) -> str:
    """The end of a process whose exit status is ``rc`` (``Popen.returncode``: negative = the signal), as
    ``WorkFailure.end`` names it: ``"SIGABRT"`` or ``"exit code 3"``."""
    import signal

    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


@dataclass(frozen=True)
class WorkFailure(Message):
    """One training process's end while it trained: training ``rank`` at ``step`` (the step its progress page
    showed: the one it was in), ``end`` (``end_of``: "SIGABRT", "exit code 137", ...), on ``node`` (its agent's MPI
    rank), in ``generation``; ``t``: when its agent saw it (Unix seconds)."""

    rank: int
    step: int
    end: str
    node: int
    generation: int
    t: float


@dataclass(frozen=True)
class CrashLoop(Message):
    """A crash loop found by ``find_loop``: training ``rank`` ended by ``end`` at ``steps`` (each failure's, in
    order) on ``nodes`` (distinct, in the order they failed), ``repeats`` = len(nodes) - 1 times on another node."""

    rank: int
    end: str
    steps: tuple[int, ...]
    nodes: tuple[int, ...]

    def __post_init__(self):
        if not self.steps or not self.nodes:
            raise ValueError(f"a crash loop of rank {self.rank} has steps {list(self.steps)} and nodes "
                             f"{list(self.nodes)}; expected at least one of each")

    @property
    def repeats(self) -> int:
        return len(self.nodes) - 1

    @property
    def step(self) -> int:
        """The step of the first failure."""
        return self.steps[0]

    def describe(self) -> str:
        """One line a person reads: what failed, where, and why the run stops."""
        steps = sorted(set(self.steps))
        at = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"
        return (f"rank {self.rank} ended by {self.end} at {at} on {', '.join(f'node{n}' for n in self.nodes)}: a "
                f"crash that follows the work, not the node; stopped after {self.repeats} "
                f"repeat{'s' if self.repeats != 1 else ''} (--crash-loop-limit)")


def same_work(a: WorkFailure, b: WorkFailure, window: int = STEP_WINDOW) -> bool:
    """Whether ``a`` and ``b`` are the same failure of the work: same training rank, same end, steps at most
    ``window`` apart."""
    return a.rank == b.rank and a.end == b.end and abs(a.step - b.step) <= window


def find_loop(failures, limit: int, window: int = STEP_WINDOW) -> CrashLoop | None:
    """The crash loop that the newest of ``failures`` (WorkFailure, oldest first) completes, or None.

    ``limit``: repeats on other nodes allowed before the run stops (0: never a loop). The newest failure and
    every earlier one that is ``same_work`` with it count; a loop when they happened on more than ``limit``
    distinct nodes."""
    if limit <= 0 or not failures:
        return None
    last = failures[-1]
    same = [f for f in failures if same_work(f, last, window)]
    nodes = tuple(dict.fromkeys(f.node for f in same))
    if len(nodes) <= limit:
        return None
    return CrashLoop(rank=last.rank, end=last.end, steps=tuple(f.step for f in same), nodes=nodes)


def follows_work(failure: WorkFailure, failures, window: int = STEP_WINDOW) -> bool:
    """Whether ``failure`` repeats, on this node, a failure some other node had with the same work (``failures``):
    the node is not to blame for it (agent/comeback.py does not quarantine a node for it)."""
    return any(f.node != failure.node and same_work(f, failure, window) for f in failures)
