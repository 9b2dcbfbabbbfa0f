"""The heartbeat failure detector of one node agent, apart from the transport: when each watched peer was last heard
of, how long its silence may last (the adaptive deadline and the local health of control/suspicion.py), and which
peers are overdue, probed, refuted or confirmed.

Owns: the per-peer last-heard times (seconds of the clock it is given, monotonic by default), the ``Suspicion`` of
this watcher (its gap statistics, open probes and health score), and the correction for this watcher's own stalls.
Does not own: heartbeats, probes or any message on the wire (``Peers``, control/peers.py, the control thread: it
feeds this what it hears and sends the pings this asks for), the set of watched peers (control/topology.py) or what a
confirmed suspicion leads to. No MPI, no socket, no thread: not thread-safe, the caller holds its lock where threads
share it (``Peers.lock``). Pure logic on a clock: tests/unit/control/test_detector.py drives it with a fake one.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from .suspicion import Probe, Suspicion

# this watcher's own loop ran late by more than 2 periods and this many seconds: its judgement of others is late too
LATE_LOOP_SLACK_S = 0.05


class Detector:
    """Heartbeat failure detection for one watcher.

    peers: the MPI ranks it may hear from (every other agent). deadline / period / ceiling: the user's heartbeat
    deadline, heartbeat interval, and the longest a silent peer goes unconfirmed (seconds; control/suspicion.py).
    probe_k: helpers asked per probe. seed: for the probes' nonces. clock: () -> seconds (default time.monotonic);
    every method that takes ``now`` reads the clock when it is None. Raises ValueError as ``Suspicion`` does (a
    non-positive deadline or period).
    """

    def __init__(self, peers: Iterable[int], deadline: float, period: float, ceiling: float, *, probe_k: int = 3,
                 seed: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.period = period
        self.sus = Suspicion(deadline, period, ceiling, k=probe_k, seed=seed)
        now = clock()
        self.last_seen: dict[int, float] = {p: now for p in peers}
        self._last_tick: float | None = None

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    # ---- settings and views ----------------------------------------------------------------------------------
    @property
    def deadline(self) -> float:
        """Seconds of silence after which a steady peer is probed (the user's deadline; may be raised and lowered)."""
        return self.sus.base

    @deadline.setter
    def deadline(self, value: float) -> None:
        self.sus.base = value

    @property
    def health(self) -> int:
        """This watcher's local health score (0 healthy .. suspicion.MAX_HEALTH): deadlines are 1 + it times wider."""
        return self.sus.health

    @property
    def probe_k(self) -> int:
        """Helpers asked per probe."""
        return self.sus.k

    @property
    def probes(self) -> dict[int, Probe]:
        """Open probes: peer -> Probe."""
        return self.sus.probes

    def __contains__(self, peer: int) -> bool:
        return peer in self.last_seen

    def silence(self, peer: int, now: float | None = None) -> float:
        """Seconds since ``peer`` was last heard of."""
        return self._now(now) - self.last_seen[peer]

    def deadline_of(self, peer: int, now: float | None = None) -> float:
        """Seconds of silence after which ``peer`` is probed now (jitter-adapted, times the health factor)."""
        return self.sus.deadline(peer, self._now(now))

    def stats(self) -> dict:
        """Probe counters and the health score (the ``heartbeat_stats`` event)."""
        return {"probes_started": self.sus.started, "probes_refuted": self.sus.refuted,
                "probes_confirmed": self.sus.confirmed_n, "health": self.sus.health}

    # ---- what the watcher hears ------------------------------------------------------------------------------
    def heard(self, peer: int, now: float | None = None, beat: bool = True) -> Probe | None:
        """``peer`` showed a sign of life: a heartbeat (``beat``: its gap feeds the jitter statistics), an ack or a
        control message. Returns the probe this refuted, if one was open."""
        now = self._now(now)
        self.last_seen[peer] = now
        return self.sus.heard(peer, now, beat=beat)

    def touch(self, peer: int, now: float | None = None) -> None:
        """(any thread) ``peer`` did something only a live agent does, known to a thread other than the watcher's:
        its silence restarts now; an open probe of it ends refuted once the watcher looks (``touched_while_probed``)."""
        if peer in self.last_seen:
            self.last_seen[peer] = self._now(now)

    def touched_while_probed(self) -> list[int]:
        """Peers with an open probe that were ``touch``-ed after it started: each is refuted (``refute``)."""
        return [p for p, probe in self.sus.probes.items() if self.last_seen.get(p, 0.0) > probe.t0]

    def refute(self, peer: int, now: float | None = None) -> Probe | None:
        """Close the open probe of ``peer`` as refuted at ``now`` (it was ``touch``-ed meanwhile), leaving its
        last-heard time as it is. Returns the probe, or None when none was open."""
        return self.sus.heard(peer, self._now(now), beat=False)

    def nack(self, peer: int, nonce: int, helper: int) -> None:
        """Helper ``helper`` heard nothing from ``peer`` for the probe ``nonce`` (its window shrinks)."""
        self.sus.nack(peer, nonce, helper)

    def reset(self, peers: Iterable[int] | None = None, now: float | None = None) -> None:
        """``peers`` (default: all) get a full deadline from ``now``, their statistics and probes dropped: the watch
        starts, a peer is readmitted, or this watcher rejoins."""
        now = self._now(now)
        for p in list(self.last_seen) if peers is None else peers:
            self.last_seen[p] = now
            self.sus.forget(p)

    def watch(self, peer: int, now: float | None = None) -> None:
        """``peer`` is newly watched: its silence counts from ``now`` at the latest (its heartbeats may have gone to
        another watcher until now)."""
        self.last_seen[peer] = max(self.last_seen[peer], self._now(now))

    def forget(self, peer: int) -> None:
        """``peer`` is suspected: drop its probe and statistics (its last-heard time stays, for ``silence``)."""
        self.sus.forget(peer)

    def drop_probes(self) -> None:
        """Close every open probe without a verdict (the watch is off: the run is ending)."""
        self.sus.probes.clear()

    # ---- this watcher's own health ---------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> float:
        """One pass of the watcher's loop at ``now``. A pass that comes more than half a deadline after the last one
        means the watcher itself did not run (CPU starvation, a paused VM): the silence it would see is its own, so
        every peer's last-heard time and every open probe move forward by the gap. A pass more than two periods late
        lowers its health (its judgement runs late too). Returns the gap (seconds) when it was a stall, else 0."""
        now = self._now(now)
        last, self._last_tick = self._last_tick, now
        if last is None:
            return 0.0
        gap = now - last
        stalled = 0.0
        if gap > self.deadline / 2:
            for p in self.last_seen:
                self.last_seen[p] += gap
            self.sus.shift(gap)
            stalled = gap
        if gap > 2 * self.period + LATE_LOOP_SLACK_S:
            self.sus.degrade(now)
        return stalled

    def degrade(self, now: float | None = None) -> None:
        """Something says this watcher is the slow one (another agent probed it): widen its deadlines."""
        self.sus.degrade(self._now(now))

    # ---- who is overdue --------------------------------------------------------------------------------------
    def silences(self, peers: Iterable[int], now: float | None = None) -> dict[int, float]:
        """peer -> seconds since last heard of, for ``peers`` (the watched ones)."""
        now = self._now(now)
        return {p: now - self.last_seen[p] for p in peers}

    def due(self, silences: dict[int, float], now: float | None = None) -> list[int]:
        """Of ``silences`` (from ``silences``), the peers silent past their deadline with no open probe: the watcher
        starts a probe of each (``start_probe``)."""
        return self.sus.due(silences, self._now(now))

    def overdue(self, peers: Iterable[int], now: float | None = None) -> list[int]:
        """The peers among ``peers`` silent past their deadline now, with no open probe."""
        now = self._now(now)
        return self.due(self.silences(peers, now), now)

    def start_probe(self, peer: int, silence: float, helpers, now: float | None = None) -> Probe:
        """Open the probe of ``peer`` (silent ``silence`` seconds), asking ``helpers`` (suspicion.helpers_for)."""
        return self.sus.start(peer, self._now(now), silence, helpers)

    def expired(self, now: float | None = None) -> list[Probe]:
        """Probes whose window ended unrefuted (removed): the watcher suspects their targets."""
        return self.sus.expired(self._now(now)) if self.sus.probes else []

    def helper_wait(self) -> float:
        """Seconds a helper pings a target for another watcher before it nacks."""
        return self.sus.helper_wait()
