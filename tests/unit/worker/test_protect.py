"""``ctx.protect``'s state (worker/protect.py) in one process: the snapshot round trip of a plain or DDP model, its
optimizer, schedule, RNG and data loader; bad input refused before training starts. The runs that recover a DDP loop
with it are tests/e2e/test_your_loop.py's.
"""
import random
import types

import pytest
import torch

from deadpool_hpc.config import RunConfig
from deadpool_hpc.replica.snapshot import Slot, StateLayout, checksum
from deadpool_hpc.train.model import GPT, GPTConfig
from deadpool_hpc.worker.protect import Protected

from snapshots import restore, snapshot, train_steps  # tests/snapshots.py


def small_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, context=8))


def setup(world_size=1, ddp=False, **kw):
    model = small_model()
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    prot = Protected(world_size, model, opt, sched, **kw)
    prot.bind(0, None)
    return model, opt, sched, prot


def digest(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


@pytest.mark.parametrize("ddp", [False, True])
@pytest.mark.parametrize("at", [0, 3])
def test_snapshot_round_trip_is_bitwise(local_group, ddp, at):
    """Snapshot after ``at`` steps (0: before the optimizer has any state), train on, restore, train the same steps
    again: identical parameters, optimizer state, schedule and RNG; the optimizer is not stepped by protect()."""
    model, opt, sched, prot = setup(ddp=ddp, python_rng=True)
    assert not opt.state, "protect() must not create optimizer state (its first real step would be the second)"
    train_steps(model, opt, sched, 0, at)
    random.seed(at)
    _, first = snapshot(prot)            # through torch.distributed.checkpoint.state_dict
    layout, slot = snapshot(prot)        # the same tensors again: the cached path
    assert bytes(first.buf) == bytes(slot.buf)
    train_steps(model, opt, sched, at, 3)
    want, want_lr, want_rand = digest(model), opt.param_groups[0]["lr"], random.random()
    want_state = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    train_steps(model, opt, sched, at + 3, 2)   # wander off
    random.seed(12345)
    restore(prot, layout, slot)
    assert bool(opt.state) == (at > 0)
    train_steps(model, opt, sched, at, 3)
    assert torch.equal(digest(model), want)
    assert opt.param_groups[0]["lr"] == want_lr and random.random() == want_rand
    got = opt.state[next(iter(model.parameters()))]
    assert all(torch.equal(got[k], v) for k, v in want_state.items())


def test_a_fresh_optimizer_is_restored_like_a_spare(local_group):
    """A spare's optimizer has no state; restoring a snapshot taken after some steps gives it the trained state."""
    model, opt, sched, prot = setup()
    train_steps(model, opt, sched, 0, 4)
    layout, slot = snapshot(prot)
    train_steps(model, opt, sched, 4, 2)
    want = digest(model)
    model2, opt2, sched2, prot2 = setup()   # the spare: same initial model, no optimizer state
    restore(prot2, layout, slot)
    train_steps(model2, opt2, sched2, 4, 2)
    assert torch.equal(digest(model2), want)
    assert sched2.last_epoch == sched.last_epoch


def test_tied_weights_stored_once(local_group):
    _, _, _, prot = setup()
    paths = [p for p, _, _ in prot.entries]
    assert "/model/tok.weight" in paths and "/model/head.weight" not in paths


# ---- bad input, refused before training starts ---------------------------------------------------------------------
class NoStateOpt:
    param_groups = []

    def step(self):
        pass


def test_an_optimizer_without_state_dict_is_refused():
    with pytest.raises(TypeError, match=r"optimizer=.*NoStateOpt.*accepted: a torch.optim.Optimizer"):
        Protected(1, small_model(), NoStateOpt())


def test_a_plain_iterator_is_refused_as_dataloader():
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match=r"dataloader=.*plain iterator.*StatefulDataLoader.*DistributedSampler"):
        Protected(1, model, opt, dataloader=iter(range(10)))
    loader = torch.utils.data.DataLoader(list(range(10)))
    with pytest.raises(TypeError, match=r"dataloader=.*DataLoader.*cannot be saved"):
        Protected(1, model, opt, dataloader=loader)


