"""worker/state/layout.py's ``SnapshotLayout`` built and used alone, over a small real module and a real
torch.optim.AdamW (no ``Protected``, no context): where each tensor sits, the shares' bytes, and a payload read back
into the same tensors."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from deadpool_hpc.worker.state.layout import SnapshotLayout


@pytest.fixture
def local_group():   # DCP's state_dict functions ask whether torch.distributed is initialized
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def small():
    """A linear layer, a batch norm (buffers, one of them int64: 8-byte elements) and AdamW with its state made by one
    real step."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt, get_model_state_dict(model), get_optimizer_state_dict(model, opt)


def build(model, opt, model_sd, optim_sd, parts=2, kept=2, small_state=None):
    buffers = {f"/model/{n}" for n, _ in model.named_buffers()}
    return SnapshotLayout(model, model, opt, model_sd, optim_sd, unique=lambda path: path in buffers,
                          small=lambda: dict(small_state or {"note": 1}), parts=parts, kept=kept)


def solid(t) -> torch.Tensor:
    """A payload entry as one tensor: a list of 1-D uint8 pieces concatenated, else the tensor's bytes."""
    return torch.cat(t) if isinstance(t, list) else t.contiguous().reshape(-1).view(torch.uint8)


def test_the_layout_places_shares_before_the_rank_s_own_tensors_and_sizes_every_region(local_group):
    model, opt, model_sd, optim_sd = small()
    layout = build(model, opt, model_sd, optim_sd, parts=2, kept=2)
    paths = [p for p, _, _ in layout.entries]
    assert "/model/0.weight" in paths and "/optim/state/0.weight/exp_avg" in paths
    unique = [layout.entries[i][0] for i in layout.unique]
    assert set(unique) == {f"/model/{n}" for n, _ in model.named_buffers()}
    assert layout.entries[layout.unique[0]][1] == torch.int64   # 8-byte elements first
    common = sum(t.numel() * t.element_size() for p, t in
                 [(p, model_sd[p[len("/model/"):]]) for p in paths if p.startswith("/model/")] if p not in unique)
    common += sum(v.numel() * v.element_size() for st in optim_sd["state"].values() for v in st.values())
    assert layout.common_nbytes == common
    assert layout.shard_nbytes == max(8, math.ceil(common / 16) * 8) and layout.local_nbytes == 2 * layout.shard_nbytes
    metas = layout.layout_tensors()
    assert len(metas) == 2 + len(layout.unique) + 1 and metas[-1].numel() == layout.blob_nbytes


def test_two_shares_hold_the_common_bytes_and_a_payload_decodes_to_the_live_tensors(local_group):
    model, opt, model_sd, optim_sd = small()
    layout = build(model, opt, model_sd, optim_sd, parts=2, kept=2, small_state={"epoch": 7})
    payload = layout.state_tensors([0, 1])
    found, _ = layout.collect()
    assert [torch.equal(solid(payload[r]), torch.cat(layout.share_pieces(r, found))) for r in (0, 1)] == [True, True]
    targets = layout.restore_targets()
    for target, entry in zip(targets, payload):
        target.reshape(-1).view(torch.uint8).copy_(solid(entry))
    restored = layout.take_restored()
    tree, small_state = layout.decode(restored, torch.cat(restored.kept))
    assert small_state == {"epoch": 7}
    live = model.state_dict()
    assert all(torch.equal(tree["model"][k], live[k]) for k in live)
    for fqn, st in tree["optim"]["state"].items():
        p = dict(model.named_parameters())[fqn]
        assert all(torch.equal(v, opt.state[p][k]) for k, v in st.items())


def test_a_state_tensor_that_changes_shape_after_the_layout_is_refused_by_name(local_group):
    model, opt, model_sd, optim_sd = small()
    layout = build(model, opt, model_sd, optim_sd)
    model[0].weight.data = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"/model/0.weight changed from torch.float32 \[3, 4\] to torch.float32 \[2, 4\]"):
        layout.state_tensors([0, 1])
