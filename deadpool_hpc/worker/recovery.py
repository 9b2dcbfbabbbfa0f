"""The training process's half of a recovery: leave the failed generation, follow the agent's roles, join the new
generation and restore the cut step (docs/architecture.md, "One failure through the code").

``Context._recover`` (below, from the step loop or ``run``) drops the generation's process group, settles the
snapshot of the step it completed, and tells its agent how far it got (``Left``); then it waits for a ``Role``
(ipc/messages.py): ``Train`` joins the new generation through the agent-backed store (``_join``) and restores the
``Restore``'s slot, or the initial state at a fresh start; ``Spare`` waits for a promotion; ``Exit`` and
``Finish`` end it. A failure while it joins or restores ends that round (``RoundFailed``); the agent starts the
next. The agent's half is agent/recovery.py.

A mixin of ``Context`` (worker/context.py): these methods use its state (the role, the groups, the protected state,
the slots, the snapshots' settle and quiesce). Does not own the step loop (worker/context.py) nor the step's order
around the state (worker/steps.py).
"""
from __future__ import annotations

import os
import time

import torch

from ..dataplane.groups import release_free_memory
from ..errors import ChannelTimeout, PeerFailure, ReplicaError
from ..ipc.messages import Exit, Left, Role, RoundFailed, Spare, Train
from ..replica import persist
from ..replica.snapshot import Slot

# seconds a process leaving a failed generation waits for the snapshot of the step it completed (a copy into shared
# memory: GB/s): finished, the recovery can cut at that step instead of recomputing it (a planned swap relies on it)
SETTLE_S = 1.0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Recovering:
    """The recovery methods of ``Context`` (worker/context.py)."""

    def _next_role(self, timeout: float) -> Role:
        return Role.from_wire(self._client.get(Role.KIND, timeout))

    def _wait_role(self, done_step: int, why: str, announce: bool = True) -> Role:
        """Wait for the next role; ``announce``: first tell the agent we left the generation and how far we got
        (a spare only answers the agent's ``failure`` notices, ``_on_failure``)."""
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
            return self._next_role(self.config.timeouts.recovery_timeout + self.config.timeouts.ready_timeout)
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

    def _recover(self, why: str) -> bool:
        """Leave the failed generation and follow the agent's decisions until this process trains again (True),
        or has no further part (False: saved, finished, or still a spare when the run ended)."""
        t_fail = time.time()
        self._client.progress.disarm()
        self._groups.abandon()
        done = self.step if self.rank is not None else -1
        self._writer.settle(done, SETTLE_S)  # a snapshot of the step just completed is worth finishing: no recompute
        self._writer.quiesce()   # the early claim too: its slot is the agent's to drop (its quiesce)
        while True:
            role = self._wait_role(done, why)
            if not isinstance(role, Train):
                if not self._follow(role):
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

    def _follow(self, role: Role) -> bool:
        """A role other than train: True while this process stays (a spare waiting for promotion), else False."""
        if isinstance(role, Spare):
            self._role = role
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
                    return self._follow(role)
                announce = False
        if isinstance(role, Exit):
            self._exit_code = role.code
        return False

    def _rejoin(self, role: Train, t_fail: float, promoted: bool = False) -> None:
        was_rank = self.rank
        self._role = role
        plan = role.restore   # (ipc/messages.py Restore: the agent's recovery round filled it)
        self._high_water = max(self._high_water, role.high_water)
        nth = plan.round
        self._faults.at_phase("rebuild", nth, self.rank)
        self._join()
        t_rebuilt = time.time()
        if not plan.is_source:
            self._faults.at_phase("restore", nth, self.rank)
        if plan.fresh:
            self._restore_initial(role)
        else:
            self._state.bind(self.rank, self.watch, from_replica=plan.from_replica)
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
        self._recovery = {"t_fail": t_fail, "recomputed_steps": plan.recomputed_steps}
        self._log.emit("recovered", generation=self.generation, rank=self.rank, promoted=promoted or was_rank is None,
                      t_fail=t_fail, t_agreed=plan.t_agreed, t_rebuilt=t_rebuilt, t_restored=t_restored,
                      cut_step=self.step, failed_nodes=list(plan.failed_nodes), round=nth, rss_bytes=_rss_bytes())

    def _restore_initial(self, role: Train) -> None:
        """A fresh start (agreement.decide): this rank's state exists nowhere, and nobody has trained a step, so it is
        the attempt's initial state: the requeued attempt's checkpoint, else the model and optimizer as this process
        built them (the user's function builds the same model in every process, spares included: docs/worker-
        contract.md), bound to its rank, with the RNG as ``run`` found it. It goes through a private slot, the path a
        snapshot takes, so that ``gather`` (a collective every rank joins) finds it as a restored own snapshot.
        Raises ReplicaError where the process's own state is not the initial one of its rank: it has trained a step,
        or (FSDP2) a spare's shards are rank 0's, not this rank's."""
        self._state.bind(self.rank, self.watch)
        if role.resume:
            self._load_checkpoint(role.resume)
            return
        built_as = self._first_rank or 0   # (a spare: rank 0)
        if self._trained or (self._state.sharded and self.rank != built_as):
            why = ("this process has trained a step since" if self._trained else
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
        limit = self.config.timeouts.startup_timeout if first else self.config.timeouts.rendezvous_timeout
        store = AgentStore(self._client, g, timeout=limit)
        self._groups.join(g, store, self.rank, self.world_size, timeout=limit)
        for group in self._mesh_groups:
            group.register()   # the join cleared torch's registry of groups (dataplane/groups.py)
        lines = [line for mg in self._mesh_groups for line in mesh_lines(mg.layout, mg.dim)]
        if lines:   # N-D meshes: this generation's sub-group of each line of each dimension
            self._groups.build_subgroups(lines)

    def _load_checkpoint(self, meta: dict) -> None:
        root = self.config.output.run_dir + "/checkpoint"
        kept = persist.shard_record(root, meta, self.rank).get("kept")
        if kept is not None:   # ctx.protect: which saved shares are this rank's (a lost rank's came from a replica)
            self._state.bind(self.rank, self.watch, kept=kept)
        rng = persist.load_shard(root, meta, self.rank, self._state.restore_targets())
        self._state.gather()
        torch.set_rng_state(rng)
        self._steps.step = meta["step"]
        self._log.emit("resumed_from_checkpoint", rank=self.rank, step=self.step, generation=self.generation)
