"""worker/state/shares.py built and used alone: ``DataParallelShares`` (who keeps which share, the restore's
exchange on one rank and a lost share named, the gradient average), ``dry_run_state`` and ``load_full`` over a real
module and torch.optim.AdamW."""
from __future__ import annotations

import threading

import pytest
import torch

from deadpool_hpc.dataplane import collectives
from deadpool_hpc.dataplane.collectives import Watch
from deadpool_hpc.errors import ReplicaError
from deadpool_hpc.worker.state.shares import DataParallelShares, dry_run_state, load_full


def test_each_rank_keeps_its_own_share_and_those_of_the_ranks_whose_replica_it_holds():
    shares = DataParallelShares(3, ring=(1, 3, 1))   # 3 nodes of one rank, one replica each: r holds r - 1's
    assert shares.kept == 2 and shares.parts == 3
    for r in range(3):
        shares.bind(r, None)
        assert shares.owners() == [r, (r - 1) % 3]
    hsdp = DataParallelShares(4, ring=(2, 2, 1), columns=[(0, 2), (1, 3)])
    hsdp.bind(3, None)
    assert (hsdp.kept, hsdp.parts, hsdp.owners()) == (1, 1, [0])
    alone = DataParallelShares(1, ring=(1, 1, 1))   # one rank: nobody to hold a replica for
    alone.bind(0, None)
    assert (alone.kept, alone.parts, alone.owners()) == (1, 1, [0])


def test_one_rank_restores_its_own_share_and_refuses_a_snapshot_without_one():
    shares = DataParallelShares(1)
    shares.bind(0, None)
    kept = [torch.arange(16, dtype=torch.uint8)]
    assert torch.equal(shares.exchange(kept, [True]), kept[0])
    with pytest.raises(ReplicaError, match="carries no share"):
        shares.exchange(kept, [False])


def test_a_share_no_live_rank_kept_is_named_with_its_holders(monkeypatch):
    """Rank 0 of 3 restores; ranks 1 and 2 (rank 1's holder) say they kept nothing: share 1 is lost."""
    def all_gather(out, inp, watch):
        out.copy_(torch.tensor([1, 1, 0, 0] + [0, 0, 0, 0] * 2))
    monkeypatch.setattr(collectives, "all_gather", all_gather)
    shares = DataParallelShares(3, ring=(1, 3, 1))
    shares.bind(0, None)
    with pytest.raises(ReplicaError, match=r"rank 1's share .* is lost: neither rank 1 nor a holder of its replica "
                                           r"\(\[2\]\) kept a copy"):
        shares.exchange([torch.zeros(8, dtype=torch.uint8)] * 2, [True, True])


def test_the_gradient_average_over_one_rank_keeps_the_gradients_and_fills_missing_ones(local_group):
    shares = DataParallelShares(1)
    shares.bind(0, Watch(threading.Event(), 30.0))
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    a.grad = torch.tensor([1.0, 2.0, 3.0])
    shares.average_gradients([a, b])
    assert a.grad.tolist() == [1.0, 2.0, 3.0] and b.grad.tolist() == [0.0, 0.0] and b.grad.dtype == torch.float64


def test_the_dry_run_state_leaves_the_optimizer_untouched_and_load_full_restores_a_tree(local_group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model_sd, optim_sd, unique = dry_run_state(model, model, opt)
    assert not opt.state, "the dry step ran on a copy"
    assert set(optim_sd["state"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert unique("/model/1.running_mean") and not unique("/model/0.weight")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model[0].weight.add_(1.0)
    load_full(model, opt, {"model": saved, "optim": {"state": {}, "param_groups": [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}, "optim_empty": True})
    assert torch.equal(model[0].weight, saved["0.weight"]) and not opt.state
