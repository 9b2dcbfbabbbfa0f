"""worker/state/shards.py's ``ShardedState`` built and used alone over a real FSDP2 module on a one-rank mesh of
ctx.device_mesh's kind (a MeshGroup) and a real torch.optim.AdamW: the layout state from the real optimizer's dry
step (undone), a rebind, loading saved shards in place, the digest over every rank's shards."""
from __future__ import annotations

import hashlib
import threading

import torch

from deadpool_hpc.dataplane.collectives import Watch
from deadpool_hpc.dataplane.meshgroup import MeshGroup, device_mesh
from deadpool_hpc.worker.state.shards import ShardedState, check_fsdp2, local_shards


def sharded():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    mesh = device_mesh(MeshGroup(0, 1, Watch(threading.Event(), 30.0)))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_the_layout_state_comes_from_an_undone_dry_step_and_every_shard_is_the_rank_s_own(local_group):
    model, opt = sharded()
    check_fsdp2(model)
    state = ShardedState(model, model, opt, world_size=1)
    assert state.column is None and state.columns() is None
    model_sd, optim_sd, unique, padded = state.dry_run_state()
    assert not opt.state, "the dry step's state is dropped again"
    assert set(optim_sd["state"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert unique("/model/0.weight") and unique("/optim/state/0.weight/exp_avg")
    assert padded[id(model_sd["0.weight"])] == (4, 4)
    assert state.bind(0, Watch(threading.Event(), 30.0)) is False   # one rank: its shapes do not change


def test_saved_shards_are_loaded_in_place(local_group):
    model, opt = sharded()
    state = ShardedState(model, model, opt, world_size=1)
    state.bind(0, Watch(threading.Event(), 30.0))
    saved = {k: v.clone() for k, v in local_shards(model.state_dict()).items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with torch.no_grad():
        model[0].weight.to_local().add_(1.0)
    state.load({"model": saved, "optim": {"state": {}, "param_groups": groups}, "optim_empty": True})
    assert torch.equal(model[0].weight.to_local(), saved["0.weight"]) and not opt.state


def test_the_digest_covers_every_rank_s_digest_in_rank_order(local_group):
    model, opt = sharded()
    state = ShardedState(model, model, opt, world_size=1)
    state.bind(0, Watch(threading.Event(), 30.0))
    mine = hashlib.sha256(b"shards").hexdigest()
    assert state.gather_digest(mine) == hashlib.sha256(bytes.fromhex(mine)).hexdigest()
