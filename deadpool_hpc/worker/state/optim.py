"""The optimizer's dry step: the state a torch.optim optimizer creates lazily at its first ``step()``, created
without changing a parameter (worker/protect.py's module docstring, "Layout")."""
from __future__ import annotations

import torch


def dry_step(optimizer) -> None:
    """One ``optimizer.step()`` that changes no parameter and creates the optimizer's state: zero gradients, lr 0
    (AdamW's decoupled weight decay multiplies by 1 - 0 * wd, its update adds 0); the gradients are dropped and the
    learning rates put back after. Its step pre-hooks run: a caller whose hook must not count it as a training step
    says so itself (worker/protect.py)."""
    lrs = []
    with torch.no_grad():
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            lrs.append(g.get("lr"))
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
            for p in g["params"]:
                p.grad = None
