"""Tensor parallel x FSDP2, the torchtitan shape: plain torch first, then surviving node loss (docs/your-loop.md).

A Llama-style decoder (RMSNorm, rotary position embedding, grouped-query attention, SwiGLU feed-forward) on
Shakespeare's bytes (deadpool_hpc.train.corpus), on a 2-D mesh ``(dp, tp)``: inside each ``tp`` group every block's
attention and feed-forward are split with ``parallelize_module`` (``ColwiseParallel`` for wq/wk/wv and w1/w3,
``RowwiseParallel`` for wo and w2: Megatron's split), and across the ``dp`` groups every block and the root are
sharded with ``fully_shard``. torch.optim.AdamW, a cosine schedule, ``clip_grad_norm_`` over the 2-D DTensor
gradients.

Plain (torchrun, no fault tolerance; GPUs with nccl, or CPU with gloo; from the repository root, as a module):

    torchrun --nproc-per-node 4 -m examples.llama_tp --steps 200

Surviving (from the repository root; the spare replaces node1, the run ends bitwise equal to a failure-free one):

    deadpool run --train-fn examples.llama_tp:train --nodes 4 --spares 1 --steps 200 --kill node1@40

Every rank builds the whole model from the same seed and keeps its own pieces (``src_data_rank=None``: no
broadcast at build time). A batch is a function of (step, data-parallel rank): the ranks of a ``tp`` group read the
same one. Settings come from ``--train-arg KEY=VALUE`` (``Settings``); ``tp`` must divide the world size, the number of
key/value heads and the hidden sizes.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from deadpool_hpc.train.corpus import Batches, load_tokens
from examples.ddp_gpt import settings_from_args


@dataclass(frozen=True)
class Settings:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2        # grouped-query attention: 2 query heads share each key/value head
    ffn_hidden: int = 128
    context: int = 32
    batch_size: int = 4
    tp: int = 2                # the tensor-parallel degree (the mesh's last dimension)
    lr: float = 3e-3
    max_norm: float = 1.0
    seed: int = 1337

    @classmethod
    def from_args(cls, args: dict) -> "Settings":
        s = settings_from_args(cls, args)
        for name in ("n_heads", "n_kv_heads", "ffn_hidden"):
            if s.tp < 1 or getattr(s, name) % s.tp:
                raise ValueError(f"--train-arg tp={s.tp}: accepted: a divisor of {name}={getattr(s, name)}")
        return s


# ---- the model (Llama-style) ----------------------------------------------------------------------------------------
def rotary(head_dim: int, context: int, theta: float = 10000.0) -> torch.Tensor:
    """cos/sin of the rotary position embedding, shape (context, head_dim // 2, 2)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(context).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D) -> rotated pairs (x[2i], x[2i+1]) by position."""
    B, T, H, D = x.shape
    xr = x.float().reshape(B, T, H, D // 2, 2)
    cos, sin = rope[:T, None, :, 0], rope[:T, None, :, 1]
    out = torch.stack([xr[..., 0] * cos - xr[..., 1] * sin, xr[..., 0] * sin + xr[..., 1] * cos], dim=-1)
    return out.reshape(B, T, H, D).type_as(x)


class Attention(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = s.n_heads, s.n_kv_heads, s.dim // s.n_heads
        self.wq = nn.Linear(s.dim, s.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(s.n_heads * self.head_dim, s.dim, bias=False)

    def forward(self, x, rope):
        B, T, _ = x.shape   # n_heads / n_kv_heads: this rank's heads (divided by tp when parallelized)
        q = apply_rotary(self.wq(x).view(B, T, -1, self.head_dim), rope)
        k = apply_rotary(self.wk(x).view(B, T, -1, self.head_dim), rope)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        groups = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))   # grouped-query attention
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.w1 = nn.Linear(s.dim, s.ffn_hidden, bias=False)
        self.w3 = nn.Linear(s.dim, s.ffn_hidden, bias=False)
        self.w2 = nn.Linear(s.ffn_hidden, s.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))   # SwiGLU


class Block(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(s.dim), nn.RMSNorm(s.dim)
        self.attention, self.feed_forward = Attention(s), FeedForward(s)

    def forward(self, x, rope):
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.tok_embeddings = nn.Embedding(256, s.dim)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.n_layers))
        self.norm = nn.RMSNorm(s.dim)
        self.output = nn.Linear(s.dim, 256, bias=False)
        self.register_buffer("rope", rotary(s.dim // s.n_heads, s.context), persistent=False)

    def forward(self, idx, targets):
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, self.rope)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


# ---- parallelism, optimizer, data: the same in both versions ---------------------------------------------------------
def build(s: Settings, steps: int, mesh, device: str = "cpu"):
    """``mesh``: a 2-D DeviceMesh ("dp", "tp"). Model (TP inside each tp group, FSDP2 across dp), optimizer,
    schedule, data."""
    torch.manual_seed(s.seed)                         # every rank builds the same model, then keeps its pieces
    model = Llama(s).to(device)
    tp = mesh["tp"]
    for block in model.layers:
        parallelize_module(block, tp, {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                                       "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                                       "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                                       "feed_forward.w2": RowwiseParallel()}, src_data_rank=None)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    data = Batches(load_tokens(), s.batch_size, s.context, s.seed)   # batch = f(step, data-parallel rank)
    return model, opt, sched, data


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for gradients on two meshes (TP's parameters on the 2-D one, the norms' and
    embeddings' on FSDP's 1-D one, which torch's refuses to stack): one norm per mesh (a DTensor reduction: an
    all-reduce over that mesh), then torch's clip with the total."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps]).full_tensor() for ps in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def train_step(model, opt, sched, s: Settings, x, y) -> float:
    loss = model(x, y)
    loss.backward()
    clip_grad_norm_(model.parameters(), s.max_norm)   # all-reduces over both mesh dimensions
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.item()


_LAST_WORK = None   # main(): the last collective's work (see fsdp2_gpt.py)


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
    mesh = init_device_mesh(device, (dist.get_world_size() // s.tp, s.tp), mesh_dim_names=("dp", "tp"))
    model, opt, sched, data = build(s, steps, mesh, device=device)

    for step in range(steps):
        x, y = data.get(step, dist.get_rank() // s.tp)
        loss = train_step(model, opt, sched, s, x.to(device), y.to(device))
        if dist.get_rank() == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step} loss {loss:.4f}", flush=True)
    global _LAST_WORK   # every rank past its last collective, and its work freed at exit, not by gloo: see fsdp2_gpt.py
    _LAST_WORK = dist.barrier(async_op=True)
    _LAST_WORK.wait()
    del model, opt, sched
    dist.destroy_process_group()


def train(ctx) -> None:
    s = Settings.from_args(ctx.config.train.train_args)
    mesh = ctx.init_device_mesh((ctx.world_size // s.tp, s.tp), ("dp", "tp"))
    model, opt, sched, data = build(s, ctx.config.train.steps, mesh, device=ctx.device)
    ctx.protect(model, opt, sched)

    def step_fn(step):
        x, y = data.get(step, ctx.rank // s.tp)
        loss = train_step(model, opt, sched, s, x.to(ctx.device), y.to(ctx.device))
        return {"loss": loss}

    ctx.run(step_fn)


train.check_args = Settings.from_args   # deadpool run checks --train-arg values before any process starts

if __name__ == "__main__":
    main()
