"""An idle spare's re-checks, and a training node's half of them.

Every ``--spare-check-every`` seconds an idle spare checks itself again (agent/preflight.py): the site's
``--health-check``, the timed matmul against the start-up's median and, once that passed, an all-reduce with one
training node, a different one each time (``link_ask``: that node's agent hands the request to its training
processes). A spare that fails leaves the pool (fenced, one spare fewer) now, not when a recovery promotes it; never
judged while a failure is handled. Owns: when the next re-check is due, the link re-checks' state. Does not own the
checks themselves (agent/preflight.py) nor what a failure means (``NodeAgent.node_failed``).
"""
from __future__ import annotations

import os
import time
from typing import Protocol

from ..control.messages import SpareLinkAsk
from .preflight import HealthCheck, link_request
from .state import NodeState


class SpareCheckHost(Protocol):
    """What the spare re-checks use of their node agent (agent/node.py's NodeAgent is one). Written directly:
    ``health_check`` (a re-check starts the site's command there, which the agent's ``checked`` polls and clears as at
    the start-up; ``end`` kills and clears it) and ``speed.asked_at`` / ``speed.link.asked_at`` (``end``: a re-check
    under way no longer matters). They are shared with the agent's start-up checks, so they stay writes."""

    cfg: object              # RunConfig: spare_check_every, preflight_factor, health_check
    cp: object               # ControlPlane: handlers, failure, assignment, generation
    peers: object            # Peers: fenced, alive(), is_suspected(node), send(node, kind, body)
    log: object              # EventLog
    state: NodeState         # agent/state.py (a str enum: "training", "spare", ...); read only
    P: int                   # ranks per node
    node: int                # this node's index
    recovery: object         # Recovery: in_round, processes_left(), rounds (read only: no re-check while a failure
    #                          is handled)
    swaps: object            # PlannedSwaps: current (a planned swap under way: no link re-check for a spare)
    speed: object            # SpeedCheck (agent/preflight.py): ask_local(), spare_verdict(), asked_at (WRITTEN by
    #                          ``end``), link: ask(), collect(), asked_at (WRITTEN by ``end``)
    health_check: object     # HealthCheck | None (agent/preflight.py): the site's command under way; WRITTEN
    sup: object              # Supervisor: env, run_dir (the health check's environment and log directory)
    channel: object          # ChannelServer: send(local, kind, body) (``link`` to the training processes)
    rendezvous: object       # Rendezvous: link.drop(prefix) (a judged re-check's keys)

    def checked(self) -> bool:
        """Whether the site's health check is done and passed; one that failed fails the node."""

    def node_failed(self, reason: str, cause: str = "other", work=None) -> None:
        """Declare this node failed: its exit is recorded (the agent's loop acts on it); the caller stops."""


