"""The training process's half of a recovery: leave the failed generation, follow the agent's roles, join the new
generation and restore the cut step (docs/architecture.md, "One failure through the code").

``Recovery.recover`` (from the context's step loop or ``run``) drops the generation's process group, settles the
snapshot of the step it completed, and tells its agent how far it got (``Left``); then it waits for a ``Role``
(ipc/messages.py): ``Train`` joins the new generation through the agent-backed store (``_join``) and restores the
``Restore``'s slot, or the initial state at a fresh start; ``Spare`` waits for a promotion; ``Exit`` and
``Finish`` end it. A failure while it joins or restores ends that round (``RoundFailed``); the agent starts the
next. The agent's half is agent/recovery.py.

An object the ``Context`` (worker/context.py) holds: it owns the process's current role (so its rank and
generation), the steps up to which faults already fired (``high_water``), what it said when it left (answered to a
``Failure`` notice while it waits) and its exit code. Does not own the step loop (worker/context.py) nor the step's
order around the state (worker/steps.py), whose current step it sets after a restore.
"""
from __future__ import annotations

import os
import time

import torch

from ..dataplane.groups import release_free_memory
from ..errors import ChannelTimeout, PeerFailure, ReplicaError
from ..ipc.messages import Exit, Failure, Left, Role, RoundFailed, Spare, Train
from ..replica import persist
from ..replica.snapshot import Slot

