"""The join desk: where a replacement node from a companion job asks to join the running job (``--spare-floor``;
the rules are control/joining.py's, the allocation launch/companion.py's).

Every agent of a run with ``--spare-floor`` > 0 listens (a non-blocking TCP listener, read by the agent's loop:
``tick``); the lowest live agent publishes its address in ``RUN_DIR/companions/join.json`` and answers: it admits
a newcomer between recoveries into the slot of a node lost whole (``joining.admit``), or refuses with a reason and
asks it to retry. A connection that sends nothing valid within HANDSHAKE_S seconds is closed, so a newcomer that
dies or hangs mid-admission costs a socket, never a wait. The other agents take the ``Joined`` notice
(``on_joined``). Any agent of the MPI world also takes over a joined node whose sponsor was lost (``Attach``), and
the agents take its ``Rerouted`` notice (``on_rerouted``); in a joined node, the desk is what re-attaches
(``_reattach``: the lowest live agents of the MPI world first, for at most ``--recovery-timeout`` seconds, then the
node leaves). Events: ``node_admitted`` (the sponsor: ``node``, ``job_id``, ``host``, ``generation``,
``spare_nodes``), ``join_refused`` (each new reason once), ``node_reattached`` (the joined node: ``sponsor``,
``seconds`` without one), ``sponsor_taken_over`` (the new sponsor: ``node``).
"""
from __future__ import annotations

import time
from typing import Protocol

from ..control import joining
from ..control.links import Link, LinkClosed
from ..errors import Fenced, WireError
from .state import NodeState

HANDSHAKE_S = 5.0   # seconds a connection has to send its Join


class JoinDeskHost(Protocol):
    """What the desk uses of its node agent (agent/node.py's NodeAgent is one); nothing is written."""

    cfg: object         # RunConfig: output.run_dir
    cp: object          # ControlPlane: me, secret, generation, failure, ...; joining.admit changes its view
    peers: object       # Peers: alive(), fenced
    log: object         # EventLog
    state: NodeState
    recovery: object    # Recovery: in_round
    swaps: object       # PlannedSwaps: current

    def retarget_ring_link(self) -> None:
        """Point the ring link at this agent's ring neighbours among the live agents."""


