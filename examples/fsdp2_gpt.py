"""Your own FSDP2 loop, first plain torch, then surviving node loss (docs/your-loop.md).

The micro GPT (deadpool_hpc.train.model) on Shakespeare (deadpool_hpc.train.corpus), every block and the root
sharded with ``torch.distributed.fsdp.fully_shard``, torch.optim.AdamW and a cosine schedule.

Plain (torchrun, no fault tolerance; GPUs with nccl, or CPU with gloo):

    torchrun --nproc-per-node 4 examples/fsdp2_gpt.py --steps 200

Surviving (from the repository root; the spare replaces node1, the run ends bitwise equal to a failure-free one):

    deadpool run --train-fn examples.fsdp2_gpt:train --nodes 4 --spares 1 --steps 200 --kill node1@40

Every sharded dimension must divide by the world size (a spare builds its model before it knows its rank, so all
ranks' shards must have the same shapes; ``ctx.protect`` says which parameter does not). The micro GPT's do for 1,
2, 4 and 8 ranks. Both versions share ``build``; ``main`` and ``train`` differ by the lines docs/your-loop.md
shows. Settings come from ``--train-arg KEY=VALUE`` (examples.ddp_gpt.Settings).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from deadpool_hpc.train.corpus import Batches, load_tokens
from deadpool_hpc.train.model import GPT, GPTConfig
from examples.ddp_gpt import Settings


def build(s: Settings, steps: int, mesh=None, device: str = "cpu"):
    """Model, optimizer, schedule and data: the same in the plain and the surviving version."""
    torch.manual_seed(s.seed)                                  # every rank builds the same model, then shards it
    model = GPT(GPTConfig(n_layer=s.n_layer, n_head=s.n_head, d_model=s.d_model, context=s.context)).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    data = Batches(load_tokens(), s.batch_size, s.context, s.seed)   # batch = f(step, rank)
    return model, opt, sched, data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    steps = p.parse_args().steps
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    model, opt, sched, data = build(Settings(), steps, device=device)

    for step in range(steps):
        x, y = data.get(step, dist.get_rank())
        _, loss = model(x.to(device), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


def train(ctx) -> None:
    model, opt, sched, data = build(Settings.from_args(ctx.config.train_args), ctx.config.steps,
                                    mesh=ctx.device_mesh, device=ctx.device)   # shard over the job's ranks
    ctx.protect(model, opt, sched)                      # snapshot, replicate, restore; pollable FSDP2 collectives

    def step_fn(step):
        x, y = data.get(step, ctx.rank)
        _, loss = model(x.to(ctx.device), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return {"loss": loss.item()}

    ctx.run(step_fn)


train.check_args = Settings.from_args   # deadpool run checks --train-arg values before any process starts

if __name__ == "__main__":
    main()
