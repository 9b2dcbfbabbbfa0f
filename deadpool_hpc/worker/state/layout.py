"""The snapshot layout of ``ctx.protect``'s state: which tensor sits where in the payload, and the payload's tensors
at a snapshot.

Owns: the layout fixed before the first step (``SnapshotLayout``: entries in payload order, 8-byte elements first;
the data-parallel *common* bytes cut into shares and the per-rank *unique* tensors; the JSON region's size), the
payload's tensors at each snapshot (``state_tensors``: views of the live tensors, cached while they are the same
objects), the byte ranges of a share (``share_pieces``) and, at a restore, the fresh tensors a payload is read into
and the state tree rebuilt from them (``restore_targets``, ``take_restored``, ``decode``). Does not own: which shares
a rank keeps and how missing ones are found (shares.py), the FSDP2 shards' padded shapes (shards.py), what the JSON
document holds besides the tensors' places (document.py).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Callable

import torch

from .document import decode, dumps, encode, without_params
from .shards import local_shard, local_shards, pad_pieces

BLOB_MIN = 64 << 10          # bytes reserved for the JSON document, at least
_HDR = struct.Struct("<Q")   # the JSON region starts with the document's length


def _storage_key(t: torch.Tensor):
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _document(tree, small: dict) -> bytes:
    return dumps({"tree": tree, "small": encode(small, "", None)}).encode()


def _split(state: dict, sink) -> object:
    """Encode ``state``; tensor leaves go to ``sink(path, tensor) -> index``; a tensor already seen (a tied weight
    under a second name) is referenced, not stored twice."""
    seen: dict = {}

    def once(path, t):
        key = _storage_key(t)
        if key not in seen:
            seen[key] = sink(path, t)
        return seen[key]

    return encode(state, "", once)


@dataclass
class Restored:
    """A payload read into ``restore_targets()``: the ``kept`` shares (1-D uint8, ``shard_nbytes`` each), the per-rank
    ``unique`` tensors (payload order) and the JSON ``doc`` (parsed)."""
    kept: list
    unique: list
    doc: dict


class SnapshotLayout:
    """The payload layout of ``model``'s (its state dict through DCP: a DDP wrapper's ``module.`` prefix dropped) and
    ``optimizer``'s state, fixed from ``model_sd`` and ``optim_sd`` (their state dicts as the first step leaves them).

    ``module``: the model's own module (DDP's ``module``), whose parameters and buffers tell whether the state's
    tensors are still the same objects; ``unique(path) -> bool``: the tensor at ``path`` is this rank's own
    (replicated whole), else the same on every rank (cut into shares); ``small()``: the rest of the JSON document
    (document.py ``RankDocument.state``), read at every snapshot; ``parts``: how many shares the common bytes are cut
    into (the world size; 1 for HSDP's replicate group); ``kept``: how many shares the payload's local prefix keeps
    (1 + K); ``sharded``: the state is FSDP2's local shards (``padded``: id(local shard) -> the shape its place has,
    ``shards._padded_shape``).

    Public after construction (read-only): ``entries`` ((path, dtype, shape) per tensor, layout index order),
    ``unique`` (the indices of the per-rank tensors, payload order), ``common_nbytes``, ``shard_nbytes``,
    ``local_nbytes`` (``kept * shard_nbytes``), ``blob_nbytes`` (the JSON region), ``kept``."""

    def __init__(self, model, module, optimizer, model_sd: dict, optim_sd: dict, *, unique: Callable[[str], bool],
                 small: Callable[[], dict], parts: int, kept: int, sharded: bool = False, padded: dict | None = None):
        self._model, self._optimizer, self._small, self._sharded = model, optimizer, small, sharded
        self.kept = kept
        self.entries: list[tuple[str, torch.dtype, tuple]] = []
        self._index: dict[str, int] = {}
        padded = padded or {}

        def add(path, t):
            self._index[path] = len(self.entries)
            self.entries.append((path, t.dtype, padded.get(id(t), tuple(t.shape))))
            return 0

        tree = _split({"model": model_sd, "optim": optim_sd}, add)
        doc = _document(tree, small())
        self.blob_nbytes = max(BLOB_MIN, 4 * len(doc) + 4096 + _HDR.size)
        self.blob_nbytes += -self.blob_nbytes % 8
        # 8-byte elements first, then 4, 2, 1: every view into the payload (and into the gathered state) is aligned
        esize = [torch.empty(0, dtype=dtype).element_size() for _, dtype, _ in self.entries]
        order = sorted(range(len(self.entries)), key=lambda i: -esize[i])
        # parameters and optimizer state are the same on every rank (DDP): each rank's payload holds 1/parts of
        # their bytes; buffers (per rank, as DDP without broadcast_buffers keeps them) are held whole
        self._common = [i for i in order if not unique(self.entries[i][0])]
        self.unique = [i for i in order if unique(self.entries[i][0])]
        self._span: dict[int, tuple[int, int]] = {}
        off = 0
        for i in self._common:
            n = math.prod(self.entries[i][2]) * esize[i]
            self._span[i] = (off, n)
            off += n
        self.common_nbytes = off
        self.shard_nbytes = max(8, -(-off // (parts * 8)) * 8)
        self.local_nbytes = kept * self.shard_nbytes   # the shares kept, never sent
        self._sig_tensors = [local_shard(t) for t in list(module.parameters()) + list(module.buffers())]
        self._plans: dict[int, tuple] = {}
        self._cache_sig, self._cache = None, None
        self._pieces = None   # ((signature, owners), the shares' pieces): see state_tensors
        self._zeros = None    # the JSON region's padding (state_tensors)
        self._pad = None      # zero bytes after short FSDP2 shards (_zero_bytes)
        self._scratch = None  # restore_targets

    def layout_tensors(self) -> list[torch.Tensor]:
        """Meta tensors describing the payload's state tensors, in payload order: the ``kept`` shares of the common
        state (bytes: the local prefix, ``local_nbytes``), the per-rank tensors, the JSON region."""
        return [torch.empty(self.shard_nbytes, dtype=torch.uint8, device="meta") for _ in range(self.kept)] + \
            [torch.empty(self.entries[i][2], dtype=self.entries[i][1], device="meta") for i in self.unique] + \
            [torch.empty(self.blob_nbytes, dtype=torch.uint8, device="meta")]

    def forget(self) -> None:
        """Drop what was cached about the live tensors (their shapes or objects changed: a restore, FSDP2's
        rebind)."""
        self._cache_sig, self._cache, self._pieces = None, None, None

    def state_tensors(self, owners: list[int]) -> list:
        """The current state, in payload order, with the shares of the ranks ``owners`` (len ``kept``) as the local
        prefix. Tensors are the live ones (the optimizer does not update before the replica is committed); the
        shares are lists of 1-D uint8 pieces of them, and so is the JSON region (a fresh tensor of the document,
        then zeros). Raises ValueError when the state no longer fits the layout."""
        sig = self._signature()
        if sig is not None and sig == self._cache_sig:
            # the same tensors as last time: only the param groups' scalars (lr, ...) and the small state are read
            # and encoded again; the rest of the document (the tensors' places, ~100 entries) is the cached JSON
            found, model_json, state_json, names = self._cache
            groups = [dict(encode(without_params(g), "", None), params=n)
                      for g, n in zip(self._optimizer.param_groups, names)]
            doc = ('{"tree":{"model":%s,"optim":{"state":%s,"param_groups":%s},"optim_empty":false},"small":%s}' % (
                model_json, state_json, dumps(groups), dumps(encode(self._small(), "", None)))).encode()
        else:
            found, tree = self.collect()
            self._cache_sig = sig if not tree["optim_empty"] else None
            if self._cache_sig is not None:
                self._cache = (found, dumps(tree["model"]), dumps(tree["optim"]["state"]),
                               [g["params"] for g in tree["optim"]["param_groups"]])
            doc = _document(tree, self._small())
        if len(doc) + _HDR.size > self.blob_nbytes:
            raise ValueError(f"protect: the non-tensor state is {len(doc)} bytes of JSON, more than the "
                             f"{self.blob_nbytes - _HDR.size} reserved at protect() (4x its size then)")
        # the shares kept: byte ranges of the live tensors (the background copy reads them before the update, which
        # waits for the commit); the same views while the state's tensors are the same ones (``_signature``)
        if sig is not None and self._pieces is not None and self._pieces[0] == (sig, owners):
            out = list(self._pieces[1])
        else:
            out = [self.share_pieces(r, found) for r in owners]
            # only views can be reused: a non-contiguous tensor's piece is a copy, taken afresh every step
            views = all(found[i].is_contiguous() for i in self._common if i in found)
            self._pieces = ((sig, list(owners)), out) if sig is not None and views else None
            out = list(out)
        for i in self.unique:
            t = found.get(i)
            shape = self.entries[i][2]
            if t is None:
                out.append(torch.zeros(shape, dtype=self.entries[i][1]))
            elif tuple(t.shape) != shape:   # an FSDP2 shard shorter than the largest rank's: padded with zeros
                out.append(pad_pieces(t, shape, self._zero_bytes))
            else:
                out.append(t.detach())
        # the JSON region: the document's length and the document, then zeros (a view of one tensor kept for it)
        head = torch.frombuffer(bytearray(_HDR.pack(len(doc)) + doc), dtype=torch.uint8)
        if self._zeros is None or self._zeros.numel() != self.blob_nbytes:
            self._zeros = torch.zeros(self.blob_nbytes, dtype=torch.uint8)
        return out + [[head, self._zeros[head.numel():]]]

    def share_pieces(self, r: int, found: dict) -> list[torch.Tensor]:
        """Bytes [r * shard_nbytes, (r + 1) * shard_nbytes) of the common state: 1-D uint8 pieces, views of the
        live tensors in ``found`` (``collect``'s) where they exist (zeros for state not there yet, e.g. no optimizer
        state before the first step, never read back, and for the padding of the last share)."""
        plan = self._plans.get(r)
        if plan is None:   # which byte range of which tensor: fixed by the layout, computed once per share
            lo, hi = r * self.shard_nbytes, (r + 1) * self.shard_nbytes
            plan, pos = [], lo
            for i in self._common:
                off, n = self._span[i]
                a, b = max(off, lo), min(off + n, hi)
                if a < b:
                    plan.append((i, a - off, b - off))
                    pos = b
            self._plans[r] = plan = (plan, hi - max(pos, lo))
        ranges, pad = plan
        pieces = []
        for i, a, b in ranges:
            t = found.get(i)
            if t is None:
                pieces.append(torch.zeros(b - a, dtype=torch.uint8))
            else:
                pieces.append(t.detach().contiguous().reshape(-1).view(torch.uint8)[a:b])
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8))
        return pieces

    def _zero_bytes(self, n: int) -> torch.Tensor:
        """A view of ``n`` zero bytes (one buffer kept for the padding of short shards)."""
        if self._pad is None or self._pad.numel() < n:
            self._pad = torch.zeros(max(n, 4096), dtype=torch.uint8)
        return self._pad[:n]

    def _signature(self):
        """Which tensors hold the model's and optimizer's state now (None: not cacheable, e.g. a non-tensor value
        in the optimizer's state). Equal signatures: the tensors found by the last ``collect`` are still the ones."""
        sig = [t.data_ptr() for t in self._sig_tensors]
        for st in self._optimizer.state.values():
            for v in st.values():
                if not isinstance(v, torch.Tensor):
                    return None
                sig.append(id(v))
                sig.append(local_shard(v).data_ptr())
        sig.append(len(self._optimizer.state))
        return tuple(sig)

    def collect(self):
        """The state through torch.distributed.checkpoint.state_dict: (tensors by layout index, encoded tree).
        Raises ValueError naming a tensor that is not in the layout, or whose dtype or shape changed."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        model_sd = get_model_state_dict(self._model)
        empty = not self._optimizer.state
        if empty:   # before the first real step: DCP would run its own dry step on the real optimizer
            optim_sd = {"param_groups": [without_params(g) for g in self._optimizer.param_groups]}
        else:
            optim_sd = get_optimizer_state_dict(self._model, self._optimizer)
        if self._sharded:   # FSDP2: the local shards of the DTensors
            model_sd, optim_sd = local_shards(model_sd), local_shards(optim_sd)
        found: dict[int, torch.Tensor] = {}

        def sink(path, t):
            i = self._index.get(path)
            if i is None:
                raise ValueError(f"protect: the state tensor {path} appeared after protect() fixed the snapshot "
                                 "layout; the optimizer's state must be the one its first step creates")
                # (e.g. an optimizer whose state grows later is not supported)
            _, dtype, shape = self.entries[i]
            if t.dtype != dtype or (tuple(t.shape) != shape and not (
                    self._sharded and t.dim() and t.shape[1:] == shape[1:] and t.shape[0] <= shape[0])):
                raise ValueError(f"protect: the state tensor {path} changed from {dtype} {list(shape)} to "
                                 f"{t.dtype} {list(t.shape)} after protect() fixed the snapshot layout")
            found[i] = t
            return i

        tree = _split({"model": model_sd, "optim": optim_sd}, sink)
        tree["optim_empty"] = empty
        return found, tree

    # ---- restore -------------------------------------------------------------------------------------------------
    def restore_targets(self) -> list[torch.Tensor]:
        """Fresh tensors a payload is read into (``take_restored`` then hands them over)."""
        self._scratch = [torch.empty(t.shape, dtype=t.dtype) for t in self.layout_tensors()]
        return self._scratch

    def take_restored(self) -> Restored:
        """The payload read into the last ``restore_targets()``, handed over once; the caches of the live tensors
        are dropped (the restore replaces them)."""
        scratch, self._scratch = self._scratch, None
        self.forget()
        blob = scratch[-1]
        (n,) = _HDR.unpack(bytes(blob[:_HDR.size].numpy()))
        doc = json.loads(bytes(blob[_HDR.size:_HDR.size + n].numpy()))
        return Restored(scratch[:self.kept], scratch[self.kept:-1], doc)

    def decode(self, restored: Restored, common: torch.Tensor) -> tuple[dict, dict]:
        """(state tree, small state) of a restored payload, given ``common``: every share of the common state,
        concatenated (``common_nbytes`` bytes at least). The tree's tensors are views of ``common`` and of the
        restored unique tensors."""
        tensors = [None] * len(self.entries)
        for i in self._common:
            off, n = self._span[i]
            _, dtype, shape = self.entries[i]
            tensors[i] = common[off:off + n].view(dtype).reshape(shape)
        for pos, i in enumerate(self.unique):
            tensors[i] = restored.unique[pos]
        return decode(restored.doc["tree"], tensors), decode(restored.doc["small"], None)