class SpareChecks:
    """The re-checks of one node agent (``agent``: its NodeAgent as far as the re-checks need it,
    ``SpareCheckHost``). ``tick`` each pass of the agent's loop while the node is an idle spare; ``on_link_ask`` is a
    control-plane handler; ``end`` when the node is promoted."""

    def __init__(self, agent: SpareCheckHost):
        self.agent = agent
        self.next_t = float("inf")   # when the next re-check is due (``arm``)
        # the link re-checks: how many, the one under way, the training nodes whose all-reduce with this spare failed
        # since the last that passed; a training node's: each spare's last re-check's keys
        self.rechecks, self.asked, self.failed_with = 0, None, {}
        self.asks_from: dict[int, str] = {}
        agent.cp.on(SpareLinkAsk.KIND, self.on_link_ask)

    def arm(self) -> None:
        """The node starts (or starts again) as a spare: the first re-check is --spare-check-every seconds away, and
        nothing of an earlier life counts."""
        self.next_t = time.monotonic() + self.agent.cfg.preflight.spare_check_every
        self.asked, self.failed_with, self.asks_from = None, {}, {}

    def tick(self) -> None:
        """An idle spare checks itself again every --spare-check-every seconds (agent/preflight.py): the site's
        command, the timed matmul against the start-up's median and, once that passed, an all-reduce with a
        training node. One that fails leaves the pool (fenced, one spare fewer) now, not when a recovery promotes
        it. Never while a failure is handled."""
        a = self.agent
        if a.cp.failure.is_set() or a.recovery.in_round or a.recovery.processes_left():
            return
        if a.speed.asked_at is None and a.health_check is None and a.speed.link.asked_at is None:
            if time.monotonic() < self.next_t:
                return
            self.next_t = time.monotonic() + a.cfg.preflight.spare_check_every
            if a.cfg.preflight.factor:
                a.speed.ask_local()   # then, once it passed, the link (not at once: the matmul is timed alone)
            if a.cfg.preflight.health_check:
                a.health_check = HealthCheck(a.cfg.preflight.health_check, a.sup.env, os.path.join(
                    a.sup.run_dir, f"health-check-node{a.node}.log"))
            return
        if a.speed.asked_at is not None:
            why = a.speed.spare_verdict()
            if why:
                a.node_failed(f"spare check: {why}", cause="preflight_slow")
                return
            elif why == "":
                self._ask_link()
        if a.speed.link.asked_at is not None and (res := a.speed.link.collect()) is not None:
            self._link_verdict(res)
        if a.health_check is not None:
            a.checked()

    def _ask_link(self) -> None:
        """An idle spare's link re-check (agent/preflight.py): an all-reduce with one training node, a different
        one each time, whose links work (it trains), so a failed one is this spare's. The training node's agent
        hands the request to its training processes (``link_ask``); their answer is for this spare only."""
        a = self.agent
        trainers = sorted(({m // a.P for m in a.cp.assignment} & set(a.peers.alive())) - {a.node})
        if not trainers:
            return
        self.rechecks += 1
        n = self.rechecks
        q = trainers[n % len(trainers)]
        lo, hi = min(q, a.node), max(q, a.node)
        tag = f"r{n}/"
        # what the answer is judged against: a round or a new generation since makes it stale (the partner may be
        # the node that failed)
        self.asked = (q, f"link/{lo}-{hi}/{tag}", a.cp.generation, a.recovery.rounds)
        a.peers.send(q, SpareLinkAsk.KIND, SpareLinkAsk(tag, lo, hi).to_wire())
        a.speed.link.ask(a.node, [(q, lo, hi)], tag)

    def _link_verdict(self, res: dict) -> None:
        """Judge an idle spare's link re-check. Fenced (cause preflight_link) once its all-reduces with two
        different training nodes in a row failed, neither by the partner's own device: one failed link may still
        be that training node's (its gloo path broken while it trains over another); two are this spare's."""
        a = self.agent
        q, prefix, generation, rounds = self.asked
        a.rendezvous.link.drop(prefix)   # judged: its keys are not needed again (a week of re-checks would pile up)
        r = res.get(q, {})
        stale = (generation, rounds) != (a.cp.generation, a.recovery.rounds) or a.peers.is_suspected(q) \
            or q not in {m // a.P for m in a.cp.assignment}
        a.log.emit("spare_link_checked", partner=q, stale=stale, **r)
        if stale or not r.get("seen"):
            return
        if r.get("ok"):
            self.failed_with.clear()
            return
        if r.get("partner_fault"):
            return
        self.failed_with[q] = r.get("error")
        if len(self.failed_with) >= 2:
            failed = "; ".join(f"node{n}: {e}" for n, e in self.failed_with.items())
            a.node_failed(f"spare check: its all-reduces with training nodes {sorted(self.failed_with)} "
                          f"failed in turn ({failed[:300]}); they train, so their own links work",
                          cause="preflight_link")

    def on_link_ask(self, src: int, msg: SpareLinkAsk) -> None:
        """(the agent's loop, ``cp.pump``) An idle spare asks this training node's processes for an all-reduce with
        it. Not while a failure or a planned swap is handled: the spare's wait then ends unseen, nothing judged."""
        a = self.agent
        if a.peers.fenced or a.state != NodeState.TRAINING or a.cp.failure.is_set() or a.recovery.in_round \
                or a.swaps.current is not None:
            return
        lo, hi, tag = msg.a, msg.b, msg.tag
        if {lo, hi} != {src, a.node}:
            return
        done = self.asks_from.get(src)
        if done is not None:
            a.rendezvous.link.drop(done)   # the spare's previous re-check is over: its keys go
        self.asks_from[src] = f"link/{lo}-{hi}/{tag}"
        for local in range(a.P):
            a.channel.send(local, "link", link_request(f"for{src}", a.node, [(src, lo, hi)], tag, local))

    def end(self) -> None:
        """Promoted: a re-check still under way no longer matters (the node passed the last one)."""
        a = self.agent
        a.speed.asked_at = None
        a.speed.link.asked_at = None
        if a.health_check is not None:
            a.health_check.kill()
            a.health_check = None
