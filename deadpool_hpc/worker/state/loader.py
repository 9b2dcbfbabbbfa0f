"""The data loader and the iterators the user's loop holds: part of the state that a restore must bring back.

Owns: what ``ctx.protect(..., dataloader=loader)`` does to the loader so that whatever the loop holds that produces
batches resumes exactly where a restored step expects it; the refusal, before step 0, of a loader or iterator that
cannot be made exact.

Why the iterators, not only the loader. Training loops make an iterator once (``it = iter(loader)`` before the loop,
torchtitan's shape) or once per epoch, and call ``next(it)`` in every step. Restoring the loader's state
(``load_state_dict``) changes what the *next* ``iter(loader)`` gives, not an iterator made before: the survivors'
went on from where they were (a step ahead after a cut behind them), a promoted spare's from the start of the
epoch, silently. So after ``protect`` every ``iter(loader)`` returns a ``BatchIterator`` owned here: it forwards
``next`` to the loader's own iterator, and a restore re-arms it (the loader's iterator is made again from the
restored state at its next ``next``), whoever holds it (the user's variable, a generator wrapped around it). The
loop keeps its shape. ``iter`` looks ``__iter__`` up on the type, so the loader's class is replaced by a subclass of
it (same name, ``isinstance`` unchanged) whose ``__iter__`` makes the ``BatchIterator``; a ``protect`` that returned
an iterator would leave the ``it = iter(loader)`` people write stale, and wrapping the loader in another object
would change what they pass to their own code.

Kinds of loader (``LoaderGuard``):

- *stateful*: anything with ``state_dict()``/``load_state_dict()`` (torchdata's ``StatefulDataLoader``, with worker
  processes and prefetching; a Hugging Face ``datasets.IterableDataset``). Saved: its state dict (the position
  counts batches handed out, not prefetched ones; worker seeds are in it). Restored: ``load_state_dict``, then the
  iterator is made again from it.
- *sampler*: a torch ``DataLoader`` whose sampler is a ``DistributedSampler``. Saved: the sampler's epoch, the
  number of batches the current iterator handed out, and the state of the generator its base seed was drawn from
  when it was made (``loader.generator``, else torch's default; 5,056 bytes). Restored: the epoch, the generator's
  state for the moment the iterator is made again (so its workers get the same seeds), then that many batches are
  read and dropped: the cost of a restore grows with the position in the epoch (every batch is loaded again), the
  result is exact, worker-side random transforms included.

In both kinds a DistributedSampler's ``epoch`` is saved too (torchdata's ``StatefulDistributedSampler`` does not
keep it), and its ``rank`` follows the process's training rank (``bind``). Re-arming an iterator does not touch the
torch RNG (its state is saved and put back around the new iterator's base-seed draw), so the restored RNG is the
failure-free run's.

Refused before step 0 (``ValueError``): an iterator of the loader made before ``protect`` (it would not be
re-armed), and, at ``ctx.run``'s start, any live DataLoader iterator that is not one of these (a loader not handed
to ``protect``: ``check_no_stray_iterators``).
"""
from __future__ import annotations

import gc
import warnings

import torch

_GUARDED: dict[type, type] = {}


def _name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _loader_iterators() -> list:
    """Every live iterator of a torch (or torchdata) DataLoader in this process (a walk over the gc's objects:
    ~0.1 s, done once before step 0)."""
    try:
        from torch.utils.data.dataloader import _BaseDataLoaderIter
    except ImportError:   # pragma: no cover
        return []
    with warnings.catch_warnings():   # isinstance on some modules' lazy objects warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, _BaseDataLoaderIter)]


def _guarded_class(cls: type) -> type:
    """``cls`` with ``__iter__`` returning the guard's ``BatchIterator`` (same name and module)."""
    sub = _GUARDED.get(cls)
    if sub is None:
        def __iter__(self):
            return self._deadpool_guard.make_iterator()

        sub = _GUARDED[cls] = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                                          "__qualname__": cls.__qualname__,
                                                          "_deadpool_base": cls})
    return sub


class _RngKept:
    """Save torch's default generator (and ``extra``, a generator) around a block; put them back after it."""

    def __init__(self, extra=None):
        self.gens = [torch.default_generator] + ([extra] if extra is not None else [])

    def __enter__(self):
        self.states = [g.get_state() for g in self.gens]

    def __exit__(self, *exc):
        for g, s in zip(self.gens, self.states):
            g.set_state(s)


