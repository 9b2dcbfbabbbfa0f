"""The checkpoint shard's assembly (replica/persist.py ``assemble_shard``), which both checkpoint paths use: the
no-spare checkpoint (agent/recovery.py ``_write_shards``) and background persistence (agent/persister.py ``_write``).
Pure logic: real snapshot slots (replica/snapshot.py) written in memory, the shard written with
``persist.save_shard`` to a tmp directory and read back with ``load_shard``; no process is started. The end-to-end
proof is tests/e2e/test_hotswap.py (the no-spare checkpoint, a requeue that resumes from it), tests/e2e/test_rundir_faults.py
and tests/e2e/test_fsdp2.py (persistence, HSDP's kept region)."""
import pytest
import torch

from deadpool_hpc.errors import ReplicaError
from deadpool_hpc.replica import persist
from deadpool_hpc.replica.snapshot import SlotPair, StateLayout
from deadpool_hpc.rundir import latest_checkpoint

SHARE = 16   # bytes per kept share of a ctx.protect payload's local prefix


def _slot(layout: StateLayout, tensors, rng, step: int):
    slot = SlotPair(layout.nbytes).begin(step)
    assert layout.write(slot, tensors, rng, step)
    return slot


def _rng(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return g.get_state()


def _roundtrip(root: str, step: int, shards: dict, template: list) -> dict:
    """Save each rank's shard, commit the step, load each back: rank -> (tensors, rng, record)."""
    for rank, shard in shards.items():
        persist.save_shard(root, step, rank, shard.tensors, shard.rng, kept=shard.kept)
    persist.commit(root, step, len(shards), generation=3, high_water=step)
    meta = latest_checkpoint(root.rpartition("/")[0])
    assert meta["step"] == step and meta["high_water"] == step
    out = {}
    for rank in shards:
        tensors = [torch.empty_like(t) for t in template]
        rng = persist.load_shard(root, meta, rank, tensors)
        out[rank] = (tensors, rng, persist.shard_record(root, meta, rank))
    return out


def test_a_zero_shard_is_the_slots_tensors_and_rng_and_keeps_no_shares(tmp_path):
    """ZeRO-1's payload (no local prefix): the shard is the slot's state tensors and RNG; ``kept`` is None and the
    record has none; the round trip through save_shard/load_shard gives back the same bytes."""
    state = [torch.randn(4, 5), torch.randn(20), torch.randn(20)]
    rng = _rng(1)
    layout = StateLayout(state, rng.numel())
    slot = _slot(layout, state, rng, 7)
    shard = persist.assemble_shard(layout, slot)
    assert shard.kept is None
    assert all(torch.equal(a, b) for a, b in zip(shard.tensors, state)) and torch.equal(shard.rng, rng)
    # the tensors handed in are the ones filled (the no-spare checkpoint reuses them for every shard of a rank)
    again = persist.assemble_shard(layout, slot, shard.tensors)
    assert again.tensors is shard.tensors
    back = _roundtrip(str(tmp_path / "checkpoint"), 7, {0: shard}, state)
    tensors, got_rng, rec = back[0]
    assert all(torch.equal(a, b) for a, b in zip(tensors, state)) and torch.equal(got_rng, rng)
    assert "kept" not in rec


def test_protect_shards_of_an_own_snapshot_a_restored_one_and_a_lost_ranks_replica(tmp_path):
    """A ctx.protect payload: 3 kept shares (rank 0's own, then those of ranks 1 and 2, whose replicas it holds) and
    a wire tensor. From rank 0's own snapshot every share is its own; from one that is itself a restored replica
    (``from_replica``) none is; a lost rank's shard from the replica held for it takes the share this rank kept for it
    (its own snapshot's view ``keeper`` names) in the first place, and records only that one as kept."""
    shares = [torch.full((SHARE,), 10 + i, dtype=torch.uint8) for i in range(3)]
    wire0, wire2 = torch.randn(6), torch.randn(6)
    rng0, rng2 = _rng(2), _rng(3)
    layout = StateLayout(shares + [wire0], rng0.numel(), local_nbytes=3 * SHARE)
    own = _slot(layout, shares + [wire0], rng0, 9)
    # the replica of rank 2 held here: its local prefix was never sent (whatever bytes the slot had), the wire was
    junk = [torch.full((SHARE,), 255, dtype=torch.uint8) for _ in range(3)]
    held = _slot(layout, junk + [wire2], rng2, 9)

    mine = persist.assemble_shard(layout, own)
    assert mine.kept == [True, True, True]
    assert all(torch.equal(a, b) for a, b in zip(mine.tensors, shares + [wire0])) and torch.equal(mine.rng, rng0)

    asked = []

    def keeper():
        asked.append(1)
        return own, 1 + 1   # rank 2 is the second of the ranks rank 0 holds: view 1 + 1

    lost = persist.assemble_shard(layout, held, keeper=keeper)
    assert asked == [1] and lost.kept == [True, False, False]
    assert torch.equal(lost.tensors[0], shares[2])          # the share rank 0 kept for rank 2
    assert torch.equal(lost.tensors[3], wire2) and torch.equal(lost.rng, rng2)

    back = _roundtrip(str(tmp_path / "checkpoint"), 9, {0: mine, 1: lost}, shares + [wire0])
    for rank, shard in ((0, mine), (1, lost)):
        tensors, got_rng, rec = back[rank]
        assert rec["kept"] == shard.kept and rec["step"] == 9
        assert all(torch.equal(a, b) for a, b in zip(tensors, shard.tensors)) and torch.equal(got_rng, shard.rng)

    own.from_replica = True   # rank 0's own snapshot is itself a replica restored from its source: no share is its own
    assert persist.assemble_shard(layout, own).kept == [False, False, False]
    assert persist.assemble_shard(layout, held, keeper=lambda: (own, 2)).kept == [False, False, False]


def test_one_kept_region_is_never_given_to_a_lost_rank():
    """HSDP keeps one region (its replicate group's shards, whole): a lost rank's shard records it as not kept
    (its group restores it), and the keeper is not asked (it may have no snapshot of the step)."""
    region, wire = torch.arange(SHARE, dtype=torch.uint8), torch.randn(3)
    rng = _rng(4)
    layout = StateLayout([region, wire], rng.numel(), local_nbytes=SHARE)
    slot = _slot(layout, [region, wire], rng, 2)
    assert persist.assemble_shard(layout, slot).kept == [True]

    def keeper():
        raise AssertionError("the keeper is asked only where there are shares to give")

    lost = persist.assemble_shard(layout, slot, keeper=keeper)
    assert lost.kept == [False] and torch.equal(lost.tensors[0], region)


def test_a_slot_that_fails_its_checksum_or_holds_no_step_gives_no_shard():
    state = [torch.randn(8)]
    rng = _rng(5)
    layout = StateLayout(state, rng.numel())
    slot = _slot(layout, state, rng, 4)
    slot.buf[0] ^= 0xFF
    with pytest.raises(ReplicaError, match="step 4 fails its checksum"):
        persist.assemble_shard(layout, slot)
    slot.invalidate()
    with pytest.raises(ReplicaError, match="fails its checksum"):
        persist.assemble_shard(layout, slot)


def test_a_failed_write_names_its_errno():
    """persist.failure_reason: an OSError anywhere in the chain (torch wraps the writer's), else the first line of the
    message (the file system's state, which the end-to-end tests check, comes between)."""
    from deadpool_hpc.replica.persist import failure_reason

    try:
        try:
            open("/dev/full", "wb", buffering=0).write(b"x")
        except OSError as inner:
            raise RuntimeError("the writer failed") from inner
    except RuntimeError as exc:
        assert failure_reason(exc).startswith("ENOSPC"), failure_reason(exc)
    assert failure_reason(RuntimeError("boom\nmore")) == "RuntimeError: boom"