def test_a_distributed_sampler_loader_is_accepted_and_follows_the_rank(local_group):
    from torch.utils.data.distributed import DistributedSampler

    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    sampler = DistributedSampler(list(range(12)), num_replicas=3, rank=0, shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(list(range(12)), sampler=sampler)
    prot = Protected(1, model, opt, dataloader=loader)
    prot.world_size = 3          # as if this process were promoted to rank 2 of 3
    prot.bind(2, None)
    assert sampler.rank == 2 and sampler.num_replicas == 3
    prot.world_size = 1
    prot.bind(0, None)
    sampler.set_epoch(5)
    layout, slot = snapshot(prot)
    sampler.set_epoch(9)
    restore(prot, layout, slot)
    assert sampler.epoch == 5


def test_an_unwrapped_model_is_refused_when_there_are_several_ranks():
    model = small_model()
    with pytest.raises(ValueError, match=r"world_size is 3.*not wrapped in DistributedDataParallel"):
        Protected(3, model, torch.optim.AdamW(model.parameters()))
    Protected(1, model, torch.optim.AdamW(model.parameters()))   # one rank: a plain module is fine


def test_a_scheduler_or_extra_without_state_dict_is_refused():
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match=r"scheduler=.*without state_dict"):
        Protected(1, model, opt, scheduler=object())
    with pytest.raises(TypeError, match=r"extra=.*without state_dict"):
        Protected(1, model, opt, extra=[1, 2])


def test_an_optimizer_over_other_parameters_is_refused():
    model = small_model()
    with pytest.raises(ValueError, match=r"not parameters of the model"):
        Protected(1, model, torch.optim.AdamW(small_model().parameters()))


def fake_context(world_size=1):
    from deadpool_hpc.worker.context import Context

    client = types.SimpleNamespace(progress=types.SimpleNamespace(beat=lambda: None), on=lambda *a: None,
                                   send=lambda *a, **k: None)
    cfg = RunConfig(nodes=world_size, spares=0, steps=4)
    return Context(cfg, client, groups=None, log=None, node=0, local=0)


def test_protect_twice_is_refused(local_group):
    ctx = fake_context()
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    ctx.protect(model, opt)
    with pytest.raises(ValueError, match=r"ctx.protect: ctx.protect was already called"):
        ctx.protect(model, opt)
    with pytest.raises(ValueError, match=r"ctx.zero_adamw: ctx.protect was already called"):
        ctx.zero_adamw(model)


def _ranks_payloads(prot, world, layout):
    """Each rank's snapshot payload, as written into a slot (shares and the JSON region are handed over as lists of
    pieces: views of the live tensors, the document, zeros), one solid tensor per entry. The DDP state is the same
    on every rank: one process plays them all."""
    out = []
    for r in range(world):
        prot.bind(r, None)
        slot = Slot(layout.nbytes)
        assert layout.write(slot, prot.state_tensors(), torch.get_rng_state(), step=0)
        out.append([v.clone() for v in layout.views(slot)])
    return out


def test_ddp_state_stays_local_and_a_lost_rank_gets_its_share_from_its_holder(local_group, monkeypatch):
    """DDP ranks hold the same parameters and optimizer state: none of it is sent. Rank r keeps its share r and the
    share of the rank whose replica it holds (r - 1 on a ring of 3 nodes); the replica carries buffers, JSON and RNG
    only. A spare restoring rank 1 from a replica (no shares of its own) gets share 1 from rank 2, which holds rank
    1's replica; the restored state trains on bitwise like the original. The two collectives (an all-gather of which
    shares each rank has, with their CRC-32C, an all-to-all of the missing ones) are played by the test; a share
    that arrives with other bytes than its sender checksummed is refused."""
    from deadpool_hpc.errors import ReplicaError
    from deadpool_hpc.dataplane import collectives

    model, opt, sched, prot = setup(world_size=3, ddp=True, ring=(1, 3, 1))
    prot.world_size = 1
    train_steps(model, opt, sched, 0, 3)   # one process: no gradient average needed
    prot.world_size = 3
    rng_n = torch.get_rng_state().numel()
    layout = StateLayout(prot.layout_tensors(), rng_n, prot.local_nbytes)
    assert layout.local_nbytes == 2 * prot.shard_nbytes >= 2 * prot.common_nbytes / 3
    per_rank = sum(t.numel() * t.element_size() for t in prot.layout_tensors()[2:-1])   # the model's buffers
    assert layout.wire_nbytes == per_rank + prot.blob_nbytes + rng_n
    payloads = _ranks_payloads(prot, 3, layout)
    for r in range(3):   # kept: own share, then the share of held_by(r) = r - 1
        shares = [torch.cat(prot._layout.share_pieces(x, prot._layout.collect()[0])) for x in (r, (r - 1) % 3)]
        assert all(torch.equal(a, b) for a, b in zip(payloads[r][:2], shares))
    slot = Slot(layout.nbytes)
    assert layout.write(slot, payloads[1], torch.get_rng_state(), step=3)
    slot.tensor[:layout.local_nbytes].fill_(0xAB)     # what a holder has: the wire bytes only
    prot.world_size = 1
    train_steps(model, opt, sched, 3, 2)
    want = digest(model)
    train_steps(model, opt, sched, 5, 2)   # wander off
    prot.world_size = 3

    def play(lost, flip=None):
        calls = []
        s = prot.shard_nbytes

        def all_gather(out, inp, watch):
            calls.append("all_gather")
            assert inp.tolist() == [0, 0, 0, 0], "a rank restored from a replica has no share (and no CRC)"
            have = [[0, 0] if r in lost else [1, 1] for r in range(3)]
            crcs = [[checksum(payloads[r][i].numpy()) * have[r][i] for i in range(2)] for r in range(3)]
            out.copy_(torch.tensor([x for r in range(3) for x in have[r] + crcs[r]]))

        def all_to_all(out, inp, out_splits, in_splits, watch):
            # rank 1 sends nothing; it gets share 0 from rank 0 (its own, kept first) and shares 1 and 2 from
            # rank 2, which keeps [2, 1]: each sender's shares in ascending order, senders in rank order
            calls.append("all_to_all")
            assert inp.numel() == 0 and in_splits == [0, 0, 0] and out_splits == [s, 0, 2 * s]
            out.copy_(torch.cat([payloads[0][0], payloads[2][1], payloads[2][0]]))
            if flip is not None:
                out[flip] ^= 1   # one bit changed on the way
        monkeypatch.setattr(collectives, "all_gather", all_gather)
        monkeypatch.setattr(collectives, "all_to_all", all_to_all)
        prot.bind(1, None, from_replica=True)
        torch.set_rng_state(layout.read(slot, prot.restore_targets()))
        return calls

    play(lost={1, 2})   # rank 1 and the holder of its replica, together
    with pytest.raises(ReplicaError, match=r"rank 1's share .* is lost: neither rank 1 nor a holder of its replica"):
        prot.gather()
    play(lost={1}, flip=prot.shard_nbytes + 5)   # in share 1, from rank 2
    with pytest.raises(ReplicaError, match=r"rank 1's share .* arrived from rank 2 with CRC-32C 0x[0-9a-f]{8}, not"):
        prot.gather()
    calls = play(lost={1})
    prot.gather()
    assert calls == ["all_gather", "all_to_all"]
    prot.world_size = 1
    train_steps(model, opt, sched, 3, 2)
    assert torch.equal(digest(model), want)


