"""Spares that come back: a node whose training processes failed returns to the spare pool.

Most failures in the field leave the node itself fine: a crashed process, a NCCL error, an OOM, a hang. When one of
this node's training processes exits or hangs after the start-up, the agent (``NodeAgent.node_failed``) ends them
all, declares the node failed with ``returning`` (the others recover around it as around any lost node, but leave
its agent alive and let its ``rejoin`` through: control/peers.py), and records the exit (agent/state.py
``PendingExit``, ``returning``). The agent's loop then runs ``Comeback.come_back``:

1. quarantine: a node that failed again within ``--quarantine`` seconds of its last return stays out, unless its
   training process ended as another node's did with the same work (the same rank, step and signal or exit code:
   control/crashloop.py ``follows_work``; that is the work's failure, which the crash-loop rule stops; with the rule
   off the quarantine applies as before);
2. health: the node's detectors' verdicts (agent/health.py; an ``Unhealthy`` one keeps it out) and the site's
   ``--health-check`` command, killed at ``--health-check-timeout`` (a check that hangs counts as failed);
3. ``rejoin``, sent to every agent once a second until the lowest live agent *readmits* it between recoveries
   (control/membership.py): the node joins the current generation's spare pool, last in promotion order, and never
   a round under way;
4. fresh training processes, started as spares (``NodeAgent.restart_as_spare``): they build the model again, and
   the snapshot slots and replica server of each local rank are reused.

A node that stays out emits ``node_quarantined`` and its agent leaves (Fenced). A whole node lost (its agent gone,
frozen, cut off) stays lost: nothing of it can ask to come back (docs/architecture.md, "Spares that come back",
says what adding nodes from another allocation would take). The run ending meanwhile (``finish``, ``abort``, or the
members leaving for a requeue: ``over``) ends the returning agent too.

Events: ``node_returning`` (checks start), ``node_quarantined`` (stays out: ``reason``), ``node_readmitted`` (the
coordinator's), ``node_returned`` (a spare again: ``seconds`` since the failure, ``health_s``, ``returns``).
"""
from __future__ import annotations

import os
import time
from typing import Protocol

from ..control.crashloop import follows_work
from ..control.membership import may_readmit, readmit, rejoin
from ..control.messages import Over, Rejoin
from ..errors import Fenced
from .state import NodeState, PendingExit

RETURNABLE = ("exit", "hang")   # node_failed causes after which the node may come back (not its checks' verdicts)
REJOIN_EVERY_S = 1.0


class ComebackHost(Protocol):
    """What the return to the spare pool uses of its node agent (agent/node.py's NodeAgent is one). The agent's state
    moves through ``transition`` only. Written directly: ``exit_code`` (``_on_over``, a control-plane handler: the
    members' requeue code, which the agent leaves with; a handler returns to ``cp.pump``, not to the agent, so it
    stays a write), and parts of the agent's collaborators while the node is out: ``cp.readmitted`` (taken),
    ``peers.fenced`` (cleared), ``ring_link.enabled`` / ``ring_link.successor`` (the ring link off, then dialled
    again)."""

    cfg: object              # RunConfig: spare_return, crash_loop_limit, quarantine, straggler_factor, health_check,
    #                          health_check_timeout, recovery_timeout
    cp: object               # ControlPlane: handlers, generation, pump(), readmitted (WRITTEN: taken), size,
    #                          spare_nodes, work_failures, _finish; control/membership.py's may_readmit, readmit, rejoin
    peers: object            # Peers: fenced (WRITTEN: cleared), stop_watching(), send_to_suspect()
    log: object              # EventLog
    state: NodeState         # agent/state.py (a str enum: "training", "returning", ...); read only
    node: int                # this node's index
    exit_code: int           # the agent's exit code; WRITTEN by ``_on_over``
    last_work_failure: object   # WorkFailure | None: how this node's last failure ended (control/crashloop.py)
    health: object           # DetectorRunner | None (agent/health.py): pending(), slowness()
    ring_link: object        # RingLink: poll(), enabled (WRITTEN), successor (WRITTEN)
    sup: object              # Supervisor: env, run_dir, poll()
    channel: object          # ChannelServer: poll(timeout)
    recovery: object         # Recovery: in_round (a round runs: no readmission)
    swaps: object            # PlannedSwaps: current (a planned swap under way: no readmission)

    def transition(self, new: NodeState, reason: str) -> None:
        """Move the agent to state ``new`` (agent/state.py; the state's only writer)."""

    def restart_as_spare(self) -> None:
        """Readmitted: start fresh training processes as spares of the current generation."""

    def retarget_ring_link(self) -> None:
        """Point the ring link at this agent's ring neighbours among the live agents."""


