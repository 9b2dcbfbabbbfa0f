import pytest
import torch

from deadpool_hpc.errors import ReplicaError
from deadpool_hpc.replica.snapshot import SlotPair, StateLayout, checksum


def test_two_slots_never_overwrite_the_newest():
    pair = SlotPair(16)
    a = pair.begin(); a.step, a.crc = 1, 0
    b = pair.begin(); assert b is not a
    b.step, b.crc = 2, 0
    c = pair.begin(); assert c is a and a.step is None  # the older slot is reused
    assert pair.steps() == [2]
    with pytest.raises(ReplicaError, match="step 1"):
        pair.get(1)


def test_layout_roundtrip_and_corruption_is_caught():
    state = [torch.randn(10), torch.randn(10), torch.randn(10)]
    rng = torch.get_rng_state()
    layout = StateLayout(state, rng.numel())
    pair = SlotPair(layout.nbytes)
    slot = pair.begin()
    layout.write(slot, state, rng, step=7)
    assert slot.step == 7 and slot.crc == checksum(slot.buf)
    out = [torch.empty(10) for _ in range(3)]
    got_rng = layout.read(slot, out)
    assert all(torch.equal(x, y) for x, y in zip(out, state)) and torch.equal(got_rng, rng)
    slot.buf[3] ^= 0xFF
    with pytest.raises(ReplicaError, match="checksum"):
        layout.read(slot, out)
