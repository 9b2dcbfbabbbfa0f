import json

import numpy as np
import pytest
import torch

from deadpool_hpc.errors import ReplicaError
from deadpool_hpc.replica import persist
from deadpool_hpc.replica.snapshot import COPY_CHUNK, CRC_PIECE, Slot, SlotPair, StateLayout, checksum
from deadpool_hpc.rundir import latest_checkpoint


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


def test_checksum_is_crc32c_and_can_be_continued_piece_by_piece():
    assert checksum(b"123456789") == 0xE3069283          # the CRC-32C check value
    data = np.random.default_rng(0).integers(0, 256, 3 * CRC_PIECE + 17, dtype=np.uint8)
    whole = checksum(data)
    assert checksum(data[1000:], checksum(data[:1000])) == whole
    assert checksum(memoryview(data)) == checksum(bytearray(data)) == checksum(data.tobytes()) == whole
    assert checksum(data[:16].view(np.float32)) == checksum(data[:16])   # any dtype counts as its bytes


def test_chunked_write_checksums_the_whole_payload_and_can_be_stopped():
    state = [torch.randn(3 * COPY_CHUNK // 4 + 5), torch.randn(7)]   # several copy chunks, then a small tensor
    rng = torch.get_rng_state()
    layout = StateLayout(state, rng.numel())
    pair = SlotPair(layout.nbytes)
    slot = pair.begin()
    assert layout.write(slot, state, rng, step=3)
    assert slot.step == 3 and slot.crc == checksum(slot.buf)
    calls = []
    other = pair.begin()
    assert not layout.write(other, state, rng, step=4, should_stop=lambda: calls.append(1) or len(calls) > 2)
    assert other.step is None and pair.steps() == [3] and len(calls) == 3


def test_write_without_checksum_batches_the_same_bytes_pieces_included():
    # the path a training process takes into its agent's slot (crc=False: torch._foreach_copy_ batches): the same
    # bytes as the checksummed path, for a large tensor and lists of byte pieces (views of live tensors, as
    # ctx.protect's shares; a document and a view of zeros, as its JSON region)
    big = torch.randn(2 * COPY_CHUNK // 4 + 3)
    a, b = torch.arange(10, dtype=torch.float32), torch.arange(6, dtype=torch.int64)
    pieces = [a.view(torch.uint8)[:24], b.view(torch.uint8), a.view(torch.uint8)[24:]]
    region = [torch.full((3,), 7, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)[:5]]
    meta = [big, torch.empty(88, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8)]
    rng = torch.get_rng_state()
    layout = StateLayout(meta, rng.numel())
    first, second, third = Slot(layout.nbytes), Slot(layout.nbytes), Slot(layout.nbytes)
    second.buf[:] = 0xAA   # stale bytes: every one must be overwritten
    assert layout.write(first, [big, pieces, region], rng, step=1)
    assert layout.write(second, [big, pieces, region], rng, step=2, crc=False)
    assert second.step == 2 and second.crc == 0
    assert bytes(second.buf) == bytes(first.buf)
    n = big.numel() * 4
    assert bytes(second.buf[n:n + 96]) == b"".join(p.numpy().tobytes() for p in pieces) + bytes([7] * 3 + [0] * 5)
    calls = []
    assert not layout.write(third, [big, pieces, region], rng, step=3, crc=False,
                            should_stop=lambda: calls.append(1) or len(calls) > 1)
    assert third.step is None


def test_a_slot_being_read_is_never_handed_out_for_writing():
    pair = SlotPair(8)
    a = pair.begin(); a.stamp(1, 0)
    b = pair.begin(); b.stamp(2, 0)
    a.readers = 1                       # e.g. a restore is sending step 1
    with pytest.raises(ReplicaError, match="step 1 is being read"):
        pair.begin()
    assert pair.steps() == [1, 2]
    a.readers = 0
    assert pair.begin() is a and pair.steps() == [2]


def test_checkpoint_shard_roundtrip_checks_its_crc32c(tmp_path):
    root = str(tmp_path / "checkpoint")   # RUN_DIR/checkpoint; LATEST is read by rundir.latest_checkpoint(RUN_DIR)
    tensors = [torch.randn(10), torch.randn(10), torch.randn(10)]
    rng = torch.get_rng_state()
    persist.save_shard(root, 5, 0, tensors, rng)
    persist.commit(root, 5, 1, generation=2)
    meta = latest_checkpoint(str(tmp_path))
    out = [torch.empty(10) for _ in range(3)]
    assert torch.equal(persist.load_shard(root, meta, 0, out), rng)
    assert all(torch.equal(x, y) for x, y in zip(out, tensors))
    rec_path = tmp_path / "checkpoint" / "step5" / "rank0.json"
    rec = json.loads(rec_path.read_text())
    rec_path.write_text(json.dumps(dict(rec, crc32c=rec["crc32c"] ^ 1)))
    with pytest.raises(ReplicaError, match="rank 0 at step 5 fails its step/checksum check"):
        persist.load_shard(root, meta, 0, out)
    legacy = persist._legacy_crc32(tensors + [rng])     # a shard recorded by a version before CRC-32C
    rec_path.write_text(json.dumps({"step": 5, "rank": 0, "crc": legacy}))
    persist.load_shard(root, meta, 0, out)
    assert "kept" not in persist.shard_record(root, meta, 0)
    persist.save_shard(root, 5, 1, tensors, rng, kept=[True, False])   # a lost rank's, saved from a replica
    assert persist.shard_record(root, meta, 1)["kept"] == [True, False]


def test_the_slot_written_keeps_what_a_recovery_may_need():
    """After a rollback to step s, re-writing s must not destroy the only valid copy of s (a second failure
    while it is written would leave no copy of the cut step): steps ahead of s go first."""
    from deadpool_hpc.replica.snapshot import SlotPair

    def pair(a, b):
        p = SlotPair(8)
        p.slots[0].step, p.slots[1].step = a, b
        return p

    assert pair(9, 10).target(9).step == 10          # rollback: the future goes, 9 stays
    assert pair(10, 9).target(9).step == 10
    assert pair(8, 9).target(9).step == 8            # s already held: keep it
    assert pair(8, 9).target(10).step == 8           # the ordinary case: the older goes
    assert pair(None, 9).target(10).step is None
    assert pair(9, 10).target(11).step == 9
    assert pair(9, 10).target().step == 9            # no step given: the one not holding the newest


def test_the_agents_itemsize_table_is_torchs_own():
    """StateLayout's byte sizes by dtype name (what a node agent lays out without torch) are torch's."""
    from deadpool_hpc.replica.snapshot import ITEMSIZE

    for name, size in ITEMSIZE.items():
        if hasattr(torch, name):
            assert torch.empty(0, dtype=getattr(torch, name)).element_size() == size, name
    named = StateLayout([("bfloat16", [3, 5]), ("float32", (7,))], 16)
    real = StateLayout([torch.empty(3, 5, dtype=torch.bfloat16), torch.empty(7)], 16)
    assert (named.sizes, named.shapes, named.nbytes) == (real.sizes, real.shapes, real.nbytes) == ([30, 28],
                                                                                                  [(3, 5), (7,)], 74)
    assert named.dtypes == [torch.bfloat16, torch.float32]
    with pytest.raises(ReplicaError, match="'float128' is not supported.*accepted: bfloat16"):
        StateLayout([("float128", [2])], 0)


AGENT_SIDE = r"""
import sys
import numpy as np
import deadpool_hpc.agent.__main__, deadpool_hpc.agent.node, deadpool_hpc.agent.desk
from deadpool_hpc.ipc.shm import SharedBuffer
from deadpool_hpc.replica import persist
from deadpool_hpc.replica.snapshot import SlotPair, StateLayout, checksum, slot_pair
from deadpool_hpc.rundir import latest_checkpoint
layout = StateLayout([("float32", [4, 4]), ("bfloat16", [8])], 5, 64)
bufs = [SharedBuffer.create(layout.nbytes, name="t") for _ in range(2)]
own = slot_pair(bufs)
slot = own.begin(3)
slot.buf[:] = np.arange(layout.nbytes, dtype=np.uint8)
assert layout.stamp_written(slot, 3) and slot.crc == checksum(layout.wire(slot))
held = SlotPair(layout.nbytes)
held.begin(3).buf[:] = slot.buf
assert latest_checkpoint("/nonexistent") is None
print("torch" in sys.modules)
"""


@pytest.mark.e2e
def test_a_node_agents_side_of_a_snapshot_never_imports_torch():
    """A node agent lays out, holds and stamps snapshots as numpy bytes: its modules import no torch, so it spawns its
    training processes before it imports torch for a checkpoint save (agent/__main__.py), not after (issue 24)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", AGENT_SIDE], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "False", "the agent's side of a snapshot imported torch"

