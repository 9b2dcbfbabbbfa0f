"""The demo training function: the micro GPT on Shakespeare, ZeRO-1 AdamW, data parallel.

This is what ``deadpool run`` trains by default, and the shape a user's own function takes:
build the model and data, get the optimizer from the context, and hand one step to ``ctx.run``.
"""
from __future__ import annotations

import torch

from .corpus import Batches, load_tokens
from .model import GPT, GPTConfig


def train(ctx) -> None:
    cfg = ctx.config
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model, context=cfg.context))
    opt = ctx.zero_adamw(model, lr=cfg.lr, warmup_steps=cfg.warmup_steps)
    data = Batches(load_tokens(), cfg.batch_size, cfg.context, cfg.seed)

    def step(s: int) -> dict:
        x, y = data.get(s, ctx.rank)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        return {"loss": opt.step(s, loss)}

    ctx.run(step)
