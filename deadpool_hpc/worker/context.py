"""The worker context: what a training function sees, and the step loop that makes it survive.

``Context.run(step_fn)`` runs ``step_fn(step)`` for each step, and around each step it injects the
faults due, snapshots the state unique to this rank and hands it to the replica plane, and, when a
peer fails, recovers: abandon the generation's process group, agree on the next generation (control
plane), build its process group (data plane), restore every rank at the cut step (own snapshot, or
a verified replica for a promoted spare), gather the parameters, re-replicate, and resume. Spare
processes run the same function: they build the model and buffers, then wait in ``run`` until they
are promoted or the run ends. The contract is in docs/worker-contract.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

import torch

from ..control.agreement import held_by, holder_of
from ..dataplane.groups import device_for
from ..dataplane import collectives
from ..errors import PeerFailure
from ..replica import persist
from ..replica.snapshot import StateLayout
from ..replica.transport import Replicator
from . import faults as fault_injection
from .zero import ShardedAdamW


class Context:
    """Per-process handle given to the training function.

    rank: training rank (None while a spare); world_size: number of training ranks; device;
    generation; config (RunConfig); process_group (the current generation's default group).
    """

    def __init__(self, cfg, control, groups, log, backend: str = "gloo"):
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
        self._recovery: dict | None = None
        self.exit_code = 0
        self._faults = fault_injection.ordered(cfg.faults)
        self._high_water = -1  # the highest step any rank had reached when the last recovery agreed
        self._preempt_ignored = False
        self._t0 = time.time()
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
        layout = StateLayout([t for t in self._shard_shapes()], rng.numel())
        self.replicator = Replicator(self.cp.repl, self.cp.secret, layout, self.cp.agent, self.log)
        if self.rank is None:
            if not self._wait_as_spare():
                return
        else:
            self.groups.join(self.generation, self._store0, self.rank, self.world_size)
            self.opt.bind(self.rank, self.cp.failure)
            if self._resume is not None:
                self._load_checkpoint(self._resume)
            self._configure_replicas()
            self._snapshot()
            if self.config.replicate:
                self.replicator.wait_committed(self.step, self.cp.failure)  # a fault at the first step needs it
            self.log.emit("started", rank=self.rank, generation=self.generation, world_size=self.world_size,
                          step=self.step)
        self._loop(step_fn)

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self, step_fn) -> None:
        cfg = self.config
        while True:
            try:
                while self.step < cfg.steps:
                    self._one_step(step_fn)
                collectives.all_reduce(torch.zeros(1), self.cp.failure)  # everyone has finished
                break
            except PeerFailure as exc:
                if not self._recover(str(exc)):
                    return
        self._finish()

    def _one_step(self, step_fn) -> None:
        s = self.step
        if self.cp.agent.preempted.is_set():
            self._leave_for_preemption()
        if s > self._high_water:  # faults fire on the first pass through their step, never on a recomputation
            fault_injection.maybe_inject(self._faults, step=s, train_rank=self.rank, mpi_rank=self.cp.me,
                                         ranks_per_node=self.cp.P, assignment=self.cp.assignment,
                                         idents=self.cp.idents, log=self.log)
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
            self.replicator.wait_committed(self.step, self.cp.failure)

    def _snapshot(self) -> None:
        if self.config.replicate:
            self.replicator.submit(self.step, self.opt.state_tensors(), torch.get_rng_state())

    def _shard_shapes(self) -> list[torch.Tensor]:
        return [torch.empty(self.opt.shard), self.opt.exp_avg, self.opt.exp_avg_sq]

    def _configure_replicas(self) -> None:
        cfg, P = self.config, self.cp.P
        r = self.rank
        if cfg.nodes < 2 or not cfg.replicate:
            self.replicator.configure(self.generation, r, None, None, None)
            return
        holder = self.cp.assignment[holder_of(r, P, cfg.nodes)]
        held = held_by(r, P, cfg.nodes)
        self.replicator.configure(self.generation, r, holder, self.cp.assignment[held], held)

    # ---- recovery ----------------------------------------------------------------------------
    def _wait_as_spare(self) -> bool:
        """Wait until promoted (True) or the run ends (False)."""
        self.log.emit("spare_ready", node=self.cp.me // self.cp.P)
        while True:
            if self.cp.finished() is not None:
                return False
            if self.cp.failure.wait(0.05):
                if not self._recover("a peer failed", spare=True):
                    return False
                if self.rank is not None:
                    return True

    def _recover(self, why: str, spare: bool = False) -> bool:
        """Recover from a failure. Returns False if this process has no further part in the run."""
        t_fail = time.time()
        self.groups.abandon()
        self.replicator.quiesce()
        report = dict(self.replicator.report(), done_step=self.step) if not spare else {}
        was_rank = self.rank
        decision = self.cp.recover(report, self.groups.host_store)
        t_agreed = time.time()
        self._high_water = max(self._high_water, decision["high_water"])
        if self.cp.me == decision["coordinator"]:
            self.log.emit("decision", generation=decision["generation"], failed_nodes=decision["failed_nodes"],
                          promoted=decision["promoted"], cut_step=decision["cut_step"],
                          exhausted=decision.get("exhausted", False), reason=decision.get("reason"),
                          recomputed_steps=decision["recomputed_steps"], store=decision["store"],
                          t_decided=decision["t_decided"], first_suspicion=self.cp.first_suspicion)
        if decision.get("exhausted"):
            self._save_checkpoint(decision)
            return False
        if self.rank is None:
            return True  # still a spare: keep waiting
        self.groups.join(decision["generation"], decision["store"], self.rank, self.world_size)
        t_rebuilt = time.time()
        self._restore(decision, was_rank)
        t_restored = time.time()
        self._configure_replicas()
        self._snapshot()
        self._recovery = {"t_fail": t_fail, "recomputed_steps": decision["recomputed_steps"]}
        self.log.emit("recovered", generation=self.generation, rank=self.rank, promoted=was_rank is None,
                      why=why[:200], t_fail=t_fail, t_agreed=t_agreed, t_rebuilt=t_rebuilt, t_restored=t_restored,
                      cut_step=decision["cut_step"], failed_nodes=decision["failed_nodes"])
        return True

    def _restore(self, decision: dict, was_rank) -> None:
        cut = decision["cut_step"]
        rep = self.replicator
        for r, src in decision["sources"].items():  # holders send promoted ranks their replica
            if src == self.cp.me:
                rep.send_held(decision["assignment"][int(r)], cut, decision["generation"])
        self.opt.bind(self.rank, self.cp.failure)
        if was_rank is None:
            slot = rep.recv_restore(decision["sources"][str(self.rank)], self.rank, cut, decision["generation"])
        else:
            slot = rep.own.get(cut)
        rng = rep.layout.read(slot, self.opt.state_tensors())
        self.opt.gather()
        torch.set_rng_state(rng)
        self.step = cut

    # ---- no spare left, or preempted: persistent checkpoint, then requeue ----------------------
    def _save_checkpoint(self, decision: dict) -> None:
        """Write every shard of the cut step this process holds (its own, and the replicas of lost
        ranks it holds), wait for all members, and let the coordinator commit LATEST. Used when a
        lost node finds no spare and when Slurm announces preemption or the time limit (SIGUSR2):
        either way the job is requeued and resumes at the cut."""
        cut, rep = decision["cut_step"], self.replicator
        mine = []
        if self.rank is not None and self.cp.me not in decision["fenced"]:
            mine.append((self.rank, rep.own.get(cut)))
        for r, src in decision["sources"].items():
            if src == self.cp.me:
                mine.append((int(r), rep.held.get(cut)))
        shard = [torch.empty_like(t) for t in self._shard_shapes()]
        for r, slot in mine:
            rng = rep.layout.read(slot, shard)  # verifies the CRC-32
            persist.save_shard(self.checkpoint_dir, cut, r, shard, rng)
        self.cp.barrier()
        if self.cp.me == decision["coordinator"]:
            persist.commit(self.checkpoint_dir, cut, self.world_size, decision["generation"], self._high_water)
            self.log.emit("checkpoint_saved", step=cut, generation=decision["generation"],
                          path=self.checkpoint_dir, reason=decision.get("reason", "no spare node left"))
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
            self.log.emit("finished", generation=self.generation, steps=self.step, param_digest=self.param_digest(),
                          world_size=self.world_size, spares_left=len(self.cp.spare_nodes),
                          bytes_per_rank_per_step=self.replicator.layout.nbytes if self.config.replicate else 0,
                          replica_wait_s=self.replicator.wait_s)
            self.log.sync()
            self.cp.finish({"steps": self.step})
            self.cp.wait_sends()
            time.sleep(0.2)
        else:
            end = time.monotonic() + 5 * self.config.heartbeat_deadline
            self.cp.agent.stop_watching()
            while self.cp.finished() is None and time.monotonic() < end:
                time.sleep(0.02)
