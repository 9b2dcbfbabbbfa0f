"""The control plane: MPI bootstrap, failure detection, agreement and barriers among the node agents.

One MPI process per node: the node agent (deadpool_hpc/agent). MPI rank n *is* node n; the P training
processes of a node are "virtual processes" m = n * P + local, the ids the recovery decision works in
(agreement.decide: assignment, members, fenced). Owns: MPI initialisation (MPI_THREAD_MULTIPLE), the identity
exchange used for fencing and to reach each agent's servers, the control thread (peers.py: heartbeats, suspicion,
MPI messages), the recovery agreement, and barriers among the member agents of a generation. It does not own
process groups, replicas or training state: the node agent's recovery (agent/recovery.py) passes it a report and
applies the decision it returns.

After start-up nothing here is an MPI collective: a collective that includes a dead or frozen process never
returns on MPICH without ULFM (notes/ft-probes.md 2b), and ``MPI_Comm_create_group`` blocks the whole agent
thread when a member dies after reporting. Agreement and barriers are point-to-point
control messages; every wait has a deadline and watches the failure flag, and a failure at any moment of a
recovery starts the next round.

Split by role: the start-up's collectives in bootstrap.py, the recovery round (both sides, and the decision
applied) in round.py, the barriers in barrier.py; this module keeps the ControlPlane object, its state, and the
dispatch of the inbox (``pump``) into the tables those read.
"""
from __future__ import annotations

import os
import time

from ..errors import Fenced, JobAborted
from ..ids import Generation, LocalRank, NodeId, ProcId, Rank
from . import barrier as barriers
from . import bootstrap
from . import round as rounds
from .crashloop import WorkFailure
from .decision import Decision, RoundFailure, decision_from_wire
from .handlers import HandlerTable
from .membership import Membership, Readmit, on_readmit
from .messages import Abort, Collect, Fenced, Finished, Preempt, Ready, Report, Suspect, Sync
from .mpi import import_mpi, unlink_mpi_shm
from .peers import Peers
from .waker import Waker

# control-message kinds this module dispatches itself (``pump``), or the control thread consumes and never hands to
# the main thread (control/peers.py): a handler registered for one of them would never run, so ``on`` refuses it
OWN_KINDS = frozenset({Collect.KIND, Ready.KIND, "decision", Sync.KIND, Readmit.KIND, Finished.KIND, Abort.KIND,
                       Suspect.KIND, Preempt.KIND, Fenced.KIND, "inject"})