def test_a_stateful_dataloader_resumes_where_it_was(local_group):
    """torchdata's StatefulDataLoader (if installed): its position, shuffling generator included, is restored."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    loader = sdl.StatefulDataLoader(list(range(40)), batch_size=2, shuffle=True,
                                    generator=torch.Generator().manual_seed(0))
    prot = Protected(1, model, opt, dataloader=loader)
    prot.bind(0, None)
    it = iter(loader)
    [next(it) for _ in range(3)]
    layout, slot = snapshot(prot)
    want = [next(it).tolist() for _ in range(4)]
    restore(prot, layout, slot)
    it = iter(loader)
    assert [next(it).tolist() for _ in range(4)] == want


def _loader(kind: str, workers: int, n: int = 96):
    """A shuffled loader of ``n`` numbers as scripts make it (issue 43): torchdata's StatefulDataLoader with a
    StatefulDistributedSampler, or torch's DataLoader with a DistributedSampler; rank 1 of 3."""
    kw = dict(batch_size=2, num_workers=workers, **(dict(prefetch_factor=2) if workers else {}))
    data = list(range(n))
    if kind == "sdl":
        sdl = pytest.importorskip("torchdata.stateful_dataloader")
        from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

        return sdl.StatefulDataLoader(data, sampler=StatefulDistributedSampler(data, 3, 1, shuffle=True), **kw)
    return torch.utils.data.DataLoader(data, sampler=torch.utils.data.DistributedSampler(data, 3, 1, shuffle=True),
                                       **kw)


def bind_rank1_of_3(prot):
    """Bound as training rank 1 of 3 (the snapshot layout here is one rank's: the loader's sampler alone says 3)."""
    prot.bind(0, None)
    prot.loader_guard.follow_rank(1, 3)


@pytest.mark.parametrize("kind,workers", [pytest.param("sdl", 2, marks=pytest.mark.e2e), ("sdl", 0),
                                          pytest.param("dl", 2, marks=pytest.mark.e2e), ("dl", 0)])  # 2 workers: processes
