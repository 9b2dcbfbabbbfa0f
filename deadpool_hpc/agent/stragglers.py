"""The straggler check: a training node that stays slower than the others is swapped out by a planned swap.

A synchronous job runs at the speed of its slowest rank, so a rank's wall time per step says nothing about who is
slow: every rank waits for the slowest in the step's collectives. What is compared is each rank's *own work* per
step: its step's wall time less the time its training thread spent blocked in waits on peers (the pollable
collectives, dataplane/collectives.py, and the replica commit), measured by the training thread and kept as running
totals in its progress page (ipc/shm.py ``add_step``; no message per step). NVIDIA's resiliency extension
(``nvidia_resiliency_ext.straggler``) scores ranks the same way, on their own compute time, and reports them; here
the report can end in a swap.

Three parts, one per process role:

- ``WorkMeter`` (every training node's agent): every ``interval`` seconds, while the node trains, it reads its
  ranks' totals and sends one summary to the coordinator (the lowest live agent, as for the swap lease,
  agent/planned.py): the node's own work per step (the slowest of its ranks over the interval) and its wall time per
  step. A few numbers per node every few seconds, point to point: N messages per interval at the coordinator (at
  4,096 nodes and 5 s, ~800 small messages a second, which one thread serves).
- ``StragglerJudge`` (pure logic, the coordinator): a node whose figure stays over ``factor`` x the *other* training
  nodes' median for ``window`` seconds, summary after summary, is a straggler. The other nodes' median, not the
  job's: with two or three nodes the slow one would pull the job's median towards itself; and the *lower* median
  (of an even count, the lower of the two middle figures), so that with three nodes of which two are slow (a slow
  node and a slow rank's new node, seen in a test) each is compared with the healthy one, not with the mean of
  the healthy one and the other slow one. A node's figure is the
  median of its last 3 summaries (one noisy interval neither makes nor breaks a straggler). A site's own signal, a
  detector plugin's ``Slow(factor, reason)`` (agent/health.py: DCGM clocks, a NIC's negotiated speed), rides in the
  node's summary and is judged by the same rules (the larger of it and the own-work ratio). Figures of an older
  generation are dropped (a recovery starts the judging again); at most one verdict per window, job-wide.
- ``Stragglers`` (the wiring, every agent): the coordinator logs ``straggler_detected`` with the figures and what it
  does. ``swap`` (``--straggler-action``, the default): with replication on and a spare free, it tells the node,
  whose agent asks for a planned swap as a detector would (detector ``straggler``): 0 steps recomputed, bitwise
  equal; else the event only (``action: report`` and why), once per node and generation. A node swapped out leaves
  the job for good (it is fenced: quarantined, never a spare again). Hysteresis: when the node that took a straggler's
  ranks is found slow too, the slowness follows the ranks' work (their data, their shard), not the node, and it is
  reported, not swapped
  again.

The coordinator also logs ``node_step_times`` once per interval (each training node's own and wall seconds per
step), which the console shows.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Protocol

from ..control.messages import Straggler, StragglerSummary
from .health import Unhealthy
from .state import NodeState

STALE_INTERVALS = 3   # a node's figure older than this many intervals is not counted in the others' median
SMOOTH = 3            # a node's figure is the median of its last SMOOTH summaries: one noisy interval is neither a
                      # straggler nor the end of one (seen: under a load of 2.8 on 2 cores the others' figures swung
                      # 55-140 ms between intervals, and every dip of a slowed node's ratio started its count again)


def interval_for(window: float) -> float:
    """Seconds between two summaries of a node: a sixth of the window (several figures per window), 0.5..5 s."""
    return min(5.0, max(0.5, window / 6))


@dataclass(frozen=True)
class Verdict:
    """A straggler found: ``node``; its own work per step ``own_s`` and the other nodes' (lower) median ``median_s``
    (seconds); ``ratio``: the larger of own_s / median_s and the site's figure (``site``: a detector's ``Slow``
    factor and reason, or None); ``slow_for_s``: seconds it has been over the factor; ``ranks``: the training ranks
    it holds."""
    node: int
    ratio: float
    own_s: float
    median_s: float
    slow_for_s: float
    ranks: tuple
    site: tuple | None = None


class StragglerJudge:
    """The coordinator's decision, pure logic (no clock of its own: every call passes ``now``, seconds).

    ``add(node, generation, own_s, step_s, ranks, now, site)`` records one summary and returns a ``Verdict`` when
    that node is a straggler, else None. A node's figure is the median of its last ``SMOOTH`` summaries of the
    generation; ``site`` (factor, reason), a detector's ``Slow`` figure for the node, counts like the ratio of its
    own work (the larger of the two is judged). Raises ValueError for a factor <= 1 or a window <= 0."""

    def __init__(self, factor: float, window: float, interval: float | None = None):
        if not factor > 1:
            raise ValueError(f"straggler factor {factor!r}: accepted: a number > 1")
        if not window > 0:
            raise ValueError(f"straggler window {window!r}: accepted: seconds > 0")
        self.factor, self.window = float(factor), float(window)
        self.interval = interval or interval_for(window)
        self.generation = -1
        self.figures: dict[int, tuple] = {}     # node -> (t, own_s, step_s, ranks): own_s smoothed
        self.recent: dict[int, list] = {}       # node -> its last SMOOTH own_s figures
        self.slow_since: dict[int, float] = {}  # node -> first summary over the factor, in an unbroken run
        self.muted: set[int] = set()            # nodes reported already in this generation (``mute``)
        self.last_verdict = float("-inf")

    def mute(self, node: int) -> None:
        """No further verdict on ``node`` in this generation (it was reported, and nothing can be done: saying so
        again every window would only fill the log); its figures still count as the others' reference."""
        self.muted.add(node)

    def add(self, node: int, generation: int, own_s: float, step_s: float, ranks: tuple, now: float,
            site: tuple | None = None):
        if generation < self.generation:
            return None
        if generation > self.generation:   # a recovery: the layout changed, judge afresh
            self.generation, self.figures, self.recent, self.slow_since = generation, {}, {}, {}
            self.muted = set()
        last = self.recent.setdefault(node, [])
        last.append(float(own_s))
        del last[:-SMOOTH]
        own_s = statistics.median(last)
        self.figures[node] = (now, own_s, float(step_s), tuple(ranks))
        others = [f[1] for n, f in self.figures.items()
                  if n != node and now - f[0] <= STALE_INTERVALS * self.interval]
        if (not others and site is None) or node in self.muted:
            return None
        median = sorted(others)[(len(others) - 1) // 2] if others else 0.0   # the lower median
        ratio = own_s / median if median > 0 else 1.0
        ratio = max(ratio, float(site[0])) if site is not None else ratio
        if ratio <= self.factor:
            self.slow_since.pop(node, None)
            return None
        since = self.slow_since.setdefault(node, now)
        if now - since < self.window or now - self.last_verdict < self.window:
            return None
        self.last_verdict = now
        self.slow_since.clear()
        return Verdict(node, ratio, own_s, median, now - since, tuple(ranks),
                       tuple(site) if site is not None and float(site[0]) >= ratio else None)

    def table(self, now: float) -> dict[int, tuple[float, float]]:
        """The fresh figures: node -> (own seconds per step, wall seconds per step)."""
        return {n: (f[1], f[2]) for n, f in sorted(self.figures.items())
                if now - f[0] <= STALE_INTERVALS * self.interval}


class WorkMeter:
    """A training node's share: the differences of its ranks' progress-page totals over an interval. ``pages(local)``
    returns local rank ``local``'s ProgressPage (or None); ``P``: ranks per node."""

    def __init__(self, pages, P: int):
        self.pages, self.P = pages, P
        self.base: dict[int, tuple] = {}

    def rebase(self) -> None:
        """Start a new interval from the current totals (a new generation, or the node starts training)."""
        self.base = {lo: p.work() for lo in range(self.P) if (p := self.pages(lo)) is not None}

    def read(self) -> tuple[float, float] | None:
        """(own seconds per step of the node's slowest rank, wall seconds per step) over the interval since the last
        read or rebase, then a new interval starts; None while some rank completed no step in it."""
        own, wall = [], []
        now = {}
        for lo in range(self.P):
            p = self.pages(lo)
            if p is None or lo not in self.base:
                self.rebase()
                return None
            now[lo] = p.work()
            n = now[lo][0] - self.base[lo][0]
            if n <= 0:
                return None
            own.append((now[lo][1] - self.base[lo][1]) / n)
            wall.append((now[lo][2] - self.base[lo][2]) / n)
        self.base = now
        return max(own), sum(wall) / len(wall)


class StragglerHost(Protocol):
    """What the straggler check uses of its node agent (agent/node.py's NodeAgent is one)."""

    cfg: object       # RunConfig: straggler_factor, straggler_window, straggler_action, replicate, ranks_per_node
    log: object       # EventLog
    state: NodeState  # agent/state.py (a str enum: "training", "spare", ...); read only
    P: int            # ranks per node
    channel: object   # ChannelServer: progress(local) -> ProgressPage | None
    swaps: object     # PlannedSwaps: want(detector, Unhealthy, t_seen)
    health: object    # DetectorRunner (agent/health.py): slowness(), a detector's Slow figure, or None

    def in_recovery(self) -> bool:
        """A failure is being handled, or a recovery round runs."""


class Stragglers:
    """The straggler check of one node agent. ``cp``: its ControlPlane; ``agent``: its node agent as far as the
    check needs it (``StragglerHost``). Called from the agent's main loop only: ``tick`` each pass; ``on_summary``
    and ``on_verdict`` are control-plane handlers (same thread)."""

    def __init__(self, cp, agent: StragglerHost):
        self.cp, self.a = cp, agent
        cfg = agent.cfg
        self.on = cfg.stragglers.action != "off"
        self.interval = interval_for(cfg.stragglers.window)
        self.meter = WorkMeter(agent.channel.progress, cfg.layout.ranks_per_node)
        self.judge = StragglerJudge(cfg.stragglers.factor, cfg.stragglers.window, self.interval) if self.on else None
        self.swapped_ranks: dict[int, int] = {}   # rank -> node swapped out for slowness while it held the rank
        self._next = float("inf")
        self._generation = None
        self._next_table = 0.0
        self.last_figure = None   # this node's newest (own, wall) seconds per step (agent/metrics.py shows it)
        cp.on(StragglerSummary.KIND, self.on_summary)
        cp.on(Straggler.KIND, self.on_verdict)

    def tick(self) -> None:
        a = self.a
        if not self.on or a.state != NodeState.TRAINING or a.in_recovery():
            self._generation = None
            return
        now = time.monotonic()
        if self._generation != self.cp.generation:   # training (again): a fresh interval
            self._generation = self.cp.generation
            self.meter.rebase()
            self._next = now + self.interval
            return
        if now < self._next:
            return
        self._next = now + self.interval
        fig = self.meter.read()
        if fig is None:
            return
        self.last_figure = fig
        ranks = [r for lo in range(a.P) if (r := self.cp.train_rank(lo)) is not None]
        site = a.health.slowness() if a.health is not None else None
        self.cp.peers.send(min(self.cp.peers.alive()), StragglerSummary.KIND,
                           StragglerSummary(node=self.cp.me, generation=self.cp.generation, own_s=fig[0],
                                            step_s=fig[1], ranks=tuple(ranks),
                                            site=list(site) if site else None).to_wire())

    # ---- the coordinator --------------------------------------------------------------------------------------
    def on_summary(self, src: int, msg: StragglerSummary) -> None:
        if self.judge is None:
            return
        node, gen, own, step, ranks = msg.node, msg.generation, msg.own_s, msg.step_s, msg.ranks
        site = (float(msg.site[0]), msg.site[1]) if msg.site else None
        if node != src or self.cp.peers.is_suspected(node):
            return
        now = time.monotonic()
        verdict = self.judge.add(node, gen, own, step, ranks, now, site)
        if now >= self._next_table:
            self._next_table = now + self.interval
            self.a.log.emit("node_step_times", generation=self.judge.generation, nodes={
                str(n): {"own_s": round(o, 5), "step_s": round(s, 5)} for n, (o, s) in self.judge.table(now).items()})
        if verdict is not None:
            self._act(verdict)

    def _act(self, v: Verdict) -> None:
        a, cp = self.a, self.cp
        why = None
        before = sorted({self.swapped_ranks[r] for r in v.ranks if r in self.swapped_ranks})
        if a.cfg.stragglers.action != "swap":
            why = "--straggler-action report"
        elif before:
            why = (f"its ranks {list(v.ranks)} were slow on node(s) {before} too, which were swapped out for it: the "
                   f"slowness follows the ranks' work, not the node")
        elif not a.cfg.replication.replicate:
            why = "replication is off (--no-replicate): no replica to hand the node's state over"
        elif not [n for n in cp.spare_nodes if not cp.peers.is_suspected(n)]:
            why = "no spare node left"
        action = "report" if why else "swap"
        if action == "report":
            self.judge.mute(v.node)   # said once per generation
        a.log.emit("straggler_detected", node=v.node, generation=cp.generation, ratio=round(v.ratio, 3),
                   own_s=round(v.own_s, 5), median_s=round(v.median_s, 5), slow_for_s=round(v.slow_for_s, 2),
                   factor=self.judge.factor, window_s=self.judge.window, ranks=list(v.ranks), action=action, why=why,
                   site=v.site[1] if v.site else None)
        if action == "swap":
            for r in v.ranks:
                self.swapped_ranks[r] = v.node
            said = (f"{v.site[1]} ({v.site[0]:.2f} x slower)" if v.site else
                    f"own work {v.own_s * 1e3:.1f} ms/step, {v.ratio:.2f} x the other nodes' median "
                    f"({v.median_s * 1e3:.1f} ms)")
            cp.peers.send(v.node, Straggler.KIND, Straggler(f"straggler: {said} for {v.slow_for_s:.0f} s").to_wire())

    # ---- the straggler's agent --------------------------------------------------------------------------------
    def on_verdict(self, src: int, msg: Straggler) -> None:
        if self.a.state == NodeState.TRAINING:
            self.a.swaps.want("straggler", Unhealthy(msg.reason), time.time())
