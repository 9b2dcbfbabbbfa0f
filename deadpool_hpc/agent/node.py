"""The node agent: one per node, the only MPI process of its node, supervising the node's training processes.

Owns, for its node (DESIGN.md "Process tree"): the control plane among agents (heartbeats, agreement, fencing:
control/), the node's own snapshot slots (shared with its training processes, ipc/shm.py) and the replicas it
holds for other nodes (replica/transport.py: one Replicator per local rank), each generation's rendezvous (the
replicated key/value store its training processes use instead of a TCPStore, agent/store.py), and the
supervision of its P training processes (agent/supervisor.py: an exit is seen at once, a hang by its progress
page). Does not own: training (worker/), launching (launch/).

Detection paths (issue 7): a training process that exits or stops making progress makes its agent declare the
node failed to every agent at once (``suspect`` of itself) and end the node; an agent that dies is seen at once by
its ring neighbours (agent/watch.py); a node that freezes or loses power, by the heartbeats.

The loop (``run``) never blocks: each iteration it moves control messages (``ControlPlane.pump``), local channel
messages, supervisor and watch events, commits, and expires store waits. A recovery (``_recover``) is a series of
rounds; each waits only with deadlines and keeps ticking the loop's sources.
"""
from __future__ import annotations

import os
import signal
import time

from ..control.decision import Decision
from ..errors import STARTUP_FAILED_EXIT, Fenced, PeerFailure, RecoveryTimeout, RunFinished
from ..ipc.messages import LINK_GENERATION, Exit, Failure, Finish, Left, Restore, RoundFailed, Spare, Train, View
from ..ipc.shm import Doorbell
from ..placement import held_by, holders_of
from ..replica import persist
from ..rundir import latest_checkpoint
from .desk import SnapshotDesk
from .persister import Persister
from .planned import PlannedSwaps
from .preflight import HealthCheck, SpeedCheck, link_pair_of, link_request
from .store import GenerationStore

MAX_FAILED_ROUNDS = 8
STEADY_TICK_S = 0.05  # seconds between passes of the agent's loop when nothing happens (issue 7: idle CPU)
# the heartbeat deadline until this agent's training processes are up (agent/__main__.py sets it, ``_start`` puts
# the run's back): each agent imports torch then, and loading its libraries holds the GIL long enough on a busy
# node (seen: > 1 s on 2 shared cores) that its heartbeat thread fell silent and a live node was declared failed
STARTUP_HEARTBEAT_DEADLINE_S = 5.0


