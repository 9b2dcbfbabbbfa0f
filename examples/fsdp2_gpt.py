"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over the micro GPT: plain torch, no fault tolerance yet.

    torchrun --nproc-per-node 2 examples/fsdp2_gpt.py --steps 20            # GPUs (nccl), or CPU (gloo)

``ctx.protect`` does not take FSDP2 modules yet (it refuses them with a ValueError): FSDP2's all-gathers and
reduce-scatters are issued inside its hooks and waited on without a way to poll them against a failure flag, and
its state is sharded DTensors. What this script does on CPU with gloo in torch 2.13 is recorded in
docs/your-loop.md.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from deadpool_hpc.train.corpus import Batches, load_tokens
from deadpool_hpc.train.model import GPT, GPTConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    steps = p.parse_args().steps
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1337)
    model = GPT(GPTConfig())
    if cuda:
        model = model.cuda()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    data = Batches(load_tokens(), 8, 128, 1337)
    for step in range(steps):
        x, y = data.get(step, dist.get_rank())
        if cuda:
            x, y = x.cuda(), y.cuda()
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