# seconds a process leaving a failed generation waits for the snapshot of the step it completed (a copy into shared
# memory: GB/s): finished, the recovery can cut at that step instead of recomputing it (a planned swap relies on it)
SETTLE_S = 1.0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Recovery:
    """The roles of one training process and its half of each recovery. ``cfg``: the RunConfig; ``client``: its
    agent's channel (worker/client.py); ``groups``: the generations' process groups (dataplane/groups.py); ``log``:
    the event log; ``faults``: the test faults of this process (faultinject/inject.py); ``steps``: the step sequence
    (worker/steps.py, its ``step`` is set after a restore); ``failure``: the flag a peer's failure sets; ``watch``:
    what the restore's collectives wait under; ``node``; ``first_rank``: the rank the job's first generation gives
    this process (None: a spare); ``mesh_groups``: the mesh groups of the context's device meshes (a list the context
    appends to). ``attach`` the state and the snapshot protocol's side before the first role.

    Public: ``role`` (the current generation's, or None), ``rank``, ``generation``, ``high_water``, ``exit_code``,
    ``trained`` (set by the context once a step has run), ``resumed`` (the recovery to report once the next step
    completes, or None)."""

    def __init__(self, cfg, client, groups, log, faults, steps, failure, watch, *, node: int,
                 first_rank: int | None, mesh_groups: list):
        self._cfg, self._client, self._groups, self._log = cfg, client, groups, log
        self._faults, self._steps, self._failure, self._watch = faults, steps, failure, watch
        self._node, self._first_rank, self._mesh_groups = node, first_rank, mesh_groups
        self.role: Train | Spare | None = None
        self.high_water = -1       # faults fire on the first pass through their step, never on a recomputation
        self.exit_code = 0
        self.trained = False       # a step has run in this process (its state is no longer the initial one)
        self.resumed: dict | None = None
        self._waiting: Left | None = None   # what this process said when it left, while it waits for its next role
        self._state = self._writer = self._layout = self._rng0 = None
        self._slots: list[Slot] = []

    def attach(self, state, writer, layout, slots: list[Slot], rng0: torch.Tensor) -> None:
        """``state`` (a worker/steps.py ``StepState``), the snapshot protocol's side (``writer``,
        replica/writer.py), the payload's ``layout`` (replica/snapshot.py ``StateLayout``), the agent's ``slots``
        and ``rng0``: the initial state's RNG (a fresh start restores it)."""
        self._state, self._writer, self._layout, self._slots, self._rng0 = state, writer, layout, slots, rng0

    @property
    def rank(self) -> int | None:
        return self.role.rank if isinstance(self.role, Train) else None

    @property
    def generation(self) -> int:
        return self.role.view.generation if self.role is not None else 0

    # ---- roles ---------------------------------------------------------------------------------------------------
    def next_role(self, timeout: float) -> Role:
        """The agent's next role. Raises ChannelTimeout after ``timeout`` seconds."""
        return Role.from_wire(self._client.get(Role.KIND, timeout))

    def on_failure(self, body: dict) -> None:
        """(reader thread) The agent starts a recovery round (``Failure``): a process already waiting for its role
        answers at once; a training one leaves at its next wait (the failure flag). Raises ValueError on a malformed
        notice (the channel logs it)."""
        Failure.from_wire(body)
        waiting = self._waiting
        if waiting is not None:
            self._client.send(Left.KIND, waiting.to_wire())
        else:
            self._failure.set()
        self._client.wake()

    def _wait_role(self, done_step: int, why: str, announce: bool = True) -> Role:
        """Wait for the next role; ``announce``: first tell the agent we left the generation and how far we got
        (a spare only answers the agent's ``failure`` notices, ``on_failure``)."""
        left = Left(self.generation, done_step, why[:200])
        self._waiting = left
        # a failure notice that came before this wait began (between a role and this wait: a spare whose role came
        # just before a start-up failure's round) has found _waiting unset: answer it now, or the agent waits for
        # this process's "left" until it gives up on the node (seen: a healthy spare fenced after 62 s)
        announce = announce or self._failure.is_set()
        self._failure.clear()
        if announce:
            self._client.send(Left.KIND, left.to_wire())
        try:
            return self.next_role(self._cfg.timeouts.recovery_timeout + self._cfg.timeouts.ready_timeout)
        finally:
            self._waiting = None

    def _idle_spare_wait(self) -> Role:
        """An idle spare's wait for its next role. A failure-free run keeps a spare idle for as long as it lasts
        (hours, weeks), so no deadline of its own ends this wait: it ends with a role from the agent (promotion,
        finish, exit), or with AgentLost as soon as the agent is gone (its socket closes; its death also ends this
        process through the lifeline). It looks every ``ready_timeout`` seconds, so a lost agent is noticed there
        at the latest."""
        while True:
            try:
                return self._wait_role(-1, "spare", announce=False)
            except ChannelTimeout:
                if self._client.lost.is_set():
                    raise

    # ---- the first generation ------------------------------------------------------------------------------------
    def start(self, role: Train) -> None:
        """Generation 0 (or the first of a requeued attempt): take ``role``, join, bind the state to the rank and
        load the attempt's checkpoint if it resumes one."""
        self.role = role
        self.high_water = role.high_water
        self._join(first=True)
        self._state.bind(self.rank, self._watch)
        if role.resume:
            self._load_checkpoint(role.resume)

    # ---- a recovery ----------------------------------------------------------------------------------------------
    def recover(self, why: str) -> bool:
        """Leave the failed generation and follow the agent's decisions until this process trains again (True),
        or has no further part (False: saved, finished, or still a spare when the run ended)."""
        t_fail = time.time()
        self._client.progress.disarm()
        self._groups.abandon()
        done = self._steps.step if self.rank is not None else -1
        self._writer.settle(done, SETTLE_S)  # a snapshot of the step just completed is worth finishing: no recompute
        self._writer.quiesce()   # the early claim too: its slot is the agent's to drop (its quiesce)
        while True:
            role = self._wait_role(done, why)
            if not isinstance(role, Train):
                if not self.follow(role):
                    return False
                continue  # still a spare: the next role comes with the next recovery
            try:
                self._rejoin(role, t_fail)
                return True
            except PeerFailure as exc:
                self._round_failed(role, exc)
                why = f"the recovery round failed: {exc}"

    def _round_failed(self, role: Train, exc: Exception) -> None:
        self._client.progress.disarm()
        self._groups.abandon()
        self._writer.quiesce()
        self._client.send(RoundFailed.KIND, RoundFailed(role.view.generation, str(exc)[:300]).to_wire())

    def follow(self, role: Role) -> bool:
        """A role other than train: True while this process stays (a spare waiting for promotion, then promoted),
        else False (``exit_code`` set by an ``Exit``)."""
        if isinstance(role, Spare):
            self.role = role
            self._log.emit("spare_ready", node=self._node, generation=role.view.generation)
            announce = False
            while True:
                role = self._wait_role(-1, "spare", announce=True) if announce else self._idle_spare_wait()
                if isinstance(role, Train):
                    try:
                        self._rejoin(role, time.time(), promoted=True)
                        return True
                    except PeerFailure as exc:  # the round failed while this process joined: the next one follows
                        self._round_failed(role, exc)
                        announce = True
                        continue
                if not isinstance(role, Spare):
                    return self.follow(role)
                announce = False
        if isinstance(role, Exit):
            self.exit_code = role.code
        return False

    def _rejoin(self, role: Train, t_fail: float, promoted: bool = False) -> None:
        was_rank = self.rank
        self.role = role
        plan = role.restore   # (ipc/messages.py Restore: the agent's recovery round filled it)
        self.high_water = max(self.high_water, role.high_water)
        nth = plan.round
        self._faults.at_phase("rebuild", nth, self.rank)
        self._join()
        t_rebuilt = time.time()
        if not plan.is_source:
            self._faults.at_phase("restore", nth, self.rank)
        if plan.fresh:
            self._restore_initial(role)
        else:
            self._state.bind(self.rank, self._watch, from_replica=plan.from_replica)
            slot = self._slots[plan.slot]
            slot.step, slot.crc = plan.cut_step, plan.crc
            rng = self._layout.read(slot, self._state.restore_targets())  # verifies the checksum the agent took
            self._state.gather()
            torch.set_rng_state(rng)
        # a restore's transient buffers (ctx.protect: every rank's shares, ~2x the model + optimizer state) are freed
        # now; glibc keeps such blocks in its heap once its mmap threshold has grown, so hand them back (without
        # this a surviving rank grew by 22 MB over 4 recoveries of the micro GPT: test_never_hang.py)
        release_free_memory()
        self._steps.step = plan.cut_step
        t_restored = time.time()
        self._steps.snapshot()
        self.resumed = {"t_fail": t_fail, "recomputed_steps": plan.recomputed_steps}
        self._log.emit("recovered", generation=self.generation, rank=self.rank, promoted=promoted or was_rank is None,
                       t_fail=t_fail, t_agreed=plan.t_agreed, t_rebuilt=t_rebuilt, t_restored=t_restored,
                       cut_step=self._steps.step, failed_nodes=list(plan.failed_nodes), round=nth,
                       rss_bytes=_rss_bytes())

    def _restore_initial(self, role: Train) -> None:
        """A fresh start (agreement.decide): this rank's state exists nowhere, and nobody has trained a step, so it is
        the attempt's initial state: the requeued attempt's checkpoint, else the model and optimizer as this process
        built them (the user's function builds the same model in every process, spares included: docs/worker-
        contract.md), bound to its rank, with the RNG as ``run`` found it. It goes through a private slot, the path a
        snapshot takes, so that ``gather`` (a collective every rank joins) finds it as a restored own snapshot.
        Raises ReplicaError where the process's own state is not the initial one of its rank: it has trained a step,
        or (FSDP2) a spare's shards are rank 0's, not this rank's."""
        self._state.bind(self.rank, self._watch)
        if role.resume:
            self._load_checkpoint(role.resume)
            return
        built_as = self._first_rank or 0   # (a spare: rank 0)
        if self.trained or (self._state.sharded and self.rank != built_as):
            why = ("this process has trained a step since" if self.trained else
                   "with FSDP2 a spare's model holds rank 0's shards of the initial model, not this rank's")
            raise ReplicaError(f"rank {self.rank}: lost before its first snapshot was committed, and its initial state "
                               f"cannot be rebuilt here: {why} (start the job again)")
        scratch = Slot(self._layout.nbytes)
        self._layout.write(scratch, self._state.state_tensors(), self._rng0, 0)
        rng = self._layout.read(scratch, self._state.restore_targets())
        del scratch
        self._state.gather()
        torch.set_rng_state(rng)
        self._log.emit("fresh_start", rank=self.rank, generation=self.generation, node=self._node)

    def _join(self, first: bool = False) -> None:
        from ..dataplane.meshgroup import mesh_lines
        from .client import AgentStore

        g = self.generation
        # the run's first join waits for members still starting (the start-up deadline, after which the agent of a
        # node whose process never started ends the run with StartupTimeout); a recovery's join has the short one
        limit = self._cfg.timeouts.startup_timeout if first else self._cfg.timeouts.rendezvous_timeout
        store = AgentStore(self._client, g, timeout=limit)
        self._groups.join(g, store, self.rank, self._cfg.layout.world_size, timeout=limit)
        for group in self._mesh_groups:
            group.register()   # the join cleared torch's registry of groups (dataplane/groups.py)
        lines = [line for mg in self._mesh_groups for line in mesh_lines(mg.layout, mg.dim)]
        if lines:   # N-D meshes: this generation's sub-group of each line of each dimension
            self._groups.build_subgroups(lines)

    def _load_checkpoint(self, meta: dict) -> None:
        root = self._cfg.output.run_dir + "/checkpoint"
        kept = persist.shard_record(root, meta, self.rank).get("kept")
        if kept is not None:   # ctx.protect: which saved shares are this rank's (a lost rank's came from a replica)
            self._state.bind(self.rank, self._watch, kept=kept)
        rng = persist.load_shard(root, meta, self.rank, self._state.restore_targets())
        self._state.gather()
        torch.set_rng_state(rng)
        self._steps.step = meta["step"]
        self._log.emit("resumed_from_checkpoint", rank=self.rank, step=self._steps.step, generation=self.generation)
