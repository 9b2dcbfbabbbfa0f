"""Your own FSDP2 loop, first plain torch, then surviving node loss (docs/your-loop.md).

The micro GPT (deadpool_hpc.train.model) on Shakespeare (deadpool_hpc.train.corpus), written as LLM loops are:
every block and the root sharded with ``torch.distributed.fsdp.fully_shard`` under a ``MixedPrecisionPolicy`` (bf16
parameters in compute, fp32 gradient reduction), gradient accumulation over micro-batches
(``set_requires_gradient_sync``), ``torch.nn.utils.clip_grad_norm_`` over the sharded gradients (a collective over the
mesh), torch.optim.AdamW and a cosine schedule; activation checkpointing of every block with ``--train-arg ac=1``.

Plain (torchrun, no fault tolerance; GPUs with nccl, or CPU with gloo; from the repository root, as a module):

    torchrun --nproc-per-node 4 -m examples.fsdp2_gpt --steps 200

Surviving (from the repository root; the spare replaces node1, the run ends bitwise equal to a failure-free one):

    deadpool run --train-fn examples.fsdp2_gpt:train --nodes 3 --spares 1 --steps 200 --kill node1@40

Any world size: where a dimension does not divide by it (3 ranks) the shards are uneven, and a spare that replaces
a rank with shorter shards reshapes its own at promotion. HSDP with ``--train-arg replicate=2`` (a (2, world / 2)
mesh from ``ctx.init_device_mesh``). Both versions share ``build`` and ``train_step``; ``main`` and ``train`` differ
by the lines docs/your-loop.md shows. Settings come from ``--train-arg KEY=VALUE`` (``Settings``).
"""
from __future__ import annotations

import argparse
import json
import os

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from deadpool_hpc.train.corpus import Batches, load_tokens
from deadpool_hpc.train.model import GPT, GPTConfig
from examples.ddp_gpt import Settings as _Settings, settings_from_args


@dataclass(frozen=True)
class Settings(_Settings):
    max_norm: float = 1.0      # clip_grad_norm_'s bound
    bf16: int = 1              # 1: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32); 0: fp32
    micro_batches: int = 2     # gradient accumulation: the batch in this many micro-batches
    ac: int = 0                # 1: activation checkpointing of every block (torch.utils.checkpoint)
    replicate: int = 1         # > 1: HSDP, a (replicate, world // replicate) mesh: replicate across, shard within
    compile: int = 0           # 1: torch.compile every block (nn.Module.compile, as torchtitan does)

    @classmethod
    def from_args(cls, args: dict) -> "Settings":
        s = settings_from_args(cls, args)
        if s.micro_batches < 1 or s.batch_size % s.micro_batches:
            raise ValueError(f"--train-arg micro_batches={s.micro_batches}: accepted: a divisor of batch_size="
                             f"{s.batch_size}")
        if s.replicate < 1:
            raise ValueError(f"--train-arg replicate={s.replicate}: accepted: 1 (FSDP) or a divisor of the world "
                             "size greater than 1 (HSDP)")
        return s


def hsdp(s: Settings, world_size: int):
    """(shape, names) of the HSDP mesh, or None for plain FSDP (a 1-D mesh of every rank)."""
    if s.replicate == 1:
        return None
    if s.replicate < 1 or world_size % s.replicate:
        raise ValueError(f"--train-arg replicate={s.replicate}: accepted: a divisor of the world size {world_size}")
    return (s.replicate, world_size // s.replicate), ("replicate", "shard")


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (torch.utils.checkpoint, non-reentrant)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def build(s: Settings, steps: int, mesh=None, device: str = "cpu"):
    """Model, optimizer, schedule and data: the same in the plain and the surviving version."""
    torch.manual_seed(s.seed)                                  # every rank builds the same model, then shards it
    model = GPT(GPTConfig(n_layer=s.n_layer, n_head=s.n_head, d_model=s.d_model, context=s.context)).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if s.bf16 else \
        MixedPrecisionPolicy()
    for i, block in enumerate(model.blocks):
        if s.ac:
            block = model.blocks[i] = Checkpointed(block)
        if s.compile:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    data = Batches(load_tokens(), s.batch_size, s.context, s.seed)   # batch = f(step, rank)
    return model, opt, sched, data


def train_step(model, opt, sched, s: Settings, x, y) -> float:
    """One optimizer step over ``s.micro_batches`` micro-batches of (x, y); returns the mean loss."""
    total = 0.0
    for i, (xb, yb) in enumerate(zip(x.chunk(s.micro_batches), y.chunk(s.micro_batches))):
        model.set_requires_gradient_sync(i == s.micro_batches - 1)   # reduce the gradients once, at the last
        _, loss = model(xb, yb)
        (loss / s.micro_batches).backward()
        total += loss.item() / s.micro_batches
    torch.nn.utils.clip_grad_norm_(model.parameters(), s.max_norm)   # the norm: an all-reduce over the mesh
    opt.step()
    sched.step()
    opt.zero_grad()
    return total


_LAST_WORK = None   # main(): the last collective's work, freed by the interpreter's own exit (see the end of main)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--train-arg", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    steps = args.steps
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    s = Settings.from_args({k: json.loads(v) for k, v in (a.split("=", 1) for a in args.train_arg)})
    layout = hsdp(s, dist.get_world_size())
    mesh = init_device_mesh(device, layout[0], mesh_dim_names=layout[1]) if layout else None
    model, opt, sched, data = build(s, steps, mesh=mesh, device=device)

    for step in range(steps):
        x, y = data.get(step, dist.get_rank())
        loss = train_step(model, opt, sched, s, x.to(device), y.to(device))
        if dist.get_rank() == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step} loss {loss:.4f}", flush=True)
    # Every rank past its last collective before any tears its groups down, and that barrier's work object kept
    # until the interpreter exits: a gloo worker thread that drops the last reference to a finished work frees its
    # tensors, which takes the GIL, and a thread that asks for the GIL while the interpreter finalizes is unwound
    # inside that destructor: the process aborts ("terminate called without an active exception"; the core's
    # stack: ProcessGroupGloo::runLoop, ~AsyncBarrierWork, decref_pyobject, take_gil, pthread_exit). A plain
    # dist.barrier() here aborted 4 runs in 75 of 3 ranks; this, 0 in 120.
    global _LAST_WORK
    _LAST_WORK = dist.barrier(async_op=True)
    _LAST_WORK.wait()
    del model, opt, sched
    dist.destroy_process_group()


def train(ctx) -> None:
    s = Settings.from_args(ctx.config.train.train_args)
    layout = hsdp(s, ctx.world_size)
    mesh = ctx.init_device_mesh(*layout) if layout else ctx.device_mesh
    model, opt, sched, data = build(s, ctx.config.train.steps, mesh=mesh, device=ctx.device)
    ctx.protect(model, opt, sched)            # snapshot, replicate, restore; the mesh's collectives pollable

    def step_fn(step):
        x, y = data.get(step, ctx.rank)
        loss = train_step(model, opt, sched, s, x.to(ctx.device), y.to(ctx.device))
        return {"loss": loss}

    ctx.run(step_fn)


train.check_args = Settings.from_args   # deadpool run checks --train-arg values before any process starts

if __name__ == "__main__":
    main()
