"""The state that is the same on every data-parallel rank (DDP): never sent while training, restored by an exchange.

Owns: the layout state of a DDP model (``dry_run_state``: a dry step on a copy), which byte *shares* of the common
state each rank keeps (``DataParallelShares.owners``: rank r's own and those of the ranks whose replica it holds,
worker/protect.py's module docstring; HSDP: its replicate group's one share), the restore's exchange of the missing
shares (``DataParallelShares.exchange``: all-gather of who kept what with its CRC-32C, one pollable all-to-all),
loading a whole state dict through DCP (``load_full``), and DDP's gradient average
(``DataParallelShares.average_gradients``: flattened in ``parameters()`` order, all-reduced pollably). Does not own:
the shares' byte ranges (layout.py), when the average runs (worker/protect.py's hooks).
"""
from __future__ import annotations

import copy

import torch

from ...dataplane import collectives
from ...errors import ReplicaError
from ...placement import held_by, holders_of
from ...replica.snapshot import checksum
from .document import set_param_groups
from .optim import dry_step


def ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def dry_run_state(model, module, optimizer) -> tuple[dict, dict, object]:
    """What a DDP (or plain) model's payload layout is made of: (model state dict, optimizer state dict as a dry step
    on a copy of ``module`` and ``optimizer`` creates it, ``unique(path)``: the module's buffers are per rank). The
    real optimizer is untouched (worker/protect.py's module docstring, "Layout")."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    twin_model, twin_opt = copy.deepcopy((module, optimizer))
    twin_opt.__dict__.pop("step", None)        # an LR scheduler's wrapper would call the real optimizer
    twin_opt._optimizer_step_pre_hooks.clear()
    twin_opt._optimizer_step_post_hooks.clear()
    dry_step(twin_opt)
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(twin_model, twin_opt)
    del twin_model, twin_opt
    buffers = {f"/model/{n}" for n, _ in module.named_buffers()}
    return model_sd, optim_sd, (lambda path: path in buffers)


def load_full(model, optimizer, tree: dict) -> None:
    """The model and optimizer state of ``tree`` (layout.py ``SnapshotLayout.decode``'s) through DCP's
    set_*_state_dict (DDP and plain modules)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, tree["model"])
    osd = tree["optim"]
    if tree["optim_empty"]:
        optimizer.state.clear()
        set_param_groups(optimizer, osd["param_groups"])
    else:
        if not optimizer.state:
            # a spare's optimizer has no state yet: fill it first, or DCP makes it with a dry step of the
            # real optimizer (lr 0); load_state_dict then replaces it as usual
            for live, saved in zip(optimizer.param_groups, osd["param_groups"]):
                for p, fqn in zip(live["params"], saved["params"]):
                    if fqn in osd["state"]:
                        optimizer.state[p] = dict(osd["state"][fqn])
        set_optimizer_state_dict(model, optimizer, osd)