class Comeback:
    """The return to the spare pool of one node agent (``agent``: its NodeAgent as far as a return needs it,
    ``ComebackHost``). ``allowed`` and ``come_back`` on the node that failed; ``on_rejoin`` (a control-plane handler)
    on the agent that readmits it."""

    def __init__(self, agent: ComebackHost):
        self.agent = agent
        self.returned_at: float | None = None   # monotonic time of this node's last return
        self.returns = 0
        agent.cp.on(Rejoin.KIND, self.on_rejoin)
        agent.cp.on(Over.KIND, self._on_over)

    def allowed(self, cause: str) -> bool:
        """Whether a failure of ``cause`` may end in a return: on, past the start-up, an exit or a hang."""
        a = self.agent
        return bool(a.cfg.comeback.enabled) and cause in RETURNABLE and a.state in (NodeState.TRAINING, NodeState.SPARE)

    # ---- the node that failed -----------------------------------------------------------------------------
    def come_back(self, exc: PendingExit) -> None:
        """Check this node and bring it back as a spare (``exc``: the failure, its reason and cause). Returns once
        it is one, or the run is over (the agent's state is then done or saved), or its fresh processes failed
        (the agent's ``pending_exit`` is set again). Raises Fenced when the node stays out, JobAborted if the run
        was aborted."""
        a, cfg = self.agent, self.agent.cfg
        t0 = time.monotonic()
        a.transition(NodeState.RETURNING, f"its training processes failed ({exc.cause}): checks, then rejoin")
        a.peers.stop_watching()   # nobody watches it now: the silence it would see is not a failure
        a.ring_link.enabled = False
        a.log.emit("node_returning", cause=exc.cause, reason=exc.reason[:300], generation=a.cp.generation)
        since = None if self.returned_at is None else t0 - self.returned_at
        work = a.last_work_failure
        if cfg.comeback.crash_loop_limit and work is not None and follows_work(work, a.cp.work_failures):
            # the same rank ended the same way at the same step on another node: the work's failure, not this
            # node's; the crash-loop rule stops a loop of it (control/crashloop.py), so no quarantine for it (with
            # the rule off, --crash-loop-limit 0, the quarantine is the only brake left and applies as before)
            a.log.emit("failure_follows_work", rank=work.rank, step=work.step, end=work.end,
                       nodes=sorted({f.node for f in a.cp.work_failures if f.rank == work.rank}))
        elif since is not None and cfg.comeback.quarantine and since < cfg.comeback.quarantine:
            self._quarantine(f"failed again {since:.1f} s after its return (--quarantine {cfg.comeback.quarantine:g})")
        if a.health is not None:
            bad = [(name, v) for name, v in a.health.pending() if getattr(v, "reason", None) is not None]
            if bad:
                self._quarantine(f"health detector {bad[0][0]!r}: {bad[0][1].reason}")
            slow = a.health.slowness()
            if slow is not None and slow[0] >= cfg.stragglers.factor:
                self._quarantine(f"{slow[0]:.2f} x slower than it should be ({slow[1]})")
        health_s = self._health_check()
        if a.state != NodeState.RETURNING:
            return
        end = time.monotonic() + cfg.timeouts.recovery_timeout
        next_ask = 0.0
        while a.cp.readmitted is None:
            if self._pump():
                return
            now = time.monotonic()
            if now >= next_ask:
                next_ask = now + REJOIN_EVERY_S
                for n in range(a.cp.size):
                    if n != a.node:
                        a.peers.send_to_suspect(n, Rejoin.KIND, Rejoin(self.returns + 1).to_wire())
            if now > end:
                self._quarantine(f"not readmitted within {cfg.timeouts.recovery_timeout:.0f} s (--recovery-timeout)")
        msg, a.cp.readmitted = a.cp.readmitted, None
        rejoin(a.cp, msg)
        a.ring_link.poll()            # connections its neighbours dropped while it was out: not failures
        a.ring_link.successor = None  # dial the ring again
        a.ring_link.enabled = True
        self.returns += 1
        a.restart_as_spare()
        if a.state != NodeState.SPARE:   # the members left for a requeue while its processes started
            return
        self.returned_at = time.monotonic()
        a.log.emit("node_returned", generation=a.cp.generation, returns=self.returns, coordinator=msg.coordinator,
                   seconds=round(self.returned_at - t0, 3), health_s=None if health_s is None else round(health_s, 3),
                   spare_nodes=list(a.cp.spare_nodes))

    def _pump(self) -> bool:
        """Move control messages; drop what the dead processes left. True when the run is over for this node."""
        a = self.agent
        a.peers.fenced = None   # the others' ``fenced`` notices: known, this node is out until readmitted
        try:
            a.cp.pump(0)        # JobAborted on ``abort``
        except Fenced:          # (one that came while it pumped: every message was moved first)
            a.peers.fenced = None
        a.channel.poll(0.05)
        a.sup.poll()
        if a.cp._finish is not None:
            a.transition(NodeState.DONE, "the run is complete (while the node was returning)")
            return True
        return a.state in (NodeState.DONE, NodeState.SAVED)

    def _health_check(self) -> float | None:
        """Run the site's --health-check (if any) within --health-check-timeout; seconds it took."""
        a, cfg = self.agent, self.agent.cfg
        if not cfg.preflight.health_check:
            return None
        from .preflight import HealthCheck

        check = HealthCheck(cfg.preflight.health_check, a.sup.env,
                            os.path.join(a.sup.run_dir, f"health-check-node{a.node}.log"))
        end = time.monotonic() + cfg.comeback.health_check_timeout
        try:
            while (res := check.poll()) is None:
                if self._pump():
                    return None
                if time.monotonic() > end:
                    self._quarantine(f"the health check {cfg.preflight.health_check!r} was still running after "
                                     f"{cfg.comeback.health_check_timeout:g} s (--health-check-timeout)")
        finally:
            if check.result is None:
                check.kill()
        rc, secs, tail = res
        a.log.emit("health_check", rc=rc, seconds=round(secs, 3), command=cfg.preflight.health_check,
                   output=tail[-400:],
                   returning=True)
        if rc != 0:
            self._quarantine(f"the health check {cfg.preflight.health_check!r} exited with {rc}"
                             + (f": {tail[-200:]}" if tail else ""))
        return secs

    def _quarantine(self, reason: str) -> None:
        a = self.agent
        a.log.emit("node_quarantined", reason=reason, returns=self.returns)
        a.transition(NodeState.DONE, "quarantined: the node stays out")
        raise Fenced(f"this node stays out: {reason}")

    def _on_over(self, src: int, msg: Over) -> None:
        """(a returning agent) The members left for a requeue: so does this one, with their exit code."""
        a = self.agent
        if a.state == NodeState.RETURNING:
            a.exit_code = msg.code
            a.transition(NodeState.SAVED, f"the members left for a requeue (exit {a.exit_code})")

    # ---- the agent that readmits it -----------------------------------------------------------------------
    def on_rejoin(self, src: int, msg: Rejoin) -> None:
        """(``cp.pump``) A returning node asks to come back: the lowest live agent readmits it between recoveries
        (control/membership.py); otherwise it asks again."""
        a = self.agent
        why = may_readmit(a.cp, src)
        if why is None and (a.recovery.in_round or a.swaps.current is not None
                            or a.state not in (NodeState.TRAINING, NodeState.SPARE)):
            why = "busy"
        if why is not None:
            return
        msg = readmit(a.cp, src)
        a.retarget_ring_link()
        a.log.emit("node_readmitted", returned=src, generation=msg.generation, spare_nodes=list(msg.spare_nodes))
