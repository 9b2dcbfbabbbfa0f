"""The demo training function: the micro GPT on Shakespeare, DDP, torch.optim.AdamW, kept alive by ``ctx.protect``.

This is what ``deadpool run`` trains by default, and the shape a user's own function takes:
read its own settings from ``ctx.config.train_args``, build the model, optimizer, schedule and data as in any torch
script, protect them (``ctx.protect``), and hand one step to ``ctx.run``. ``DemoConfig`` is the demo's settings; the
launcher checks ``--train-arg`` values with it (``train.check_args``) before any process starts.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DemoConfig:
    """The demo's settings, from ``--train-arg KEY=VALUE`` (``RunConfig.train_args``); sizes in tokens.

    batch_size: sequences per rank per step; context: tokens per sequence; n_layer, n_head, d_model: the GPT's
    depth, attention heads and width; lr: peak learning rate; warmup_steps: its linear warm-up, in steps;
    seed: seeds the initial model (every process builds the same one) and the data order.
    """

    batch_size: int = 8
    context: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    seed: int = 1337

    @classmethod
    def from_args(cls, args: dict) -> "DemoConfig":
        """Build from train_args; missing keys keep their defaults. Raises ValueError naming an unknown key (and
        the accepted ones) or a bad value."""
        known = [f.name for f in dataclasses.fields(cls)]
        for k in args:
            if k not in known:
                raise ValueError(f"--train-arg {k}: not a setting of the demo; accepted: {', '.join(known)}")
        vals = {k: float(v) if k == "lr" and isinstance(v, int) and not isinstance(v, bool) else v
                for k, v in args.items()}
        return cls(**vals).validate()

    def validate(self) -> "DemoConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name, low in (("batch_size", 1), ("context", 2), ("n_layer", 1), ("n_head", 1), ("d_model", 1),
                          ("warmup_steps", 0)):
            v = getattr(self, name)
            need(is_int(v) and v >= low, f"--train-arg {name}={v!r}: accepted: an integer >= {low}")
        need(self.d_model % self.n_head == 0,
             f"--train-arg d_model={self.d_model} is not divisible by n_head={self.n_head}")
        need(isinstance(self.lr, float) and math.isfinite(self.lr) and 0 < self.lr <= 1,
             f"--train-arg lr={self.lr!r}: accepted: a learning rate in (0, 1], e.g. 3e-3")
        need(is_int(self.seed) and 0 <= self.seed < 2**64,
             f"--train-arg seed={self.seed!r}: accepted: an integer in 0..{2**64 - 1} (torch.manual_seed's range)")
        return self


def train(ctx) -> None:
    """The micro GPT in DistributedDataParallel, torch.optim.AdamW with a linear warm-up (LambdaLR), made to survive
    with one call: ``ctx.protect(model, optimizer, scheduler)`` (docs/your-loop.md)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .corpus import Batches, load_tokens
    from .model import GPT, GPTConfig

    cfg = DemoConfig.from_args(ctx.config.train.train_args)
    torch.manual_seed(cfg.seed)                                      # every process builds the same model
    model = DDP(GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model, context=cfg.context)))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, cfg.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    ctx.protect(model, opt, sched)
    data = Batches(load_tokens(), cfg.batch_size, cfg.context, cfg.seed)   # batch = f(step, rank)
    tokens = cfg.batch_size * cfg.context

    def step(s: int) -> dict:
        x, y = data.get(s, ctx.rank)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return {"loss": loss.item(), "tokens": tokens}

    ctx.run(step)


train.check_args = DemoConfig.from_args  # the launcher calls it on train_args before any process starts


def train_zero(ctx) -> None:
    """The same model and data with the built-in ZeRO-1 AdamW (``ctx.zero_adamw``: each rank's shard of the
    parameters and AdamW state is what gets replicated): ``--train-fn deadpool_hpc.train.demo:train_zero``."""
    import torch

    from .corpus import Batches, load_tokens
    from .model import GPT, GPTConfig

    cfg = DemoConfig.from_args(ctx.config.train.train_args)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model, context=cfg.context))
    opt = ctx.zero_adamw(model, lr=cfg.lr, warmup_steps=cfg.warmup_steps)
    data = Batches(load_tokens(), cfg.batch_size, cfg.context, cfg.seed)
    tokens = cfg.batch_size * cfg.context

    def step(s: int) -> dict:
        x, y = data.get(s, ctx.rank)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        return {"loss": opt.step(s, loss), "tokens": tokens}

    ctx.run(step)


train_zero.check_args = DemoConfig.from_args
