"""The per-step snapshot protocol over the progress page (agent/desk.py, ipc/shm.py): a claim word answered with a
grant, a written word shipped to a real holder over TCP, the committed word stored by the Replicator, all woken by
a real eventfd doorbell; stale and busy claims. The training process's side is played here by storing the words,
then by its SnapshotWriter (replica/writer.py: inline and background copies, the waits); tests/unit/replica/test_replicator.py
takes every snapshot through the writer, and the end-to-end runs (test_your_loop.py, test_hotswap.py) run it all.
Run: DEADPOOL_SLURM_TESTS=0 .venv/bin/python -m pytest -q tests/unit/agent/test_desk.py
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from deadpool_hpc.ipc.shm import GEN_MASK, Doorbell, ProgressPage, SharedBuffer, pack_word, unpack_word
from deadpool_hpc.errors import PeerFailure
from deadpool_hpc.replica.snapshot import Slot, StateLayout, checksum, slot_pair
from deadpool_hpc.replica.pusher import INLINE_STAMP_BYTES
from deadpool_hpc.replica.replicator import Replicator
from deadpool_hpc.replica.writer import SnapshotWriter
from snapnode import Agent  # tests/snapnode.py: the NodeAgent attributes the desk reads

SECRET = b"test-secret-0123456789abcdef-32b"
NBYTES = 1 << 16


class Log:
    def __init__(self):
        self.events = []

    def emit(self, name, **fields):
        self.events.append(dict(fields, event=name))


def wait_until(pred, timeout, what):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.002)


def test_words_pack_generation_step_and_index_into_one_word():
    for g, step, index in [(0, -1, -1), (0, 0, 0), (7, 123_456_789, 1), (GEN_MASK, (1 << 40) - 2, 14)]:
        assert unpack_word(pack_word(g, step, index)) == (g, step, index)
    assert unpack_word(pack_word(GEN_MASK + 3, 5))[0] == 2   # the generation wraps at 20 bits: compared masked
    assert pack_word(0, 0) != 0   # the first claim of the first generation differs from an empty word


def test_doorbell_wakes_a_waiter_and_coalesces_rings():
    bell = Doorbell.create()
    try:
        assert bell.wait(0.01) is False
        for _ in range(3):
            bell.ring()
        assert bell.wait(0.01) is True and bell.wait(0.01) is False   # three rings, one wake: the words say what
        t = threading.Timer(0.05, bell.ring)
        t.start()
        t0 = time.monotonic()
        assert bell.wait(2.0) is True and time.monotonic() - t0 < 1.0
    finally:
        bell.close()
    with pytest.raises(TypeError):
        bell.ring()   # closed: never a write to a reused fd number


@pytest.fixture(params=[NBYTES, 2 * INLINE_STAMP_BYTES + 4], ids=["stamped-by-the-desk", "stamped-by-the-stamp-thread"])
def desk_setup(request):
    """A node of one local rank: its own slots in shared memory, a Replicator pushing to a holder Replicator over
    TCP, its progress page, and the desk. Everything is closed at the end. Two payload sizes: one the desk
    checksums itself, one it hands to the Replicator's stamp thread (``INLINE_STAMP_BYTES``)."""
    nbytes = request.param
    layout = StateLayout([torch.empty(nbytes // 4)], 0)
    bufs = [SharedBuffer.create(nbytes) for _ in range(2)]
    holder = Replicator(SECRET, layout, Log(), host="127.0.0.1")
    me = Replicator(SECRET, layout, Log(), host="127.0.0.1", own=slot_pair(bufs))
    page = ProgressPage.create()
    agent = Agent({0: me}, {0: page})
    committed = []
    me.on_commit = lambda g, step: (committed.append((g, step)), page.put(page.COMMITTED, g, step))
    desk = agent.desk()
    yield layout, bufs, holder, me, page, agent, desk, committed
    desk.close()
    me.close()
    holder.close()
    page.close()
    for b in bufs:
        b.close()


def _configure(holder, me, g):
    holder.configure(g, None, [], [0])
    me.configure(g, 0, [holder.address], [])


def _grant(page, g, step, timeout=5.0):
    wait_until(lambda: unpack_word(page.raw(page.GRANT))[:2] == (g, step), timeout, f"the grant of step {step}")
    return page.get(page.GRANT)[2]


def test_a_claimed_and_written_snapshot_reaches_its_holder_and_comes_back_committed(desk_setup):
    layout, bufs, holder, me, page, agent, desk, committed = desk_setup
    _configure(holder, me, 3)
    for step in range(4):
        page.put(page.CLAIM, 3, step)
        desk.bell.ring()
        index = _grant(page, 3, step)
        state = [torch.full((layout.nbytes // 4,), float(step))]
        assert layout.write(me.own.slots[index], state, torch.empty(0, dtype=torch.uint8), step, crc=False)
        page.put(page.WRITTEN, 3, step, index)
        desk.bell.ring()
        wait_until(lambda: page.get(page.COMMITTED)[:2] == (3, step), 5, f"the commit of step {step}")
        held = holder.held(0).get(step)
        assert checksum(layout.wire(held)) == held.crc == me.own.get(step).crc
        assert agent.written[0] == step
    assert committed == [(3, s) for s in range(4)]
    # two slots, alternating: the newest step and the one before are kept, the grant never hands out the newest
    assert me.own.steps() == [2, 3]
    # a written word whose claim was dropped (a quiesce between them) is not this generation's snapshot
    page.put(page.CLAIM, 3, 4)
    desk.bell.ring()
    index = _grant(page, 3, 4)
    me.quiesce()
    page.put(page.WRITTEN, 3, 4, index)
    desk.bell.ring()
    time.sleep(0.1)
    assert agent.written[0] == 3 and me.own.find(4) is None


def test_a_claim_of_an_older_generation_is_never_granted(desk_setup):
    layout, bufs, holder, me, page, agent, desk, committed = desk_setup
    _configure(holder, me, 5)
    page.put(page.CLAIM, 4, 10)    # a process still on generation 4 (it left before the agent reconfigured)
    desk.bell.ring()
    time.sleep(0.1)
    assert page.raw(page.GRANT) == 0 and desk.pending == {}
    assert me.claim(11, generation=4) is None   # the Replicator refuses it too (under its lock)
    page.put(page.CLAIM, 5, 10)
    desk.bell.ring()
    assert _grant(page, 5, 10) in (0, 1)


def test_a_claim_refused_while_a_slot_is_busy_is_granted_once_it_is_free(desk_setup):
    layout, bufs, holder, me, page, agent, desk, committed = desk_setup
    _configure(holder, me, 1)
    page.put(page.CLAIM, 1, 0)
    desk.bell.ring()
    first = _grant(page, 1, 0)
    # the granted slot is still being written (no written word yet): the next claim must wait for it
    page.put(page.CLAIM, 1, 1)
    desk.bell.ring()
    wait_until(lambda: desk.pending.get(0) == (1, 1), 5, "the busy claim to be pending")
    assert unpack_word(page.raw(page.GRANT))[1] == 0
    layout.write(me.own.slots[first], [torch.zeros(layout.nbytes // 4)], torch.empty(0, dtype=torch.uint8), 0,
                 crc=False)
    page.put(page.WRITTEN, 1, 0, first)
    desk.bell.ring()   # the written word frees the slot; the pending claim is retried without another ring
    assert _grant(page, 1, 1) == 1 - first
    assert desk.pending == {}


def test_the_writer_copies_inline_once_its_early_claim_is_granted_and_in_the_background_otherwise(desk_setup):
    layout, bufs, holder, me, page, agent, desk, committed = desk_setup
    _configure(holder, me, 2)
    lost = threading.Event()
    slots = [Slot(layout.nbytes, torch.from_numpy(b.array)) for b in bufs]
    writer = SnapshotWriter(page, desk.bell, slots, layout, lost=lost, grant_timeout=5)
    try:
        no_rng = torch.empty(0, dtype=torch.uint8)
        state = [torch.full((layout.nbytes // 4,), 1.0)]
        assert writer.snapshot(0, state, no_rng, 2) == "background"   # no early claim
        writer.wait_committed(0, 2, threading.Event(), 5)
        writer.claim_early(1, 2)
        _grant(page, 2, 1)
        assert writer.snapshot(1, state, no_rng, 2) == "inline"
        assert writer.wait_committed(1, 2, threading.Event(), 5) >= 0.0
        assert writer.counts == {"inline": 1, "background": 1} and me.own.steps() == [0, 1]
        assert checksum(layout.wire(holder.held(0).get(1))) == me.own.get(1).crc
        assert writer.committed(1, 2) and not writer.committed(1, 3) and not writer.committed(2, 2)
        # a commit that never comes: the failure flag, the agent's loss or the timeout end the wait
        me.quiesce()
        writer.submit(2, state, no_rng, 2)
        flag = threading.Event()
        threading.Timer(0.1, flag.set).start()
        with pytest.raises(PeerFailure, match="step 2 not committed: a peer failed"):
            writer.wait_committed(2, 2, flag, 5)
        with pytest.raises(PeerFailure, match=r"step 2 not committed within 0\.2 s"):
            writer.wait_committed(2, 2, threading.Event(), 0.2)
        lost.set()
        with pytest.raises(PeerFailure, match="a peer failed"):
            writer.wait_committed(2, 2, threading.Event(), 5)
        t = time.monotonic()
        writer.quiesce()   # the copy thread waiting for a grant the paused Replicator holds back stops at once
        assert time.monotonic() - t < 1.0 and writer.settle(2, 0.1)
    finally:
        writer.close()
