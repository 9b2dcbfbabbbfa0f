"""A node agent's recovery: the rounds after a failure, from the failure notice to its training processes to their
new roles (docs/architecture.md, "Recovery", and "One failure through the code").

Each round: tell the node's training processes (``Failure``) and wait until each has left the failed generation
(``Left``: how far it got); pause the replicas (``Replicator.quiesce``) and drop the desk's pending claims; report
to the coordinator and get the decision (``ControlPlane.recover``: control/plane.py, agreement.py); send the
replicas this node is the source of (``Replicator.send_restore``, on threads) and receive those of the ranks it takes
over (``expect_restore``, ``poll_restore`` between ticks: replica/restore.py); meet the new generation's other agents
(``ControlPlane.barrier``), open its store, and send each training process its role (``Train`` with a ``Restore``,
or ``Spare``: ipc/messages.py). A failure at any moment (``PeerFailure``) ends the round and starts the next;
``MAX_FAILED_ROUNDS`` in a row end the run. A training process whose join or restore fails says so
(``RoundFailed``), and the agent's loop starts another round. With no spare left, or preempted, the round saves a
persistent checkpoint at the cut step instead and tells the processes to leave with 75 (requeue); after a crash loop
(control/crashloop.py) the same checkpoint, and CRASH_LOOP_EXIT (never requeued).

Owns: the rounds' state (the processes' ``Left`` and ``RoundFailed``, the round count, the highest step any
process completed), the fault phases of a recovery (``phase``), the checkpoint of the no-spare path. Does not own:
the agreement (control/), the replicas (replica/replicator.py), the worker's half (worker/recovery.py).
Runs on the agent's main thread; uses the NodeAgent's public parts, listed in ``RecoveryHost`` (agent/node.py:
``tick``, ``node_failed``, ``configure``, ``view``, ``send_role``, ...), and returns how the recovery leaves the node
(``RecoveryEnd``: the agent's next state, agent/state.py, and its exit code) instead of writing them into the agent.
A failure of this node meanwhile (``node_failed``) is not raised through the round: it is recorded in the agent
(``exiting``), every wait of the round stops at it, and the round returns None (the agent's loop acts on it).
The checkpoint's shards are assembled by replica/persist.py ``assemble_shard``, as background persistence's are.
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from ..control.decision import Decision
from ..control.messages import Report
from ..errors import CRASH_LOOP_EXIT, CheckpointFailed, PeerFailure, RecoveryTimeout, ReplicaError, RunFinished
from ..ipc.messages import Exit, Failure, Left, Restore, RoundFailed, Spare, Train
from ..placement import held_by
from ..replica import persist
from ..rundir import latest_checkpoint
from .state import NodeState

MAX_FAILED_ROUNDS = 8
RESTORE_POLL_S = 0.005   # the restore's wait between two ticks of the agent's loop, seconds (its arrival ends it)


class RecoveryHost(Protocol):
    """What a recovery uses of its node agent (agent/node.py's NodeAgent is one). It writes nothing of the agent:
    the agent's state and exit code are ``run``'s result (``RecoveryEnd``), the snapshots written are set to the
    decision's cut step by the agent (``cut_to``), and a failure of this node is the agent's (``node_failed``,
    ``exiting``). The rest is calls on the agent's parts, listed with each member."""

    cfg: object              # RunConfig: ready_timeout, wait_timeout, rendezvous_timeout, collective_timeout,
    #                          world_size, nodes, replica_holders, run_dir, crash_loop_limit
    cp: object               # ControlPlane: generation, failure, recover(), barrier(), train_rank(local),
    #                          member_nodes, wait_sends()
    log: object              # EventLog
    faults: object           # NodeFaults (faultinject/inject.py): wants_phase(), at_phase(): faults planned at a phase
    P: int                   # ranks per node
    node: int                # this node's index
    resume: dict | None      # LATEST of the checkpoint this attempt resumed from (step, high_water), or None
    reps: dict               # local rank -> Replicator: quiesce(), report(), expect_restore(), poll_restore(),
    #                          send_restore(), own, held(rank)
    layouts: dict            # local rank -> StateLayout (read only)
    checkpoint_dir: str      # RUN_DIR/checkpoint
    sup: object              # Supervisor: alive(), wait_all(timeout)
    channel: object          # ChannelServer: send(local, kind, body) (the ``Failure`` notice)
    desk: object             # SnapshotDesk: drop_pending() (claims of the failed generation)
    rendezvous: object       # Rendezvous: fail_all(), open(generation)
    swaps: object            # PlannedSwaps: suspend() (a swap waiting for its boundary lets its processes go)
    spare_checks: object     # SpareChecks: end() (promoted: a re-check under way no longer matters)
    persister: object        # Persister: quiesce() (no background write races the no-spare checkpoint)

    exiting: bool            # this node failed (``node_failed``): every wait of the round stops, the round returns

    def tick(self, timeout: float = 0.0) -> None:
        """One pass over the agent's sources of events (every wait of a round keeps ticking)."""

    def node_failed(self, reason: str, cause: str = "other", work=None) -> None:
        """Declare this node failed: recorded (``exiting``), acted on by the agent's loop; the round stops."""

    def cut_to(self, step: int) -> None:
        """A decision's cut step: training resumes from it (each local rank's last snapshot written is that step)."""

    def configure(self, local: int) -> None:
        """Point local rank ``local``'s Replicator at the current generation."""

    def view(self):
        """The generation's layout (ipc/messages.py View) a Train or Spare role carries."""

    def send_role(self, local: int, role) -> None:
        """Tell training process ``local`` its next role (Train, Spare, Exit)."""

    def retarget_ring_link(self) -> None:
        """Point the ring link at this agent's ring neighbours among the live agents."""

    def replica_address(self, proc: int) -> list:
        """Where virtual process ``proc``'s replica server listens."""


class _RoundOver:
    """A send's failure flag: ``is_set()`` once a failure ends the round of ``generation``'s decision, or a newer
    decision replaced it (the control plane clears its flag when it applies one)."""

    def __init__(self, cp, generation: int):
        self.cp, self.generation = cp, generation

    def is_set(self) -> bool:
        return self.cp.failure.is_set() or self.cp.generation != self.generation


@dataclass(frozen=True)
class RecoveryEnd:
    """How a recovery leaves its node (``Recovery.run``'s result; the agent makes the move, agent/state.py):
    ``state`` TRAINING (it holds ranks of the new generation), SPARE, or SAVED (the checkpoint is saved and the
    training processes left: the agent leaves with ``exit_code``, 75 or CRASH_LOOP_EXIT); ``reason``: the
    ``agent_state`` event's."""

    state: NodeState
    reason: str
    exit_code: int | None = None


class Recovery:
    """The recovery state of one node agent (``agent``: its NodeAgent as far as a recovery needs it,
    ``RecoveryHost``). ``wanted()``: a training process asks for a round; ``run()``: rounds until one succeeds (from
    the agent's loop); ``forget()``: the node's processes were replaced (agent/comeback.py)."""

    def __init__(self, agent: RecoveryHost):
        self.agent = agent
        self.left: dict[int, int] = {}   # local -> done_step, during a recovery
        self.round_failed = False        # a training process's join or restore failed (RoundFailed)
        self.in_round = False            # a round runs (its own failure notices are answered in it)
        self.rounds = 0
        self.failed_rounds = 0
        self.rebuilt_at = -1             # the cut step of the last "rebuild" decision (nobody at fault)
        resume = agent.resume
        self.high_water = resume.get("high_water", -1) if resume is not None else -1

    # ---- from the agent's loop -----------------------------------------------------------------------------
    def wanted(self) -> bool:
        """Whether a training process left the generation, or failed to join the new one: a round must run."""
        return bool(self.left) or self.round_failed

    def processes_left(self) -> bool:
        """Whether a training process left the generation (``Left``) and no round took it up yet."""
        return bool(self.left)

    def forget(self) -> None:
        """The node's training processes were replaced (readmitted: ``NodeAgent.restart_as_spare``): what the old
        ones said (``Left``, ``RoundFailed``) and the rounds that failed in a row are forgotten."""
        self.left, self.round_failed, self.failed_rounds = {}, False, 0

    def progressed(self) -> None:
        """Training makes progress again (a replica was committed): the rounds that failed in a row start over."""
        self.failed_rounds = 0

    def on_left(self, local: int, left: Left) -> None:
        # a training process that left an older generation than ours is late: the round that generation's
        # failure started is over, and its "left" must not start another
        if self.in_round or left.generation >= self.agent.cp.generation:
            self.left[local] = left.done_step

    def on_round_failed(self, local: int, failed: RoundFailed) -> None:
        a = self.agent
        # only the newest generation's rebuild failing starts a round; one for a generation a round already
        # replaced (its failure is what that round handles) would start a round with nobody at fault
        if not self.in_round and failed.generation >= a.cp.generation:
            self.round_failed = True
        a.log.emit("recovery_round_failed", generation=a.cp.generation, local=local, error=failed.error[:300])

    def phase(self, name: str) -> None:
        """A phase of the current recovery is reached (a fault planned there fires: tests, demos)."""
        a = self.agent
        if name == "decided" and a.faults.wants_phase(name, self.rounds):
            a.cp.wait_sends()  # a coordinator dies once its decision has reached the members
        a.faults.at_phase(name, self.rounds)

    # ---- the rounds ----------------------------------------------------------------------------------------
    def run(self) -> RecoveryEnd | None:
        """Rounds until one succeeds; every wait has a deadline and keeps the loop's sources ticking. Returns how
        the recovery leaves the node (the agent moves to its state), or None when the run finished meanwhile (the
        agent finishes) or this node failed (the agent's ``exiting``: its loop acts on it)."""
        a = self.agent
        a.swaps.suspend()  # a planned swap waiting for its boundary lets its stopped processes go
        t_fail = time.time()
        while True:
            self.rounds += 1
            self.failed_rounds += 1
            if self.failed_rounds > MAX_FAILED_ROUNDS:
                raise RecoveryTimeout(f"{MAX_FAILED_ROUNDS} recovery rounds in a row failed")
            try:
                self.in_round = True
                try:
                    return self._round(t_fail)
                finally:
                    self.in_round = False
            except RunFinished:
                return None
            except PeerFailure as exc:
                a.log.emit("recovery_round_failed", generation=a.cp.generation, round=self.rounds,
                           error=str(exc)[:300])

    def _round(self, t_fail: float) -> RecoveryEnd | None:
        """One round: None when this node failed during it (``exiting``)."""
        a, cfg, P = self.agent, self.agent.cfg, self.agent.P
        g0 = a.cp.generation
        self.round_failed = False
        a.rendezvous.fail_all()
        for local in a.sup.alive():
            a.channel.send(local, Failure.KIND, Failure(g0).to_wire())
        # every live training process leaves the generation and says how far it got (bounded: a stuck one is
        # found by its progress page, the wait by the ready timeout)
        end = time.monotonic() + cfg.timeouts.ready_timeout
        while any(lo not in self.left for lo in a.sup.alive()):
            a.tick(0.005)
            if a.exiting:
                return None
            if time.monotonic() > end:
                a.node_failed(f"training process(es) {[lo for lo in a.sup.alive() if lo not in self.left]} "
                              f"did not leave the failed generation within {cfg.timeouts.ready_timeout:.0f} s")
                return None
        for rep in a.reps.values():
            rep.quiesce()
        # a claim waiting for a slot belongs to the failed generation: granted after the resume, it would hold the
        # own slots for a copy nobody makes (the training process dropped it when it left)
        a.desk.drop_pending()
        report = {}
        for local, rep in a.reps.items():
            m = a.node * P + local
            report[m] = Report.from_wire(dict(rep.report(), done_step=self.left.get(local, -1),
                                              start_step=a.resume["step"] if a.resume else 0))
        self.phase("detect")
        decision = a.cp.recover(report, on_phase=self.phase, wait=a.tick, stop=lambda: a.exiting)
        if decision is None:   # this node failed while it waited
            return None
        g = decision.generation
        self.high_water = max(self.high_water, decision.high_water)
        self.left = {}
        a.cut_to(decision.cut_step)   # training resumes from the cut
        if decision.reason == "rebuild":  # collectives timed out with nobody at fault
            if decision.cut_step == self.rebuilt_at:
                raise RecoveryTimeout(
                    f"collectives at step {decision.cut_step} timed out twice ({cfg.timeouts.wait_timeout:.0f} s) with "
                    f"no process at fault: a rank's step takes longer than that (raise --collective-timeout and "
                    f"--hang-timeout above your longest step), or the network is wedged")
            self.rebuilt_at = decision.cut_step
        if decision.exhausted:
            return self._save_checkpoint(decision)
        ranks = {local: a.cp.train_rank(local) for local in range(P)}
        for local, r in ranks.items():
            if r is not None and r in decision.sources:
                a.reps[local].expect_restore(r, decision.cut_step, g)
        self._send_restores(decision)
        a.retarget_ring_link()
        if ranks[0] is None:  # still a spare
            for local in range(P):
                a.configure(local)
                a.send_role(local, Spare(a.view()))
            return RecoveryEnd(NodeState.SPARE, f"recovery round {self.rounds}: a spare of generation {g}")
        a.spare_checks.end()
        is_source = any(src // P == a.node for src in decision.sources.values())
        slots = {}
        for local, r in ranks.items():
            if r in decision.fresh:
                slots[local] = None   # a fresh start: the training process takes its own initial state
            elif r in decision.sources:
                slots[local] = self._await_restore(a.reps[local], cfg.timeouts.wait_timeout)   # (expected above)
                if slots[local] is None:   # this node failed while it waited
                    return None
            else:
                slots[local] = a.reps[local].own.get(decision.cut_step)
        trainers = sorted({decision.assignment[r] // P for r in range(cfg.layout.world_size)})
        if not a.cp.barrier(f"rebuild{g}.{decision.coordinator}", trainers, cfg.timeouts.rendezvous_timeout,
                            tick=a.tick,
                            stop=lambda: a.exiting):
            return None
        self.phase("rebuild")
        a.rendezvous.open(g)
        for local, r in ranks.items():
            rep, slot = a.reps[local], slots[local]
            a.configure(local)  # keeps the restore slot (its rank is r); pushes start with the next claim
            plan = Restore(
                cut_step=decision.cut_step, slot=-1 if slot is None else rep.own.slots.index(slot),
                crc=0 if slot is None else slot.crc, fresh=slot is None,
                # from_replica: sent by its source (this round for decision.sources, or an earlier round of this
                # recovery): no kept shares in the slot
                from_replica=slot is not None and slot.from_replica, promoted=r in decision.promoted,
                is_source=is_source, recomputed_steps=decision.recomputed_steps,
                failed_nodes=tuple(decision.failed_nodes), round=self.rounds, t_fail=t_fail, t_agreed=time.time())
            a.send_role(local, Train(a.view(), r, cfg.layout.world_size, self.high_water, a.resume, plan))
        return RecoveryEnd(NodeState.TRAINING, f"recovery round {self.rounds}: training ranks of generation {g}")

    def _await_restore(self, rep, timeout: float):
        """The restore ``rep`` expects (``Replicator.poll_restore``), ticking the agent's loop meanwhile: a poll of
        up to ``RESTORE_POLL_S`` on the replica's own wake-up, then a tick, until it arrived or ``timeout`` seconds
        passed (PeerFailure, as ``wait_restore``'s). None once this node failed meanwhile (``exiting``). Raises what
        ``poll_restore`` raises (ReplicaError; PeerFailure: the transfer broke off, the failure flag, the deadline)."""
        a, since = self.agent, time.monotonic()
        while (slot := rep.poll_restore(a.cp.failure, since, timeout, RESTORE_POLL_S)) is None:
            a.tick(0.0)
            if a.exiting:
                return None
        return slot

    def _send_restores(self, decision: Decision) -> None:
        """Send every replica this node is the source of (``decision.sources``) to the process that restores it, one
        thread each: the sources do not wait for each other, nor this agent for them (the rebuild barrier comes after
        every restore arrived). A send that fails is logged; the restoring agent's wait raises, and its round fails."""
        a, P = self.agent, self.agent.P
        for r, src in sorted(decision.sources.items()):
            if src // P != a.node:
                continue
            to = a.replica_address(decision.assignment[r])
            threading.Thread(target=self._send_restore, args=(a.reps[src % P], to, r, decision),
                             name=f"deadpool-restore-rank{r}", daemon=True).start()

    def _send_restore(self, rep, to, r: int, decision: Decision) -> None:
        a = self.agent
        try:
            rep.send_restore(to, r, decision.cut_step, decision.generation, _RoundOver(a.cp, decision.generation),
                             a.cfg.timeouts.wait_timeout)
        except (PeerFailure, ReplicaError) as exc:
            a.log.emit("restore_not_sent", rank=r, step=decision.cut_step, generation=decision.generation,
                       to=list(to), error=str(exc)[:300])

    # ---- no spare left, or preempted -----------------------------------------------------------------------
    def _save_checkpoint(self, decision: Decision) -> RecoveryEnd | None:
        """No spare left, or preempted: write every shard of the cut step this node holds (its ranks' own, and the
        lost ranks whose source it is), wait for every member agent, commit LATEST (each member does: the
        coordinator may die right here), tell the training processes to leave with 75 (requeue). None when this node
        failed meanwhile (``exiting``)."""
        a, cfg, P = self.agent, self.agent.cfg, self.agent.P
        cut, g = decision.cut_step, decision.generation
        a.persister.quiesce()   # a background write of an older step must not race this one
        if decision.fresh:
            # lost before any rank trained a step: some rank's state is only its initial one, rebuilt by a new attempt
            # (from step 0, or the checkpoint this attempt resumed from): nothing new to save
            if a.node == decision.coordinator:
                a.log.emit("checkpoint_skipped", step=cut, generation=g, reason=decision.reason,
                           fresh=list(decision.fresh),
                           why=f"no rank has trained a step yet: a new attempt starts again from step {cut}"
                               + (" (the checkpoint this attempt resumed from)" if a.resume else ""))
            self._crash_loop(decision, None)
            return self._leave_for_requeue(decision)
        written: list[int] = []

        if not self._on_disk(decision, "write", lambda: self._write_shards(decision, written), written):
            return None
        if not a.cp.barrier(f"saved{g}.{decision.coordinator}", a.cp.member_nodes, cfg.timeouts.collective_timeout,
                            tick=a.tick, stop=lambda: a.exiting):
            return None
        if not self._on_disk(decision, "commit",
                             lambda: persist.commit(a.checkpoint_dir, cut, cfg.layout.world_size, g, self.high_water),
                             []):   # every shard is written: another member's LATEST may name them, none is removed
            return None
        if a.node == decision.coordinator:
            a.log.emit("checkpoint_saved", step=cut, generation=g, path=a.checkpoint_dir, reason=decision.reason)
        self._crash_loop(decision, cut)
        return self._leave_for_requeue(decision)

    def _crash_loop(self, decision: Decision, saved: int | None) -> None:
        """(the coordinator, once the checkpoint of a "crash loop" decision is saved, or none was needed: ``saved``
        None) Say why the run stops: ``crash_loop`` with the loop, and ``error`` with the same line (the summary's
        errors, the console)."""
        a, loop = self.agent, decision.crash_loop
        if loop is None or a.node != decision.coordinator:
            return
        kept = f"checkpoint at step {saved} saved in {a.checkpoint_dir}" if saved is not None else \
            f"no checkpoint saved (no rank had trained a step: a new run starts again from step {decision.cut_step})"
        text = f"{loop.describe()}; {kept}"
        a.log.emit("crash_loop", generation=decision.generation, rank=loop.rank, end=loop.end, step=loop.step,
                   steps=list(loop.steps), nodes=list(loop.nodes), repeats=loop.repeats,
                   limit=a.cfg.comeback.crash_loop_limit, checkpoint_step=saved, error=text)
        a.log.emit("error", error=text)

    def _on_disk(self, decision: Decision, phase: str, fn, written: list[int]) -> bool:
        """Run ``fn`` (a write of the no-spare checkpoint) on a thread, the agent's loop ticking meanwhile, for at most
        the collective timeout. True once it is done; False when this node failed meanwhile (``exiting``: the wait
        stops, the write goes on on its thread). A write that fails or does not end in time ends the run
        (CheckpointFailed, which the agent reports as its ``error`` and the others are told to stop): the run needs
        this checkpoint now and there is none to go on without. What this node wrote of it is removed first; LATEST
        is left as it was."""
        a, cfg = self.agent, self.agent.cfg
        out: dict = {}

        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported below, on the loop
                out["error"] = exc
            out["done"] = True

        th = threading.Thread(target=run, name=f"checkpoint-{phase}", daemon=True)
        th.start()
        end = time.monotonic() + cfg.timeouts.collective_timeout
        while not out.get("done") and time.monotonic() < end:
            a.tick(0.02)
            if a.exiting:
                return False
        if out.get("done") and "error" not in out:
            return True
        reason = persist.failure_reason(out["error"], a.checkpoint_dir) if "error" in out else \
            f"the {phase} did not complete within {cfg.timeouts.collective_timeout:.0f} s (the file system does not " \
            "answer)"
        for rank in written:
            persist.discard_shard(a.checkpoint_dir, decision.cut_step, rank)
        latest = latest_checkpoint(cfg.output.run_dir)
        a.log.emit("checkpoint_failed", step=decision.cut_step, generation=decision.generation, phase=phase,
                   reason=reason, why=decision.reason, path=a.checkpoint_dir,
                   latest=None if latest is None else latest.get("step"))
        raise CheckpointFailed(
            f"the checkpoint of step {decision.cut_step} ({decision.reason}) could not be written to "
            f"{a.checkpoint_dir}: {reason}; the run ends here (" +
            (f"checkpoint/LATEST still names step {latest['step']}" if latest else "no complete checkpoint exists")
            + ")")

    def _write_shards(self, decision: Decision, written: list[int]) -> None:
        """Write every shard of the cut step this node holds (its ranks' own, the lost ranks whose source it is:
        ``persist.assemble_shard``); ``written`` gets each rank whose write began."""
        a, P = self.agent, self.agent.P
        cut = decision.cut_step
        for local, rep in a.reps.items():
            r = a.cp.train_rank(local)
            mine = []
            if r is not None and r not in decision.sources:
                mine.append((r, rep.own.get(cut)))
            for rr, src in decision.sources.items():
                if src == a.node * P + local:
                    mine.append((rr, rep.held(rr).get(cut)))
            layout, tensors = a.layouts[local], None   # (the tensors are reused for each shard of this rank)
            for rank, slot in mine:
                keeper = None if rank == r else functools.partial(self._kept_for, rep, r, rank, cut)
                shard = persist.assemble_shard(layout, slot, tensors, keeper)
                tensors = shard.tensors
                written.append(rank)
                persist.save_shard(a.checkpoint_dir, cut, rank, shard.tensors, shard.rng, kept=shard.kept)

    def _kept_for(self, rep, r: int, lost: int, cut: int) -> tuple:
        """Where rank ``r`` (local rank ``rep``'s) kept the share of the lost rank ``lost`` whose replica it holds:
        its own snapshot of step ``cut`` and that share's index among the snapshot's views (``assemble_shard``'s
        keeper). Raises ReplicaError when it has no snapshot of ``cut``."""
        cfg = self.agent.cfg
        return rep.own.get(cut), 1 + held_by(r, self.agent.P, cfg.layout.nodes, cfg.replica_holders).index(lost)

    def _leave_for_requeue(self, decision: Decision) -> RecoveryEnd:
        """The training processes leave and so does this agent: with 75 (requeue me), or CRASH_LOOP_EXIT after a
        crash loop (a requeue would resume into the same crash); the agent's exit code is the result's."""
        a = self.agent
        code = CRASH_LOOP_EXIT if decision.crash_loop is not None else 75
        for local in a.sup.alive():
            a.send_role(local, Exit(code))
        a.sup.wait_all(10.0)
        return RecoveryEnd(NodeState.SAVED, f"recovery round {self.rounds}: {decision.reason} at step "
                                            f"{decision.cut_step}: leaving with {code}", exit_code=code)
