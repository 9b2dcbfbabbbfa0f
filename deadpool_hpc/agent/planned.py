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

import os
import signal
import time

from .health import Unhealthy

ASK_S = 2.0       # seconds without an answer to swap_ask before asking again
RETRY_S = 1.0     # seconds before asking again after "busy" (another node holds the lease)
SETTLE_S = 1.0    # longest wait for the neighbours' replicas of the boundary step (seconds)


class PlannedSwaps:
    """The planned-swap state of one node agent (``agent``: its NodeAgent). Called from the agent's main loop only:
    ``tick`` each pass, ``on_written`` for each snapshot written, ``suspend`` when a recovery starts; ``on_ask`` and
    ``on_answer`` are control-plane handlers (run by ``ControlPlane.pump`` on the same thread)."""

    def __init__(self, agent):
        self.a = agent
        self.wanted: list = []          # [(detector, Unhealthy, t_seen, not_before)]
        self.current: dict | None = None
        self.lease: tuple | None = None  # (node, monotonic time) while this agent coordinates and gave the lease
        self._said: set = set()          # (detector, why) already logged as refused
        agent.cp.handlers["swap_ask"] = self.on_ask
        agent.cp.handlers["swap_answer"] = self.on_answer

    # ---- the node that leaves -------------------------------------------------------------------------------
    def want(self, detector: str, verdict, t_seen: float) -> None:
        self.wanted.append((detector, verdict, t_seen, 0.0))

    def frozen(self) -> set:
        return set(self.current["frozen"]) if self.current and self.current.get("frozen") else set()

    def tick(self) -> None:
        a = self.a
        if a.cp.finished() is not None:  # the run is over: nothing to hand over
            self.wanted, self.current = [], None
            return
        quiet = a.state in ("training", "spare") and not a.cp.failure.is_set() and not a._in_round
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
            self.a.log.emit("swap_refused", **self._common(cur), why=why)
        self.a.health.consumed(cur["detector"])
        self.current = None

    @staticmethod
    def _common(cur: dict) -> dict:
        return {k: cur[k] for k in ("detector", "reason", "t_seen", "generation")}

    def _ask(self, detector: str, verdict, t_seen: float) -> None:
        a = self.a
        cur = {"detector": detector, "reason": verdict.reason, "t_seen": t_seen, "generation": a.cp.generation,
               "msg": f"planned swap ({detector}): {verdict.reason}", "phase": "asking", "frozen": set()}
        self.current = cur
        if a.state == "training":
            if not (a.cfg.replicate and a.reps):
                return self._refuse(cur, "replication is off (--no-replicate): no replica to hand the node's "
                                         "state over")
            if max(a.written.values(), default=-1) + 1 >= a.cfg.steps:
                return self._refuse(cur, f"the run ends at step {a.cfg.steps} before the next step boundary")
        self._send_ask()

    def _send_ask(self) -> None:
        cur, cp = self.current, self.a.cp
        cur["asked"] = time.monotonic()
        cp.peers.send(min(cp.peers.alive()), "swap_ask", {"node": cp.me, "generation": cp.generation})

    def on_answer(self, src: int, body: dict) -> None:
        cur = self.current
        if cur is None or cur["phase"] != "asking":
            return
        if body.get("ok"):
            self._arm(cur)
        elif body.get("busy") is not None:  # another node is leaving: ask again later
            self.current = None
            self.wanted.insert(0, (cur["detector"], Unhealthy(cur["reason"]), cur["t_seen"],
                                   time.monotonic() + RETRY_S))
        else:
            self._refuse(cur, str(body.get("why")))

    def _arm(self, cur: dict) -> None:
        a = self.a
        if a.state == "spare":  # nothing to hand over: the job has one spare fewer
            a.log.emit("swap_requested", **self._common(cur), role="spare")
            a.health.consumed(cur["detector"])
            a._node_failed(cur["msg"], cause="planned")
        cur.update(phase="armed", target=max(a.written.values(), default=-1) + 1, armed=time.monotonic())
        a.log.emit("swap_requested", **self._common(cur), role="active", boundary=cur["target"])
        for local in list(a.written):
            self.on_written(local)

    def on_written(self, local: int) -> None:
        a, cur = self.a, self.current
        if cur is None or cur["phase"] != "armed" or local in cur["frozen"] or local not in a.sup.alive():
            return
        if a.written.get(local, -1) >= cur["target"]:
            os.kill(a.sup.procs[local].pid, signal.SIGSTOP)
            cur["frozen"].add(local)

    def _advance(self) -> None:
        a, cur = self.a, self.current
        committed = all(lo in a.reps and a.reps[lo].committed_step >= cur["target"] for lo in range(a.P))
        ready = len(cur["frozen"]) == a.P and committed
        late = time.monotonic() - cur["armed"] > a.cfg.collective_timeout
        if ready and not late:
            # the survivors' snapshots of B: the replicas this node holds for its ring neighbour's ranks reaching B
            # say they wrote theirs (they cannot pass B+1 meanwhile); bounded
            cur.setdefault("t_committed", time.monotonic())
            held = [max(steps, default=-1) for rep in a.reps.values() for steps in rep.report()["held"].values()]
            if any(h < cur["target"] for h in held) and time.monotonic() - cur["t_committed"] < SETTLE_S:
                return
        if ready or late:
            a.log.emit("swap_boundary", generation=a.cp.generation, boundary=cur["target"], committed=committed,
                       detector=cur["detector"])
            a.health.consumed(cur["detector"])
            a._node_failed(cur["msg"] + ("" if committed else f" (boundary {cur['target']} not committed within "
                                                              f"{a.cfg.collective_timeout:.0f} s)"), cause="planned")

    def suspend(self) -> None:
        """A failure elsewhere interrupts the swap: let the stopped processes go (the recovery round needs them to
        leave the generation) and ask again once training resumes."""
        cur, self.current = self.current, None
        if cur is None:
            return
        for local in cur["frozen"]:
            if local in self.a.sup.alive():
                os.kill(self.a.sup.procs[local].pid, signal.SIGCONT)
        self.wanted.insert(0, (cur["detector"], Unhealthy(cur["reason"]), cur["t_seen"], 0.0))

    # ---- the coordinator: one lease at a time ---------------------------------------------------------------
    def on_ask(self, src: int, body: dict) -> None:
        cp = self.a.cp
        node = int(body.get("node", src))
        holder = self.lease[0] if self.lease else None
        expired = holder is None or holder == node or cp.peers.is_suspected(holder) \
            or time.monotonic() - self.lease[1] > 2 * self.a.cfg.collective_timeout
        spares = [n for n in cp.spare_nodes if not cp.peers.is_suspected(n)]
        if not expired:
            answer = {"ok": False, "busy": holder}
        elif not spares:
            answer = {"ok": False, "why": "no spare node left"}
        else:
            self.lease = (node, time.monotonic())
            answer = {"ok": True}
        cp.peers.send(src, "swap_answer", answer)
