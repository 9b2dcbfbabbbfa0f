"""A small decoder-only transformer (nanoGPT-style) that the demos and tests train.

Owns: the model definition and its initialisation. Pre-LN blocks, causal
``F.scaled_dot_product_attention``, GELU MLP (4x), learned positions, input/output embedding tied,
init N(0, 0.02) with residual projections scaled by 1/sqrt(2 * n_layer), no dropout.
Given ``torch.manual_seed`` the initial weights, and so a whole run, are reproducible.
Does not own: data (``corpus``), optimizer, training loop, or anything distributed.
The defaults are the "micro" model: 2 layers, 4 heads, d_model 128, context 128, byte vocab (0.446 M params).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    context: int = 128

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} is not accepted: it must be an int >= 1")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model={self.d_model} is not accepted: "
                             f"it must be a multiple of n_head={self.n_head}")


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.attn_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.mlp_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)  # LayerNorm weights stay 1

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx: (B, T) int64 with T <= context -> (logits (B, T, vocab), mean cross-entropy or None)."""
        T = idx.shape[-1]
        if idx.dim() != 2 or T > self.cfg.context:
            raise ValueError(f"idx has shape {tuple(idx.shape)}: "
                             f"(batch, T) with T <= context={self.cfg.context} is accepted")
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss
