"""ctx.protect and ctx.zero_adamw refuse a model with a parameter elsewhere than ctx.device before step 0, naming the
parameter, its device and ctx.device (worker/context.py, dataplane/backend.py ``misplaced_parameter``). On the CPU
with the meta device; a CPU model under a CUDA ctx.device needs CUDA and is skipped here."""
import types

import pytest
import torch

from deadpool_hpc.config import RunConfig
from deadpool_hpc.worker.context import Context


def bare_context(device, backend):
    """A Context before its run: what protect and zero_adamw read (no agent, no group: nothing is joined)."""
    ctx = Context.__new__(Context)
    ctx.config, ctx.world_size, ctx.device = RunConfig(nodes=1, spares=0), 1, torch.device(device)
    ctx._groups = types.SimpleNamespace(backend=backend)
    ctx._state, ctx._refusal = None, None
    return ctx


def meta_model():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with torch.device("meta"):
        model.append(torch.nn.Linear(4, 2))
    return model


@pytest.mark.parametrize("what", ["protect", "zero_adamw"])
def test_a_parameter_on_the_meta_device_is_refused_before_step_0(what):
    ctx, model = bare_context("cpu", "gloo"), meta_model()
    with pytest.raises(ValueError) as info:
        ctx.protect(model, torch.optim.SGD(model.parameters(), lr=0.1)) if what == "protect" else ctx.zero_adamw(model)
    assert str(info.value).startswith(f"ctx.{what}(model=Sequential): parameter '2.weight' is on meta but this "
                                      f"training process's device (ctx.device) is cpu")
    assert ctx.refusal is info.value   # job-wide: the entry point ends the job (worker/entry.py)
    assert ctx._state is None          # nothing protected, no step run


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (ctx.device cuda:0 under NCCL)")
def test_a_cpu_model_under_nccl_is_refused():
    ctx, model = bare_context("cuda:0", "nccl"), torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"parameter 'weight' is on cpu but .*ctx.device\) is cuda:0"):
        ctx.protect(model, torch.optim.SGD(model.parameters(), lr=0.1))