def test_the_iterator_made_once_resumes_where_the_restored_step_expects(local_group, kind, workers):
    """Issue 43: ``it = iter(loader)`` made once after protect, as torchtitan's loop does; after a restore the *same*
    iterator object gives the batches that followed the snapshot (a cut behind it), with loader workers or not, and
    the torch RNG is the restored one (re-arming the iterator draws no base seed from it)."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    loader = _loader(kind, workers)
    prot = Protected(1, model, opt, dataloader=loader)
    bind_rank1_of_3(prot)
    it = iter(loader)
    [next(it) for _ in range(3)]
    layout, slot = snapshot(prot)
    want = [next(it).tolist() for _ in range(4)]
    rng = torch.get_rng_state()
    [next(it) for _ in range(2)]   # on past the snapshot, then back to it
    restore(prot, layout, slot)
    assert [next(it).tolist() for _ in range(4)] == want
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.e2e
def test_a_promoted_spare_s_iterator_resumes_at_its_predecessor_s_position(local_group):
    """A spare built its loader and iterator as rank 0 (ctx.rank is None before ctx.run); promoted to rank 1, the
    restored state moves its iterator to rank 1's position."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    src = _loader("dl", 2)
    prot = Protected(1, model, opt, dataloader=src)
    bind_rank1_of_3(prot)
    it = iter(src)
    [next(it) for _ in range(5)]
    layout, slot = snapshot(prot)
    want = [next(it).tolist() for _ in range(3)]
    spare_loader = _loader("dl", 2)
    spare_loader.sampler.rank = 0
    spare_model = small_model()
    spare = Protected(1, spare_model, torch.optim.AdamW(spare_model.parameters()), dataloader=spare_loader)
    mine = iter(spare_loader)
    next(mine)
    bind_rank1_of_3(spare)
    restore(spare, layout, slot)
    assert [next(mine).tolist() for _ in range(3)] == want


def test_a_loader_iterator_made_before_protect_or_unknown_to_it_is_refused(local_group):
    """Issue 43: what no restore can move is refused before step 0, naming what was found and what is accepted."""
    from deadpool_hpc.worker.state.loader import check_no_stray_iterators

    model = small_model()
    for kind in ("sdl", "dl"):
        loader = _loader(kind, 0)
        early = iter(loader)
        with pytest.raises(ValueError, match=r"an iterator of this loader was made before ctx.protect.*accepted: "
                                             r"call iter\(loader\) after ctx.protect"):
            Protected(1, model, torch.optim.AdamW(model.parameters()), dataloader=loader)
        del early
    other = iter(_loader("dl", 0))
    loader = _loader("sdl", 0)
    prot = Protected(1, model, torch.optim.AdamW(model.parameters()), dataloader=loader)
    mine = iter(loader)
    with pytest.raises(ValueError, match=r"1 DataLoader iterator\(s\) \(torch.utils.data.dataloader."
                                         r"_SingleProcessDataLoaderIter\) exist that ctx.protect does not know"):
        check_no_stray_iterators([prot.loader_guard])
    del other
    check_no_stray_iterators([prot.loader_guard])
    assert next(mine) is not None


def test_a_hugging_face_iterable_dataset_split_by_node_follows_the_rank(local_group):
    """A ``datasets.IterableDataset`` split with ``split_dataset_by_node`` reads its node's part at iteration time:
    its rank follows the training rank (a spare built it as rank 0); another world size is refused."""
    datasets = pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    model = small_model()
    ds = datasets.Dataset.from_dict({"i": list(range(12))}).to_iterable_dataset(num_shards=3)
    want = [r["i"] for r in split_dataset_by_node(ds, rank=1, world_size=3)]
    spare_ds = split_dataset_by_node(ds, rank=0, world_size=3)
    prot = Protected(1, model, torch.optim.AdamW(model.parameters()), dataloader=spare_ds)
    prot.loader_guard.follow_rank(1, 3)
    assert [r["i"] for r in iter(spare_ds)] == want
    with pytest.raises(ValueError, match=r"split_dataset_by_node\(world_size=2\); accepted: world_size=ctx.world_size "
                                         r"\(3\)"):
        prot.loader_guard.__class__(split_dataset_by_node(ds, rank=0, world_size=2), True, None).follow_rank(0, 3)


def test_a_snapshot_reads_the_live_state_every_step_even_for_a_non_contiguous_parameter(local_group):
    """The shares are handed to the copy as views of the live tensors, reused while the tensors stay the same; a
    non-contiguous parameter's piece is a copy, so it must be taken afresh: a change made in place between two
    snapshots is in the second."""
    model = torch.nn.Linear(3, 4)
    model.weight = torch.nn.Parameter(torch.randn(3, 4).t())   # non-contiguous, same storage from step to step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prot = Protected(1, model, opt)
    prot.bind(0, None)
    first = snapshot(prot)
    with torch.no_grad():
        model.weight.add_(1.0)
        model.bias.add_(1.0)
    want = [p.detach().clone() for p in model.parameters()]
    layout, slot = snapshot(prot)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    restore(prot, layout, slot)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), want))
    assert first[1].tensor.ne(slot.tensor).any()
