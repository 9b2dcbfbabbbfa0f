"""Planned swap: a node asked to leave before it fails (a detector's verdict, agent/health.py) hands its ranks to a
spare at a step boundary, with no step recomputed (docs/plugins.md, "Planned swap").

One at a time, job-wide: the node's agent first asks the coordinator (the lowest live agent) for the *swap lease*
(``swap_ask`` / ``swap_answer`` over the control plane). Two nodes leaving together could be a rank's node and the
holder of its replica (its state would be lost) or could take the last spare twice; a lease is given to one node
until it has left (it is then suspected) or ``LEASE_S`` has passed, and refused while no spare is left.

With the lease, the node picks its boundary B: the first snapshot its training processes write after the grant.
Each process is stopped (SIGSTOP) once it has written snapshot B. In the built-in ZeRO step the parameters'
all-gather of B+1 needs every rank, so no rank completes B+1; once every snapshot B of the node is committed at its
holders and the replicas the node holds for its ring neighbour reach B (the survivors wrote theirs; at most
``SETTLE_S``), the node declares itself failed (``cause: planned``) and leaves. The survivors' recovery then cuts at
B. Limit: with ``ctx.protect`` the update after the gradient all-reduce is local, so if a snapshot copy takes longer
than a forward and backward, the node may already have given its gradients of B+1 when it is stopped, the
survivors complete B+1, and one step is recomputed (the run stays bitwise equal).

Every wait has a deadline: no answer to an ask within ``ASK_S`` asks again (the coordinator may have changed); a
boundary not committed within ``--collective-timeout`` seconds makes the node leave anyway (a step may then be
recomputed, as after a crash). A failure elsewhere meanwhile resumes the stopped processes (``suspend``) and the
swap is asked for again once training resumes. Refused, with ``swap_refused`` (once per reason) and training going
on: no spare left, ``--no-replicate``, a boundary past the run's last step.
"""
from __future__ import annotations

import signal
import time
from typing import Protocol

from ..control.messages import SwapAnswer, SwapAsk
from .health import Unhealthy
from .state import NodeState

ASK_S = 2.0       # seconds without an answer to swap_ask before asking again
RETRY_S = 1.0     # seconds before asking again after "busy" (another node holds the lease)
SETTLE_S = 1.0    # longest wait for the neighbours' replicas of the boundary step (seconds)


class SwapHost(Protocol):
    """What a planned swap uses of its node agent (agent/node.py's NodeAgent is one)."""

    cfg: object                  # RunConfig: replicate, steps, ranks_per_node, collective_timeout
    log: object                  # EventLog
    state: NodeState             # agent/state.py (a str enum: "training", "spare", ...); read only
    written: dict                # local rank -> step of the last snapshot its process wrote (agent/desk.py)
    reps: dict                   # local rank -> Replicator (committed_step, report())
    health: object               # DetectorRunner: ``consumed(detector)`` once a verdict is handled

    def in_recovery(self) -> bool:
        """A failure is being handled, or a recovery round runs."""

    def signal_local(self, local: int, sig: int) -> bool:
        """Send ``sig`` to training process ``local`` if it is alive; whether it was sent."""

    def node_failed(self, reason: str, cause: str) -> None:
        """Declare this node failed: its exit is recorded (the agent's loop acts on it); the caller stops."""


