"""Shared by the in-process tests of ``ctx.protect``'s state (unit/worker/test_protect.py, unit/dataplane/test_fsdp.py):
train a model a few steps on seeded batches, snapshot its protected state into a slot as a training process does, and
restore it from there."""
import torch

from deadpool_hpc.replica.snapshot import Slot, StateLayout


def train_steps(model, opt, sched, first, n):
    """Steps ``first`` .. ``first + n - 1``: each on a batch of 2 x 8 token ids (< 256) drawn from a generator seeded
    with the step, so a step recomputed after a restore sees the same batch."""
    for s in range(first, first + n):
        g = torch.Generator().manual_seed(s)
        x = torch.randint(0, 256, (2, 8), generator=g)
        _, loss = model(x, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def snapshot(prot):
    """``prot``'s state and the torch RNG written into a new slot, as a training process writes a snapshot; returns
    (layout, slot)."""
    layout = StateLayout(prot.layout_tensors(), torch.get_rng_state().numel())
    slot = Slot(layout.nbytes)
    assert layout.write(slot, prot.state_tensors(), torch.get_rng_state(), step=0)
    return layout, slot


def restore(prot, layout, slot):
    """Puts ``slot``'s state (``snapshot``'s) back into ``prot`` and the torch RNG, as a recovery does."""
    torch.set_rng_state(layout.read(slot, prot.restore_targets()))
    prot.gather()
