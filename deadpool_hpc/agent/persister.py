"""Background persistence: every ``--persist-every`` seconds the node agents write the newest committed snapshot of
every rank to RUN_DIR/checkpoint, off the training path.

Why: a spare covers a node lost while the job runs, and a checkpoint is saved when no spare is left or Slurm warns
(SIGUSR2, SIGTERM to the steps). An outright kill of every process (``scancel -f -s TERM``: srun SIGKILLs its step at
once on Slurm 22.05), an admin's ``scontrol requeue`` or a lost allocation leaves nothing to save from; the agents
already hold every rank's newest committed snapshot in memory, so they write one to disk from time to time, and
such a requeue resumes from at most that many seconds back.

How, per round (one every ``persist_every`` seconds, none before the first period has passed):

1. the agent of training rank 0 (the *scheduler*) picks ``S`` = its rank 0's committed step + 2, a step every rank
   commits soon, and sends ``persist`` {step, generation} to every training node (itself included); not before its
   rank 0 has reached the previous round's ``S`` (a round that overtook the last one before any node could write it
   left nothing persisted when steps took longer than half the period);
2. each training node's agent, once a local rank's committed step reaches ``S``, copies that rank's own slot of
   ``S`` (pinned while copied: ``Replicator.copy_own``; about a memcpy of the payload, on the agent's loop) and a
   background thread writes it with torch.distributed.checkpoint (``persist.save_shard``: the same layout as the
   no-spare checkpoint, CRC-32C recorded); then it sends ``persisted`` {step, node} to the scheduler;
3. the scheduler, once every training node said so, commits ``checkpoint/LATEST`` (only if ``S`` is newer than
   the LATEST there) and removes the older ``step{T}`` directories.

A node that misses ``S`` (its ranks already two steps past it when it looked: a slow loop) or a round cut by a
recovery leaves that round uncommitted; the next round tries again. Every node answers every round it was asked
(``persisted`` with ``ok`` false for a round it missed or failed), so the scheduler knows which rounds are over on
every node: a round's directory is removed only once each training node has answered a later round (a node writes
its rounds one after another), never while a slow node still writes it (the removal of rounds older than the previous
ask, whatever their state, destroyed every round of a file system slower than two periods: seen in CI, a first
round slowed by the import of torch.distributed.checkpoint on two busy cores, removed before its commit). LATEST is only
written once every shard of ``S`` is on disk, so a half-written round is never read back as good. The training processes
do nothing for it.

A run directory that fails writes (full, over quota, read-only, EIO, a stale NFS handle) costs the round
only: the node logs ``persist_failed`` with the reason, removes what it wrote of the round, and sends no
``persisted``; LATEST keeps naming the previous complete checkpoint, and the next round tries again. Nothing here
touches the disk on the agent's loop: the shards are written by the ``persist`` thread, LATEST and the removal of
older or abandoned rounds by the scheduler's ``persist-commit`` thread; a write that blocks (a file system that
stopped answering) holds that thread only, and no new round starts on that node while it does.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Protocol

from ..control.messages import Persist, Persisted
from ..replica import persist
from ..rundir import latest_checkpoint
from .state import NodeState


class PersistHost(Protocol):
    """What background persistence uses of its node agent (agent/node.py's NodeAgent is one): read-only state and
    one wake-up; nothing private, no method of the agent's loop."""

    cfg: object              # RunConfig: persist_every, run_dir, world_size
    cp: object               # ControlPlane: handlers, peers, generation, assignment, train_rank(local)
    log: object              # EventLog
    state: NodeState         # agent/state.py (a str enum: "training", "spare", ...); read only
    P: int                   # ranks per node
    node: int                # this node's index
    checkpoint_dir: str      # RUN_DIR/checkpoint
    reps: dict               # local rank -> Replicator (committed_step, copy_own)
    layouts: dict            # local rank -> StateLayout
    channel: object          # ChannelServer: wake()
    recovery: object         # Recovery: high_water (the step the run has reached)


class Persister:
    """One node agent's share. ``agent``: its node agent as far as persistence needs it (``PersistHost``);
    ``tick()`` from its loop."""

    def __init__(self, agent: PersistHost):
        self.agent = agent
        self.every = float(agent.cfg.persistence.persist_every or 0.0)
        self.root = agent.checkpoint_dir
        self.next_t = time.monotonic() + self.every
        self.want: tuple[int, int] | None = None      # (generation, step) this node is asked to write
        self.acks: dict[tuple[int, int], set[int]] = {}  # (generation, step) -> nodes done (the scheduler)
        self._thread: threading.Thread | None = None
        self._house: threading.Thread | None = None    # the scheduler's commit / clean-up thread
        self._asked: int | None = None                  # the step of the scheduler's last round
        self._done: tuple[int, int, float, int, bool] | None = None   # (generation, step, seconds, bytes, ok)
        self.answered: dict[int, int] = {}              # the scheduler: node -> newest step it answered (this gen.)
        self._answered_g: int | None = None
        agent.cp.on("persist", self._on_persist)
        agent.cp.on("persisted", self._on_persisted)

    # ---- the loop ---------------------------------------------------------------------------------------------
    def tick(self) -> None:
        if self.every <= 0 or self.agent.state != NodeState.TRAINING:
            return
        cp = self.agent.cp
        if self._done is not None:   # the writer thread finished: tell the scheduler (from this loop, not that thread)
            g, step, secs, nbytes, ok = self._done
            self._done = None
            if ok:
                self.agent.log.emit("persisted", step=step, generation=g, seconds=round(secs, 3), bytes=nbytes)
            self._answer(g, step, ok)
        if self._scheduler() and time.monotonic() >= self.next_t:
            self.next_t = time.monotonic() + self.every
            rep = self.agent.reps.get(0)
            # a round does not overtake the previous one before its step is reached: with steps longer than half
            # --persist-every, each round's request replaced the last before any node got to write it, and nothing
            # was ever persisted (seen with --persist-every 1 and 0.6 s steps)
            if rep is not None and rep.committed_step >= 0 and (self._asked is None
                                                                 or rep.committed_step >= self._asked):
                msg = Persist(g=cp.generation, step=rep.committed_step + 2)
                done = self._over()
                if done is not None:   # what rounds every node is done with left (failed rounds) frees room
                    self._in_background("clean", self._clean, done)
                self._asked = msg.step
                cp.peers.send_many(self._trainers(), Persist.KIND, msg.to_wire())
        if self.want is not None and self._thread is None:
            self._copy()

    def quiesce(self, timeout: float = 30.0) -> None:
        """Wait for a write in progress (a checkpoint of the no-spare path must not race it); drop the round."""
        self.want = None
        writer = self._thread   # read once: the writer clears it when it ends
        if writer is not None:
            writer.join(timeout)

    # ---- the rounds -------------------------------------------------------------------------------------------
    def _scheduler(self) -> bool:
        cp = self.agent.cp
        return cp.assignment[0] // self.agent.P == self.agent.node

    def _trainers(self) -> list[int]:
        cp, P = self.agent.cp, self.agent.P
        return sorted({m // P for m in cp.assignment})

    def _on_persist(self, src: int, msg: Persist) -> None:
        if msg.g == self.agent.cp.generation and self.agent.cp.train_rank(0) is not None:
            self.want = (msg.g, msg.step)

    def _answer(self, g: int, step: int, ok: bool) -> None:
        """Tell the scheduler this node is done with round ``step`` of generation ``g``: written (``ok``), or
        missed or failed (its reason is this node's ``persist_missed`` / ``persist_failed`` event)."""
        cp = self.agent.cp
        cp.peers.send(cp.assignment[0] // self.agent.P, Persisted.KIND, Persisted(g, step, ok).to_wire())

    def _over(self) -> int | None:
        """The scheduler: the newest step every training node has answered in this generation (each node writes its
        rounds in order, so no node still writes a round before it), or None while one has answered none."""
        if self._answered_g != self.agent.cp.generation:
            return None
        steps = [self.answered.get(n) for n in self._trainers()]
        return None if any(s is None for s in steps) else min(steps)

    def _on_persisted(self, src: int, msg: Persisted) -> None:
        key = (msg.g, msg.step)
        if key[0] != self.agent.cp.generation or not self._scheduler():
            return
        if self._answered_g != key[0]:
            self._answered_g, self.answered = key[0], {}
        self.answered[src] = max(self.answered.get(src, -1), key[1])
        if not msg.ok:   # (a node of a version without ``ok`` answers written rounds only: ok by default)
            self.acks.pop(key, None)
            return
        done = self.acks.setdefault(key, set())
        done.add(src)
        if set(self._trainers()) <= done:
            self.acks = {}
            self._in_background("commit", self._commit, *key)

    def _copy(self) -> None:
        """Copy each local rank's own slot of the wanted step once committed, then write them in the background."""
        g, step = self.want
        if g != self.agent.cp.generation:
            self.want = None
            return
        reps = self.agent.reps
        if any(rep.committed_step < step for rep in reps.values()):
            return   # not yet
        copies = {}
        for local, rep in reps.items():
            slot = rep.copy_own(step)
            if slot is None:
                self.want = None
                self.agent.log.emit("persist_missed", step=step, generation=g, local=local,
                                why=f"rank {self.agent.cp.train_rank(local)} is already at step {rep.committed_step}")
                self._answer(g, step, False)
                return
            copies[local] = slot
        self.want = None
        ranks = {local: self.agent.cp.train_rank(local) for local in copies}
        self._thread = threading.Thread(target=self._write, args=(g, step, copies, ranks), name="persist", daemon=True)
        self._thread.start()

    def _write(self, g: int, step: int, copies: dict, ranks: dict) -> None:
        t0, nbytes = time.perf_counter(), 0
        try:
            for local, slot in copies.items():
                layout = self.agent.layouts[local]
                shard = persist.assemble_shard(layout, slot)   # the rank's own snapshot: checked, kept shares
                persist.save_shard(self.root, step, ranks[local], shard.tensors, shard.rng, kept=shard.kept)
                nbytes += layout.nbytes
            self._done = (g, step, time.perf_counter() - t0, nbytes, True)
        except BaseException as exc:  # noqa: BLE001 - costs this round only. BaseException: torch's
            # CheckpointException (a full disk inside dcp.save) is one, and escaped ``except Exception``: the thread
            # died without a word
            reason = persist.failure_reason(exc, self.root)   # (before the removal frees the room it lacked)
            for r in ranks.values():
                persist.discard_shard(self.root, step, r)
            self.agent.log.emit("persist_failed", step=step, generation=g, phase="write", path=self.root,
                                reason=reason, ranks=sorted(ranks.values()))
            self._done = (g, step, time.perf_counter() - t0, nbytes, False)
        finally:
            self._thread = None
            self.agent.channel.wake()

    def _in_background(self, what: str, fn, *args) -> None:
        """Run ``fn(*args)`` on the scheduler's disk thread, off the loop; skipped (``persist_failed`` for a commit)
        while the previous one still runs: a write blocked in a file system that stopped answering."""
        house = self._house
        if house is not None and house.is_alive():
            if what == "commit":
                self.agent.log.emit("persist_failed", step=args[1], generation=args[0], phase="commit", path=self.root,
                                    reason=f"the previous {house.name} is still blocked in the file system")
            return
        self._house = threading.Thread(target=fn, args=args, name=f"persist-{what}", daemon=True)
        self._house.start()

    def _commit(self, g: int, step: int) -> None:
        """Write LATEST for ``step`` (only if newer than the one there) and remove older rounds. A failure leaves
        LATEST as it was (persist.commit writes it by rename) and is logged."""
        try:
            latest = latest_checkpoint(self.agent.cfg.output.run_dir)
            if latest is not None and latest["step"] >= step:
                return
            persist.commit(self.root, step, self.agent.cfg.layout.world_size, g, self.agent.recovery.high_water)
        except BaseException as exc:  # noqa: BLE001 - an uncommitted round; the next one tries again
            self.agent.log.emit("persist_failed", step=step, generation=g, phase="commit", path=self.root,
                                reason=persist.failure_reason(exc, self.root))
            return
        self.agent.log.emit("checkpoint_persisted", step=step, generation=g, path=self.root)
        self._clean(step)

    def _clean(self, before: int) -> None:
        """Remove every ``step{T}`` directory with T < ``before`` that LATEST does not name: older committed rounds
        and what rounds that failed left on the disk. Called with a ``before`` no node still writes below (a
        commit's step: each node wrote the older rounds first; ``_over()``). Never raises."""
        keep = (latest_checkpoint(self.agent.cfg.output.run_dir) or {}).get("step")
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            if name.startswith("step") and name[4:].isdigit() and int(name[4:]) < before and int(name[4:]) != keep:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
