"""The training function of benchmarks/gpu_check.sh's case b: gloo between the training processes, their state CUDA
tensors. The micro GPT under DistributedDataParallel on ``cuda:LOCAL_RANK`` (modulo the GPUs), protected by
``ctx.protect``: its snapshot is a device-to-host copy into the node's shared slot (replica/devicecopy.py) and a
restore a host-to-device copy, with several ranks. Settings as examples/ddp_gpt.py's (``--train-arg``).
WRITTEN, NOT RUN ON A DEVICE. Run by ``deadpool run --backend gloo --train-fn benchmarks.gpu_check_train:train``."""
from __future__ import annotations

import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from deadpool_hpc.train.corpus import Batches, load_tokens
from deadpool_hpc.train.model import GPT, GPTConfig
from examples.ddp_gpt import Settings


def train(ctx) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks.gpu_check_train needs CUDA (its state is CUDA tensors); accepted: a machine "
                           "with a GPU, or examples.ddp_gpt:train on the CPU")
    s = Settings.from_args(ctx.config.train.train_args)
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.manual_seed(s.seed)
    model = DDP(GPT(GPTConfig(n_layer=s.n_layer, n_head=s.n_head, d_model=s.d_model, context=s.context)).to(dev),
                device_ids=[dev.index])
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ctx.config.train.steps)
    data = Batches(load_tokens(), s.batch_size, s.context, s.seed)
    ctx.protect(model, opt, sched)

    def step_fn(step):
        x, y = data.get(step, ctx.rank)
        _, loss = model(x.to(dev), y.to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return {"loss": loss.item()}

    ctx.run(step_fn)


train.check_args = Settings.from_args
