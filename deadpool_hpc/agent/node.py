"""The node agent: one per node, the only MPI process of its node, supervising the node's training processes.

Owns, for its node (DESIGN.md "Process tree"): the loop that serves the node, and the parts it wires together: the
control plane among agents (heartbeats, agreement, fencing: control/), the node's own snapshot slots (shared with
its training processes, ipc/shm.py) and the replicas it holds for other nodes (replica/replicator.py: one Replicator
per local rank; their per-step protocol is agent/desk.py's), each generation's rendezvous (the replicated
key/value store its training processes use instead of a TCPStore, agent/rendezvous.py), the supervision of its P
training processes (agent/supervisor.py: an exit is seen at once, a hang by its progress page), the start-up and
spare re-checks (agent/sparecheck.py, agent/preflight.py), the straggler check (agent/stragglers.py), planned
swaps (agent/planned.py), the recovery (agent/recovery.py) and the return to the spare pool after its training
processes failed (agent/comeback.py). Does not own: training (worker/), launching (launch/).

Detection paths: a training process that exits or stops making progress makes its agent declare the
node failed to every agent at once (``suspect`` of itself) and end the node; an agent that dies is seen at once by
its ring neighbours (agent/ringlink.py); a node that freezes or loses power, by the heartbeats.

The loop (``run``) never blocks: each iteration (``tick``) it moves control messages (``ControlPlane.pump``),
local channel messages, supervisor and ring-link events, commits, and expires store waits. A recovery
(``Recovery.run``) is a series of rounds; each waits only with deadlines and keeps ticking the loop's sources.
A failure of this node (``node_failed``) is recorded (``pending_exit``, agent/state.py PendingExit), not raised:
``tick`` stops at it and does nothing more while it is pending, every wait that ticks stops early, and ``run``
acts on it at the top of its loop (the agent leaves, fenced, or the node returns: agent/comeback.py).
What the recovery, the desk and planned swaps use of this class is public (``tick``, ``node_failed``,
``configure``, ``view``, ``send_role``, ...); the rest is this module's.

The agent's state (``state``: agent/state.py NodeState, starting -> training or spare -> ... -> done or saved) has
one writer, ``transition``, which checks each move against agent/state.py's table and logs each change
(``agent_state``); a recovery returns the state it leaves the node in (agent/recovery.py ``RecoveryEnd``).
"""
from __future__ import annotations

import os
import time

from ..cause import signal_name
from ..control.crashloop import WorkFailure, end_of
from ..control.joining import mark_joined
from ..control.messages import Finished, Over
from ..errors import STARTUP_FAILED_EXIT, Fenced
from ..faultinject.messages import FireNode, Inject, InjectSpare
from ..ipc.messages import (AbortAsk, Finish, Layout, Left, LinkAnswer, MatmulFigure, RoundFailed, Slots, Spare, Train,
                            Trained, View)
from ..ipc.shm import Doorbell
from ..placement import held_by, holders_of
from ..rundir import RunDir, latest_checkpoint
from .comeback import Comeback
from .desk import SnapshotDesk
from .joindesk import JoinDesk
from .metrics import NodeMetrics
from .persister import Persister
from .planned import PlannedSwaps
from .preflight import PreflightStopped, SpeedCheck
from .recovery import Recovery
from .rendezvous import Rendezvous
from .sparecheck import SpareChecks
from .sparepool import SparePool
from .state import NodeState, PendingExit, check_transition
from .stragglers import Stragglers
STEADY_TICK_S = 0.05  # seconds between passes of the agent's loop when nothing happens (a quiet loop keeps an idle
#                       agent near 1 % of a core; every source it serves also wakes it at once)
# the heartbeat deadline until this agent's training processes are up (agent/__main__.py sets it, ``_start`` puts
# the run's back): each agent imports torch then, and loading its libraries holds the GIL long enough on a busy
# node (seen: > 1 s on 2 shared cores) that its heartbeat thread fell silent and a live node was declared failed
STARTUP_HEARTBEAT_DEADLINE_S = 5.0
# an exited training process's stderr may still hold its last words: the most its agent waits for the pipe's end
# before it declares the node failed (the end comes with the process's, unless a child of it holds its stderr)
STDERR_WAIT_S = 0.2


