"""The worker context: what a training function sees, and the step loop that makes it survive.

``Context.run(step_fn)`` runs ``step_fn(step)`` for each step, and around each step it injects the
faults due, snapshots the state unique to this rank and hands it to the replica plane, and, when a
peer fails, recovers: abandon the generation's process group, agree on the next generation (control
plane), pass a barrier of the new generation's ranks, build its process group (data plane), restore
every rank at the cut step (its own snapshot, or a verified replica pulled from a holder), gather the
parameters, re-replicate, and resume. A failure during any of that starts the next recovery round.
Spare processes run the same function: they build the model and buffers, then wait in ``run`` until
they are promoted or the run ends. The contract is in docs/worker-contract.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

import torch

from ..control.agreement import held_by, holders_of
from ..dataplane import collectives
from ..dataplane.collectives import Watch
from ..dataplane.groups import device_for
from ..errors import PeerFailure, RecoveryTimeout, RunFinished
from ..replica import persist
from ..replica.snapshot import StateLayout
from ..replica.transport import Replicator
from .faults import Injector
from .zero import ShardedAdamW

MAX_FAILED_ROUNDS = 8  # recovery rounds in a row that fail before the run gives up (a clear exit)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Context:
    """Per-process handle given to the training function.

    rank: training rank (None while a spare); world_size: number of training ranks; device;
    generation; config (RunConfig); process_group (the current generation's default group).
    """

    def __init__(self, cfg, control, groups, log, listener, backend: str = "gloo"):
        self.config = cfg
        self.cp = control
        self.groups = groups
        self.log = log
        self.backend = backend
        self.device = device_for(backend)
        self.world_size = cfg.world_size
        self.step = 0
        self.opt: ShardedAdamW | None = None
        self.replicator: Replicator | None = None
        self._listener = listener
        self._recovery: dict | None = None
        self._rounds = 0  # recovery rounds this process took part in (phase faults count them)
        self.exit_code = 0
        self.watch = Watch(control.failure, cfg.wait_timeout, control.watchdog.beat)
        self.faults = Injector(cfg.faults, mpi_rank=control.me, ranks_per_node=control.P, idents=control.idents,
                               log=log, send=control.agent.send)
        control.agent.on_inject = self.faults.on_message
        control.on_member_lost = groups.drop_stores  # a rendezvous in progress fails at once, not at its timeout
        self._high_water = -1  # the highest step any rank had reached when the last recovery agreed
        self._rebuilt_at = -1  # the cut step of the last "rebuild" decision (nobody failed: a collective timed out)
        self._preempt_ignored = False
        addr = json.dumps(groups.host_store()) if control.me == 0 else None
        self._store0 = json.loads(control.bcast_text(addr, root=0))
        self.checkpoint_dir = os.path.join(cfg.run_dir, "checkpoint")
        self._resume = persist.latest(self.checkpoint_dir)
        if self._resume is not None:  # a requeued job: carry on the generation count and the high-water step
            control.generation = control.agent.generation = self._resume["generation"] + 1
            self._high_water = self._resume.get("high_water", -1)
        control.start()  # from here on only the agent thread calls MPI

    # ---- what the training function uses ---------------------------------------------------
    @property
    def rank(self) -> int | None:
        return self.cp.train_rank

    @property
    def generation(self) -> int:
        return self.cp.generation

    @property
    def process_group(self):
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_group()

    def zero_adamw(self, model: torch.nn.Module, **kwargs) -> ShardedAdamW:
        """A ZeRO-1 AdamW over ``model`` whose shard is the state this context protects."""
        self.opt = ShardedAdamW(model, self.world_size, **kwargs)
        self.opt.before_update = self._before_update
        return self.opt

    def run(self, step_fn) -> None:
        """Run ``step_fn(step) -> dict`` (it must call ``opt.step(step, loss)``) from the current step
        to ``config.steps``, surviving peer failures. Returns when the run is complete everywhere."""
        if self.opt is None:
            raise RuntimeError("Context.run needs an optimizer: call ctx.zero_adamw(model) first")
        rng = torch.get_rng_state()
        layout = StateLayout(self._shard_shapes(), rng.numel())
        self.replicator = Replicator(self.cp.secret, layout, self.log, sock=self._listener,
                                     timeout=self.config.collective_timeout)
        self.replicator.serve_hook = self._serve_hook
        if self.rank is None and not self._wait_as_spare():
            return
        self._loop(step_fn, started=self._recovery is not None)

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self, step_fn, started: bool) -> None:
        cfg = self.config
        while True:
            try:
                if not started:
                    self._start()
                    started = True
                while self.step < cfg.steps:
                    self._one_step(step_fn)
                self.cp.watchdog.disarm()
                collectives.all_reduce(torch.zeros(1), self.watch)  # everyone has finished
                break
            except PeerFailure as exc:
                if not self._recover(str(exc)):
                    return
                started = True
        self._finish()

    def _start(self) -> None:
        """Generation 0 (or the first of a requeued attempt): join, load a checkpoint, first snapshot."""
        self.groups.join(self.generation, self._store0, self.rank, self.world_size, self.cp.failure)
        self.opt.bind(self.rank, self.watch)
        if self._resume is not None:
            self._load_checkpoint(self._resume)
        self._configure_replicas()
        self._snapshot()
        if self.config.replicate:
            self._wait_committed(self.step)  # a fault at the first step needs it
        self.log.emit("started", rank=self.rank, generation=self.generation, world_size=self.world_size,
                      step=self.step)

    def _one_step(self, step_fn) -> None:
        s = self.step
        self.cp.watchdog.arm(f"step {s}")
        if self.cp.agent.preempted.is_set():
            self._leave_for_preemption()
        if self._recovery is not None:
            self.faults.at_phase("resume", self._rounds, self.rank)
        if s > self._high_water:  # faults fire on the first pass through their step, never on a recomputation
            self.faults.at_step(s, self.rank, self.cp.assignment, self.cp.spare_nodes)
        t = time.perf_counter()
        metrics = step_fn(s) or {}
        dt = time.perf_counter() - t
        self.step = s + 1
        self._snapshot()
        if self._recovery is not None:
            r, self._recovery = self._recovery, None
            self.log.emit("resumed", generation=self.generation, rank=self.rank, step=self.step,
                          t_fail=r["t_fail"], recomputed_steps=r["recomputed_steps"])
        if self.rank == 0 and (s % self.config.log_every == 0 or self.step == self.config.steps):
            tokens = self.world_size * self.config.batch_size * self.config.context
            self.log.emit("step", step=self.step, generation=self.generation, step_s=dt,
                          tokens_per_s=tokens / dt if dt > 0 else 0.0,
                          **{k: v for k, v in metrics.items() if isinstance(v, (int, float))})

    def _leave_for_preemption(self) -> None:
        """Slurm's SIGUSR2 reached some process: at this step boundary, leave the generation like for a
        failure (the others break out of their collectives on our teardown); the agreement then decides
        "preempted" and every rank saves the cut step. Without replicas there is no snapshot to agree
        on, so the request is logged and ignored."""
        if not self.config.replicate:
            if not self._preempt_ignored:
                self._preempt_ignored = True
                self.log.emit("preempt_ignored", step=self.step, reason="--no-replicate: no snapshot to save")
            return
        self.cp.failure.set()
        raise PeerFailure("preempted (SIGUSR2)")

    def _before_update(self) -> None:
        if self.config.replicate:
            self._wait_committed(self.step)

    def _wait_committed(self, step: int) -> None:
        self.replicator.wait_committed(step, self.cp.failure, self.config.wait_timeout, beat=self.cp.watchdog.beat)

    def _snapshot(self) -> None:
        if self.config.replicate:
            self.replicator.submit(self.step, self.opt.state_tensors(), torch.get_rng_state())

    def _shard_shapes(self) -> list[torch.Tensor]:
        return [torch.empty(self.opt.shard), self.opt.exp_avg, self.opt.exp_avg_sq]

    def _configure_replicas(self) -> None:
        cfg, P, r = self.config, self.cp.P, self.rank
        k = min(cfg.replicas, cfg.nodes - 1) if cfg.replicate else 0
        if r is None or k <= 0:
            self.replicator.configure(self.generation, r, [], [])
            return
        addr = lambda t: self.cp.idents[self.cp.assignment[t]]["replica"]  # noqa: E731
        self.replicator.configure(self.generation, r, [addr(h) for h in holders_of(r, P, cfg.nodes, k)],
                                  held_by(r, P, cfg.nodes, k))

    # ---- recovery ----------------------------------------------------------------------------
    def _wait_as_spare(self) -> bool:
        """Wait until promoted (True) or the run ends (False)."""
        self.log.emit("spare_ready", node=self.cp.me // self.cp.P)
        while True:
            if self.cp.finished() is not None:
                return False
            if self.cp.failure.wait(0.05):
                if not self._recover("a peer failed"):
                    return False
                if self.rank is not None:
                    return True

    def _phase(self, name: str) -> None:
        if name == "decided" and self.faults.wants_phase(name, self._rounds, self.rank):
            self.cp.wait_sends()  # a coordinator dies once its decision has reached the members, not before
        self.faults.at_phase(name, self._rounds, self.rank)

    def _recover(self, why: str) -> bool:
        """Recover from a failure, round after round until one succeeds. Returns False if this process has no
        further part in the run (it saved a checkpoint, or stays a spare until the run ends: then True only
        once promoted)."""
        t_fail = time.time()
        self.cp.watchdog.disarm()
        failed_rounds = 0
        while True:
            self._rounds += 1
            try:
                done = self._recover_round(why, t_fail)
            except RunFinished:
                return False
            except PeerFailure as exc:
                failed_rounds += 1
                self.log.emit("recovery_round_failed", generation=self.generation, rank=self.rank, round=self._rounds,
                              error=str(exc)[:300])
                if failed_rounds >= MAX_FAILED_ROUNDS:
                    raise RecoveryTimeout(f"{failed_rounds} recovery rounds in a row failed; the last: {exc}") from exc
                why = f"the previous recovery round failed: {exc}"
                continue
            return done

    def _recover_round(self, why: str, t_fail: float) -> bool:
        self.groups.abandon()
        self.replicator.quiesce()
        report = dict(self.replicator.report(), done_step=self.step if self.rank is not None else -1)
        self._phase("detect")
        was_rank = self.rank
        decision = self.cp.recover(report, self.groups.host_store, on_phase=self._phase)
        t_agreed = time.time()
        g = decision["generation"]
        self._high_water = max(self._high_water, decision["high_water"])
        if decision.get("reason") == "rebuild":  # collectives timed out with nobody at fault
            if decision["cut_step"] == self._rebuilt_at:
                raise RecoveryTimeout(
                    f"collectives at step {decision['cut_step']} timed out twice ({self.config.wait_timeout:.0f} s) with "
                    f"no process at fault: a rank's step takes longer than that (raise --collective-timeout and "
                    f"--hang-timeout above your longest step), or the network is wedged")
            self._rebuilt_at = decision["cut_step"]
        if decision.get("exhausted"):
            self._save_checkpoint(decision)
            return False
        if self.rank is None:
            return True  # still a spare: keep waiting
        self.opt.bind(self.rank, self.watch)
        self._serving = {int(r) for r, src in decision["sources"].items() if src == self.cp.me}
        ranks = [decision["assignment"][r] for r in range(self.world_size)]
        # the tag names the coordinator too: two decisions for one generation (a coordinator change) never meet
        self.cp.barrier(f"rebuild{g}.{decision['coordinator']}", ranks, self.config.rendezvous_timeout)
        self._phase("rebuild")
        self.groups.join(g, decision["store"], self.rank, self.world_size, self.cp.failure)
        t_rebuilt = time.time()
        if not self._serving:
            self._phase("restore")
        self._restore(decision)
        t_restored = time.time()
        self._configure_replicas()
        self._snapshot()
        self._recovery = {"t_fail": t_fail, "recomputed_steps": decision["recomputed_steps"]}
        self.log.emit("recovered", generation=g, rank=self.rank, promoted=was_rank is None, why=why[:200],
                      t_fail=t_fail, t_agreed=t_agreed, t_rebuilt=t_rebuilt, t_restored=t_restored,
                      cut_step=decision["cut_step"], failed_nodes=decision["failed_nodes"], round=self._rounds,
                      rss_bytes=_rss_bytes())
        return True

    _serving: set = set()

    def _serve_hook(self, rank: int, step: int, sent: int, total: int) -> None:
        """Called by the replica server after each chunk it serves: the "restore" phase fault fires half-way."""
        if rank in self._serving and 2 * sent >= total:
            self._phase("restore")

    def _restore(self, decision: dict) -> None:
        cut = decision["cut_step"]
        src = decision["sources"].get(str(self.rank))
        rep = self.replicator
        if src is not None:
            slot = rep.fetch(self.cp.idents[src]["replica"], self.rank, cut, self.cp.failure,
                             self.config.collective_timeout)
        else:
            slot = rep.own.get(cut)
        rng = rep.layout.read(slot, self.opt.state_tensors())
        self.opt.gather()
        torch.set_rng_state(rng)
        self.step = cut

    # ---- no spare left, or preempted: persistent checkpoint, then requeue ----------------------
    def _save_checkpoint(self, decision: dict) -> None:
        """Write every shard of the cut step this process holds (its own, and those of lost ranks whose
        source it is), wait for all members, and let the coordinator commit LATEST. Used when a lost node
        finds no spare and when Slurm announces preemption or the time limit (SIGUSR2): either way the job
        is requeued and resumes at the cut. A member lost while saving fails the barrier: the next round
        decides again (with the lost member's shards taken from their holders)."""
        cut, rep, g = decision["cut_step"], self.replicator, decision["generation"]
        mine = []
        if self.rank is not None and str(self.rank) not in decision["sources"]:
            mine.append((self.rank, rep.own.get(cut)))
        for r, src in decision["sources"].items():
            if src == self.cp.me:
                mine.append((int(r), rep.held(int(r)).get(cut)))
        shard = [torch.empty_like(t) for t in self._shard_shapes()]
        for r, slot in mine:
            rng = rep.layout.read(slot, shard)  # verifies the checksum
            persist.save_shard(self.checkpoint_dir, cut, r, shard, rng)
        self.cp.barrier(f"saved{g}.{decision['coordinator']}", decision["members"], self.config.collective_timeout)
        # every member commits (the same LATEST, written by rename): the coordinator may die right here
        persist.commit(self.checkpoint_dir, cut, self.world_size, g, self._high_water)
        if self.cp.me == decision["coordinator"]:
            self.log.emit("checkpoint_saved", step=cut, generation=g, path=self.checkpoint_dir,
                          reason=decision.get("reason", "no spare node left"))
        self.exit_code = 75  # EX_TEMPFAIL: requeue me

    def _load_checkpoint(self, meta: dict) -> None:
        rng = persist.load_shard(self.checkpoint_dir, meta, self.rank, self.opt.state_tensors())
        self.opt.gather()
        torch.set_rng_state(rng)
        self.step = meta["step"]
        self.log.emit("resumed_from_checkpoint", rank=self.rank, step=self.step, generation=self.generation)

    # ---- the end -----------------------------------------------------------------------------
    def param_digest(self) -> str:
        """sha256 over the final parameters (flat, in model.parameters() order, float32 bytes)."""
        return hashlib.sha256(self.opt.flat[: self.opt.numel].numpy().tobytes()).hexdigest()

    def _finish(self) -> None:
        if self.rank == 0:
            self.cp.finish({"steps": self.step})  # first: hashing a large model takes a while, nobody waits for it
            self.log.emit("finished", generation=self.generation, steps=self.step, param_digest=self.param_digest(),
                          world_size=self.world_size, spares_left=len(self.cp.spare_nodes),
                          bytes_per_rank_per_step=self.replicator.layout.nbytes if self.config.replicate else 0,
                          replica_wait_s=self.replicator.wait_s)
            self.log.sync()
            self.cp.wait_sends()
        else:
            end = time.monotonic() + self.config.collective_timeout
            self.cp.agent.stop_watching()
            while self.cp.finished() is None and time.monotonic() < end:
                time.sleep(0.02)
