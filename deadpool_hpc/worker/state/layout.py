"""The snapshot layout of ``ctx.protect``'s state: which tensor sits where in the payload, and the payload's tensors
at a snapshot.

Owns: the layout fixed before the first step (``_fix_layout``: entries in payload order, 8-byte elements first; the
data-parallel *common* bytes cut into world-size shares and the per-rank *unique* tensors; the JSON region's size),
the payload's tensors at each snapshot (``state_tensors``: views of the live tensors, cached while they are the same
objects) and the fresh tensors a restore reads into. Does not own: what the shares are (shares.py), the FSDP2 shards'
padding (shards.py), the JSON document (document.py).
"""
from __future__ import annotations

import math

import torch

from .document import dumps, encode, without_params
from .shards import local_shard, local_shards, pad_pieces

BLOB_MIN = 64 << 10          # bytes reserved for the JSON document, at least


def _storage_key(t: torch.Tensor):
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


class SnapshotLayout:
    """The snapshot layout (mixed into worker/protect.Protected: it reads the state's owners there)."""

    def _fix_layout(self, model_sd: dict, optim_sd: dict, unique, padded: dict | None = None) -> None:
        """The payload's layout from the state dicts' tensors; ``unique(path)``: the tensor is this rank's own
        (replicated whole), else the same on every rank (cut into shares); ``padded``: id(tensor) -> the shape its
        place has (an FSDP2 shard: the largest rank's, ``_padded_shape``), else the tensor's own."""
        self.entries: list[tuple[str, torch.dtype, tuple]] = []
        self._index: dict[str, int] = {}
        padded = padded or {}

        def add(path, t):
            self._index[path] = len(self.entries)
            self.entries.append((path, t.dtype, padded.get(id(t), tuple(t.shape))))
            return 0

        tree = self._split({"model": model_sd, "optim": optim_sd}, add)
        doc = self._document(tree, self.document.state())
        self.blob_nbytes = max(BLOB_MIN, 4 * len(doc) + 4096 + self._hdr.size)
        self.blob_nbytes += -self.blob_nbytes % 8
        # 8-byte elements first, then 4, 2, 1: every view into the payload (and into the gathered state) is aligned
        esize = [torch.empty(0, dtype=dtype).element_size() for _, dtype, _ in self.entries]
        self.order = sorted(range(len(self.entries)), key=lambda i: -esize[i])
        # parameters and optimizer state are the same on every rank (DDP): each rank's payload holds 1/world_size
        # of their bytes; buffers (per rank, as DDP without broadcast_buffers keeps them) are held whole
        self._common = [i for i in self.order if not unique(self.entries[i][0])]
        self._unique = [i for i in self.order if unique(self.entries[i][0])]
        self._span: dict[int, tuple[int, int]] = {}
        off = 0
        for i in self._common:
            n = math.prod(self.entries[i][2]) * esize[i]
            self._span[i] = (off, n)
            off += n
        self.common_nbytes = off
        # DDP: cut into world_size shares; HSDP: the column's state whole, one share (state/shares.py)
        parts = 1 if self.column is not None else self.world_size
        self.shard_nbytes = max(8, -(-off // (parts * 8)) * 8)
        self.local_nbytes = self.m * self.shard_nbytes   # the shares kept, never sent

    def layout_tensors(self) -> list[torch.Tensor]:
        """Meta tensors describing the payload's state tensors, in payload order: this rank's share of the common
        state (bytes) and the K shares it keeps for the ranks whose replica it holds (the local prefix,
        ``local_nbytes``), the per-rank tensors, the JSON region."""
        return [torch.empty(self.shard_nbytes, dtype=torch.uint8, device="meta") for _ in range(self.m)] + \
            [torch.empty(self.entries[i][2], dtype=self.entries[i][1], device="meta") for i in self._unique] + \
            [torch.empty(self.blob_nbytes, dtype=torch.uint8, device="meta")]

    def state_tensors(self) -> list[torch.Tensor]:
        """The current state, in payload order. Tensors are the live ones (the optimizer does not update before the
        replica is committed); the shares are lists of 1-D uint8 pieces of them, and so is the JSON region (a fresh
        tensor of the document, then zeros)."""
        sig = self._signature()
        if sig is not None and sig == self._cache_sig:
            # the same tensors as last time: only the param groups' scalars (lr, ...) and the small state are read
            # and encoded again; the rest of the document (the tensors' places, ~100 entries) is the cached JSON
            found, model_json, state_json, names = self._cache
            groups = [dict(encode(without_params(g), "", None), params=n)
                      for g, n in zip(self.optimizer.param_groups, names)]
            doc = ('{"tree":{"model":%s,"optim":{"state":%s,"param_groups":%s},"optim_empty":false},"small":%s}' % (
                model_json, state_json, dumps(groups), dumps(encode(self.document.state(), "", None)))).encode()
        else:
            found, tree = self._collect()
            self._cache_sig = sig if not tree["optim_empty"] else None
            if self._cache_sig is not None:
                self._cache = (found, dumps(tree["model"]), dumps(tree["optim"]["state"]),
                               [g["params"] for g in tree["optim"]["param_groups"]])
            doc = self._document(tree, self.document.state())
        if len(doc) + self._hdr.size > self.blob_nbytes:
            raise ValueError(f"protect: the non-tensor state is {len(doc)} bytes of JSON, more than the "
                             f"{self.blob_nbytes - self._hdr.size} reserved at protect() (4x its size then)")
        # this rank's share of the common state and the shares it keeps for others: byte ranges of the live tensors
        # (the background copy reads them before the update, which waits for the commit); the same views while the
        # state's tensors are the same ones (``_signature``)
        owners = [0] if self.column is not None else [self.rank] + self.held   # byte shares kept (shares.py)
        if sig is not None and self._pieces is not None and self._pieces[0] == (sig, owners):
            out = list(self._pieces[1])
        else:
            out = [self._share(r, found) for r in owners]
            # only views can be reused: a non-contiguous tensor's piece is a copy, taken afresh every step
            views = all(found[i].is_contiguous() for i in self._common if i in found)
            self._pieces = ((sig, owners), out) if sig is not None and views else None
            out = list(out)
        for i in self._unique:
            t = found.get(i)
            shape = self.entries[i][2]
            if t is None:
                out.append(torch.zeros(shape, dtype=self.entries[i][1]))
            elif tuple(t.shape) != shape:   # an FSDP2 shard shorter than the largest rank's: padded with zeros
                out.append(pad_pieces(t, shape, self._zero_bytes))
            else:
                out.append(t.detach())
        # the JSON region: the document's length and the document, then zeros (a view of one tensor kept for it)
        head = torch.frombuffer(bytearray(self._hdr.pack(len(doc)) + doc), dtype=torch.uint8)
        if self._zeros is None or self._zeros.numel() != self.blob_nbytes:
            self._zeros = torch.zeros(self.blob_nbytes, dtype=torch.uint8)
        return out + [[head, self._zeros[head.numel():]]]

    def _zero_bytes(self, n: int) -> torch.Tensor:
        """A view of ``n`` zero bytes (one buffer kept for the padding of short shards)."""
        if self._pad is None or self._pad.numel() < n:
            self._pad = torch.zeros(max(n, 4096), dtype=torch.uint8)
        return self._pad[:n]

    def _signature(self):
        """Which tensors hold the model's and optimizer's state now (None: not cacheable, e.g. a non-tensor value
        in the optimizer's state). Equal signatures: the tensors found by the last ``_collect`` are still the ones."""
        sig = [t.data_ptr() for t in self._sig_tensors]
        for st in self.optimizer.state.values():
            for v in st.values():
                if not isinstance(v, torch.Tensor):
                    return None
                sig.append(id(v))
                sig.append(local_shard(v).data_ptr())
        sig.append(len(self.optimizer.state))
        return tuple(sig)

    def _collect(self):
        """The state through torch.distributed.checkpoint.state_dict: (tensors by layout index, encoded tree)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        model_sd = get_model_state_dict(self.model)
        empty = not self.optimizer.state
        if empty:   # before the first real step: DCP would run its own dry step on the real optimizer
            optim_sd = {"param_groups": [without_params(g) for g in self.optimizer.param_groups]}
        else:
            optim_sd = get_optimizer_state_dict(self.model, self.optimizer)
        if self.sharded:   # FSDP2: the local shards of the DTensors
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
                    self.sharded and t.dim() and t.shape[1:] == shape[1:] and t.shape[0] <= shape[0])):
                raise ValueError(f"protect: the state tensor {path} changed from {dtype} {list(shape)} to "
                                 f"{t.dtype} {list(t.shape)} after protect() fixed the snapshot layout")
            found[i] = t
            return i

        tree = self._split({"model": model_sd, "optim": optim_sd}, sink)
        tree["optim_empty"] = empty
        return found, tree

    def _split(self, state: dict, sink) -> object:
        """Encode ``state``; tensor leaves go to ``sink(path, tensor) -> index``; a tensor already seen (a tied
        weight under a second name) is referenced, not stored twice."""
        seen: dict = {}

        def once(path, t):
            key = _storage_key(t)
            if key not in seen:
                seen[key] = sink(path, t)
            return seen[key]

        return encode(state, "", once)

    @staticmethod
    def _document(tree, small: dict) -> bytes:
        return dumps({"tree": tree, "small": encode(small, "", None)}).encode()

    def restore_targets(self) -> list[torch.Tensor]:
        """Fresh tensors a payload is read into (``gather`` then applies them)."""
        self._scratch = [torch.empty(t.shape, dtype=t.dtype) for t in self.layout_tensors()]
        return self._scratch