class PlannedSwaps:
    """The planned-swap state of one node agent: ``cp``, its ControlPlane (the lease's messages); ``host``, the agent
    itself as far as a swap needs it (``SwapHost``). Called from the agent's main loop only: ``tick`` each pass,
    ``on_written`` for each snapshot written, ``suspend`` when a recovery starts; ``on_ask`` and ``on_answer`` are
    control-plane handlers (run by ``ControlPlane.pump`` on the same thread)."""

    def __init__(self, cp, host: SwapHost):
        self.cp = cp
        self.host = host
        self.wanted: list = []          # [(detector, Unhealthy, t_seen, not_before)]
        self.current: dict | None = None
        self.lease: tuple | None = None  # (node, monotonic time) while this agent coordinates and gave the lease
        self._said: set = set()          # (detector, why) already logged as refused
        cp.on(SwapAsk.KIND, self.on_ask)
        cp.on(SwapAnswer.KIND, self.on_answer)

    # ---- the node that leaves -------------------------------------------------------------------------------
    def want(self, detector: str, verdict, t_seen: float) -> None:
        self.wanted.append((detector, verdict, t_seen, 0.0))

    def frozen(self) -> set:
        return set(self.current["frozen"]) if self.current and self.current.get("frozen") else set()

    def tick(self) -> None:
        if self.cp.finished() is not None:  # the run is over: nothing to hand over
            self.wanted, self.current = [], None
            return
        quiet = self.host.state in (NodeState.TRAINING, NodeState.SPARE) and not self.host.in_recovery()
        if self.current is None and self.wanted and quiet and self.wanted[0][3] <= time.monotonic():
            self._ask(*self.wanted.pop(0)[:3])
        cur = self.current
        if cur is None:
            return
        if cur["phase"] == "asking" and time.monotonic() - cur["asked"] > ASK_S:
            self._send_ask()
        elif cur["phase"] == "armed":
            self._advance()

    def _refuse(self, cur: dict, why: str) -> None:
        if (cur["detector"], why) not in self._said:
            self._said.add((cur["detector"], why))
            self.host.log.emit("swap_refused", **self._common(cur), why=why)
        self.host.health.consumed(cur["detector"])
        self.current = None

    @staticmethod
    def _common(cur: dict) -> dict:
        return {k: cur[k] for k in ("detector", "reason", "t_seen", "generation")}

    def _ask(self, detector: str, verdict, t_seen: float) -> None:
        a = self.host
        cur = {"detector": detector, "reason": verdict.reason, "t_seen": t_seen, "generation": self.cp.generation,
               "msg": f"planned swap ({detector}): {verdict.reason}", "phase": "asking", "frozen": set()}
        self.current = cur
        if a.state == NodeState.TRAINING:
            if not (a.cfg.replication.replicate and a.reps):
                return self._refuse(cur, "replication is off (--no-replicate): no replica to hand the node's "
                                         "state over")
            if max(a.written.values(), default=-1) + 1 >= a.cfg.train.steps:
                return self._refuse(cur, f"the run ends at step {a.cfg.train.steps} before the next step boundary")
        self._send_ask()

    def _send_ask(self) -> None:
        cur, cp = self.current, self.cp
        cur["asked"] = time.monotonic()
        cp.peers.send(min(cp.peers.alive()), SwapAsk.KIND, SwapAsk(cp.me, cp.generation).to_wire())

    def on_answer(self, src: int, msg: SwapAnswer) -> None:
        cur = self.current
        if cur is None or cur["phase"] != "asking":
            return
        if msg.ok:
            self._arm(cur)
        elif msg.busy is not None:  # another node is leaving: ask again later
            self.current = None
            self.wanted.insert(0, (cur["detector"], Unhealthy(cur["reason"]), cur["t_seen"],
                                   time.monotonic() + RETRY_S))
        else:
            self._refuse(cur, str(msg.why))

    def _arm(self, cur: dict) -> None:
        a = self.host
        if a.state == NodeState.SPARE:  # nothing to hand over: the job has one spare fewer
            a.log.emit("swap_requested", **self._common(cur), role="spare")
            a.health.consumed(cur["detector"])
            a.node_failed(cur["msg"], cause="planned")
            return
        cur.update(phase="armed", target=max(a.written.values(), default=-1) + 1, armed=time.monotonic())
        a.log.emit("swap_requested", **self._common(cur), role="active", boundary=cur["target"])
        for local in list(a.written):
            self.on_written(local)

    def on_written(self, local: int) -> None:
        a, cur = self.host, self.current
        if cur is None or cur["phase"] != "armed" or local in cur["frozen"]:
            return
        if a.written.get(local, -1) >= cur["target"] and a.signal_local(local, signal.SIGSTOP):
            cur["frozen"].add(local)

    def _advance(self) -> None:
        a, cur, P = self.host, self.current, self.host.cfg.layout.ranks_per_node
        committed = all(lo in a.reps and a.reps[lo].committed_step >= cur["target"] for lo in range(P))
        ready = len(cur["frozen"]) == P and committed
        late = time.monotonic() - cur["armed"] > a.cfg.timeouts.collective_timeout
        if ready and not late:
            # the survivors' snapshots of B: the replicas this node holds for its ring neighbour's ranks reaching B
            # say they wrote theirs (they cannot pass B+1 meanwhile); bounded
            cur.setdefault("t_committed", time.monotonic())
            held = [max(steps, default=-1) for rep in a.reps.values() for steps in rep.report()["held"].values()]
            if any(h < cur["target"] for h in held) and time.monotonic() - cur["t_committed"] < SETTLE_S:
                return
        if ready or late:
            a.log.emit("swap_boundary", generation=self.cp.generation, boundary=cur["target"], committed=committed,
                       detector=cur["detector"])
            a.health.consumed(cur["detector"])
            a.node_failed(cur["msg"] + ("" if committed else f" (boundary {cur['target']} not committed within "
                                                              f"{a.cfg.timeouts.collective_timeout:.0f} s)"),
                          cause="planned")

    def suspend(self) -> None:
        """A failure elsewhere interrupts the swap: let the stopped processes go (the recovery round needs them to
        leave the generation) and ask again once training resumes."""
        cur, self.current = self.current, None
        if cur is None:
            return
        for local in cur["frozen"]:
            self.host.signal_local(local, signal.SIGCONT)
        self.wanted.insert(0, (cur["detector"], Unhealthy(cur["reason"]), cur["t_seen"], 0.0))

    # ---- the coordinator: one lease at a time ---------------------------------------------------------------
    def on_ask(self, src: int, msg: SwapAsk) -> None:
        cp = self.cp
        node = msg.node
        holder = self.lease[0] if self.lease else None
        expired = holder is None or holder == node or cp.peers.is_suspected(holder) \
            or time.monotonic() - self.lease[1] > 2 * self.host.cfg.timeouts.collective_timeout
        spares = [n for n in cp.spare_nodes if not cp.peers.is_suspected(n)]
        if not expired:
            answer = SwapAnswer(False, busy=holder)
        elif not spares:
            answer = SwapAnswer(False, why="no spare node left")
        else:
            self.lease = (node, time.monotonic())
            answer = SwapAnswer(True)
        cp.peers.send(src, SwapAnswer.KIND, answer.to_wire())
