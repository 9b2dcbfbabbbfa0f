"""The state that is the same on every data-parallel rank (DDP): never sent while training, restored by an exchange.

Owns: the layout of a DDP model (a dry step on a copy), the byte *shares* of the common state each rank keeps
(``_share``: rank r's own and those of the ranks whose replica it holds, worker/protect.py's module docstring), the
restore's exchange of the missing shares (``_exchange_shares``: all-gather of who kept what with its CRC-32C, one
pollable all-to-all), loading a whole state dict through DCP (``_load_full``), and DDP's gradient average (the reducer
left idle; at the end of backward the gradients are all-reduced pollably, flattened in ``parameters()`` order).
"""
from __future__ import annotations

import copy

import torch

from ...dataplane import collectives
from ...errors import ReplicaError
from ...placement import held_by, holders_of
from ...replica.snapshot import checksum
from .document import set_param_groups


def ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


class DataParallelShares:
    """DDP's common state and gradient average (mixed into worker/protect.Protected)."""

    def _layout_from_dry_run(self) -> None:
        """Fix the payload layout: the model's tensors, and the optimizer state's as a dry step on a copy creates
        them (module docstring, "Layout")."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        twin_model, twin_opt = copy.deepcopy((self.inner, self.optimizer))
        twin_opt.__dict__.pop("step", None)        # an LR scheduler's wrapper would call the real optimizer
        twin_opt._optimizer_step_pre_hooks.clear()
        twin_opt._optimizer_step_post_hooks.clear()
        self._dry_step(twin_opt)
        model_sd = get_model_state_dict(self.model)
        optim_sd = get_optimizer_state_dict(twin_model, twin_opt)
        del twin_model, twin_opt
        buffers = {f"/model/{n}" for n, _ in self.inner.named_buffers()}
        self._fix_layout(model_sd, optim_sd, unique=lambda path: path in buffers)

    def _share(self, r: int, found: dict) -> list[torch.Tensor]:
        """Bytes [r * shard_nbytes, (r + 1) * shard_nbytes) of the common state: 1-D uint8 pieces, views of the
        live tensors where they exist (zeros for state not there yet, e.g. no optimizer state before the first step,
        never read back, and for the padding of the last share)."""
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

    def _exchange_shares(self, kept: list[torch.Tensor], have: list[bool]) -> torch.Tensor:
        """Every rank's share of the common state, at the restored step. A pollable all-gather of which shares each
        rank kept (``have``) with their CRC-32C, taken now, then one all-to-all that moves only the shares a rank
        lacks: share j comes from rank j, else from a holder of rank j's replica, and goes to every rank that kept no
        copy of it (a survivor lacks W - 1 - K shares, a promoted spare all W). Raises ReplicaError naming the share
        no live rank kept, or one that arrived with another checksum than its sender's."""
        W, m, shard = self.world_size, self.m, self.shard_nbytes
        if W == 1:
            if not have[0]:
                raise ReplicaError("protect: the restored snapshot carries no share of the parameters and "
                                   "optimizer state")
            return kept[0]
        mine_info = torch.tensor(have + [checksum(t.numpy()) if h else 0 for t, h in zip(kept, have)],
                                 dtype=torch.int64)
        info = torch.zeros(W * 2 * m, dtype=torch.int64)
        collectives.all_gather(info, mine_info, self.watch)
        info = info.view(W, 2 * m).tolist()
        flags, crcs = [row[:m] for row in info], [row[m:] for row in info]
        keeps = [self._kept_ids(r) for r in range(W)]   # the shares rank r keeps, in its kept order
        needs = [self._needs(q) for q in range(W)]      # the shares rank q restores from, in its order
        wants = [set(n) for n in needs]                 # the same, for membership (W ranks x W shares)

        def good_copy(r: int, j: int) -> int | None:
            """Where in rank r's kept shares a copy of share j is (None: r has none)."""
            return next((i for i, jj in enumerate(keeps[r]) if jj == j and flags[r][i]), None)

        pos_of = {j: i for i, j in enumerate(needs[self.rank])}
        out = torch.empty(len(pos_of) * shard, dtype=torch.uint8)
        to, frm = [[] for _ in range(W)], [[] for _ in range(W)]   # share ids sent to / received from each rank
        sent_from = {}  # share id this rank sends -> where in its kept shares its copy is
        for j in sorted(set().union(*wants)):
            src = next((r for r in self._sources(j) if good_copy(r, j) is not None), None)
            if src is None:
                raise ReplicaError(self._lost(j))
            mine = good_copy(self.rank, j)
            if j in pos_of:
                if mine is not None:
                    out[pos_of[j] * shard:(pos_of[j] + 1) * shard] = kept[mine]
                elif src != self.rank:
                    frm[src].append(j)
            if src == self.rank:
                sent_from[j] = mine
                for q in range(W):
                    if q != src and j in wants[q] and good_copy(q, j) is None:
                        to[q].append(j)
        send = [kept[sent_from[j]] for q in range(W) for j in to[q]]
        inp = torch.cat(send) if send else torch.empty(0, dtype=torch.uint8)
        got = torch.empty(sum(len(f) for f in frm) * shard, dtype=torch.uint8)
        collectives.all_to_all(got, inp, [len(f) * shard for f in frm], [len(t) * shard for t in to], self.watch)
        pos = 0
        for q in range(W):
            for j in frm[q]:
                piece = got[pos:pos + shard]
                want, crc = crcs[q][good_copy(q, j)], checksum(piece.numpy())
                if crc != want:
                    raise ReplicaError(f"protect: {self._what(j)} arrived from rank {q} with CRC-32C {crc:#010x}, "
                                       f"not the {want:#010x} rank {q} took before sending it")
                out[pos_of[j] * shard:(pos_of[j] + 1) * shard] = piece
                pos += shard
        return out

    # which shares exist, who keeps them, who needs them: DDP's ring (held_by), or HSDP's columns (one share each,
    # kept whole by every rank of the column, shards.py)
    def _kept_ids(self, r: int) -> list[int]:
        if self.column is not None:
            return [self._column_index(r)]
        P, nodes, k = self.ring
        return [r] + held_by(r, P, nodes, k)

    def _needs(self, q: int) -> list[int]:
        return [self._column_index(q)] if self.column is not None else list(range(self.world_size))

    def _sources(self, j: int) -> list[int]:
        if self.column is not None:
            return list(self._columns()[j])
        P, nodes, k = self.ring
        return [j] + holders_of(j, P, nodes, k)

    def _what(self, j: int) -> str:
        if self.column is not None:
            return f"the shards of replicate group {j} (ranks {list(self._columns()[j])})"
        return f"rank {j}'s share of the parameters and optimizer state"

    def _lost(self, j: int) -> str:
        if self.column is not None:
            return (f"protect: {self._what(j)} are lost: no rank of the group restored its own snapshot (each keeps "
                    "them whole, none sends them)")
        P, nodes, k = self.ring
        return (f"protect: rank {j}'s share of the parameters and optimizer state is lost: neither rank {j} nor a "
                f"holder of its replica ({holders_of(j, P, nodes, k)}) kept a copy")

    def _load_full(self, tree: dict) -> None:
        """The model and optimizer state through DCP's set_*_state_dict (DDP and plain modules)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, tree["model"])
        osd = tree["optim"]
        if tree["optim_empty"]:
            self.optimizer.state.clear()
            set_param_groups(self.optimizer, osd["param_groups"])
        else:
            if not self.optimizer.state:
                # a spare's optimizer has no state yet: fill it first, or DCP makes it with a dry step of the
                # real optimizer (lr 0); load_state_dict then replaces it as usual
                for live, saved in zip(self.optimizer.param_groups, osd["param_groups"]):
                    for p, fqn in zip(live["params"], saved["params"]):
                        if fqn in osd["state"]:
                            self.optimizer.state[p] = dict(osd["state"][fqn])
            set_optimizer_state_dict(self.model, self.optimizer, osd)

    def _forward_starts(self, module, args) -> None:
        self._queued = False   # a backward that failed half-way never ran its callback
        self.hooks.forward_starts()

    def _grad_ready(self, param) -> None:
        if not self._queued and self.world_size > 1 and self.rank is not None:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average_gradients)

    def _average_gradients(self) -> None:
        """(end of backward) Sum every gradient over the ranks, pollably, and divide by the world size. First wait
        for this rank's replica of the step to be committed: the all-reduce completes nowhere before every rank's is,
        so no survivor can be more than one snapshot ahead of a lost rank's newest replica (module docstring)."""
        self._queued = False
        self.hooks.before_collective()
        by_dtype: dict[torch.dtype, list] = {}
        for p in self.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        with torch.no_grad():
            for dtype, params in by_dtype.items():
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in params])
                collectives.all_reduce(flat, self.watch)
                flat.div_(self.world_size)
                off = 0
                for p in params:
                    n = p.numel()
                    g = flat[off:off + n].view_as(p)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
                    off += n
        self.hooks.reduced()
