"""Your own DDP loop, first plain torch, then surviving node loss (docs/your-loop.md).

The micro GPT (deadpool_hpc.train.model) on Shakespeare (deadpool_hpc.train.corpus), DistributedDataParallel,
torch.optim.AdamW and a cosine schedule from torch.optim.lr_scheduler.

Plain (torchrun, no fault tolerance):

    torchrun --nproc-per-node 3 examples/ddp_gpt.py --steps 200

Surviving (from the repository root; the spare replaces node1, the run ends bitwise equal to a failure-free one):

    deadpool run --train-fn examples.ddp_gpt:train --nodes 3 --spares 1 --steps 200 --kill node1@40

Both share ``build``; ``main`` and ``train`` differ by the lines docs/your-loop.md shows. Settings come from
``--train-arg KEY=VALUE`` (``Settings``).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from deadpool_hpc.train.corpus import Batches, load_tokens
from deadpool_hpc.train.model import GPT, GPTConfig


@dataclass(frozen=True)
class Settings:
    batch_size: int = 8
    context: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    lr: float = 3e-3
    seed: int = 1337

    @classmethod
    def from_args(cls, args: dict) -> "Settings":
        return settings_from_args(cls, args)


def settings_from_args(cls, args: dict):
    """``cls`` (a dataclass of int and float fields) from ``--train-arg`` values; ValueError names a bad one."""
    known = {f.name: f.type for f in dataclasses.fields(cls)}
    for k, v in args.items():
        if k not in known:
            raise ValueError(f"--train-arg {k}: not a setting of {cls.__module__}; accepted: {', '.join(known)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (known[k] == "int" and not isinstance(v, int)):
            raise ValueError(f"--train-arg {k}={v!r}: accepted: a number ({known[k]})")
    return cls(**{k: float(v) if known[k] == "float" else v for k, v in args.items()})


def build(s: Settings, steps: int):
    """Model, optimizer, schedule and data: the same in the plain and the surviving version."""
    torch.manual_seed(s.seed)                                  # every rank builds the same model
    model = DDP(GPT(GPTConfig(n_layer=s.n_layer, n_head=s.n_head, d_model=s.d_model, context=s.context)))
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    data = Batches(load_tokens(), s.batch_size, s.context, s.seed)   # batch = f(step, rank)
    return model, opt, sched, data


_LAST_WORK = None   # main(): the last collective's work (see fsdp2_gpt.py)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    steps = p.parse_args().steps
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, opt, sched, data = build(Settings(), steps)

    for step in range(steps):
        x, y = data.get(step, dist.get_rank())
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    global _LAST_WORK   # every rank past its last collective, and its work freed at exit, not by gloo: see fsdp2_gpt.py
    _LAST_WORK = dist.barrier(async_op=True)
    _LAST_WORK.wait()
    del model, opt, sched
    dist.destroy_process_group()


def train(ctx) -> None:
    model, opt, sched, data = build(Settings.from_args(ctx.config.train.train_args), ctx.config.train.steps)
    ctx.protect(model, opt, sched)                      # snapshot, replicate, restore; pollable gradient average

    def step_fn(step):
        x, y = data.get(step, ctx.rank)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return {"loss": loss.item()}

    ctx.run(step_fn)


train.check_args = Settings.from_args   # deadpool run checks --train-arg values before any process starts

if __name__ == "__main__":
    main()
