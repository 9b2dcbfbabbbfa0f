"""Confirming a silent peer: the probes one agent's control thread starts, answers and passes on
(``Peers.prober``; the rules and their sources, SWIM's ping and ping-req and Lifeguard's nack and local health, are
control/suspicion.py's and control/detector.py's; the datagrams are control/waker.py's).

A watched peer silent past its deadline gets a direct ping and ``probe_k`` indirect ones through other agents; it is
suspected only when its probe's window ends unanswered (or, while ``last_resort`` holds, never by silence alone). An
agent answers pings of itself (and takes them as a sign of its own slowness), and passes on the pings other agents
ask of it, nacking those it could not confirm. Runs on the control thread only (control/peers.py).
"""
from __future__ import annotations

from .suspicion import helpers_for
from .waker import ACK, NACK, PING, PING_REQ


class Prober:
    """``peers``: the Peers (control/peers.py) this belongs to: its ``detector`` (under its ``lock``), ``watched``,
    ``suspected``, ``alive()``, ``suspect()``, ``last_resort``, ``on_probe`` and its Waker and heartbeat addresses.
    ``asked``: (target, nonce) -> (origin, monotonic start) of the pings other agents asked of this one; ``held``:
    peers a ``suspicion_held`` event was written for."""

    def __init__(self, peers):
        self.peers = peers
        self.asked: dict[tuple, tuple] = {}
        self.held: set[int] = set()

    def event(self, event: str, **fields) -> None:
        """Tell ``peers.on_probe`` (the control plane: an event in the log)."""
        ps = self.peers
        if ps.on_probe is not None:
            ps.on_probe(event, **fields)

    def alive_sign(self, src: int, now: float, beat: bool, how: str = "answer") -> None:
        """``src`` showed a sign of life: a heartbeat (``beat``), an ack or a control message (its silence restarts)."""
        ps = self.peers
        with ps.lock:
            probe = ps.detector.heard(src, now, beat=beat)
            health = ps.detector.health
        self.refuted(src, probe, now, beat, how, health)

    def refuted(self, src: int, probe, now: float, beat: bool, how: str, health: int) -> None:
        """``probe`` (of ``src``; None: none open) ends refuted: said (``probe_refuted``)."""
        if probe is not None:
            self.event("probe_refuted", suspect=src, after_s=round(now - probe.t0, 3),
                       silence_s=round(probe.silence + now - probe.t0, 3), nacks=sorted(probe.nacks),
                       how="heartbeat" if beat else how, health=health)

    def check_silence(self, now: float) -> None:
        """Probe the watched peers silent past their deadline; suspect those whose probe's window ended unanswered."""
        ps = self.peers
        det = ps.detector
        with ps.lock:
            watched = [p for p in ps.watched if p not in ps.suspected]
            silences = det.silences(watched, now)
            due = det.due(silences, now)
        for p in due:
            helpers = helpers_for(p, ps.me, ps.alive(), det.probe_k)
            with ps.lock:
                probe = det.start_probe(p, silences[p], helpers, now)
                health = det.health
            ps._wake.probe(PING, ps.me, ps.me, p, probe.nonce, ps._hb_to[p])
            for h in probe.helpers:
                ps._wake.probe(PING_REQ, ps.me, ps.me, p, probe.nonce, ps._hb_to[h])
            self.event("probe_started", suspect=p, silence_s=round(silences[p], 3), helpers=list(probe.helpers),
                              window_s=[round(probe.w_min, 3), round(probe.w_max, 3)], health=health)
        with ps.lock:
            # heard of since its probe started by other means (heard_from: a replica it pushed us)
            pushed = det.touched_while_probed()
        for p in pushed:
            with ps.lock:
                probe = det.refute(p, now)
                health = det.health
            self.refuted(p, probe, now, False, "replica", health)
        with ps.lock:
            expired = det.expired(now)
        for probe in expired:
            p = probe.target
            if p not in silences:
                continue   # no longer watched, or suspected meanwhile
            silence = det.silence(p, now)
            if ps.last_resort:
                if p not in self.held:
                    self.held.add(p)
                    self.event("suspicion_held", suspect=p, silence_s=round(silence, 3),
                                      why="no spare left: the checkpoint round needs every member's copies; only a "
                                          "closed connection or the round's own timeout ends a member now")
                continue
            ps.suspect(p, f"no heartbeat for {silence:.2f} s, confirmed: no answer to a direct ping and "
                            f"{len(probe.helpers)} indirect ones ({len(probe.nacks)} helpers heard nothing) within "
                            f"{now - probe.t0:.2f} s")
        if self.asked:
            wait = det.helper_wait()
            for key, (origin, t0) in list(self.asked.items()):
                if now - t0 > wait:
                    del self.asked[key]
                    ps._wake.probe(NACK, ps.me, origin, key[0], key[1], ps._hb_to[origin])

    def on_probes(self, now: float) -> None:
        """Answer and relay the probe datagrams that arrived (SWIM's ping, ping-req, ack; Lifeguard's nack)."""
        ps = self.peers
        got, ps._wake.probes = ps._wake.probes, []
        for kind, sender, origin, target, nonce in got:
            if not (0 <= sender < ps.size and 0 <= origin < ps.size and 0 <= target < ps.size):
                continue
            if kind == PING and target == ps.me:
                # somebody doubts this agent: answer (the refutation), and take it as a sign of its own slowness
                ps._wake.probe(ACK, ps.me, origin, ps.me, nonce, ps._hb_to[sender])
                with ps.lock:
                    ps.detector.degrade(now)
            elif kind == PING_REQ and sender == origin and target != ps.me:
                if ps.is_suspected(target):
                    ps._wake.probe(NACK, ps.me, origin, target, nonce, ps._hb_to[origin])
                else:
                    self.asked[(target, nonce)] = (origin, now)
                    ps._wake.probe(PING, ps.me, origin, target, nonce, ps._hb_to[target])
            elif kind == ACK and sender == target and not ps.is_suspected(target):
                if origin == ps.me:
                    self.alive_sign(target, now, beat=False)
                elif self.asked.pop((target, nonce), None) is not None:
                    ps._wake.probe(ACK, ps.me, origin, target, nonce, ps._hb_to[origin])
            elif kind == ACK and origin == ps.me and sender != target and not ps.is_suspected(target):
                self.alive_sign(target, now, beat=False)   # relayed by a helper
            elif kind == NACK and origin == ps.me:
                with ps.lock:
                    ps.detector.nack(target, nonce, sender)
