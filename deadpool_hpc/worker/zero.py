"""ZeRO-1 AdamW whose every collective can be interrupted by the control plane.

Each rank keeps the full parameters (data parallelism) but the AdamW state (exp_avg, exp_avg_sq) and
the authoritative ("master") copy of only its 1/world_size shard of the flattened parameters, as
torch's ``ZeroRedundancyOptimizer`` partitions it. One step: all-reduce the gradients (each rank keeps
the sum of its shard), one all-reduce of [grad norm^2, loss] for clipping and logging, an
AdamW update of the shard, and an all-gather of the shards into the full parameters. torch's own
ZeroRedundancyOptimizer broadcasts with blocking collectives that nothing interrupts on gloo
(notes/ft-probes.md 1c), hence this one: every collective goes through dataplane.collectives.

The shard (parameter shard + its AdamW state) is the state unique to a rank; ``state_tensors()``
hands it to the replica plane: ``ShardedAdamW`` is a ``StepState`` (worker/steps.py), as ``ctx.protect``'s
state is. Given identical inputs and world size, results are bitwise reproducible (elementwise CPU math, fixed
collective order).
"""
from __future__ import annotations

import hashlib
import math

import torch

from ..dataplane import collectives
from .steps import NO_HOOKS, StepHooks


class ShardedAdamW:
    """ZeRO-1 AdamW over ``model``'s parameters (AdamW as in Loshchilov & Hutter, decoupled decay).

    lr: peak learning rate; warmup_steps: linear warm-up length; betas, eps, weight_decay (applied
    to parameters with 2+ dimensions only, as nanoGPT does); clip: max global grad norm (0 = off).
    The parameters become views of one flat float32 buffer of ``padded`` elements.
    """

    def __init__(self, model: torch.nn.Module, world_size: int, *, lr: float = 3e-3, warmup_steps: int = 0,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1, clip: float = 1.0):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world_size = world_size
        self.lr, self.warmup, self.betas, self.eps = lr, warmup_steps, betas, eps
        self.wd, self.clip = weight_decay, clip
        total = sum(p.numel() for p in self.params)
        self.shard = math.ceil(total / world_size)
        self.padded = self.shard * world_size
        self.numel = total
        self.flat = torch.zeros(self.padded)
        self.grad = torch.zeros(self.padded)
        decay = torch.zeros(self.padded)
        self._offsets = []
        off = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.flat[off:off + n].copy_(p.detach().reshape(-1))
                p.data = self.flat[off:off + n].view_as(p)
                if p.dim() >= 2:
                    decay[off:off + n] = 1.0
                self._offsets.append((off, n))
                off += n
        self._decay_full = decay
        self.exp_avg = torch.zeros(self.shard)
        self.exp_avg_sq = torch.zeros(self.shard)
        self.rank: int | None = None
        self.watch = None
        self.hooks: StepHooks = NO_HOOKS   # set by the context (worker/steps.py StepSequence)

    # the StepState protocol (worker/steps.py): the whole shard is in the replica, nothing is kept locally; the update
    # ends with an all-gather, and its snapshot is left to the writer's copy thread (no early claim); the parameters
    # are whole on every rank (any process can rebuild any rank's initial shard); no data loader
    local_nbytes = 0
    on_host = False
    sharded = False
    loader_guard = None

    def bind(self, rank: int, watch, from_replica: bool = False, kept: list[bool] | None = None) -> None:
        """Take shard ``rank`` (call again when the process is promoted or its rank changes); ``watch``: the
        dataplane.collectives.Watch every collective of a step waits under. ``from_replica`` (the state restored next
        came from a replica) and ``kept`` (a checkpoint's record of kept regions) change nothing here: the whole shard
        is in
        the replica."""
        self.rank = rank
        self.watch = watch
        lo = rank * self.shard
        self._lo, self._hi = lo, lo + self.shard
        self._decay = self._decay_full[lo:lo + self.shard]

    def state_tensors(self) -> list[torch.Tensor]:
        """The rank's unique state: [parameter shard, exp_avg, exp_avg_sq], each ``shard`` float32."""
        return [self.flat[self._lo:self._hi], self.exp_avg, self.exp_avg_sq]

    def layout_tensors(self) -> list[torch.Tensor]:
        """Tensors of the payload's shapes: three of ``shard`` float32."""
        return [torch.empty(self.shard), self.exp_avg, self.exp_avg_sq]

    def restore_targets(self) -> list[torch.Tensor]:
        """Where a payload is read into: the shard itself (``gather`` then all-gathers it)."""
        return self.state_tensors()

    def end_of_run(self) -> None:
        """Nothing: every rank holds the whole parameters."""

    def param_digest(self) -> str:
        """sha256 over the final parameters (flat, in model.parameters() order, float32 bytes)."""
        return hashlib.sha256(self.flat[: self.numel].numpy().tobytes()).hexdigest()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def lr_at(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        return self.lr

    def step(self, step: int, loss: torch.Tensor | None = None) -> float:
        """Apply update number ``step + 1``. Returns the mean ``loss`` over ranks (nan if None).

        Raises PeerFailure if a peer fails during any collective (state may then be half-updated:
        the recovery restores it from the snapshot of the cut step).
        """
        W, f = self.world_size, self.watch
        with torch.no_grad():
            for p, (off, n) in zip(self.params, self._offsets):
                if p.grad is None:
                    self.grad[off:off + n].zero_()
                else:
                    self.grad[off:off + n].copy_(p.grad.reshape(-1))
            # gloo's reduce_scatter work never reports is_completed() before wait() (measured, torch
            # 2.13), so it cannot be polled: all-reduce the full gradient and keep this rank's shard.
            collectives.all_reduce(self.grad, f)
            g = self.grad[self._lo:self._hi].div(W)
            stats = torch.stack([g.pow(2).sum(),
                                 (loss.detach().float() if loss is not None else torch.tensor(float("nan")))])
            collectives.all_reduce(stats, f)
            norm = stats[0].sqrt().item()
            if self.clip and norm > self.clip:
                g.mul_(self.clip / (norm + 1e-6))
            self.hooks.before_update()  # the replica of the current state must be committed first
            t = step + 1
            b1, b2 = self.betas
            lr = self.lr_at(step)
            p = self.flat[self._lo:self._hi]
            p.mul_(1 - lr * self.wd * self._decay)
            self.exp_avg.mul_(b1).add_(g, alpha=1 - b1)
            self.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (self.exp_avg_sq / (1 - b2 ** t)).sqrt_().add_(self.eps)
            p.addcdiv_(self.exp_avg, denom, value=-lr / (1 - b1 ** t))
            self.gather()
        return stats[1].item() / W

    def gather(self) -> None:
        """All-gather the shards into the full flat parameters (pollable)."""
        collectives.all_gather(self.flat, self.flat[self._lo:self._hi].clone(), self.watch)