class ControlPlane:
    """One node agent's view of the job's membership.

    ranks_per_node (P) / active_nodes describe the initial layout: node n (MPI rank n) holds virtual processes
    n*P .. n*P+P-1. ``log`` is an EventLog. Times are seconds: heartbeat ``period`` and ``deadline``;
    ``ready_timeout`` (coordinator waiting for a live agent's report) and ``recovery_timeout`` (an agent waiting
    for a decision). ``replicas``: K, passed on to ``decide``. ``extra_identity``: more fields for this agent's
    identity record (e.g. its replica servers' addresses). ``handlers``: {kind: fn(src, body)} for control
    messages this module does not own, registered as by ``on`` (called from ``pump``, i.e. the agent's main thread);
    ``handlers`` stays readable afterwards (a read-only mapping, control/handlers.py). ``watch_k``: how many
    agents watch each agent's heartbeats (control/topology.py; 0: all-to-all). ``host``: the address other agents
    reach this one at (its wake-up bell, control/waker.py).
    """

    def __init__(self, *, secret: bytes, ranks_per_node: int, active_nodes: int, period: float, deadline: float,
                 log, ceiling: float = 4.0, settle: float = 0.02, ready_timeout: float = 60.0,
                 recovery_timeout: float = 120.0,
                 replicas: int = 1, extra_identity: dict | None = None, handlers: dict | None = None,
                 watch_k: int = 2, host: str = "127.0.0.1", crash_loop_limit: int = 0, admission=None):
        # admission: (a joined agent) its joining.Admission: no MPI at all, the node id, world size, view and identity
        # records are its sponsor's
        if admission is None:
            MPI = import_mpi()
            world = MPI.COMM_WORLD
            self.me, self.size = world.Get_rank(), world.Get_size()
        else:
            MPI = world = None
            self.me, self.size = admission.admit.node, admission.admit.size
        self.MPI = MPI
        self.world = world
        self.P = ranks_per_node
        self.log = log
        self.secret = secret
        self.settle = settle
        self.ready_timeout = ready_timeout
        self.recovery_timeout = recovery_timeout
        self.replicas = replicas
        self.crash_loop_limit = crash_loop_limit
        # every training process's end while it trained that this agent heard of, oldest first (its own node's, and
        # each other node's from its ``suspect`` notice): the crash-loop rule's input (crashloop.py). Appended by the
        # control thread, read by the main thread (a list append is atomic)
        self.work_failures: list[WorkFailure] = []
        self.ctrl = None
        if world is not None:
            for c in (MPI.COMM_SELF, world):
                c.Set_errhandler(MPI.ERRORS_RETURN)
            self.ctrl = world.Dup()
            self.ctrl.Set_errhandler(MPI.ERRORS_RETURN)
        # the generation's view (control/membership.py Membership), replaced whole by ``adopt``, its one writer;
        # ``generation``, ``assignment``, ``spare_nodes``, ``members`` and ``coordinator`` read it, and so does the
        # control thread (Peers.generation)
        self._membership = Membership.initial(ranks_per_node, active_nodes, self.size) if admission is None else \
            Membership(admission.admit.generation, admission.admit.assignment, admission.admit.spare_nodes,
                       admission.admit.members, admission.admit.coordinator)   # (a joined agent: its sponsor's view)
        # seconds the recovery's and the barriers' loops wait for a control message (or, through their ``wait``, a
        # local event) before they look again: an event ends the wait at once, so this only bounds the latency of
        # what rings nothing; shorter costs CPU in every agent of a large job at once. What a waiting agent
        # acts on all rings: a control message or a suspicion (the control thread's on_notice), a training process's
        # exit (its channel socket closes). At 0.1 s the 255 waiting agents of the 256-agent study spent about 1.3
        # s of CPU per second of recovery in these wake-ups, on the two cores the recovery itself needed
        self.poll_s = 1.0
        self.handlers = HandlerTable(reserved=OWN_KINDS)   # readable; ``on`` / ``off`` write it (control/handlers.py)
        for kind, fn in (handlers or {}).items():
            self.on(kind, fn)
        if admission is None:
            self.waker = Waker(host, secret)
            self.idents = bootstrap.exchange_identities(world, self.size, {**(extra_identity or {}),
                                                                           "wake": self.waker.address,
                                                                           "hb": self.waker.hb_address})
            unlink_mpi_shm()  # every agent is past MPI_Init: the exchange above was a collective over COMM_WORLD
            bootstrap.wire_up(MPI, (world, self.ctrl), self.me, self.size)   # no connection made mid-recovery
        else:
            self.waker = admission.waker
            self.idents = [dict(i) for i in admission.idents]
            self.idents[self.me] = dict(admission.identity)
        self._round = 0
        self._collects: dict[int, tuple] = {}        # coordinator MPI rank -> (its newest round id, its generation)
        self._ready: dict[tuple, dict[int, Ready]] = {}  # round id -> {MPI rank: its report}
        self._auto: dict[int, Ready] = {}              # MPI rank -> the report it sent unasked (its newest)
        # seconds a coordinator waits for the reports sent unasked before it asks the agents still missing
        # (``collect``): those the failure notice did not reach (a forwarder died unnoticed). Not sooner: at 256
        # agents on 2 cores the notice takes ~0.5 s to reach everyone, and a collect to an agent whose report is
        # on its way doubles the coordinator's load; at 0.5 s the coordinator of a freeze recovery was starved
        # so long that its own heartbeats stopped (it was suspected, a false failure)
        self.collect_after = 2.0
        self._decisions: dict[int, tuple[int, Decision | RoundFailure]] = {}
        self._sync: dict[str, set[int]] = {}
        self._finish: Finished | None = None
        self._abort: Abort | None = None
        self.first_suspicion: float | None = None
        self.on_member_lost = None  # on_member_lost(): a member of the current generation was suspected (any thread)
        self.pending_readmits: list = []   # Readmit messages of a generation not applied here yet (membership.py)
        self.readmitted = None             # the Readmit that brought this agent back into the spare pool
        log.emit("hello", mpi_rank=self.me, node=self.me, role="agent", **self.idents[self.me])
        self.peers = Peers(self.ctrl, secret, period, deadline, waker=self.waker,
                           wake_addresses=[ident["wake"] for ident in self.idents],
                           heartbeat_addresses=[ident["hb"] for ident in self.idents], on_suspect=self._on_suspect,
                           watch_k=watch_k, ceiling=ceiling, generation=lambda: self._membership.generation,
                           me=self.me, size=self.size)
        if admission is not None:   # its sponsor is its one link; it suspects whom its sponsor suspects
            self.peers.relays.join_through(admission.admit.coordinator, admission.link)
            for n, sponsor in admission.admit.routes.items():   # the other joined nodes (none of them sponsors it)
                self.peers.relays.route(n, sponsor)
            self.peers.rejoined(admission.admit.suspected)
            self.peers.notice_g = admission.admit.generation
        self.peers.on_preempt = self._on_preempt
        self.peers.on_probe = self._on_probe
        self.peers.on_work_failure = self._on_work_failure

    def start(self) -> None:
        """Start the control thread. From here on only it calls MPI (see peers.py). A joined agent (no MPI) waits
        for nobody."""
        if self.world is not None:
            self.world.Barrier()
        self.peers.start()   # every peer's heartbeat deadline counts from here (Peers.start)

    # ---- the generation's view (control/membership.py Membership): read here, replaced by ``adopt`` ---------------
    @property
    def membership(self):
        """This agent's view of its generation (a frozen Membership: generation, assignment, spare_nodes, members,
        coordinator). Replaced whole, never changed: a reader keeps a consistent view as long as it holds it."""
        return self._membership

    @property
    def generation(self) -> Generation:
        """The generation this agent has applied (0 at the start; each recovery's decision is the next). Read-only:
        ``adopt`` (and ``enter_generation``) replace it, and the control thread (``peers.generation``) reads this
        same value."""
        return self._membership.generation

    @property
    def assignment(self) -> tuple[ProcId, ...]:
        """The virtual process that holds each training rank (assignment[r]) in the current generation."""
        return self._membership.assignment

    @property
    def spare_nodes(self) -> tuple[NodeId, ...]:
        """The current generation's spare nodes (MPI ranks), in promotion order."""
        return self._membership.spare_nodes

    @property
    def members(self) -> tuple[ProcId, ...]:
        """The current generation's virtual processes (training and spare)."""
        return self._membership.members

    @property
    def coordinator(self) -> NodeId | None:
        """The MPI rank whose decision made the current generation (None before the first)."""
        return self._membership.coordinator

    def adopt(self, view) -> None:
        """Make ``view`` (a Membership) this agent's: a decision applied (control/round.py ``apply_decision``), a
        readmission (control/membership.py), a rejoin's view. The one writer of the view. Raises TypeError for
        anything but a Membership."""
        if not isinstance(view, Membership):
            raise TypeError(f"a control plane's view is a Membership, not {type(view).__name__}")
        self._membership = view

    def take_identity(self, node: NodeId, ident: dict) -> None:
        """Node ``node``'s identity record is ``ident`` from now on: a joined node's (control/joining.py), which
        takes a lost node's id. Its bell and heartbeat addresses go to the control thread."""
        self.idents[node] = ident
        self.peers.set_addresses(node, ident["wake"], ident["hb"])

    def enter_generation(self, g: Generation) -> None:
        """Make ``g`` this agent's generation, the rest of the view kept: a resume from a checkpoint of generation
        ``g - 1`` (agent/node.py). Raises ValueError for a negative or non-integer ``g``."""
        self.adopt(self._membership.replace(generation=g))

    def forget_rounds(self) -> None:
        """Drop what this control plane kept of rounds, decisions and barriers before its node failed (a rejoin,
        control/membership.py): the reports and collects seen, the decisions not applied, the barriers reached,
        the readmissions waiting for a generation, the first suspicion of the last failure."""
        self._collects, self._ready, self._auto, self._decisions, self._sync = {}, {}, {}, {}, {}
        self.pending_readmits = []
        self.first_suspicion = None

    def on(self, kind: str, handler) -> None:
        """Register ``handler(src, body)`` for control messages of ``kind`` (called from ``pump``, on the agent's main
        thread; ``src`` is the sender's MPI rank). Raises ValueError for a kind registered already (naming both
        handlers) or a kind this control plane handles itself (``OWN_KINDS``: such a handler would never run)."""
        self.handlers.on(kind, handler)

    def off(self, owner) -> list[str]:
        """Unregister every handler that is a method of ``owner`` (an object being replaced: the node agent's
        collaborators made anew for a returned node, agent/node.py). Returns the kinds unregistered."""
        return self.handlers.off(owner)

    # ---- bootstrap (every process alive: collectives are fine here; control/bootstrap.py) ---------------------
    def bcast_text(self, text: str | None, root: int = 0) -> str:
        """Broadcast a short text from ``root`` before ``start`` (all processes alive). No pickle. Raises
        RuntimeError in a joined agent (it has no MPI world)."""
        if self.world is None:
            raise RuntimeError("a joined agent has no MPI world to broadcast over")
        return bootstrap.bcast_text(self.world, self.me, text, root)

    # ---- roles ----------------------------------------------------------------------------------------------
    def procs(self, node: NodeId | None = None) -> list[ProcId]:
        """The virtual processes of ``node`` (default: this one)."""
        n = self.me if node is None else node
        return list(range(n * self.P, (n + 1) * self.P))

    def train_rank(self, local: LocalRank) -> Rank | None:
        """Training rank local process ``local`` of this node holds now, or None while the node is a spare."""
        try:
            return self.assignment.index(self.me * self.P + local)
        except ValueError:
            return None

    @property
    def member_nodes(self) -> list[NodeId]:
        """Agents (MPI ranks) of the current generation's members."""
        return sorted({m // self.P for m in self.members})

    @property
    def failure(self):
        """threading.Event set when a peer is suspected or a peer tears the generation down."""
        return self.peers.failure

    def _on_suspect(self, rank: int, reason: str, t: float, last_heard: float | None) -> None:
        if self.first_suspicion is None:
            self.first_suspicion = t
        if rank in self.member_nodes and self.on_member_lost is not None:
            self.on_member_lost()
        self.log.emit("suspect", t=t, generation=self.generation, suspect=rank, node=rank, reason=reason,
                      last_heard=last_heard)

    def _on_probe(self, event: str, **fields) -> None:
        self.log.emit(event, generation=self.generation, **fields)

    def _on_preempt(self, source: int) -> None:
        if source == self.me:  # the processes that got the signal say so; the others just follow
            self.log.emit("preempt_requested", generation=self.generation,
                          signal=getattr(self.peers, "preempt_by", None))

    def _on_work_failure(self, body) -> None:
        """(control thread) A ``suspect`` notice says how the node's training process ended (crashloop.py)."""
        try:
            self.work_failures.append(WorkFailure.from_wire(body))
        except ValueError as exc:
            self.log.emit("bad_message", kind="suspect", error=str(exc)[:300])

    def declare_failed(self, reason: str, last_heard: float | None = None, returning: bool = False,
                       work: WorkFailure | None = None) -> None:
        """This node failed (a training process exited or froze, its supervisor saw it): tell every live agent now,
        so they recover in milliseconds instead of after a heartbeat deadline, and wait (at most 1 s) for the
        notices to leave. The caller then ends its training processes and itself; or, ``returning`` (it ended them
        already), lives on to ask for its return to the spare pool (agent/comeback.py): the others then leave its
        agent alive (no fencing by pid) and let its ``rejoin`` through. ``work``: how its training process ended
        (rank, step, signal or code), for every agent's crash-loop rule (crashloop.py)."""
        if work is not None:
            self.work_failures.append(work)
        note = Suspect((self.me,), reason, time.time() if last_heard is None else last_heard, returning=returning,
                       work=None if work is None else work.to_wire())
        self.peers.disseminate(Suspect.KIND, note.to_wire())
        self.wait_sends(1.0)

    # ---- inbox ----------------------------------------------------------------------------------------------
    def pump(self, timeout: float = 0.0) -> None:
        """Move messages from the agent's inbox into per-kind tables. Raises JobAborted on ``abort``."""
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, src, body = self.peers.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if kind == Collect.KIND:
                c = Collect.from_wire(body)
                if c.g >= self.generation:  # a collect from before our last decision is stale
                    self._collects[src] = (c.round, c.g)
            elif kind == Ready.KIND:
                r = Ready.from_wire(body)
                if r.unasked:   # sent unasked, as soon as the sender began to recover
                    self._auto[src] = r
                else:
                    self._ready.setdefault(r.round, {})[src] = r
            elif kind == "decision":
                d = decision_from_wire(body)  # ValueError naming the bad key: a bug, not a fault to tolerate
                # it may come through a forwarder of the tree: the coordinator is the one that must be unsuspected
                self._decisions[d.generation] = (src if d.coordinator is None else d.coordinator, d)
            elif kind == Sync.KIND:
                self._sync.setdefault(Sync.from_wire(body).tag, set()).add(src)
            elif kind == Readmit.KIND:   # a node back in the spare pool (control/membership.py)
                msg = Readmit.from_wire(body)
                if msg.node == self.me:
                    self.readmitted = msg   # (agent/comeback.py takes it)
                else:
                    on_readmit(self, msg)
            elif kind == Finished.KIND:
                self._finish = Finished.from_wire(body)
            elif kind == Abort.KIND:
                self._abort = Abort.from_wire(body)
            elif kind in self.handlers:
                try:
                    self.handlers.dispatch(src, kind, body)   # typed, for a kind with a schema (control/handlers.py)
                except ValueError as exc:   # malformed: dropped, and said (the sender's bug, not a fault)
                    self.log.emit("bad_message", kind=kind, src=src, error=str(exc)[:300])
            timeout = 0.0
            deadline = time.monotonic()
        if self._abort is not None:
            raise JobAborted(f"MPI rank {self._abort.mpi_rank} aborted the job: {self._abort.error}")
        if self.peers.fenced:
            raise Fenced(self.peers.fenced)

    def finished(self) -> Finished | None:
        self.pump()
        return self._finish

    def finish(self, msg: Finished) -> None:
        """Tell every live process the run is over (they exit without recovering), and every returning one:
        ``msg`` (``steps``: the steps trained, when known)."""
        self.peers.stop_watching()
        self.peers.broadcast(Finished.KIND, msg.to_wire())
        self.tell_returning(Finished.KIND, msg.to_wire())
        self._finish = msg

    def abort(self, error: str) -> None:
        msg = Abort(error=error, mpi_rank=self.me).to_wire()
        self.peers.stop_watching()
        self.peers.broadcast(Abort.KIND, msg)
        self.tell_returning(Abort.KIND, msg)

    def tell_returning(self, kind: str, body: dict) -> None:
        """Send to every agent on its way back to the spare pool (it is still suspected: no broadcast reaches it)."""
        with self.peers.lock:
            back = list(self.peers.returning)
        for n in back:
            self.peers.send_to_suspect(n, kind, body)

    def wait_sends(self, timeout: float = 2.0) -> None:
        """Give queued sends a moment to leave before the process exits."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self.peers.sends_done():
            time.sleep(0.01)

    # ---- recovery (control/round.py) and barriers (control/barrier.py) ----------------------------------------
    def recover(self, report: dict[ProcId, Report], on_phase=None, wait=None, stop=None) -> Decision | None:
        """Agree on the next generation. Called by every live process after leaving the current one.

        report: {virtual process: Report} for this node's processes (control/messages.py; agreement.decide reads
        them). wait(seconds): block until then or until something happens (default: a control message;
        the node agent's also ends on a local event), so that the hundreds of agents of a large job do not all poll at
        once. stop(): checked after each wait; when true the round is left at once and None returned (the caller's
        own failure, seen while it waited: it acts on it). on_phase(name): called at "agree" (report sent, or reports
        asked for) and "decided" (fault injection for tests). Returns the Decision (with its coordinator and times
        filled in). Raises ReplicaError from ``decide`` (after telling the members), Fenced if the decision declares
        this process failed, JobAborted if another process aborted, RecoveryTimeout if no decision comes within
        ``recovery_timeout`` seconds, RunFinished if the run ended meanwhile.
        """
        return rounds.recover(self, report, on_phase=on_phase, wait=wait, stop=stop)

    def barrier(self, tag: str, participants: list[NodeId], timeout: float, tick=None, stop=None) -> bool:
        """Wait until every MPI rank in ``participants`` has reached the barrier ``tag`` (point-to-point
        messages, so a dead participant blocks nothing): True; False at once when ``stop()`` is true after a
        ``tick()`` (the caller's own failure). Raises PeerFailure when a participant is suspected, the failure flag
        is raised, or ``timeout`` seconds pass (naming who is missing)."""
        return barriers.barrier(self, tag, participants, timeout, tick=tick, stop=stop)

    def exit(self, code: int = 0) -> None:
        """Leave without MPI_Finalize (peers may be dead), after the queued control messages have left (a peer
        may still wait for them: the barrier of a checkpoint save, say)."""
        self.wait_sends()
        self.peers.stop()
        os._exit(code)