class BatchIterator:
    """What ``iter(loader)`` returns once the loader is protected: the loader's own iterator behind it, made again
    from the restored state after a restore (at the next ``next``). Raises what the loader's iterator raises
    (``StopIteration`` at the epoch's end)."""

    def __init__(self, guard: "LoaderGuard"):
        self._guard = guard
        self._inner = None
        self.consumed = 0          # batches handed out since this iterator's epoch began
        self._gen_state = None     # sampler kind: the generator's state when its loader iterator was made

    def __iter__(self):
        return self

    def __next__(self):
        if self._inner is None:
            self._guard._arm(self)
        batch = next(self._inner)
        self.consumed += 1
        return batch

    def __len__(self) -> int:
        return len(self._guard.loader)

    def __getattr__(self, name):   # the loader iterator's own attributes (e.g. _num_yielded)
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class LoaderGuard:
    """The loader handed to ``ctx.protect`` (see the module docstring). ``stateful``: the loader saves its own
    position; else ``sampler`` (the DistributedSampler found in it) must be set. Raises ValueError if an iterator of
    the loader exists already."""

    def __init__(self, loader, stateful: bool, sampler):
        self.loader, self.stateful, self.sampler = loader, stateful, sampler
        self._check_no_iterator_yet()
        self._base = type(loader)
        self.current: BatchIterator | None = None
        self._pending: dict | None = None   # sampler kind: a restored position the next arm applies
        loader.__class__ = _guarded_class(self._base)
        object.__setattr__(loader, "_deadpool_guard", self)

    def follow_rank(self, rank: int | None, world_size: int) -> None:
        """The DistributedSampler reads for training rank ``rank`` of ``world_size`` (its sizes follow a changed
        ``num_replicas``, as its constructor computes them). Called by ``protect`` with the first generation's rank
        (before ``ctx.run``, ``ctx.rank`` is None and torch's default group is the process alone, so a sampler built
        with ``rank=ctx.rank`` or none says rank 0 of 1, and a loader with workers draws its first indices at
        ``iter()``), and at every ``bind``. ``rank`` None (a spare): left as it is."""
        if rank is None:
            return
        # a Hugging Face datasets.IterableDataset split with split_dataset_by_node reads its node's part at iteration
        # time from its DistributedConfig: it follows the rank too (given as the loader, or as its dataset)
        for ds in (self.loader, getattr(self.loader, "dataset", None)):
            dist_cfg = getattr(ds, "_distributed", None)
            if dist_cfg is not None and hasattr(dist_cfg, "rank") and hasattr(dist_cfg, "world_size"):
                if dist_cfg.world_size != world_size:
                    raise ValueError(f"protect(dataloader=...): the datasets.IterableDataset was split with "
                                     f"split_dataset_by_node(world_size={dist_cfg.world_size}); accepted: "
                                     f"world_size=ctx.world_size ({world_size})")
                dist_cfg.rank = rank
        s = self.sampler
        if s is None:
            return
        s.rank = rank
        if s.num_replicas != world_size:
            s.num_replicas = world_size
            n = len(s.dataset)
            if s.drop_last and n % world_size:
                s.num_samples = -(-(n - world_size) // world_size)
            else:
                s.num_samples = -(-n // world_size)
            s.total_size = s.num_samples * world_size

    # ---- checks ------------------------------------------------------------------------------------------------
    def _check_no_iterator_yet(self) -> None:
        loader = self.loader
        own = getattr(loader, "_iterator", None)
        made = own is not None and not getattr(loader, "_initial_iter_for_state_dict", False)
        if not made:
            sampler = getattr(loader, "_index_sampler", None) if hasattr(loader, "_get_iterator") else None
            made = sampler is not None and any(getattr(i, "_index_sampler", None) is sampler
                                               for i in _loader_iterators())
        if made:
            raise ValueError(
                f"protect(dataloader={type(loader).__name__}): an iterator of this loader was made before "
                "ctx.protect (iter(loader)); it is the loader's own iterator, which a restore cannot move, so after "
                "a recovery it would go on from where it was (a promoted spare's from the epoch's start) and the "
                "data order would silently differ from the failure-free run's; accepted: call iter(loader) after "
                "ctx.protect(model, opt, dataloader=loader) (before ctx.run or inside the step), "
                "docs/your-loop.md, 'Data'")

    def owns(self, it) -> bool:
        """Whether the loader iterator ``it`` is the one behind this guard's current ``BatchIterator``."""
        if it is getattr(self.loader, "_iterator", None):   # a StatefulDataLoader's, made by state_dict()
            return True
        return self.current is not None and self.current.__dict__.get("_inner") is it

    # ---- iterators ---------------------------------------------------------------------------------------------
    def _real_iter(self):
        return self._base.__iter__(self.loader)

    def _generator(self):
        return getattr(self.loader, "generator", None) or torch.default_generator

    def make_iterator(self) -> BatchIterator:
        """``iter(loader)``: a new ``BatchIterator`` over a new loader iterator, made now (workers start now, the
        base seed is drawn now: as without deadpool)."""
        it = BatchIterator(self)
        if self._pending is not None:
            self._arm(it)
        else:
            if not self.stateful:
                it._gen_state = self._generator().get_state()
            it._inner = self._real_iter()
        self.current = it
        return it

    def _arm(self, it: BatchIterator) -> None:
        """Make ``it``'s loader iterator again from the restored state, leaving the torch RNG as it is."""
        pending, self._pending = self._pending, None
        if self.stateful:
            with _RngKept():
                it._inner = self._real_iter()
            return
        pending = pending or {}
        gen = self._generator()
        with _RngKept(None if gen is torch.default_generator else gen):
            state = pending.get("gen")
            if state is not None:
                gen.set_state(state)
            it._gen_state = gen.get_state()
            inner = self._real_iter()
        skip = int(pending.get("consumed", 0))
        for _ in range(skip):   # read and dropped: the workers' own progress (random transforms) is replayed too
            next(inner)
        it._inner, it.consumed = inner, skip

    # ---- state ------------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """The loader's position, as JSON-able values and small tensors (the snapshot's document)."""
        out: dict = {}
        if self.sampler is not None:
            out["epoch"] = int(self.sampler.epoch)
        if self.stateful:
            with _RngKept():   # a StatefulDataLoader without an iterator makes one here (its base seed)
                out["state"] = self.loader.state_dict()
        else:
            cur = self.current
            out["consumed"] = 0 if cur is None else int(cur.consumed)
            gen = None if cur is None else cur._gen_state
            out["gen"] = gen
        return out

    def load(self, state: dict) -> None:
        """Apply a saved ``state``: the loader's position; the current iterator is made again at its next ``next``
        (its old loader iterator's workers are shut down now)."""
        if self.sampler is not None and "epoch" in state:
            self.sampler.set_epoch(int(state["epoch"]))
        cur = self.current
        old = None if cur is None else cur.__dict__.get("_inner")
        if old is not None:
            shutdown = getattr(old, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
            if getattr(self.loader, "_iterator", None) is old:
                object.__setattr__(self.loader, "_iterator", None)
            cur._inner = None
        if self.stateful:
            self.loader.load_state_dict(state["state"])
        else:
            self._pending = {"consumed": state.get("consumed", 0), "gen": state.get("gen")}


def check_no_stray_iterators(guards) -> None:
    """Before step 0: every live DataLoader iterator must be behind a protected loader's ``BatchIterator``
    (``guards``: the LoaderGuards of this process). Raises ValueError naming what was found."""
    def find():
        return [i for i in _loader_iterators() if not any(g.owns(i) for g in guards)]

    stray = find()
    if stray:
        del stray
        gc.collect()   # an unreferenced iterator in a reference cycle is not one the loop holds
        stray = find()
    if stray:
        kinds = sorted({_name(i) for i in stray})
        raise ValueError(
            f"ctx.run: {len(stray)} DataLoader iterator(s) ({', '.join(kinds)}) exist that ctx.protect does not "
            "know about: their position is not saved, so after a recovery they would go on from where they were and "
            "the data order would silently differ from the failure-free run's; accepted: hand the loader to "
            "ctx.protect(model, opt, dataloader=loader) and call iter(loader) after it, or draw the batches as a "
            "function of the step (docs/your-loop.md, 'Data')")