class NodeAgent:
    """One node's agent. ``cp``: its ControlPlane (started); ``channel``: its ChannelServer; ``supervisor``;
    ``ring_link``: its RingLink; ``listeners``: one listening replica server socket per local rank, made by
    ``transport`` (replica/transports.py; None: TCP); ``log``: EventLog."""

    def __init__(self, cfg, cp, channel, supervisor, ring_link, listeners, log, injector, transport=None,
                 joined: dict | None = None, join_listener: tuple | None = None):
        self.cfg = cfg
        self.cp = cp
        self.peers = cp.peers              # its control thread (control/peers.py): heartbeats, suspicion, messages
        self.channel = channel
        self.peers.on_notice = channel.wake  # a control message or a suspicion ends the main loop's wait at once
        self.sup = supervisor
        self.ring_link = ring_link
        self.listeners = listeners
        self.transport = transport         # replica/transports.py (None: TCP)
        self.log = log
        self.faults = injector
        self.P = cfg.layout.ranks_per_node
        self.node = cp.me
        self.reps: dict = {}               # local -> Replicator (once the training process sent its layout)
        self.layouts: dict = {}            # local -> StateLayout (of its current process, once it sent it)
        self.layouts_seen: dict = {}       # local -> StateLayout of its first process (a returned node's are equal)
        self.bufs: dict = {}               # local -> [SharedBuffer, SharedBuffer]
        self.committed_seen: dict = {}     # local -> last committed step seen (training makes progress)
        self.health = None                 # agent/health.py DetectorRunner: detectors asking for a planned swap
        self.health_check = None           # agent/preflight.py HealthCheck: the site's check at start-up, until done
        self.written: dict = {}            # local -> step of the last snapshot it wrote into its slot
        self.swaps = PlannedSwaps(cp, self)   # agent/planned.py: leaving on a detector's request, one node at a time
        self._state = NodeState.STARTING   # (agent/state.py) written by ``transition`` only
        self._preempt_ignored = False
        self.exit_code = 0
        self.last_work_failure: WorkFailure | None = None   # how this node's last failure ended (agent/comeback.py)
        self.pending_exit: PendingExit | None = None   # this node failed: ``run`` acts on it at the top of its loop
        self.checkpoint_dir = RunDir(cfg.output.run_dir).checkpoint
        # a requeued attempt's checkpoint (the launchers clear a new run's); a joined node's is its sponsor's
        self.resume = latest_checkpoint(cfg.output.run_dir) if joined is None else joined.get("resume")
        self.recovery = Recovery(self)     # agent/recovery.py: the rounds after a failure
        self.rendezvous = Rendezvous(cp)   # agent/rendezvous.py: each generation's store, kept equal across agents
        self.peers.on_inject = self._on_inject
        # agent/desk.py: claim, written, committed, off this loop
        self.desk = SnapshotDesk(self.reps, channel.progress, self._on_written, log, Doorbell.create())
        self.persister = Persister(self)   # agent/persister.py: every --persist-every s, the snapshots to disk
        self.speed = SpeedCheck(cp, channel, self.P, log, cfg.preflight.factor)   # agent/preflight.py
        self.stragglers = Stragglers(cp, self)   # agent/stragglers.py: each node's own work per step, judged job-wide
        self.comeback = Comeback(self)     # agent/comeback.py: after its training processes failed, back as a spare
        self.spare_checks = SpareChecks(self)   # agent/sparecheck.py: an idle spare checks itself again
        # agent/metrics.py: --metrics-port / --metrics-textfile (None: off)
        self.metrics = NodeMetrics(self) if cfg.output.metrics_port or cfg.output.metrics_textfile else None
        # agent/sparepool.py: --spare-floor: the pool's size, for the batch host's replacement requests (None: off)
        self.spare_pool = SparePool(self) if cfg.replacement.spare_floor else None
        # a replacement node that joined the running job (control/joining.py): {job_id, t_asked} (None: started with
        # the job). It starts as a spare of the generation it joined: no resume, no pre-flight with the others
        self.joined = joined
        # agent/joindesk.py: --spare-floor: where replacement nodes ask to join and joined nodes re-attach; in a joined
        # node, its re-attachment after its sponsor's loss. ``join_listener``: (socket, [host, port]) (None: off)
        self.join_desk = JoinDesk(self, *join_listener) if join_listener is not None else None

    # ---- the loop ------------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until the run ends for this node. Returns the exit code (0 done, 75 checkpoint saved: requeue)."""
        if self.resume is not None and self.joined is None:
            self.cp.enter_generation(self.resume["generation"] + 1)
        self._start()
        while True:
            failed, self.pending_exit = self.pending_exit, None
            if failed is not None and not failed.returning:   # (``node_failed``) the others go on without it
                raise Fenced(f"this node failed: {failed.reason}")
            if failed is not None:   # its training processes failed, its agent lives on (agent/comeback.py)
                self.comeback.come_back(failed)
                continue
            if self.state in (NodeState.DONE, NodeState.SAVED):
                break
            self._serve()
        if self.state == NodeState.SAVED:   # the members leave for a requeue: so does a node on its way back
            self.cp.tell_returning(Over.KIND, Over(self.exit_code).to_wire())
        return self.exit_code

    def _serve(self) -> None:
        """The loop of ``run`` until the run ends for this node, or this node fails (it returns with ``pending_exit``
        set: ``node_failed``)."""
        while self.state not in (NodeState.DONE, NodeState.SAVED):
            # a local message, a training process's exit (its socket closes), a control message or a suspicion
            # (the heartbeat thread wakes the channel) end the wait at once; the rest (ring-link connections,
            # replicas committed) is looked at each pass: every 5 ms while a failure is handled, else STEADY_TICK_S
            steady = not self.cp.failure.is_set() and not self.recovery.wanted()
            self.tick(STEADY_TICK_S if steady else 0.005)
            if self.pending_exit is not None:
                return
            if self.state in (NodeState.DONE, NodeState.SAVED):
                break
            if self.cp.finished() is not None:
                self.finish()
                break
            if self.peers.fenced:
                raise Fenced(self.peers.fenced)
            if (self.peers.preempted.is_set() and self.state == NodeState.TRAINING
                    and not self.cfg.replication.replicate):
                if not self._preempt_ignored:
                    self._preempt_ignored = True
                    self.log.emit("preempt_ignored", reason="--no-replicate: no snapshot to save")
            elif self.peers.preempted.is_set() and self.state == NodeState.TRAINING:
                self.cp.failure.set()  # Slurm's warning (SIGUSR2/SIGTERM): agree on a cut, save it, requeue
            if self.cp.failure.is_set() or self.recovery.wanted():
                end = self.recovery.run()   # (it stops early at a failure of this node: node_failed)
                if self.pending_exit is not None:
                    return
                if end is None:   # the run finished during the recovery
                    self.finish()
                    break
                if end.exit_code is not None:
                    self.exit_code = end.exit_code
                self.transition(end.state, end.reason)

    # ---- the state (agent/state.py) -----------------------------------------------------------------------------
    @property
    def state(self) -> NodeState:
        """What this agent is doing (agent/state.py NodeState); ``transition`` is its only writer."""
        return self._state

    def transition(self, new: NodeState, reason: str) -> None:
        """Move this agent to state ``new`` because of ``reason`` (a few words: the event's). A move ``ALLOWED``
        does not list raises IllegalTransition naming both states (agent/state.py), and the state stays; a change
        is logged once (``agent_state``: ``state``, ``previous``, ``reason``, ``generation``); a move to the same
        state (a recovery round that ends in the node's role) is checked, not logged."""
        old = self._state
        check_transition(old, new)
        self._state = NodeState(new)
        if new != old:
            self.log.emit("agent_state", state=self._state.value, previous=old.value, reason=reason,
                          generation=self.cp.generation)

    def tick(self, timeout: float = 0.0) -> None:
        """One pass over every source of events; returns within about ``timeout`` seconds. Stops at a failure of this
        node (``node_failed``: the rest of the pass is not done) and does nothing while one is pending."""
        if self.pending_exit is not None:
            return
        self.cp.pump(0)   # (its handlers may fail the node: a planned swap, a spare's re-check)
        if self.pending_exit is not None:
            return
        for local, kind, body in self.channel.poll(timeout):
            self._on_local(local, kind, body)
        for local, rc in self.sup.poll():
            if rc == 0 and self.cp._finish is not None:
                continue  # the run is complete: training processes leave
            # before it reached ctx.run: no layout sent, or the start-up's exit code (worker/entry.py) from a process
            # that began no step (a process that trained and then exits 3 on its own is not starting)
            page = self.channel.progress(local)
            starting = local not in self.layouts or (rc == STARTUP_FAILED_EXIT and (page is None or page.step is None))
            self._exited(local, rc, starting)
            self.node_failed(f"training process {local} (pid {self.sup.procs[local].pid}) exited with "
                              f"{'signal ' + signal_name(rc) if rc < 0 else 'code ' + str(rc)}"
                              + (" during its start-up" if starting else ""),
                              cause="startup_failed" if starting else "exit",
                              work=None if starting else self._work_failure(local, rc))
            return
        frozen = self.swaps.frozen()  # stopped on purpose at a planned swap's boundary: not a hang
        armed = [lo for lo in range(self.P) if self.channel.progress(lo) is not None and self.channel.progress(lo).armed
                 and lo not in frozen]
        for local, stuck in self.sup.hung(armed):
            # every thread's stack before anything is killed (agent/stacks.py: at most STACK_TIMEOUT_S)
            st = self.sup.stack(local)
            self.log.emit("hang_detected", generation=self.cp.generation, local=local, stuck_s=round(stuck, 3),
                          step=self.channel.progress(local).step, where=f"step {self.channel.progress(local).step}",
                          timeout_s=self.cfg.timeouts.hang_timeout, rank=self.cp.train_rank(local),
                          pid=self.sup.procs[local].pid, stack=st.text, stack_source=st.source,
                          stack_s=round(st.seconds, 3), hung_in=st.hung_in, stack_errors=st.errors)
            self.node_failed(f"training process {local} made no progress for {stuck:.1f} s"
                             + (f" (in {st.hung_in['function']})" if st.hung_in else ""), cause="hang")
            return
        for lost in self.ring_link.poll():
            self.peers.suspect(lost, "its agent's watch connection closed (the process is gone)")
        for local, rep in self.reps.items():
            c = rep.committed_step
            if c > self.committed_seen.get(local, -1):
                self.committed_seen[local] = c
                self.recovery.progressed()
        if self.swaps.current is not None:  # the desk wakes this loop at each snapshot written meanwhile
            for local in list(self.written):
                self.swaps.on_written(local)
        self.rendezvous.expire()
        if self.health is not None:
            for name, verdict in self.health.pending():
                self.swaps.want(name, verdict, time.time())
        self.stragglers.tick()
        self.swaps.tick()   # (a planned swap's boundary fails the node)
        if self.pending_exit is not None:
            return
        self.persister.tick()
        if self.state == NodeState.SPARE and self.cfg.preflight.spare_check_every:
            self.spare_checks.tick()   # (a failed re-check fails the node)
            if self.pending_exit is not None:
                return
        if self.metrics is not None:
            self.metrics.tick()
        if self.spare_pool is not None:
            self.spare_pool.tick()
        if self.join_desk is not None:
            self.join_desk.tick()

    # ---- start-up --------------------------------------------------------------------------------------------
    def _start(self) -> None:
        """The start-up: the training processes' models built, the health check, the pre-flight; then each its
        role. Returns early when this node fails meanwhile (``pending_exit``)."""
        deadline = time.monotonic() + self.cfg.timeouts.startup_timeout
        # every training process built its model and sent its layout, and the site's health check (if any) passed
        while not self.checked() or len(self.layouts) < self.P:
            if self.pending_exit is not None:   # (the health check failed)
                return
            self.tick(0.01)
            if self.pending_exit is not None:
                return
            if time.monotonic() > deadline:   # a failure of this node like any other: a spare takes its place
                if not self.checked():
                    self.health_check.kill()
                    self.node_failed(f"the health check {self.cfg.preflight.health_check!r} was still running after "
                                      f"{self.cfg.timeouts.startup_timeout:.0f} s (--startup-timeout)",
                                     cause="health_check")
                    return
                late = [lo for lo in range(self.P) if lo not in self.layouts]
                self.node_failed(f"training process(es) {late} did not reach ctx.run within "
                                  f"{self.cfg.timeouts.startup_timeout:.0f} s (--startup-timeout)",
                                 cause="startup_timeout")
                return
        if self.pending_exit is not None:   # (the health check failed as the last layout came)
            return
        # links with the neighbour nodes, the timed matmul (agent/preflight.py); not for a joined node
        if self.cfg.preflight.factor and self.joined is None:
            try:
                verdict = self.speed.at_startup(self._tick_or_stop, deadline)
            except PreflightStopped:
                return
            if verdict:
                cause, why = verdict
                self.node_failed(f"pre-flight: {why}", cause=cause)
                return
        self.spare_checks.arm()
        self.peers.deadline = self.cfg.timeouts.heartbeat_deadline   # (STARTUP_HEARTBEAT_DEADLINE_S until now)
        self.retarget_ring_link()
        self.rendezvous.open(self.cp.generation)
        for local in range(self.P):
            self.configure(local)
            r = self.cp.train_rank(local)
            role = Spare(self.view()) if r is None else \
                Train(self.view(), r, self.cfg.layout.world_size, self.recovery.high_water, self.resume)
            self.send_role(local, role)
        if self.cp.train_rank(0) is not None:
            self.transition(NodeState.TRAINING, "started: its processes hold training ranks")
        elif self.joined is not None:
            self.transition(NodeState.SPARE, "joined the running job: its processes are spares")
            self.log.emit("node_joined", generation=self.cp.generation, job_id=self.joined["job_id"],
                          sponsor=self.peers.relays.via, spare_nodes=list(self.cp.spare_nodes),
                          seconds=round(time.time() - self.joined["t_asked"], 3))
            try:
                mark_joined(self.cfg.output.run_dir, self.joined["job_id"], self.node)
            except OSError as exc:   # a full run directory: the policy counts it from the pool's events instead
                self.log.emit("join_marker_failed", error=str(exc)[:300])
        else:
            self.transition(NodeState.SPARE, "started: its processes are spares")

    def _tick_or_stop(self, timeout: float = 0.0) -> None:
        """``tick`` for the start-up's pre-flight (agent/preflight.py), whose waits know nothing of a pending exit:
        raises PreflightStopped, which ``_start`` catches right above that call, once this node failed."""
        self.tick(timeout)
        if self.pending_exit is not None:
            raise PreflightStopped()

    def restart_as_spare(self) -> None:
        """(agent/comeback.py) Readmitted: forget the failed processes' state, start fresh ones and make them spares
        of the current generation. A process that fails to come up is this node's failure, as at the start-up (it
        returns with ``pending_exit`` set). Returns with the state ``saved`` instead if the members left for a
        requeue while the processes started."""
        self.layouts.clear()
        self.written.clear()
        self.committed_seen.clear()
        self.recovery.forget()
        self.desk.drop_pending()
        self.persister.quiesce()
        for old in (self.swaps, self.stragglers, self.rendezvous):   # their control-message handlers go with them
            self.cp.off(old)
        self.swaps = PlannedSwaps(self.cp, self)
        self.stragglers = Stragglers(self.cp, self)
        self.rendezvous = Rendezvous(self.cp)
        self.channel.poll(0)   # the old processes' connections end here (reaped), then their pages go
        for local in range(self.P):
            self.channel.forget(local)
        self.sup.restart()
        deadline = time.monotonic() + self.cfg.timeouts.startup_timeout
        while len(self.layouts) < self.P:
            self.tick(0.01)
            if self.pending_exit is not None:
                return
            if time.monotonic() > deadline:
                late = [lo for lo in range(self.P) if lo not in self.layouts]
                self.node_failed(f"training process(es) {late} of the returned node did not reach ctx.run within "
                                 f"{self.cfg.timeouts.startup_timeout:.0f} s (--startup-timeout)",
                                cause="startup_timeout")
                return
        if self.state != NodeState.RETURNING:
            return   # the members left for a requeue meanwhile (agent/comeback.py ``_on_over``): so does this node
        self.spare_checks.arm()
        self.retarget_ring_link()
        self.rendezvous.open(self.cp.generation)
        for local in range(self.P):
            self.configure(local)
            self.send_role(local, Spare(self.view()))
        self.transition(NodeState.SPARE, "readmitted: fresh processes started as spares")

    def checked(self) -> bool:
        """Whether the site's health check (agent/preflight.py) is done; one that failed fails the node
        (``node_failed``: True, with ``pending_exit`` set)."""
        hc = self.health_check
        if hc is None:
            return True
        res = hc.poll()
        if res is None:
            return False
        rc, secs, tail = res
        self.health_check = None
        # seconds: from its start until this agent saw it end (its loop starts after the agent imported torch)
        self.log.emit("health_check", rc=rc, seconds=round(secs, 3), command=self.cfg.preflight.health_check,
                      output=tail[-400:])
        if rc != 0:
            self.node_failed(f"the health check {self.cfg.preflight.health_check!r} exited with {rc} after {secs:.1f} s"
                              + (f": {tail[-200:]}" if tail else ""), cause="health_check")
        return True

    def _on_local(self, local: int, kind: str, body: dict) -> None:
        if self.peers.fenced:
            return
        if kind.startswith("store_"):
            self.rendezvous.handle(local, kind, body, self.channel.send)
        elif kind == Layout.KIND:
            self._layout(local, Layout.from_wire(body))
        elif kind == MatmulFigure.KIND:
            if (figure := self._answer(local, MatmulFigure, body)) is not None:
                self.speed.on_local(local, figure)
        elif kind == LinkAnswer.KIND:
            if (answer := self._answer(local, LinkAnswer, body)) is not None:
                self.speed.link.on_local(local, answer)
        elif kind == Left.KIND:
            self.recovery.on_left(local, Left.from_wire(body))
        elif kind == RoundFailed.KIND:
            self.recovery.on_round_failed(local, RoundFailed.from_wire(body))
        elif kind == FireNode.KIND:   # a test's fault on this whole node (faultinject/inject.py)
            if (fault := self._answer(local, FireNode, body)) is not None:
                self.faults.fire_node(fault)
        elif kind == InjectSpare.KIND:   # ... on a spare node: passed on to its agent (``_on_inject`` there)
            if (ask := self._answer(local, InjectSpare, body)) is not None:
                self.peers.send(ask.node, Inject.KIND, Inject(ask.node, ask.fault).to_wire())
        elif kind == Trained.KIND:   # training rank 0 completed the run (worker/context.py)
            # a malformed one ends the run all the same (said): the kind is what counts, its steps are information
            done = self._answer(local, Trained, body) or Trained()
            self.cp.finish(Finished(done.steps))
        elif kind == AbortAsk.KIND:  # an error in the user's code: the whole job stops (every agent is told)
            from ..errors import JobAborted

            # a malformed one stops the job all the same (said): the kind is what counts
            ask = self._answer(local, AbortAsk, body) or AbortAsk(f"(a malformed abort message: {body!r:.200})")
            self.cp.abort(ask.error)
            raise JobAborted(f"training process {local} failed: {ask.error}")
        elif kind == "closed" and self.state not in (NodeState.DONE, NodeState.SAVED):
            pass  # the supervisor reports the exit itself (with its status)

    def _answer(self, local: int, cls, body: dict):
        """A training process's message read into ``cls``; None for a malformed one, dropped and said
        (``bad_message``; a pre-flight answer's process then counts as not answering)."""
        try:
            return cls.from_wire(body)
        except ValueError as exc:
            self.log.emit("bad_message", kind=cls.KIND, local=local, error=str(exc)[:300])
            return None

    def _layout(self, local: int, msg: Layout) -> None:
        from ..ipc.shm import SharedBuffer
        from ..replica.snapshot import StateLayout, slot_pair
        from ..replica.replicator import Replicator

        nbytes = msg.nbytes
        # (dtype name, shape) pairs: the layout needs no torch (the agent imports it only after spawning its ranks)
        layout = StateLayout(msg.tensors, msg.rng_nbytes, msg.local_nbytes)
        if layout.nbytes != nbytes:
            raise ValueError(f"training process {local} sent a layout of {layout.nbytes} bytes but asked for {nbytes}")
        if local in self.reps:   # a fresh process of a node back in the spare pool: its slots and server are kept
            old = self.layouts_seen[local]
            shape = lambda x: (x.dtype_names, [list(d) for d in x.shapes], x.rng_nbytes, x.local_nbytes)  # noqa: E731
            if shape(old) != shape(layout) or len(self.bufs[local]) != msg.count:
                raise ValueError(f"training process {local} of the returned node sent another layout than before")
            self.layouts[local] = old
            self.desk.attach(local, self.reps[local])   # its committed word goes to the new process's page
            self.channel.send(local, Slots.KIND, Slots(nbytes, len(self.bufs[local]), bell=True).to_wire(),
                              fds=[b.fd for b in self.bufs[local]] + [self.desk.bell.fd])
            return
        bufs = [SharedBuffer.create(nbytes, name=f"deadpool-slot{local}") for _ in range(msg.count)]
        self.bufs[local] = bufs
        self.layouts[local] = self.layouts_seen[local] = layout
        self.reps[local] = Replicator(self.cp.secret, layout, self.log, sock=self.listeners[local],
                                      transport=self.transport,
                                      timeout=self.cfg.timeouts.collective_timeout, own=slot_pair(bufs))
        self.reps[local].restore_send_hook = self._restore_send_hook
        self.reps[local].receive_hook = self._receive_hook
        self.desk.attach(local, self.reps[local])   # its update waits for the committed word (agent/desk.py)
        self.channel.send(local, Slots.KIND, Slots(nbytes, len(bufs), bell=True).to_wire(),
                          fds=[b.fd for b in bufs] + [self.desk.bell.fd])

    def configure(self, local: int) -> None:
        """Point local rank ``local``'s Replicator at the current generation: its rank, its holders, whom it holds."""
        cfg, P, r = self.cfg, self.P, self.cp.train_rank(local)
        k = cfg.replica_holders
        rep = self.reps[local]
        if r is None or k <= 0:
            rep.configure(self.cp.generation, r, [], [])
            return
        addr = lambda t: self.replica_address(self.cp.assignment[t])  # noqa: E731
        rep.configure(self.cp.generation, r, [addr(h) for h in holders_of(r, P, cfg.layout.nodes, k)],
                      held_by(r, P, cfg.layout.nodes, k))
        self.committed_seen[local] = -1

    def replica_address(self, proc: int) -> list:
        """Where virtual process ``proc``'s replica server listens."""
        return self.cp.idents[proc // self.P]["replica"][proc % self.P]

    def view(self) -> View:
        """The generation's layout, which a Train or Spare role carries (fault targets, the summary)."""
        return View(self.cp.generation, tuple(sorted({m // self.P for m in self.cp.assignment})),
                    tuple(self.cp.spare_nodes))

    def send_role(self, local: int, role) -> None:
        """Tell training process ``local`` its next role (ipc/messages.py: Train, Spare, Exit, Finish)."""
        self.channel.send(local, role.KIND, role.to_wire())

    def retarget_ring_link(self) -> None:
        """Point the ring link at this agent's ring neighbours among the live agents."""
        self.ring_link.retarget(self.peers.alive(), {n: ident["watch"] for n, ident in enumerate(self.cp.idents)})

    def cut_to(self, step: int) -> None:
        """(agent/recovery.py) A decision's cut step: training resumes from it, so each local rank's last snapshot
        written counts as that step's. Mid-round, before the round's waits: a round that fails later keeps it."""
        self.written.update((lo, step) for lo in list(self.written))

    def _on_written(self, local: int, step: int) -> None:
        """(desk thread) Training process ``local`` wrote its snapshot of ``step`` in the current generation."""
        self.written[local] = step
        if self.swaps.current is not None:
            self.channel.wake()   # a planned swap waits for this step: the main loop looks (PlannedSwaps)

    # ---- what planned swaps use (agent/planned.py SwapHost) ----------------------------------------------------
    def in_recovery(self) -> bool:
        """A failure is being handled, or a recovery round runs."""
        return self.cp.failure.is_set() or self.recovery.in_round

    def signal_local(self, local: int, sig: int) -> bool:
        """Send ``sig`` to training process ``local`` if it is alive; whether it was sent."""
        if local not in self.sup.alive():
            return False
        os.kill(self.sup.procs[local].pid, sig)
        return True

    # ---- failures --------------------------------------------------------------------------------------------
    def _exited(self, local: int, rc: int, starting: bool) -> None:
        """The evidence of training process ``local``'s exit, in a ``process_exited`` event: its status (code, or
        the signal's name), its training rank and last step, the last lines of its stderr (waited for at most
        STDERR_WAIT_S: what it wrote last may still be in the pipe)."""
        page = self.channel.progress(local)
        self.log.emit("process_exited", generation=self.cp.generation, local=local, rank=self.cp.train_rank(local),
                      pid=self.sup.procs[local].pid, rc=rc, signal=signal_name(rc),
                      step=page.step if page is not None else None, during_start_up=starting,
                      stderr_tail=self.sup.stderr_tail(local, STDERR_WAIT_S))

    def _work_failure(self, local: int, rc: int) -> WorkFailure | None:
        """The record of training process ``local``'s end with status ``rc`` while it trained (its training rank,
        the step its progress page showed), for the crash-loop rule (control/crashloop.py); None for a spare's
        process or one that had not begun a step."""
        rank, page = self.cp.train_rank(local), self.channel.progress(local)
        if self.state != NodeState.TRAINING or rank is None or page is None or page.step is None:
            return None
        return WorkFailure(rank=rank, step=page.step, end=end_of(rc), node=self.node, generation=self.cp.generation,
                           t=time.time())

    @property
    def exiting(self) -> bool:
        """This node failed and ``run`` has not acted on it yet (``pending_exit``): a wait that ticks stops early."""
        return self.pending_exit is not None

    def node_failed(self, reason: str, cause: str = "other", work: WorkFailure | None = None) -> None:
        """A training process of this node exited or froze: the node is lost (spares are nodes). Tell every agent,
        end the node's processes, and record the exit (``pending_exit``): the agent leaves (Fenced, raised by
        ``run`` at the top of its loop: exit 1), or, when the node may come back (agent/comeback.py: an exit or a
        hang past the start-up), it returns to the spare pool. Returns; the caller stops what it was doing. A second
        failure while one is pending is not declared again. ``work``: how a training process ended, which travels
        with the notice (the crash-loop rule's record)."""
        if self.pending_exit is not None:
            return
        self.log.emit("node_failed", reason=reason, cause=cause, generation=self.cp.generation,
                      **({"rank": work.rank, "step": work.step, "end": work.end} if work is not None else {}))
        self.log.sync()
        self.last_work_failure = work
        if self.comeback.allowed(cause):
            self.sup.kill_all(1.0)   # first: nothing of this node acts once the others go on without it
            for rep in self.reps.values():
                rep.quiesce()
            self.cp.declare_failed(reason, returning=True, work=work)
            self.pending_exit = PendingExit(reason, cause, returning=True)
            return
        self.cp.declare_failed(reason, work=work)
        self.sup.kill_all(1.0)
        self.transition(NodeState.DONE, f"this node failed ({cause})")
        self.pending_exit = PendingExit(reason, cause, returning=False)

    def _on_inject(self, body: dict) -> None:
        """(control thread) Training rank 0 asks this (spare) node to fire a fault on itself (``Inject``); a malformed
        ask is dropped and said (``bad_message``), never fired."""
        try:
            msg = Inject.from_wire(body)
        except ValueError as exc:
            self.log.emit("bad_message", kind=Inject.KIND, error=str(exc)[:300])
            return
        self.faults.on_message(msg)

    def _restore_send_hook(self, rank: int, step: int, sent: int, total: int) -> None:
        """(a restore's send thread, agent/recovery.py) A replica is sent only for a recovery's restore: halfway
        through one, the "restore" phase is reached (a fault planned there fires)."""
        if 2 * sent >= total:
            self.recovery.phase("restore")

    def _receive_hook(self, rank: int, step: int, received: int, total: int) -> None:
        """(a replica server thread) A piece of rank ``rank``'s replica arrived: its node's agent is alive, whatever
        its heartbeats say (control/peers.py, heard_from)."""
        try:
            self.peers.heard_from(self.cp.assignment[rank] // self.P)
        except (IndexError, TypeError):
            pass

    def finish(self) -> None:
        """The run is complete: tell the training processes, let them leave, leave."""
        self.peers.stop_watching()
        self.ring_link.enabled = False
        for local in self.sup.alive():
            self.send_role(local, Finish())
        end = time.monotonic() + self.cfg.timeouts.collective_timeout
        while self.sup.alive() and time.monotonic() < end:
            self._tick_quiet(0.02)
        self.sup.kill_all(1.0)
        self.transition(NodeState.DONE, "the run is complete")

    def _tick_quiet(self, timeout: float) -> None:
        self.channel.poll(timeout)
        self.sup.poll()
