"""The state that exists once per rank besides tensors: the JSON document of a snapshot (no pickle).

Owns: encoding the optimizer's param groups and non-tensor state, the scheduler's, data loader's and ``extra``'s state
dicts (small tensors inline, base64), the CUDA generators and, when asked, Python's and numpy's RNG
(``RankDocument.state``); decoding and applying them at a restore (``RankDocument.load``); the data loader check
(``check_loader``). Also the JSON encoding of the whole document (``encode``, ``decode``: no pickle).
"""
from __future__ import annotations

import base64
import json
import random

import torch



def type_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def is_stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def encode(obj, path: str, sink):
    """JSON-able form of ``obj``. Tensors go to ``sink(path, tensor) -> index`` if given, else inline (base64)."""
    if isinstance(obj, torch.Tensor):
        if sink is not None:
            return {"$t": sink(path, obj)}
        t = obj.detach().cpu().contiguous()
        return {"$x": [str(t.dtype).replace("torch.", ""), list(t.shape),
                       base64.b64encode(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").decode()]}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, float, str)):
        return obj
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: encode(v, f"{path}/{k}", sink) for k, v in obj.items()}
        return {"$d": [[encode(k, path, None), encode(v, f"{path}/{k}", sink)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"$tuple": [encode(v, f"{path}/{i}", sink) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, f"{path}/{i}", sink) for i, v in enumerate(obj)]
    if hasattr(obj, "item") and getattr(obj, "shape", None) == ():   # a numpy scalar
        return obj.item()
    raise TypeError(f"protect: the state at {path or '/'} holds a {type_name(obj)}; accepted: tensors, numbers, "
                    "strings, None, and dicts/lists/tuples of them")


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def decode(obj, tensors):
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "$t" in obj:
            return tensors[obj["$t"]]
        if "$x" in obj:
            dtype, shape, data = obj["$x"]
            raw = bytearray(base64.b64decode(data))
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return t.view(getattr(torch, dtype)).reshape(shape).clone()
        if "$tuple" in obj:
            return tuple(decode(v, tensors) for v in obj["$tuple"])
        if "$d" in obj:
            return {decode(k, tensors): decode(v, tensors) for k, v in obj["$d"]}
        return {k: decode(v, tensors) for k, v in obj.items()}
    return obj


def distributed_sampler(loader):
    from torch.utils.data.distributed import DistributedSampler

    for s in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(s, DistributedSampler):
            return s
    return None


def without_params(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def set_param_groups(optimizer, groups: list[dict]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"protect: the snapshot has {len(groups)} param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    for live, saved in zip(optimizer.param_groups, groups):
        for k, v in saved.items():
            if k != "params":
                live[k] = v


def check_loader(loader) -> None:
    """A data loader whose position can be saved and restored. Raises TypeError naming what was given and what is
    accepted."""
    if is_stateful(loader):
        return   # torchdata's StatefulDataLoader, or any loader that saves and restores its position
    sampler = distributed_sampler(loader)
    if sampler is not None:
        return
    what = "a plain iterator" if hasattr(loader, "__next__") else f"a {type_name(loader)}"
    raise TypeError(f"protect(dataloader=...): got {what}, whose position cannot be saved or restored; "
                    "accepted: torchdata's StatefulDataLoader (anything with state_dict()/load_state_dict()), "
                    "a torch DataLoader whose sampler is a DistributedSampler (its epoch and rank are kept; "
                    "derive the position in the epoch from the step), or None (data drawn as a function of "
                    "the step, e.g. deadpool_hpc.train.Batches.get(step, ctx.rank))")


class RankDocument:
    """What the per-rank JSON document holds besides the model and optimizer tensors: the ``scheduler``'s, the data
    loader's (``loader_guard``, state/loader.py) and ``extra``'s state dicts, the CUDA generators (when CUDA is
    available), Python's (``python_rng``) and numpy's (``numpy_rng``) global RNG. Each of the first three may be
    None. ``state()`` reads them, ``load()`` applies them; the ``optimizer``'s and ``module``'s gradients are
    dropped at a load."""

    def __init__(self, optimizer, module, scheduler=None, loader_guard=None, extra=None, *, python_rng: bool = False,
                 numpy_rng: bool = False):
        self.optimizer, self.module = optimizer, module
        self.scheduler, self.loader_guard, self.extra = scheduler, loader_guard, extra
        self.python_rng, self.numpy_rng = python_rng, numpy_rng
        self.cuda = torch.cuda.is_available()

    def state(self) -> dict:
        """Everything but the model and optimizer tensors (goes into the JSON document)."""
        out: dict = {}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.loader_guard is not None:
            out["loader"] = self.loader_guard.state()   # state/loader.py: the position, the iterators re-armed
        if self.extra is not None:
            out["extra"] = self.extra.state_dict()
        rng: dict = {}
        if self.cuda:
            rng["cuda"] = torch.cuda.get_rng_state_all()
        if self.python_rng:
            rng["python"] = random.getstate()
        if self.numpy_rng:
            import numpy as np

            name, keys, pos, has_gauss, gauss = np.random.get_state()
            rng["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
        out["rng"] = rng
        return out

    def load(self, small: dict) -> None:
        """Gradients dropped; scheduler, loader, extra and RNGs from ``small`` (what ``state()`` gave)."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.module.parameters():
            p.grad = None
        if self.scheduler is not None:
            self.scheduler.load_state_dict(small["scheduler"])
        if self.loader_guard is not None:
            self.loader_guard.load(small["loader"])
        if self.extra is not None:
            self.extra.load_state_dict(small["extra"])
        rng = small["rng"]
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])
        if "python" in rng:
            random.setstate(rng["python"])
        if "numpy" in rng:
            import numpy as np

            name, keys, pos, has_gauss, gauss = rng["numpy"]
            np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