class JoinDesk:
    """``tick()`` from the agent's loop; ``on_joined`` / ``on_rerouted`` are control-plane handlers. ``srv`` /
    ``address``: this agent's join listener (control/links.py ``listen``) and its [host, port], which its identity
    record carries (``join``)."""

    def __init__(self, agent: JoinDeskHost, srv, address: list):
        self.a = agent
        self.srv, self.address = srv, address
        self.pending: list[tuple[Link, float]] = []   # connections whose Join has not come yet, with a deadline
        self.publishing = False                      # this agent's address is the published one
        self.last_refusal: str | None = None
        self.publish_error: str | None = None
        self.turn = 0                                # the next re-attachment candidate (a joined node)
        self.next_try = 0.0
        agent.cp.on(joining.Joined.KIND, self.on_joined)
        agent.cp.on(joining.Rerouted.KIND, self.on_rerouted)

    def tick(self) -> None:
        a = self.a
        if a.peers.relays.detached is not None:
            self._reattach()
        lowest = joining.admitter(a.cp) == a.cp.me and not a.peers.fenced
        if lowest and not self.publishing:
            try:
                joining.publish(a.cfg.output.run_dir, a.cp.me, self.address, a.cp.generation)
            except OSError as exc:   # a full or read-only run directory: said once, tried again next pass
                if self.publish_error != str(exc):
                    self.publish_error = str(exc)
                    a.log.emit("join_address_failed", error=str(exc)[:300], path=joining.address_file(
                        a.cfg.output.run_dir))
                lowest = False
        self.publishing = lowest
        while True:
            try:
                sock, _ = self.srv.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            self.pending.append((Link(sock, a.cp.secret), time.monotonic() + HANDSHAKE_S))
        if not self.pending:
            return
        now, keep = time.monotonic(), []
        for link, deadline in self.pending:
            try:
                msgs = link.receive()
            except LinkClosed:
                continue
            if not msgs:
                if now < deadline:
                    keep.append((link, deadline))
                else:
                    link.close()
                continue
            kind, body = msgs[0]
            try:
                msg = joining.Join.from_wire(body) if kind == joining.Join.KIND else \
                    joining.Attach.from_wire(body) if kind == joining.Attach.KIND else None
            except ValueError as exc:
                a.log.emit("bad_message", kind=kind, error=str(exc)[:300])
                msg = None
            if msg is None:
                link.close()
            elif isinstance(msg, joining.Attach):
                self._take_over(link, msg)
            else:
                self._answer(link, msg)
        self.pending = keep

    def _answer(self, link: Link, join: joining.Join) -> None:
        a = self.a
        why = joining.may_admit(a.cp)
        if why is None and (a.recovery.in_round or a.swaps.current is not None
                            or a.state not in (NodeState.TRAINING, NodeState.SPARE)):
            why = f"busy ({a.state.value})" if a.state not in (NodeState.TRAINING, NodeState.SPARE) else "busy"
        slot = joining.free_slot(a.cp) if why is None else None
        if why is None and slot is None:
            why = "no free slot: no node lost whole yet, or the decision that took it out is not applied yet"
        if why is not None:
            ending = a.state in (NodeState.DONE, NodeState.SAVED)
            alive = a.peers.alive()
            try:
                link.send(joining.JoinRefused.KIND, joining.JoinRefused(
                    reason=why, retry=not ending, nonce=join.nonce,
                    coordinator=alive[0] if alive else None).to_wire())
            except LinkClosed:
                pass
            link.close()
            if why != self.last_refusal:
                self.last_refusal = why
                a.log.emit("join_refused", reason=why, job_id=join.job_id, host=join.host,
                           generation=a.cp.generation)
            return
        try:
            joining.admit(a.cp, link, join, slot, resume=a.resume)
        except (LinkClosed, WireError) as exc:   # it left before its answer, or a record is too large: not admitted
            a.log.emit("join_failed", node=slot, job_id=join.job_id, host=join.host, error=str(exc)[:200])
            link.close()   # (the slot stays suspected and free: the view is as it was)
            return
        self.last_refusal = None
        a.retarget_ring_link()
        a.log.emit("node_admitted", node=slot, job_id=join.job_id, host=join.host, generation=a.cp.generation,
                   spare_nodes=list(a.cp.spare_nodes), waited_s=round(time.time() - join.t, 3))

    def _take_over(self, link: Link, msg: joining.Attach) -> None:
        """A joined node whose sponsor was lost asks this agent to be its sponsor."""
        a = self.a
        why = joining.may_attach(a.cp, msg.node)
        if why is not None:
            try:
                link.send(joining.JoinRefused.KIND, joining.JoinRefused(reason=why, retry=False,
                                                                        nonce=msg.nonce).to_wire())
            except LinkClosed:
                pass
            link.close()
            return
        try:
            joining.attach(a.cp, link, msg)
        except LinkClosed:
            return
        a.log.emit("sponsor_taken_over", node=msg.node, job_id=msg.job_id, generation=a.cp.generation)

    def _reattach(self) -> None:
        """(a joined node whose sponsor was lost) Ask the live agents of the MPI world, lowest first, one per pass
        (at most 2 s for the connection and 2 s for the answer: this is the agent's loop), to be its sponsor;
        raises Fenced once none took it within --recovery-timeout seconds."""
        a, now = self.a, time.monotonic()
        if now < self.next_try:
            return
        lost_for = now - a.peers.relays.detached
        with a.peers.lock:
            joined = set(a.peers.relays.routes)
        candidates = [n for n in a.peers.alive() if n != a.cp.me and n not in joined]
        pick = [candidates[self.turn % len(candidates)]] if candidates else []
        self.turn += 1
        got = joining.reattach(a.cp.idents, pick, a.cp.me, a.joined["job_id"] if a.joined else "", a.cp.secret)
        if got is None:
            if lost_for > a.cfg.timeouts.recovery_timeout:
                raise Fenced(f"lost its sponsor and no agent took it over within "
                             f"{a.cfg.timeouts.recovery_timeout:g} s (--recovery-timeout)")
            self.next_try = now + joining.RETRY_S
            return
        sock, answer, rest = got
        lost_for = time.monotonic() - a.peers.relays.detached
        a.peers.relays.join_through(answer.sponsor, Link(sock, a.cp.secret, node=answer.sponsor, rest=rest))
        a.retarget_ring_link()
        a.log.emit("node_reattached", sponsor=answer.sponsor, seconds=round(lost_for, 3), generation=a.cp.generation)

    def on_rerouted(self, src: int, msg: joining.Rerouted) -> None:
        """(every agent) Joined node ``msg.node`` is reached through ``msg.sponsor`` now."""
        if msg.node != self.a.cp.me and msg.sponsor != self.a.cp.me:
            self.a.cp.peers.relays.route(msg.node, msg.sponsor)

    def on_joined(self, src: int, msg: joining.Joined) -> None:
        """(every other agent) A joined node: its route, identity record and place in the spare pool."""
        joining.on_joined(self.a.cp, msg)
        self.a.retarget_ring_link()
