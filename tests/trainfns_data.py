"""The data pipeline as people write it (issue 43): ``--train-fn trainfns_data:train`` with this folder on PYTHONPATH.

A small DDP MLP with AdamW, fed by a loader made the way training scripts make it, chosen by ``--train-arg``:

- ``loader``: ``sdl`` (torchdata's ``StatefulDataLoader`` with a shuffled ``StatefulDistributedSampler``), ``dl``
  (torch's ``DataLoader`` with a shuffled ``DistributedSampler``), ``hf`` (a Hugging Face ``datasets`` map-style
  dataset in a ``StatefulDataLoader``), ``hfiter`` (a ``datasets.IterableDataset`` split with
  ``split_dataset_by_node``, in a ``StatefulDataLoader``);
- ``workers``: the loader's ``num_workers`` (0, 2, ...);
- ``shape``: ``once`` (one iterator made before ``ctx.run``, ``next(it)`` in every step: torchtitan's loop) or
  ``epoch`` (a new iterator at every epoch's end, the epoch taken from the sampler: ``set_epoch(epoch + 1)``);
- ``samples``: the dataset's length (default: enough for every step in one epoch);
- ``pace``: seconds each step after step 40 sleeps first (default 0): time for a node whose rank was killed at step
  40 to come back to the spare pool before the run ends, whatever the machine's load (the arithmetic is unchanged).

Every rank's loss is reported; the parameters' digest at the end tells whether the data order was the
failure-free run's.
"""
from __future__ import annotations

import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

BATCH = 4


class Squares(torch.utils.data.Dataset):
    """Sample i: a fixed input (from a generator seeded with i) and its target; the same in every process."""

    def __init__(self, n: int, width: int = 8):
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + int(i))
        x = torch.randn(self.width, generator=g)
        return x, x.pow(2).sum(dim=0, keepdim=True)


def make_loader(ctx, kind: str, workers: int, n: int):
    common = dict(batch_size=BATCH, num_workers=workers)
    if workers:
        common.update(prefetch_factor=2)
    if kind == "dl":
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(Squares(n), num_replicas=ctx.world_size, rank=ctx.rank or 0, shuffle=True,
                                     seed=7)
        return DataLoader(Squares(n), sampler=sampler, **common), sampler
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    if kind == "hfiter":   # a datasets.IterableDataset split by node, in a StatefulDataLoader
        import datasets
        from datasets.distributed import split_dataset_by_node

        ds = datasets.Dataset.from_dict({"i": list(range(n))}).to_iterable_dataset(num_shards=12)
        ds = split_dataset_by_node(ds, rank=ctx.rank or 0, world_size=ctx.world_size)
        return StatefulDataLoader(ds, **common), None
    if kind == "hf":
        import datasets

        ds = datasets.Dataset.from_dict({"i": list(range(n))}).with_format("torch")
        data = _HFSquares(ds)
    else:
        data = Squares(n)
    sampler = StatefulDistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank or 0, shuffle=True, seed=7)
    return StatefulDataLoader(data, sampler=sampler, **common), sampler


class _HFSquares(torch.utils.data.Dataset):
    """A Hugging Face map-style dataset's rows turned into samples, as a user's ``.map`` / collate would."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        return Squares(len(self.ds))[int(self.ds[int(i)]["i"])]


def train(ctx) -> None:
    a = ctx.config.train.train_args
    kind, workers, shape = a.get("loader", "sdl"), int(a.get("workers", 2)), a.get("shape", "once")
    n = int(a.get("samples", ctx.world_size * BATCH * ctx.config.train.steps))
    pace = float(a.get("pace", 0))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader, sampler = make_loader(ctx, kind, workers, n)
    ctx.protect(model, opt, dataloader=loader)
    it = iter(loader)

    def step_fn(s: int) -> dict:
        nonlocal it
        if pace and s > 40:
            time.sleep(pace)
        try:
            batch = next(it)
        except StopIteration:
            if shape != "epoch":
                raise
            sampler.set_epoch(sampler.epoch + 1)
            it = iter(loader)
            batch = next(it)
        if isinstance(batch, dict):   # rows of a datasets.IterableDataset: {"i": tensor of row numbers}
            rows = [Squares(n)[int(i)] for i in batch["i"]]
            x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        else:
            x, y = batch
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return {"loss": loss.item()}

    ctx.run(step_fn)