class DataParallelShares:
    """Which shares of the common state each of ``world_size`` ranks keeps and how a restore finds the missing ones,
    and DDP's gradient average. ``ring``: (ranks per node, active nodes, K replicas), the replicas' ring
    (control/agreement.py); ``columns``: HSDP's replicate groups (shards.py ``ShardedState.columns``), each kept whole
    as one share by every rank of the group, else None (DDP: world_size shares, rank r keeps its own and those of the
    K ranks whose replica it holds). ``kept``: shares in a rank's payload; ``parts``: shares the common state is cut
    into. ``bind`` before ``owners``, ``exchange`` and ``average_gradients``."""

    def __init__(self, world_size: int, ring: tuple[int, int, int] = (1, 1, 0),
                 columns: list[tuple[int, ...]] | None = None):
        self._world_size = world_size
        self._ring = ring
        self._k = ring[2] if world_size > 1 else 0
        self._columns = columns
        self.kept = 1 if columns is not None else 1 + self._k
        self.parts = 1 if columns is not None else world_size
        self._rank: int | None = None
        self._watch = None
        self._held: list[int] = []

    def bind(self, rank: int, watch) -> None:
        """This process is now rank ``rank``; ``watch``: what the exchange's and the average's collectives wait
        under."""
        self._rank, self._watch = rank, watch
        if self._k and self._columns is None:
            P, nodes, k = self._ring
            self._held = held_by(rank, P, nodes, k)

    def owners(self) -> list[int]:
        """Whose shares this rank's payload keeps, in payload order (``kept`` of them)."""
        return [0] if self._columns is not None else [self._rank] + self._held

    def exchange(self, kept: list[torch.Tensor], have: list[bool]) -> torch.Tensor:
        """Every share of the common state this rank restores, concatenated, at the restored step, from ``kept`` (its
        payload's shares, 1-D uint8 of one size each) of which ``have`` says which are really there. A pollable
        all-gather of which shares each rank kept with their CRC-32C, taken now, then one all-to-all that moves only
        the shares a rank lacks: share j comes from rank j, else from a holder of rank j's replica, and goes to every
        rank that kept no copy of it (a survivor lacks W - 1 - K shares, a promoted spare all W). Raises ReplicaError
        naming the share no live rank kept, or one that arrived with another checksum than its sender's."""
        W, m, shard = self._world_size, len(kept), kept[0].numel()
        if W == 1:
            if not have[0]:
                raise ReplicaError("protect: the restored snapshot carries no share of the parameters and "
                                   "optimizer state")
            return kept[0]
        mine_info = torch.tensor(have + [checksum(t.numpy()) if h else 0 for t, h in zip(kept, have)],
                                 dtype=torch.int64)
        info = torch.zeros(W * 2 * m, dtype=torch.int64)
        collectives.all_gather(info, mine_info, self._watch)
        info = info.view(W, 2 * m).tolist()
        flags, crcs = [row[:m] for row in info], [row[m:] for row in info]
        keeps = [self._kept_ids(r) for r in range(W)]   # the shares rank r keeps, in its kept order
        needs = [self._needs(q) for q in range(W)]      # the shares rank q restores from, in its order
        wants = [set(n) for n in needs]                 # the same, for membership (W ranks x W shares)

        def good_copy(r: int, j: int) -> int | None:
            """Where in rank r's kept shares a copy of share j is (None: r has none)."""
            return next((i for i, jj in enumerate(keeps[r]) if jj == j and flags[r][i]), None)

        me = self._rank
        pos_of = {j: i for i, j in enumerate(needs[me])}
        out = torch.empty(len(pos_of) * shard, dtype=torch.uint8)
        to, frm = [[] for _ in range(W)], [[] for _ in range(W)]   # share ids sent to / received from each rank
        sent_from = {}  # share id this rank sends -> where in its kept shares its copy is
        for j in sorted(set().union(*wants)):
            src = next((r for r in self._sources(j) if good_copy(r, j) is not None), None)
            if src is None:
                raise ReplicaError(self._lost(j))
            mine = good_copy(me, j)
            if j in pos_of:
                if mine is not None:
                    out[pos_of[j] * shard:(pos_of[j] + 1) * shard] = kept[mine]
                elif src != me:
                    frm[src].append(j)
            if src == me:
                sent_from[j] = mine
                for q in range(W):
                    if q != src and j in wants[q] and good_copy(q, j) is None:
                        to[q].append(j)
        send = [kept[sent_from[j]] for q in range(W) for j in to[q]]
        inp = torch.cat(send) if send else torch.empty(0, dtype=torch.uint8)
        got = torch.empty(sum(len(f) for f in frm) * shard, dtype=torch.uint8)
        collectives.all_to_all(got, inp, [len(f) * shard for f in frm], [len(t) * shard for t in to], self._watch)
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
    def _column_index(self, r: int) -> int:
        return next(i for i, line in enumerate(self._columns) if r in line)

    def _kept_ids(self, r: int) -> list[int]:
        if self._columns is not None:
            return [self._column_index(r)]
        P, nodes, k = self._ring
        return [r] + held_by(r, P, nodes, k)

    def _needs(self, q: int) -> list[int]:
        return [self._column_index(q)] if self._columns is not None else list(range(self._world_size))

    def _sources(self, j: int) -> list[int]:
        if self._columns is not None:
            return list(self._columns[j])
        P, nodes, k = self._ring
        return [j] + holders_of(j, P, nodes, k)

    def _what(self, j: int) -> str:
        if self._columns is not None:
            return f"the shards of replicate group {j} (ranks {list(self._columns[j])})"
        return f"rank {j}'s share of the parameters and optimizer state"

    def _lost(self, j: int) -> str:
        if self._columns is not None:
            return (f"protect: {self._what(j)} are lost: no rank of the group restored its own snapshot (each keeps "
                    "them whole, none sends them)")
        P, nodes, k = self._ring
        return (f"protect: rank {j}'s share of the parameters and optimizer state is lost: neither rank {j} nor a "
                f"holder of its replica ({holders_of(j, P, nodes, k)}) kept a copy")

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients of ``params`` over the ranks, pollably (one all-reduce per dtype, flattened in the
        given order), divide by the world size and write them back (a missing gradient counts as zeros). Raises
        PeerFailure."""
        by_dtype: dict[torch.dtype, list] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        with torch.no_grad():
            for dtype, group in by_dtype.items():
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in group])
                collectives.all_reduce(flat, self._watch)
                flat.div_(self._world_size)
                off = 0
                for p in group:
                    n = p.numel()
                    g = flat[off:off + n].view_as(p)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
                    off += n