class NodeAgent:
    """One node's agent. ``cp``: its ControlPlane (started); ``channel``: its ChannelServer; ``supervisor``;
    ``watch``: its RingWatch; ``listeners``: one listening replica server socket per local rank, made by
    ``transport`` (replica/transports.py; None: TCP); ``log``: EventLog."""

    def __init__(self, cfg, cp, channel, supervisor, watch, listeners, log, injector, transport=None):
        self.cfg = cfg
        self.cp = cp
        self.channel = channel
        cp.peers.on_notice = channel.wake  # a control message or a suspicion ends the main loop's wait at once
        self.sup = supervisor
        self.watch = watch
        self.listeners = listeners
        self.transport = transport         # replica/transports.py (None: TCP)
        self.log = log
        self.faults = injector
        self.P = cfg.ranks_per_node
        self.node = cp.me
        self.reps: dict = {}               # local -> Replicator (once the training process sent its layout)
        self.layouts: dict = {}            # local -> StateLayout
        self.bufs: dict = {}               # local -> [SharedBuffer, SharedBuffer]
        self.committed_seen: dict = {}     # local -> last committed step seen (training makes progress)
        self.left: dict = {}               # local -> done_step, during a recovery
        self.round_failed = False
        self._in_round = False             # a recovery round runs (its own failure notices are answered in it)
        self.health = None                 # agent/health.py HealthWatch: detectors asking for a planned swap
        self.health_check = None           # agent/preflight.py HealthCheck: the site's check at start-up, until done
        self.written: dict = {}            # local -> step of the last snapshot it wrote into its slot
        self.swaps = PlannedSwaps(self)    # agent/planned.py: leaving on a detector's request, one node at a time
        self.stores: dict[int, GenerationStore] = {}
        self.kv_early: dict[int, list] = {}  # generation -> [(key, value)] broadcast before we had that store
        self.high_water = -1
        self.rounds = 0
        self.failed_rounds = 0
        self.state = "starting"
        self._preempt_ignored = False
        self._rebuilt_at = -1
        self.exit_code = 0
        self.checkpoint_dir = os.path.join(cfg.run_dir, "checkpoint")
        self.resume = latest_checkpoint(cfg.run_dir)  # a requeued attempt (the launchers clear a new run's)
        cp.handlers["kv"] = self._on_kv
        cp.handlers["link_ask"] = self._on_link_ask
        cp.on_member_lost = self._fail_stores
        cp.peers.on_inject = self._on_inject
        self.desk = SnapshotDesk(self, Doorbell.create())  # agent/desk.py: claim, written, committed, off this loop
        self.persister = Persister(self)   # agent/persister.py: every --persist-every s, the snapshots to disk
        self.speed = SpeedCheck(cp, channel, self.P, log, cfg.preflight_factor)   # agent/preflight.py
        # the store the pre-flight's link pairs meet through: every agent's, spares included (agent/preflight.py)
        self.link_store = GenerationStore(LINK_GENERATION,
                                          broadcast=lambda key, value: self._broadcast_kv(LINK_GENERATION, key, value))
        self._next_spare_check = float("inf")
        # an idle spare's link re-checks (_ask_spare_link): how many, the one under way, the training nodes whose
        # all-reduce with it failed since the last that passed; a training node's: each spare's last re-check's keys
        self._link_rechecks, self._link_asked, self._link_failed_with = 0, None, {}
        self._link_asks_from: dict[int, str] = {}

    # ---- the loop ------------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until the run ends for this node. Returns the exit code (0 done, 75 checkpoint saved: requeue)."""
        if self.resume is not None:
            self.cp.generation = self.cp.peers.generation = self.resume["generation"] + 1
            self.high_water = self.resume.get("high_water", -1)
        self._start()
        while self.state not in ("done", "saved"):
            # a local message, a training process's exit (its socket closes), a control message or a suspicion
            # (the heartbeat thread wakes the channel) end the wait at once; the rest (ring-watch connections,
            # replicas committed) is looked at each pass: every 5 ms while a failure is handled, else STEADY_TICK_S
            steady = not self.cp.failure.is_set() and not self.left and not self.round_failed
            self._tick(STEADY_TICK_S if steady else 0.005)
            if self.state in ("done", "saved"):
                break
            if self.cp.finished() is not None:
                self._finish()
                break
            if self.cp.peers.fenced:
                raise Fenced(self.cp.peers.fenced)
            if self.cp.peers.preempted.is_set() and self.state == "training" and not self.cfg.replicate:
                if not self._preempt_ignored:
                    self._preempt_ignored = True
                    self.log.emit("preempt_ignored", reason="--no-replicate: no snapshot to save")
            elif self.cp.peers.preempted.is_set() and self.state == "training":
                self.cp.failure.set()  # Slurm's warning (SIGUSR2/SIGTERM): agree on a cut, save it, requeue
            if self.cp.failure.is_set() or self.left or self.round_failed:
                self._recover()
        return self.exit_code

    def _tick(self, timeout: float = 0.0) -> None:
        """One pass over every source of events; returns within about ``timeout`` seconds."""
        self.cp.pump(0)
        for local, kind, body in self.channel.poll(timeout):
            self._on_local(local, kind, body)
        for local, rc in self.sup.poll():
            if rc == 0 and self.cp._finish is not None:
                continue  # the run is complete: training processes leave
            starting = rc == STARTUP_FAILED_EXIT or local not in self.layouts   # before it reached ctx.run
            self._node_failed(f"training process {local} (pid {self.sup.procs[local].pid}) exited with "
                              f"{'signal ' + signal.Signals(-rc).name if rc < 0 else 'code ' + str(rc)}"
                              + (" during its start-up" if starting else ""),
                              cause="startup_failed" if starting else "exit")
        frozen = self.swaps.frozen()  # stopped on purpose at a planned swap's boundary: not a hang
        armed = [lo for lo in range(self.P) if self.channel.progress(lo) is not None and self.channel.progress(lo).armed
                 and lo not in frozen]
        for local, stuck in self.sup.hung(armed):
            self.log.emit("hang_detected", generation=self.cp.generation, local=local, stuck_s=round(stuck, 3),
                          step=self.channel.progress(local).step, where=f"step {self.channel.progress(local).step}",
                          timeout_s=self.cfg.hang_timeout)
            self._node_failed(f"training process {local} made no progress for {stuck:.1f} s", cause="hang")
        for lost in self.watch.poll():
            self.cp.peers.suspect(lost, "its agent's watch connection closed (the process is gone)")
        for local, rep in self.reps.items():
            c = rep.committed_step
            if c > self.committed_seen.get(local, -1):
                self.committed_seen[local] = c
                self.failed_rounds = 0  # training makes progress again
        if self.swaps.current is not None:  # the desk wakes this loop at each snapshot written meanwhile
            for local in list(self.written):
                self.swaps.on_written(local)
        for st in self.stores.values():
            st.expire()
        self.link_store.expire()
        if self.health is not None:
            for name, verdict in self.health.pending():
                self.swaps.want(name, verdict, time.time())
        self.swaps.tick()
        self.persister.tick()
        if self.state == "spare" and self.cfg.spare_check_every:
            self._spare_check()

    # ---- start-up --------------------------------------------------------------------------------------------
    def _start(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout
        # every training process built its model and sent its layout, and the site's health check (if any) passed
        while not self._checked() or len(self.layouts) < self.P:
            self._tick(0.01)
            if time.monotonic() > deadline:   # a failure of this node like any other: a spare takes its place
                if not self._checked():
                    self.health_check.kill()
                    self._node_failed(f"the health check {self.cfg.health_check!r} was still running after "
                                      f"{self.cfg.startup_timeout:.0f} s (--startup-timeout)", cause="health_check")
                late = [lo for lo in range(self.P) if lo not in self.layouts]
                self._node_failed(f"training process(es) {late} did not reach ctx.run within "
                                  f"{self.cfg.startup_timeout:.0f} s (--startup-timeout)", cause="startup_timeout")
        if self.cfg.preflight_factor:   # links with the neighbour nodes, the timed matmul (agent/preflight.py)
            verdict = self.speed.at_startup(self._tick, deadline)
            if verdict:
                cause, why = verdict
                self._node_failed(f"pre-flight: {why}", cause=cause)
        self._next_spare_check = time.monotonic() + self.cfg.spare_check_every
        self.cp.peers.deadline = self.cfg.heartbeat_deadline   # (STARTUP_HEARTBEAT_DEADLINE_S until now)
        self.watch.retarget(self.cp.peers.alive(), self._watch_addresses())
        g = self.cp.generation
        self._store(g)
        for local in range(self.P):
            self._configure(local)
            r = self.cp.train_rank(local)
            role = Spare(self._view()) if r is None else \
                Train(self._view(), r, self.cfg.world_size, self.high_water, self.resume)
            self._send_role(local, role)
        self.state = "training" if self.cp.train_rank(0) is not None else "spare"

    def _checked(self) -> bool:
        """Whether the site's health check (agent/preflight.py) is done and passed; one that failed fails the node."""
        hc = self.health_check
        if hc is None:
            return True
        res = hc.poll()
        if res is None:
            return False
        rc, secs, tail = res
        self.health_check = None
        # seconds: from its start until this agent saw it end (its loop starts after the agent imported torch)
        self.log.emit("health_check", rc=rc, seconds=round(secs, 3), command=self.cfg.health_check, output=tail[-400:])
        if rc != 0:
            self._node_failed(f"the health check {self.cfg.health_check!r} exited with {rc} after {secs:.1f} s"
                              + (f": {tail[-200:]}" if tail else ""), cause="health_check")
        return True

    def _spare_check(self) -> None:
        """An idle spare checks itself again every --spare-check-every seconds (agent/preflight.py): the site's
        command, the timed matmul against the start-up's median and, once that passed, an all-reduce with a
        training node. One that fails leaves the pool (fenced, one spare fewer) now, not when a recovery promotes
        it. Never while a failure is handled."""
        if self.cp.failure.is_set() or self._in_round or self.left:
            return
        if self.speed.asked_at is None and self.health_check is None and self.speed.link.asked_at is None:
            if time.monotonic() < self._next_spare_check:
                return
            self._next_spare_check = time.monotonic() + self.cfg.spare_check_every
            if self.cfg.preflight_factor:
                self.speed.ask_local()   # then, once it passed, the link (not at once: the matmul is timed alone)
            if self.cfg.health_check:
                self.health_check = HealthCheck(self.cfg.health_check, self.sup.env, os.path.join(
                    self.sup.run_dir, f"health-check-node{self.node}.log"))
            return
        if self.speed.asked_at is not None:
            why = self.speed.spare_verdict()
            if why:
                self._node_failed(f"spare check: {why}", cause="preflight_slow")
            elif why == "":
                self._ask_spare_link()
        if self.speed.link.asked_at is not None and (res := self.speed.link.collect()) is not None:
            self._spare_link_verdict(res)
        if self.health_check is not None:
            self._checked()

    def _ask_spare_link(self) -> None:
        """An idle spare's link re-check (agent/preflight.py): an all-reduce with one training node, a different
        one each time, whose links work (it trains), so a failed one is this spare's. The training node's agent
        hands the request to its training processes (``link_ask``); their answer is for this spare only."""
        trainers = sorted(({m // self.P for m in self.cp.assignment} & set(self.cp.peers.alive())) - {self.node})
        if not trainers:
            return
        self._link_rechecks += 1
        n = self._link_rechecks
        q = trainers[n % len(trainers)]
        a, b = min(q, self.node), max(q, self.node)
        tag = f"r{n}/"
        # what the answer is judged against: a round or a new generation since makes it stale (the partner may be
        # the node that failed)
        self._link_asked = (q, f"link/{a}-{b}/{tag}", self.cp.generation, self.rounds)
        self.cp.peers.send(q, "link_ask", {"tag": tag, "a": a, "b": b})
        self.speed.link.ask(self.node, [(q, a, b)], tag)

    def _spare_link_verdict(self, res: dict) -> None:
        """Judge an idle spare's link re-check. Fenced (cause preflight_link) once its all-reduces with two
        different training nodes in a row failed, neither by the partner's own device: one failed link may still
        be that training node's (its gloo path broken while it trains over another); two are this spare's."""
        q, prefix, generation, rounds = self._link_asked
        self.link_store.drop(prefix)   # judged: its keys are not needed again (a week of re-checks would pile up)
        r = res.get(q, {})
        stale = (generation, rounds) != (self.cp.generation, self.rounds) or self.cp.peers.is_suspected(q) \
            or q not in {m // self.P for m in self.cp.assignment}
        self.log.emit("spare_link_checked", partner=q, stale=stale, **r)
        if stale or not r.get("seen"):
            return
        if r.get("ok"):
            self._link_failed_with.clear()
            return
        if r.get("partner_fault"):
            return
        self._link_failed_with[q] = r.get("error")
        if len(self._link_failed_with) >= 2:
            failed = "; ".join(f"node{n}: {e}" for n, e in self._link_failed_with.items())
            self._node_failed(f"spare check: its all-reduces with training nodes {sorted(self._link_failed_with)} "
                              f"failed in turn ({failed[:300]}); they train, so their own links work",
                              cause="preflight_link")

    def _on_link_ask(self, src: int, body: dict) -> None:
        """(the agent's loop, ``cp.pump``) An idle spare asks this training node's processes for an all-reduce with
        it. Not while a failure or a planned swap is handled: the spare's wait then ends unseen, nothing judged."""
        if self.cp.peers.fenced or self.state != "training" or self.cp.failure.is_set() or self._in_round \
                or self.swaps.current is not None:
            return
        try:
            a, b, tag = int(body["a"]), int(body["b"]), str(body["tag"])
        except (KeyError, TypeError, ValueError):
            return
        if {a, b} != {src, self.node}:
            return
        done = self._link_asks_from.get(src)
        if done is not None:
            self.link_store.drop(done)   # the spare's previous re-check is over: its keys go
        self._link_asks_from[src] = f"link/{a}-{b}/{tag}"
        for local in range(self.P):
            self.channel.send(local, "link", link_request(f"for{src}", self.node, [(src, a, b)], tag, local))

    def _end_spare_check(self) -> None:
        """Promoted: a re-check still under way no longer matters (the node passed the last one)."""
        self.speed.asked_at = None
        self.speed.link.asked_at = None
        if self.health_check is not None:
            self.health_check.kill()
            self.health_check = None

    def _on_local(self, local: int, kind: str, body: dict) -> None:
        if self.cp.peers.fenced:
            return
        st = self.stores.get(self.cp.generation)
        if kind.startswith("store_") and body.get("generation") == LINK_GENERATION:
            self.link_store.handle(local, kind, body, self.channel.send)   # the pre-flight's link pairs meet here
        elif kind.startswith("store_"):
            gen = body.get("generation")
            (self.stores.get(gen) or st or self._store(self.cp.generation)).handle(local, kind, body, self.channel.send)
        elif kind == "layout":
            self._layout(local, body)
        elif kind == "preflight":
            self.speed.on_local(local, body)
        elif kind == "link":
            self.speed.link.on_local(local, body)
        elif kind == Left.KIND:
            left = Left.from_wire(body)
            # a training process that left an older generation than ours is late: the round that generation's
            # failure started is over, and its "left" must not start another
            if self._in_round or left.generation >= self.cp.generation:
                self.left[local] = left.done_step
        elif kind == RoundFailed.KIND:
            failed = RoundFailed.from_wire(body)
            # only the newest generation's rebuild failing starts a round; one for a generation a round already
            # replaced (its failure is what that round handles) would start a round with nobody at fault
            if not self._in_round and failed.generation >= self.cp.generation:
                self.round_failed = True
            self.log.emit("recovery_round_failed", generation=self.cp.generation, local=local,
                          error=failed.error[:300])
        elif kind == "fault":
            self.faults.fire_node(body)
        elif kind == "inject_spare":
            self.cp.peers.send(int(body["node"]), "inject", body)
        elif kind == "finished":
            self.cp.finish({"steps": body.get("steps")})
        elif kind == "abort":  # an error in the user's code: the whole job stops (every agent is told)
            from ..errors import JobAborted

            self.cp.abort(str(body.get("error")))
            raise JobAborted(f"training process {local} failed: {body.get('error')}")
        elif kind == "closed" and self.state not in ("done", "saved"):
            pass  # the supervisor reports the exit itself (with its status)

    def _layout(self, local: int, body: dict) -> None:
        from ..ipc.shm import SharedBuffer
        from ..replica.snapshot import StateLayout, slot_pair
        from ..replica.transport import Replicator

        nbytes = int(body["nbytes"])
        # (dtype name, shape) pairs: the layout needs no torch (the agent imports it only after spawning its ranks)
        layout = StateLayout(body["tensors"], int(body["rng_nbytes"]), int(body.get("local_nbytes", 0)))
        if layout.nbytes != nbytes:
            raise ValueError(f"training process {local} sent a layout of {layout.nbytes} bytes but asked for {nbytes}")
        bufs = [SharedBuffer.create(nbytes, name=f"deadpool-slot{local}") for _ in range(int(body.get("count", 2)))]
        self.bufs[local] = bufs
        self.layouts[local] = layout
        self.reps[local] = Replicator(self.cp.secret, layout, self.log, sock=self.listeners[local],
                                      transport=self.transport,
                                      timeout=self.cfg.collective_timeout, own=slot_pair(bufs))
        self.reps[local].serve_hook = self._serve_hook
        # the training process's update waits for the committed word of its progress page (agent/desk.py)
        page = self.channel.progress(local)
        self.reps[local].on_commit = lambda g, step: page.put(page.COMMITTED, g, step)
        self.channel.send(local, "slots", {"nbytes": nbytes, "count": len(bufs), "bell": True},
                          fds=[b.fd for b in bufs] + [self.desk.bell.fd])

    def _configure(self, local: int) -> None:
        cfg, P, r = self.cfg, self.P, self.cp.train_rank(local)
        k = cfg.replica_holders
        rep = self.reps[local]
        if r is None or k <= 0:
            rep.configure(self.cp.generation, r, [], [])
            return
        addr = lambda t: self._replica_address(self.cp.assignment[t])  # noqa: E731
        rep.configure(self.cp.generation, r, [addr(h) for h in holders_of(r, P, cfg.nodes, k)], held_by(r, P, cfg.nodes, k))
        self.committed_seen[local] = -1

    def _replica_address(self, proc: int) -> list:
        return self.cp.idents[proc // self.P]["replica"][proc % self.P]

    def _view(self) -> View:
        """The generation's layout, which a Train or Spare role carries (fault targets, the summary)."""
        return View(self.cp.generation, tuple(sorted({m // self.P for m in self.cp.assignment})),
                    tuple(self.cp.spare_nodes))

    def _send_role(self, local: int, role) -> None:
        self.channel.send(local, role.KIND, role.to_wire())

    def _watch_addresses(self) -> dict:
        return {n: ident["watch"] for n, ident in enumerate(self.cp.idents)}

    # ---- the rendezvous store ------------------------------------------------------------------------------
    def _store(self, g: int) -> GenerationStore:
        if g not in self.stores:
            st = GenerationStore(g, broadcast=lambda key, value, g=g: self._broadcast_kv(g, key, value))
            for key, value in self.kv_early.pop(g, []):
                st.apply(key, value)
            self.stores = {gen: s for gen, s in self.stores.items() if gen >= g - 1}
            self.stores[g] = st
        return self.stores[g]

    def _broadcast_kv(self, g: int, key: str, value: bytes) -> None:
        """Carry a local ``set`` of generation ``g``'s store to the other agents that serve it: the generation's
        members; for the link store, the key's pair only (O(1) messages per node, not O(nodes))."""
        import base64

        body = {"g": g, "key": key, "value": base64.b64encode(value).decode()}
        if g == LINK_GENERATION:
            dests = set(link_pair_of(key) or self.cp.peers.alive())
        else:
            dests = set(self.cp.member_nodes)
        self.cp.peers.send_many(sorted(dests - {self.node}), "kv", body)   # encoded once; a suspected node skipped

    def _on_kv(self, src: int, body: dict) -> None:
        import base64

        g, key, value = int(body["g"]), body["key"], base64.b64decode(body["value"])
        if g == LINK_GENERATION:
            self.link_store.apply(key, value)
        elif g in self.stores:
            self.stores[g].apply(key, value)
        elif g > self.cp.generation - 1:
            self.kv_early.setdefault(g, []).append((key, value))

    def _fail_stores(self) -> None:
        """A member agent was lost (any thread): every rendezvous wait fails now, not at its timeout."""
        for st in list(self.stores.values()):
            st.fail_all("a member node was lost")

    # ---- failures --------------------------------------------------------------------------------------------
    def _node_failed(self, reason: str, cause: str = "other") -> None:
        """A training process of this node exited or froze: the node is lost (spares are nodes). Tell every agent,
        end the node's processes, and leave (raises Fenced, which ends the agent with exit 1)."""
        self.log.emit("node_failed", reason=reason, cause=cause, generation=self.cp.generation)
        self.log.sync()
        self.cp.declare_failed(reason)
        self.sup.kill_all(1.0)
        self.state = "done"
        raise Fenced(f"this node failed: {reason}")

    def _on_inject(self, body: dict) -> None:
        """(control thread) Training rank 0 asks this (spare) node to fire a fault on itself."""
        self.faults.on_message(body)

    def _serve_hook(self, rank: int, step: int, sent: int, total: int) -> None:
        """(replica server thread) A replica is pulled only by a recovery's restore: halfway through one, the
        "restore" phase is reached (a fault planned there fires). It does not wait for this agent to have read the
        decision itself: the puller may read it first and be served before."""
        if 2 * sent >= total:
            self._phase("restore")

    _serving: set = set()

    def _phase(self, name: str) -> None:
        if name == "decided" and self.faults.wants_phase(name, self.rounds):
            self.cp.wait_sends()  # a coordinator dies once its decision has reached the members
        self.faults.at_phase(name, self.rounds)

    # ---- recovery ---------------------------------------------------------------------------------------------
    def _recover(self) -> None:
        """Rounds until one succeeds; every wait has a deadline and keeps the loop's sources ticking."""
        self.swaps.suspend()  # a planned swap waiting for its boundary lets its stopped processes go
        t_fail = time.time()
        while True:
            self.rounds += 1
            self.failed_rounds += 1
            if self.failed_rounds > MAX_FAILED_ROUNDS:
                raise RecoveryTimeout(f"{MAX_FAILED_ROUNDS} recovery rounds in a row failed")
            try:
                self._in_round = True
                try:
                    self._round(t_fail)
                finally:
                    self._in_round = False
                return
            except RunFinished:
                self._finish()
                return
            except PeerFailure as exc:
                self.log.emit("recovery_round_failed", generation=self.cp.generation, round=self.rounds,
                              error=str(exc)[:300])

    def _round(self, t_fail: float) -> None:
        g0 = self.cp.generation
        self.round_failed = False
        self._fail_stores()
        for local in self.sup.alive():
            self.channel.send(local, Failure.KIND, Failure(g0).to_wire())
        # every live training process leaves the generation and says how far it got (bounded: a stuck one is
        # found by its progress page, the wait by the ready timeout)
        end = time.monotonic() + self.cfg.ready_timeout
        while any(lo not in self.left for lo in self.sup.alive()):
            self._tick(0.005)
            if time.monotonic() > end:
                self._node_failed(f"training process(es) {[lo for lo in self.sup.alive() if lo not in self.left]} "
                                  f"did not leave the failed generation within {self.cfg.ready_timeout:.0f} s")
        for rep in self.reps.values():
            rep.quiesce()
        # a claim waiting for a slot belongs to the failed generation: granted after the resume, it would hold the
        # own slots for a copy nobody makes (the training process dropped it when it left)
        self.desk.drop_pending()
        report = {}
        for local, rep in self.reps.items():
            m = self.node * self.P + local
            report[str(m)] = dict(rep.report(), done_step=self.left.get(local, -1),
                                  start_step=self.resume["step"] if self.resume else 0)
        self._phase("detect")
        decision = self.cp.recover(report, on_phase=self._phase, wait=self._tick)
        g = decision.generation
        self.high_water = max(self.high_water, decision.high_water)
        self.left = {}
        self.written = {lo: decision.cut_step for lo in list(self.written)}  # training resumes from the cut
        if decision.reason == "rebuild":  # collectives timed out with nobody at fault
            if decision.cut_step == self._rebuilt_at:
                raise RecoveryTimeout(
                    f"collectives at step {decision.cut_step} timed out twice ({self.cfg.wait_timeout:.0f} s) with "
                    f"no process at fault: a rank's step takes longer than that (raise --collective-timeout and "
                    f"--hang-timeout above your longest step), or the network is wedged")
            self._rebuilt_at = decision.cut_step
        if decision.exhausted:
            self._save_checkpoint(decision)
            return
        ranks = {local: self.cp.train_rank(local) for local in range(self.P)}
        self.watch.retarget(self.cp.peers.alive(), self._watch_addresses())
        if ranks[0] is None:  # still a spare
            for local in range(self.P):
                self._configure(local)
                self._send_role(local, Spare(self._view()))
            self.state = "spare"
            return
        self._end_spare_check()
        self._serving = {r for r, src in decision.sources.items() if src // self.P == self.node}
        slots = {}
        for local, r in ranks.items():
            src = decision.sources.get(r)
            rep = self.reps[local]
            if r in decision.fresh:
                slot = None   # a fresh start: the training process takes its own initial state
            elif src is not None:
                slot = rep.fetch(self._replica_address(src), r, decision.cut_step, self.cp.failure,
                                 self.cfg.wait_timeout)
            else:
                slot = rep.own.get(decision.cut_step)
            slots[local] = slot
        trainers = sorted({decision.assignment[r] // self.P for r in range(self.cfg.world_size)})
        self.cp.barrier(f"rebuild{g}.{decision.coordinator}", trainers, self.cfg.rendezvous_timeout,
                        tick=self._tick)
        self._phase("rebuild")
        self._store(g)
        for local, r in ranks.items():
            rep, slot = self.reps[local], slots[local]
            self._configure(local)  # keeps the restore slot (its rank is r); pushes start with the next claim
            plan = Restore(
                cut_step=decision.cut_step, slot=-1 if slot is None else rep.own.slots.index(slot),
                crc=0 if slot is None else slot.crc, fresh=slot is None,
                # pulled: fetched (this round for decision.sources, or an earlier round of this recovery): no kept
                # shares in the slot
                pulled=slot is not None and slot.pulled, promoted=r in decision.promoted,
                serving=bool(self._serving), recomputed_steps=decision.recomputed_steps,
                failed_nodes=tuple(decision.failed_nodes), round=self.rounds, t_fail=t_fail, t_agreed=time.time())
            self._send_role(local, Train(self._view(), r, self.cfg.world_size, self.high_water, self.resume, plan))
        self.state = "training"

    def _save_checkpoint(self, decision: Decision) -> None:
        """No spare left, or preempted: write every shard of the cut step this node holds (its ranks' own, and the
        lost ranks whose source it is), wait for every member agent, commit LATEST (each member does: the
        coordinator may die right here), tell the training processes to leave with 75 (requeue)."""
        cut, g = decision.cut_step, decision.generation
        self.persister.quiesce()   # a background write of an older step must not race this one
        if decision.fresh:
            # lost before any rank trained a step: some rank's state is only its initial one, rebuilt by a new attempt
            # (from step 0, or the checkpoint this attempt resumed from): nothing new to save
            if self.node == decision.coordinator:
                self.log.emit("checkpoint_skipped", step=cut, generation=g, reason=decision.reason, fresh=list(decision.fresh),
                              why=f"no rank has trained a step yet: a new attempt starts again from step {cut}"
                                  + (" (the checkpoint this attempt resumed from)" if self.resume else ""))
            return self._leave_for_requeue()
        import torch

        for local, rep in self.reps.items():
            r = self.cp.train_rank(local)
            mine = []
            if r is not None and r not in decision.sources:
                mine.append((r, rep.own.get(cut)))
            for rr, src in decision.sources.items():
                if src == self.node * self.P + local:
                    mine.append((rr, rep.held(rr).get(cut)))
            layout = self.layouts[local]
            shard = [torch.empty(shape, dtype=dtype) for shape, dtype in zip(layout.shapes, layout.dtypes)]
            for rank, slot in mine:
                rng = layout.read(slot, shard)
                kept = None
                if layout.local_nbytes:
                    # a replica carries no share of the data-parallel state (worker/protect.py): the lost rank's
                    # share is the one this rank kept for it, in its own snapshot of the cut step; the other shares
                    # of the saved local prefix are not the lost rank's, and a snapshot that is itself a fetched
                    # replica (Slot.pulled) kept none (the record says which are)
                    n = layout.local_nbytes // shard[0].numel()   # the shares: equal uint8 tensors
                    kept = [not slot.pulled] * n
                    if rank != r:
                        own = rep.own.get(cut)
                        held = held_by(r, self.P, self.cfg.nodes, self.cfg.replica_holders)
                        shard[0].copy_(layout.views(own)[1 + held.index(rank)])
                        kept = [not own.pulled] + [False] * (n - 1)
                persist.save_shard(self.checkpoint_dir, cut, rank, shard, rng, kept=kept)
        self.cp.barrier(f"saved{g}.{decision.coordinator}", self.cp.member_nodes, self.cfg.collective_timeout,
                        tick=self._tick)
        persist.commit(self.checkpoint_dir, cut, self.cfg.world_size, g, self.high_water)
        if self.node == decision.coordinator:
            self.log.emit("checkpoint_saved", step=cut, generation=g, path=self.checkpoint_dir,
                          reason=decision.reason)
        self._leave_for_requeue()

    def _leave_for_requeue(self) -> None:
        for local in self.sup.alive():
            self._send_role(local, Exit(75))
        self.sup.wait_all(10.0)
        self.exit_code = 75
        self.state = "saved"

    def _finish(self) -> None:
        """The run is complete: tell the training processes, let them leave, leave."""
        self.cp.peers.stop_watching()
        self.watch.enabled = False
        for local in self.sup.alive():
            self._send_role(local, Finish())
        end = time.monotonic() + self.cfg.collective_timeout
        while self.sup.alive() and time.monotonic() < end:
            self._tick_quiet(0.02)
        self.sup.kill_all(1.0)
        self.state = "done"

    def _tick_quiet(self, timeout: float) -> None:
        self.channel.poll(timeout)
        self.sup.poll()
