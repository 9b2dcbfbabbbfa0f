"""When a silent peer becomes a suspect: a heartbeat deadline that follows the jitter each watcher observes, a
confirmation by other members before anyone is suspected, and a watcher that knows when it is itself the slow one.

A heartbeat that comes late is not a dead node. On a loaded machine (a burst of replica traffic, page reclaim, a
hypervisor's steal, the agent's own threads holding the interpreter) a live agent's heartbeats can reach its watcher
over a second late; with one watcher's silence as the verdict, that cost a live node and, once, the job's last copy
of some state. The rules here come from the SWIM family of failure detectors:

- **Adaptive deadline** (phi-accrual, Hayashibara et al. 2004; Cassandra, Akka): a peer is *silent* once it has
  not been heard of for ``max(base, mean + PHI_SIGMAS * std)`` of its observed heartbeat gaps, times this watcher's
  local health factor (below). A steady peer is judged by the user's ``--heartbeat-deadline``; a jittery one gets the
  room its jitter asks for.
- **Confirmation** (SWIM, Das et al. 2002, section 4: the indirect probe): a silent peer is not suspected yet. The
  watcher pings it directly and asks ``k`` other members to ping it too (``ping-req``), over paths that do not share
  the watcher's own delays. Any sign of life (a heartbeat, an ack relayed by a helper, a control message) ends the
  probe: the suspect has refuted. A helper that hears nothing within its wait says so (a *nack*).
- **Dynamic suspicion timeout** (Lifeguard, Dadgar et al. 2018, section 4.2, as in HashiCorp memberlist): the probe's
  window starts at its maximum (what is left of the ceiling) and shrinks towards its minimum as independent nacks come
  in: ``max(min, max - (max - min) * log(c + 1) / log(k + 1))`` for ``c`` nacks of ``k`` helpers. Only a probe whose
  window ends unrefuted is a confirmed suspicion.
- **Local health** (Lifeguard, section 4.1): a watcher whose own loop ran late, whose probe was refuted (it was wrong),
  or that was itself probed (others find it slow) raises its health score (0..MAX_HEALTH); each score point widens its
  deadlines by one base deadline. A quiet ``HEALTH_DECAY`` deadlines lowers it by one.
- **Ceiling**: whatever the factors, a peer silent since ``t`` is confirmed by ``t + ceiling`` (``--heartbeat-ceiling``:
  how long a frozen node may go unnoticed), as long as the probe's minimum window fits.

Owns: the per-peer gap statistics, the open probes and the local health score. Does not own: the last-heard times and
the watcher's stalls (``Detector``, control/detector.py, which holds this), sending (``Peers`` sends the pings asked
for, control/peers.py), the datagrams (control/waker.py), or what a confirmed suspicion leads to.
Pure logic on a clock the caller passes (monotonic seconds): tests/unit/control/test_suspicion.py runs it without
processes.
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

PHI_SIGMAS = 6.0      # a gap this many standard deviations over the mean: phi ~ 9 for a normal distribution
GAP_WINDOW = 64       # heartbeat gaps kept per peer
MAX_HEALTH = 4        # local health scores 0..4: deadlines and windows up to 5x the base
HEALTH_DECAY = 8      # deadlines without an incident after which the score drops by one
HELPER_WAIT_FRACTION = 0.8   # a helper nacks after this fraction of the probe's minimum window


@dataclass
class Probe:
    """An open confirmation of ``target``: started at ``t0`` (monotonic seconds) after ``silence`` seconds without
    word; ``helpers``: the MPI ranks asked to ping it; ``nacks``: those that heard nothing; ``nonce``: matches acks
    and nacks to this probe (a late ack of an older probe refutes nothing)."""
    target: int
    t0: float
    silence: float
    nonce: int
    helpers: tuple[int, ...]
    w_min: float
    w_max: float
    nacks: set = field(default_factory=set)

    def window(self) -> float:
        """Seconds from ``t0`` until the suspicion is confirmed (Lifeguard's dynamic suspicion timeout)."""
        k = len(self.helpers)
        if not k:
            return self.w_max
        c = min(len(self.nacks), k)
        return max(self.w_min, self.w_max - (self.w_max - self.w_min) * math.log(c + 1) / math.log(k + 1))


class Suspicion:
    """One watcher's judgement of its watched peers.

    base: the user's heartbeat deadline (seconds; may be raised at start-up by assigning ``base``); period: the
    heartbeat interval (seconds); ceiling: the longest a silent peer goes unconfirmed (seconds; raised to
    ``base + confirm`` when smaller); confirm: a probe's minimum window (seconds, default ``base``); k: helpers asked
    per probe. Raises ValueError on a non-positive period, base or confirm.
    """

    def __init__(self, base: float, period: float, ceiling: float, confirm: float | None = None, k: int = 3,
                 seed: int | None = None):
        confirm = base if confirm is None else confirm
        for name, v in (("base", base), ("period", period), ("confirm", confirm)):
            if not v > 0:
                raise ValueError(f"suspicion {name} {v!r} s: must be > 0")
        self.base, self.period, self.ceiling, self.confirm, self.k = base, period, ceiling, confirm, k
        self.gaps: dict[int, deque] = {}
        self.heard_at: dict[int, float] = {}
        self.probes: dict[int, Probe] = {}
        self.health = 0
        self._health_t = 0.0
        self._rand = random.Random(seed)
        # counters, for the event log and the benchmarks
        self.started = self.refuted = self.confirmed_n = 0

    # ---- what the watcher hears ------------------------------------------------------------------------------
    def heard(self, peer: int, now: float, beat: bool = True) -> Probe | None:
        """``peer`` showed a sign of life at ``now`` (``beat``: a heartbeat, whose gap feeds the statistics; else an
        ack or a control message). Returns the probe this refuted, if one was open (the watcher was wrong about it:
        its own health score goes up)."""
        if beat:
            last = self.heard_at.get(peer)
            if last is not None and now > last:
                self.gaps.setdefault(peer, deque(maxlen=GAP_WINDOW)).append(now - last)
            self.heard_at[peer] = now
        probe = self.probes.pop(peer, None)
        if probe is not None:
            self.refuted += 1
            self.degrade(now)
        return probe

    def nack(self, peer: int, nonce: int, helper: int) -> None:
        """Helper ``helper`` heard nothing from ``peer`` for the probe ``nonce``."""
        probe = self.probes.get(peer)
        if probe is not None and probe.nonce == nonce and helper in probe.helpers:
            probe.nacks.add(helper)

    def forget(self, peer: int) -> None:
        """``peer`` is suspected (or left the watched set): drop its probe; its statistics start over if it returns."""
        self.probes.pop(peer, None)
        self.gaps.pop(peer, None)
        self.heard_at.pop(peer, None)

    def shift(self, seconds: float) -> None:
        """This watcher did not run for ``seconds`` (its own stall): the silence it would now see is its own, so the
        last heard-of times and the open probes' starts move forward by as much (no gap sample, no window, counts
        it)."""
        for p in self.heard_at:
            self.heard_at[p] += seconds
        for probe in self.probes.values():
            probe.t0 += seconds

        # ---- local health (Lifeguard) ----------------------------------------------------------------------------
    def degrade(self, now: float) -> None:
        """Something says this watcher is the slow one: its loop ran late, its probe was refuted, or it was probed."""
        self.health = min(MAX_HEALTH, self.health + 1)
        self._health_t = now

    def factor(self, now: float) -> int:
        """1 + the local health score, after the decay for quiet time since the last incident."""
        while self.health and now - self._health_t > HEALTH_DECAY * self.base:
            self.health -= 1
            self._health_t += HEALTH_DECAY * self.base
        return 1 + self.health

    # ---- deadlines -------------------------------------------------------------------------------------------
    def ceiling_s(self) -> float:
        return max(self.ceiling, self.base + self.confirm)

    def deadline(self, peer: int, now: float) -> float:
        """Seconds of silence after which ``peer`` is probed: its jitter-adapted deadline times the health factor,
        kept so that the probe's minimum window still fits under the ceiling."""
        d = self.base
        gaps = self.gaps.get(peer)
        if gaps and len(gaps) >= 8:
            mean = sum(gaps) / len(gaps)
            std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
            d = max(d, mean + PHI_SIGMAS * std)
        d = d * self.factor(now) if self.health else d
        return min(d, self.ceiling_s() - self.confirm)

    def due(self, silences: dict[int, float], now: float) -> list[int]:
        """Watched peers (``silences``: peer -> seconds since last heard of) silent past their deadline, with no open
        probe: the caller starts one for each (``start``)."""
        return [p for p, s in silences.items() if p not in self.probes and s > self.deadline(p, now)]

    def start(self, peer: int, now: float, silence: float, helpers) -> Probe:
        """Open the probe of ``peer`` (silent for ``silence`` seconds) with ``helpers`` (at most ``k`` are kept).
        Its window runs from the health-scaled minimum to what is left of the ceiling."""
        helpers = tuple(helpers)[: self.k]
        w_min = self.confirm * self.factor(now)
        w_max = max(self.ceiling_s() - silence, self.confirm)
        w_min = min(w_min, w_max)
        probe = Probe(peer, now, silence, self._rand.getrandbits(31), helpers, w_min, w_max)
        self.probes[peer] = probe
        self.started += 1
        return probe

    def expired(self, now: float) -> list[Probe]:
        """Probes whose window ended unrefuted: confirmed suspicions (removed from the open probes)."""
        out = [p for p in self.probes.values() if now - p.t0 >= p.window()]
        for p in out:
            del self.probes[p.target]
        self.confirmed_n += len(out)
        return out

    def helper_wait(self) -> float:
        """Seconds a helper pings a target before it nacks (within the requester's minimum window)."""
        return HELPER_WAIT_FRACTION * self.confirm


def helpers_for(target: int, me: int, alive: list[int], k: int) -> list[int]:
    """The ``k`` members asked to probe ``target`` for watcher ``me``: live members other than both, nearest to the
    target on the ring first (its other watchers, who know its recent heartbeats), in a stable order."""
    others = [p for p in alive if p not in (me, target)]
    n = max(alive + [me, target]) + 1
    return sorted(others, key=lambda p: (target - p) % n)[:k]
