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

Agreement (DESIGN.md "Recovery"), one *round*: a process that leaves its generation without having heard of the
failure disseminates ``teardown``. Every live process sends its report (``ready``) unasked to the coordinator,
the lowest-ranked live process in its view, as soon as it starts to recover, and again to a new coordinator if
that one is suspected. The coordinator asks only the processes whose report is still missing ``collect_after``
seconds into its round (``collect``, with a fresh round id: the failure notice may not have reached them), and
waits for every ``ready`` (a live process that does not answer within ``ready_timeout`` seconds has a stuck
training thread: it is suspected). Once all live processes have reported and no suspicion arrived for
``settle`` seconds, it takes the newest view among the reports (the assignment of the highest applied
generation: some members may have applied a decision others never received), runs ``agreement.decide``, and
disseminates ``decision`` down a binomial tree over the live agents (each agent
passes it on before reading it: O(log N) hops, no agent sends more than log2 N copies). If the coordinator is
suspected meanwhile, the next lowest takes over with a new round. A forwarder that dies unnoticed cuts its
subtree off this decision; its death is a failure, and the next round's decision reaches them. A process
accepts a decision newer than its generation from an unsuspected coordinator; if its waiting exceeds
``recovery_timeout`` it gives up with RecoveryTimeout (a clear exit, never a hang).
"""
from __future__ import annotations

import dataclasses
import json
import operator
import os
import time

import numpy as np

from ..errors import Fenced, JobAborted, PeerFailure, RecoveryTimeout, RunFinished
from ..process import fence as fencing
from .agreement import decide
from .crashloop import WorkFailure
from .decision import Decision, RoundFailure, decision_from_wire, from_int_runs, int_runs
from .handlers import HandlerTable
from .membership import Readmit, apply_pending, on_readmit, spares_of
from .mpi import import_mpi, unlink_mpi_shm
from .peers import Peers
from .waker import Waker

_HELLO_BYTES = 512
# control-message kinds this module dispatches itself (``pump``), or the control thread consumes and never hands to
# the main thread (control/peers.py): a handler registered for one of them would never run, so ``on`` refuses it
OWN_KINDS = frozenset({"collect", "ready", "decision", "sync", Readmit.KIND, "finish", "abort",
                       "suspect", "preempt", "fenced", "inject"})


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
                 log, ceiling: float = 4.0, settle: float = 0.02, ready_timeout: float = 60.0, recovery_timeout: float = 120.0,
                 replicas: int = 1, extra_identity: dict | None = None, handlers: dict | None = None,
                 watch_k: int = 2, host: str = "127.0.0.1", crash_loop_limit: int = 0):
        MPI = import_mpi()
        self.MPI = MPI
        world = MPI.COMM_WORLD
        self.world = world
        self.me = world.Get_rank()
        self.size = world.Get_size()
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
        for c in (MPI.COMM_SELF, world):
            c.Set_errhandler(MPI.ERRORS_RETURN)
        self.ctrl = world.Dup()
        self.ctrl.Set_errhandler(MPI.ERRORS_RETURN)
        self._generation = 0   # the one copy: ``generation`` reads it, ``enter_generation`` writes it, Peers reads it
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
        W = active_nodes * ranks_per_node
        self.assignment = list(range(W))
        self.spare_nodes = list(range(active_nodes, self.size))
        self.members = list(range(self.size * ranks_per_node))
        self.waker = Waker(host, secret)
        self.idents = self._exchange_identities({**(extra_identity or {}), "wake": self.waker.address,
                                                 "hb": self.waker.hb_address})
        unlink_mpi_shm()  # every agent is past MPI_Init: the exchange above was a collective over COMM_WORLD
        self._wire_up()
        self.coordinator: int | None = None  # of the last applied decision
        self._round = 0
        self._collects: dict[int, tuple] = {}        # coordinator MPI rank -> (its newest round id, its generation)
        self._ready: dict[tuple, dict[int, dict]] = {}  # round id -> {MPI rank: ready body}
        self._auto: dict[int, dict] = {}              # MPI rank -> the report it sent unasked (its newest)
        # seconds a coordinator waits for the reports sent unasked before it asks the agents still missing
        # (``collect``): those the failure notice did not reach (a forwarder died unnoticed). Not sooner: at 256
        # agents on 2 cores the notice takes ~0.5 s to reach everyone, and a collect to an agent whose report is
        # on its way doubles the coordinator's load; at 0.5 s the coordinator of a freeze recovery was starved
        # so long that its own heartbeats stopped (it was suspected, a false failure)
        self.collect_after = 2.0
        self._decisions: dict[int, tuple[int, Decision | RoundFailure]] = {}
        self._sync: dict[str, set[int]] = {}
        self._finish: dict | None = None
        self._abort: dict | None = None
        self.first_suspicion: float | None = None
        self.on_member_lost = None  # on_member_lost(): a member of the current generation was suspected (any thread)
        self.pending_readmits: list = []   # Readmit messages of a generation not applied here yet (membership.py)
        self.readmitted = None             # the Readmit that brought this agent back into the spare pool
        log.emit("hello", mpi_rank=self.me, node=self.me, role="agent", **self.idents[self.me])
        self.peers = Peers(self.ctrl, secret, period, deadline, waker=self.waker,
                           wake_addresses=[ident["wake"] for ident in self.idents],
                           heartbeat_addresses=[ident["hb"] for ident in self.idents], on_suspect=self._on_suspect,
                           watch_k=watch_k, ceiling=ceiling, generation=lambda: self._generation)
        self.peers.on_preempt = self._on_preempt
        self.peers.on_probe = self._on_probe
        self.peers.on_work_failure = self._on_work_failure

    def start(self) -> None:
        """Start the control thread. From here on only it calls MPI (see peers.py)."""
        self.world.Barrier()
        self.peers.start()   # every peer's heartbeat deadline counts from here (Peers.start)

    @property
    def generation(self) -> int:
        """The generation this agent has applied (0 at the start; each recovery's decision is the next). Read-only:
        ``enter_generation`` is its one writer, and the control thread (``peers.generation``) reads this same value."""
        return self._generation

    def enter_generation(self, g: int) -> None:
        """Make ``g`` this agent's generation: a decision applied (``_apply``), a readmission taken as this agent's
        own view (control/membership.py ``rejoin``), or a resume from a checkpoint of generation ``g - 1``
        (agent/node.py). Raises ValueError for a negative or non-integer ``g``."""
        try:
            n = operator.index(g)
        except TypeError:
            n = -1
        if isinstance(g, bool) or n < 0:
            raise ValueError(f"generation {g!r}: must be an integer >= 0")
        self._generation = n

    def on(self, kind: str, handler) -> None:
        """Register ``handler(src, body)`` for control messages of ``kind`` (called from ``pump``, on the agent's main
        thread; ``src`` is the sender's MPI rank). Raises ValueError for a kind registered already (naming both
        handlers) or a kind this control plane handles itself (``OWN_KINDS``: such a handler would never run)."""
        self.handlers.on(kind, handler)

    def off(self, owner) -> list[str]:
        """Unregister every handler that is a method of ``owner`` (an object being replaced: the node agent's
        collaborators made anew for a returned node, agent/node.py). Returns the kinds unregistered."""
        return self.handlers.off(owner)

    # ---- bootstrap (every process alive: collectives are fine here) ---------------------------------------
    def _exchange_identities(self, extra: dict) -> list[dict]:
        mine = json.dumps({**fencing.identity(), **extra}).encode()
        if len(mine) > _HELLO_BYTES:
            raise ValueError(f"identity record of {len(mine)} bytes exceeds {_HELLO_BYTES}")
        out = np.empty(_HELLO_BYTES * self.size, dtype=np.uint8)
        self.world.Allgather(np.frombuffer(mine.ljust(_HELLO_BYTES, b" "), dtype=np.uint8), out)
        return [json.loads(out[i * _HELLO_BYTES:(i + 1) * _HELLO_BYTES].tobytes()) for i in range(self.size)]

    def _wire_up(self) -> None:
        """Connect every pair of processes at start-up, so no connection is made mid-recovery."""
        MPI = self.MPI
        for comm in (self.world, self.ctrl):
            out = np.zeros(self.size, dtype=np.uint8)
            back = np.empty(self.size, dtype=np.uint8)
            reqs = []
            for p in range(self.size):
                if p != self.me:
                    reqs.append(comm.Irecv(back[p:p + 1], source=p, tag=3))
                    reqs.append(comm.Isend(out[p:p + 1], dest=p, tag=3))
            MPI.Request.Waitall(reqs)

    def bcast_text(self, text: str | None, root: int = 0) -> str:
        """Broadcast a short text from ``root`` before ``start`` (all processes alive). No pickle."""
        buf = np.zeros(1024, dtype=np.uint8)
        if self.me == root:
            raw = text.encode()
            buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        self.world.Bcast(buf, root=root)
        return buf.tobytes().rstrip(b"\0").decode()

    # ---- roles ----------------------------------------------------------------------------------------------
    def procs(self, node: int | None = None) -> list[int]:
        """The virtual processes of ``node`` (default: this one)."""
        n = self.me if node is None else node
        return list(range(n * self.P, (n + 1) * self.P))

    def train_rank(self, local: int) -> int | None:
        """Training rank local process ``local`` of this node holds now, or None while the node is a spare."""
        try:
            return self.assignment.index(self.me * self.P + local)
        except ValueError:
            return None

    @property
    def member_nodes(self) -> list[int]:
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
            self.log.emit("preempt_requested", generation=self.generation, signal=getattr(self.peers, "preempt_by", None))

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
        body = {"ranks": [self.me], "reason": reason, "returning": returning,
                "last_heard": time.time() if last_heard is None else last_heard}
        if work is not None:
            self.work_failures.append(work)
            body["work"] = work.to_wire()
        self.peers.disseminate("suspect", body)
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
            if kind == "collect":
                if int(body["g"]) >= self.generation:  # a collect from before our last decision is stale
                    self._collects[src] = (body["round"], int(body["g"]))
            elif kind == "ready":
                if body["round"][0] == "auto":   # sent unasked, as soon as the sender began to recover
                    self._auto[src] = body
                else:
                    self._ready.setdefault(tuple(body["round"]), {})[src] = body
            elif kind == "decision":
                d = decision_from_wire(body)  # ValueError naming the bad key: a bug, not a fault to tolerate
                # it may come through a forwarder of the tree: the coordinator is the one that must be unsuspected
                self._decisions[d.generation] = (src if d.coordinator is None else d.coordinator, d)
            elif kind == "sync":
                self._sync.setdefault(body["tag"], set()).add(src)
            elif kind == Readmit.KIND:   # a node back in the spare pool (control/membership.py)
                msg = Readmit.from_wire(body)
                if msg.node == self.me:
                    self.readmitted = msg   # (agent/comeback.py takes it)
                else:
                    on_readmit(self, msg)
            elif kind == "finish":
                self._finish = body
            elif kind == "abort":
                self._abort = body
            elif kind in self.handlers:
                self.handlers[kind](src, body)
            timeout = 0.0
            deadline = time.monotonic()
        if self._abort is not None:
            raise JobAborted(f"MPI rank {self._abort.get('mpi_rank')} aborted the job: {self._abort.get('error')}")
        if self.peers.fenced:
            raise Fenced(self.peers.fenced)

    def finished(self) -> dict | None:
        self.pump()
        return self._finish

    def finish(self, body: dict) -> None:
        """Tell every live process the run is over (they exit without recovering), and every returning one."""
        self.peers.stop_watching()
        self.peers.broadcast("finish", body)
        self.tell_returning("finish", body)
        self._finish = body

    def abort(self, error: str) -> None:
        self.peers.stop_watching()
        self.peers.broadcast("abort", {"error": error, "mpi_rank": self.me})
        self.tell_returning("abort", {"error": error, "mpi_rank": self.me})

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

    # ---- recovery ---------------------------------------------------------------------------------------------
    def recover(self, report: dict, on_phase=None, wait=None) -> Decision:
        """Agree on the next generation. Called by every live process after leaving the current one.

        report: {str(virtual process): {"own_rank", "own", "held", "done_step"}} for this node's processes (see
        agreement.decide). wait(seconds): block until then or until something happens (default: a control message;
        the node agent's also ends on a local event), so that the hundreds of agents of a large job do not all poll at
        once. on_phase(name): called at "agree" (report sent, or reports asked for) and "decided" (fault injection
        for tests). Returns the Decision (with its coordinator and times filled in). Raises ReplicaError from
        ``decide`` (after telling the members), Fenced if the decision declares this process failed, JobAborted if another process aborted, RecoveryTimeout if no decision
        comes within ``recovery_timeout`` seconds, RunFinished if the run ended meanwhile.
        """
        on_phase = on_phase or (lambda _name: None)
        wait = wait or self.pump
        self.peers.failure.set()
        if self.peers.notice_g < self.generation:  # nobody told us: we are the first to leave this generation
            self.peers.disseminate("teardown", {"g": self.generation})
        end = time.monotonic() + self.recovery_timeout
        answered: dict[int, list] = {}
        my_round = None
        told = False
        auto_to = None
        while True:
            self.pump(0)
            if self._finish is not None:
                raise RunFinished("the run finished while this process was recovering")
            decision = self._take_decision()
            if decision is not None:
                break
            alive = self._coordinator_candidates()
            if alive[0] == self.me:
                if my_round is None:
                    my_round = self._start_round(alive)
                    if not told:
                        told = True
                        on_phase("agree")
                decision = self._coordinate(my_round, alive, report)
                if decision is not None:
                    break
            else:
                my_round = None
                if auto_to != alive[0]:   # report at once to the coordinator-to-be: no collect round trip
                    auto_to = alive[0]
                    self.peers.send(auto_to, "ready", self._ready_body(["auto", self.generation], report))
                    if not told:
                        told = True
                        on_phase("agree")
                for src, (rid, _g) in list(self._collects.items()):
                    if src in alive and answered.get(src) != rid:
                        self.peers.send(src, "ready", self._ready_body(rid, report))
                        answered[src] = rid
                        if not told:
                            told = True
                            on_phase("agree")
            if time.monotonic() > end:
                raise RecoveryTimeout(f"no decision for a generation after {self.generation} within "
                                      f"{self.recovery_timeout:.0f} s (coordinator: MPI rank {alive[0]})")
            # a coordinator re-checks its round at least every ``settle`` seconds; the others wait for a message
            wait(self.settle if alive[0] == self.me else self.poll_s)
        if isinstance(decision, RoundFailure):
            raise decision.exception()
        if set(self.procs()) & set(decision.fenced):
            raise Fenced(f"the decision for generation {decision.generation} (coordinator MPI rank "
                         f"{decision.coordinator}) declares this process failed")
        on_phase("decided")
        self._apply(decision)
        return decision

    def _coordinator_candidates(self) -> list[int]:
        """Live agents, in order: the first coordinates. (A node whose training process failed declares itself
        failed and leaves, so a coordinator is never on a node the decision fences.)"""
        return self.peers.alive()

    def _ready_body(self, rid, report: dict) -> dict:
        return {"round": rid, "report": report, "applied": self.generation, "assignment": int_runs(self.assignment),
                "spare_nodes": self.spare_nodes}   # the assignment as runs of ids: O(N) ids, a few runs

    def _start_round(self, alive: list[int]) -> tuple:
        """A new round with this agent as coordinator. The reports come unasked (``recover``); ``_coordinate``
        asks the agents still missing ``collect_after`` seconds from now."""
        self._round += 1
        rid = (self.me, self._round)
        self._round_t0 = time.monotonic()
        self._collected = False
        return rid

    def _take_decision(self) -> Decision | RoundFailure | None:
        """The newest decision for a generation after ours, from an unsuspected coordinator, naming us."""
        best = None
        for g, (src, d) in self._decisions.items():
            mine = set(self.procs())
            named = mine & set(d.members) or mine & set(d.fenced)
            if g > self.generation and not self.peers.is_suspected(src) and named:
                if best is None or g > best.generation:
                    best = d
        return best

    def _coordinate(self, rid: tuple, alive: list[int], report: dict) -> Decision | RoundFailure | None:
        ready = self._ready.setdefault(rid, {})
        if self.me not in ready:
            ready[self.me] = self._ready_body(list(rid), report)
        if self._auto:
            for src, body in self._auto.items():
                old = ready.get(src)
                if old is None or body["applied"] > old["applied"]:   # a newer report replaces an older one
                    ready[src] = body
            self._auto.clear()
        now = time.monotonic()
        if not self._collected and len(ready) < len(alive) and now - self._round_t0 >= self.collect_after:
            self._collected = True
            self.peers.send_many([p for p in alive if p not in ready], "collect",
                                 {"round": list(rid), "g": self.generation})
        if len(ready) < len(alive) and now - self._round_t0 <= self.ready_timeout:
            return None  # someone is missing for sure: the O(N) look below waits for the last report
        missing = [p for p in alive if p not in ready]
        if missing:
            if now - self._round_t0 > self.ready_timeout:
                for p in missing:
                    self.peers.suspect(p, f"no recovery report within {self.ready_timeout:.1f} s while its heartbeats "
                                          f"go on: its training thread is stuck")
            return None
        if now - self.peers.last_suspicion < self.settle:
            return None
        view = max((ready[n] for n in alive), key=lambda b: b["applied"])
        g = view["applied"] + 1
        P = self.P
        assignment = list(from_int_runs(view["assignment"], "a recovery report's assignment"))
        # a spare readmitted (control/membership.py) after some reports' view was taken is a spare all the same
        spare_nodes = spares_of(view["spare_nodes"], alive, assignment, P)
        in_job = set(assignment) | {n * P + i for n in spare_nodes for i in range(P)}
        failed = {m for n in range(self.size) if self.peers.is_suspected(n) for m in self.procs(n) if m in in_job}
        reports = {int(m): rep for n in alive for m, rep in ready[n]["report"].items()}
        try:
            decision = decide(generation=g, ranks_per_node=P, assignment=assignment,
                              spare_nodes=spare_nodes, failed=failed, reports=reports,
                              preempt=self.peers.preempted.is_set(), replicas=self.replicas,
                              work_failures=tuple(self.work_failures), crash_loop_limit=self.crash_loop_limit)
        except Exception as exc:  # tell everybody, then raise the same error everywhere
            decision = RoundFailure(generation=g, error=type(exc).__name__, message=str(exc),
                                    members=tuple(sorted(m for n in alive for m in self.procs(n))),
                                    failed_nodes=tuple(sorted({m // P for m in failed})))
        decision = dataclasses.replace(decision, coordinator=self.me, t_decided=time.time(),
                                       first_suspicion=self.first_suspicion)
        wire = decision.to_wire()
        self.peers.disseminate("decision", wire)   # down a tree over the live agents: O(log N) hops
        self._ready.pop(rid, None)
        self.log.emit("decision", **{k: wire.get(k) if k not in ("failed_nodes", "fresh") else list(getattr(decision, k, ()))
                                     for k in ("generation", "failed_nodes", "promoted", "replaced", "sources", "fresh",
                                               "cut_step", "exhausted", "reason", "recomputed_steps",
                                               "t_decided", "first_suspicion", "error", "message", "crash_loop")})
        return decision

    def _apply(self, decision: Decision) -> None:
        g = decision.generation
        self.assignment = list(decision.assignment)
        self.spare_nodes = list(decision.spare_nodes)
        self.members = list(decision.members)  # first: fencing the failed below is no loss of a member
        if decision.exhausted:   # no spare left: the checkpoint round must not lose a slow member's copies
            self.peers.last_resort = True
        for n in sorted({m // self.P for m in decision.fenced}):
            self.peers.suspect(n, "fenced by decision", notify=False)
            if n not in self.peers.returning:   # a returning agent ended its processes itself, and lives on
                fencing.fence(self.idents[n])
        self.coordinator = decision.coordinator
        self.enter_generation(g)
        self.first_suspicion = None
        apply_pending(self)   # nodes readmitted to this generation before its decision reached us
        self.peers.failure.clear()
        # a suspicion raised after the decision belongs to the next round (a preemption waits for the next
        # step boundary: Context._one_step)
        if any(self.peers.is_suspected(n) for n in self.member_nodes):
            self.peers.failure.set()
        self._decisions = {k: v for k, v in self._decisions.items() if k > g}
        # a report sent unasked before this decision belongs to a round now over
        self._auto = {src: b for src, b in self._auto.items() if b["applied"] >= g}
        # a collect sent from generation g already asks for the next round: keep it
        self._collects = {src: c for src, c in self._collects.items() if c[1] >= g}

    def barrier(self, tag: str, participants: list[int], timeout: float, tick=None) -> None:
        """Wait until every MPI rank in ``participants`` has reached the barrier ``tag`` (point-to-point
        messages, so a dead participant blocks nothing). Raises PeerFailure when a participant is suspected,
        the failure flag is raised, or ``timeout`` seconds pass (naming who is missing)."""
        for p in participants:
            if p != self.me:
                self.peers.send(p, "sync", {"tag": tag})
        end = time.monotonic() + timeout
        while True:
            self.pump(0.01)
            if tick is not None:
                tick()
            got = self._sync.get(tag, set()) | {self.me}
            missing = [p for p in participants if p not in got]
            if not missing:
                self._sync.pop(tag, None)
                return
            dead = [p for p in participants if self.peers.is_suspected(p)]
            if dead:
                raise PeerFailure(f"barrier {tag}: MPI rank(s) {dead} failed")
            if self.peers.failure.is_set():
                raise PeerFailure(f"barrier {tag}: a peer failed")
            if time.monotonic() > end:
                raise PeerFailure(f"barrier {tag}: MPI rank(s) {missing} did not arrive within {timeout:.1f} s")

    def exit(self, code: int = 0) -> None:
        """Leave without MPI_Finalize (peers may be dead), after the queued control messages have left (a peer
        may still wait for them: the barrier of a checkpoint save, say)."""
        self.wait_sends()
        self.peers.stop()
        os._exit(code)

