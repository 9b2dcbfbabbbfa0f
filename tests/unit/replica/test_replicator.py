"""The Replicator over real TCP sockets, with peers in real processes that are SIGKILLed or
SIGSTOPped mid-transfer (always reaped). Each snapshot takes the path of a run: the training process's SnapshotWriter
claims, writes and says written, the agent's desk and Replicator checksum, push and commit (tests/snapnode.py).
A refused or failed push is seen as a commit that never comes (the training process's view) and in the event log.
Run: DEADPOOL_SLURM_TESTS=0 .venv/bin/python -m pytest -q tests/unit/replica/test_replicator.py
"""
from __future__ import annotations

import gc
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from deadpool_hpc.errors import PeerFailure, ReplicaError
from deadpool_hpc.replica.snapshot import StateLayout, checksum
from deadpool_hpc.replica.headers import Ack, Go, Push
from deadpool_hpc.replica.stream import Link
from deadpool_hpc.replica.replicator import Replicator
from snapnode import SnapNode  # tests/snapnode.py
from testkit import SECRET, Log, made_and_ended, wait_until  # tests/testkit.py

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
HERE = paths.TESTS


def layout_of(nbytes: int) -> StateLayout:
    return StateLayout([torch.empty(nbytes // 4)], 0)


def state_of(nbytes: int, seed: int) -> list[torch.Tensor]:
    return [torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed))]


@pytest.fixture
def reps():
    """Replicators made by a test, each with its desk and writer (``r.node``: tests/snapnode.py); closed at the
    end, each within a bounded time."""
    made = []

    def make(nbytes=1 << 16, secret=SECRET, **kw):
        log = Log()
        r = Replicator(secret, layout_of(nbytes), log, host="127.0.0.1", **kw)
        r.log_ = log
        r.node = SnapNode(r)
        made.append(r)
        return r

    yield make
    for r in made:
        t = time.monotonic()
        r.node.close()
        r.close()
        assert time.monotonic() - t < 2.0


# ---- a peer in another process -------------------------------------------------------------------
PEER = r"""
import json, sys, threading, time, torch
a = json.loads(sys.argv[1])
sys.path.insert(0, a["tests"])
from deadpool_hpc.replica.snapshot import StateLayout
from deadpool_hpc.replica.replicator import Replicator
from snapnode import SnapNode
torch.set_num_threads(1)
out = threading.Lock()
def say(**kw):
    with out:
        print(json.dumps(kw), flush=True)
class Log:
    def emit(self, name, **f): say(event=name, **f)
n = a["nbytes"]
rep = Replicator(a["secret"].encode(), StateLayout([torch.empty(n // 4)], 0), Log(), host="127.0.0.1")
rep.configure(0, a.get("rank"), [], a.get("held", []))
if "own_step" in a:
    node = SnapNode(rep)
    node.commit(a["own_step"], [torch.randn(n // 4, generator=torch.Generator().manual_seed(a["seed"]))], timeout=30)
    node.close()
def slow(kind):  # a slow transfer that says once when it is under way
    told = []
    def hook(rank, step, done, total):
        if not told:
            told.append(1); say(**{kind: done})
        time.sleep(0.5)
    return hook
if a.get("slow_restore_send"): rep.restore_send_hook = slow("mid_restore_send")
if a.get("slow_receive"): rep.receive_hook = slow("mid_push")
say(address=rep.address)
def send(r):  # as a rank's source in a recovery: send a restore
    try:
        rep.send_restore(r["to"], r["rank"], r["step"], r["generation"], threading.Event(), r["timeout"])
        say(sent="ok")
    except Exception as exc:
        say(sent=f"{type(exc).__name__}: {exc}")
for line in sys.stdin:
    if line.strip() == "report": say(report=rep.report())
    elif line.startswith("send "): threading.Thread(target=send, args=(json.loads(line[5:]),), daemon=True).start()
rep.close()
"""


class Peer:
    """A Replicator in a child process; killed (SIGKILL) and reaped on exit whatever happened."""

    def __init__(self, **args):
        args = dict(args, secret=SECRET.decode(), tests=HERE)
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.events = []
        threading.Thread(target=self._read, daemon=True).start()
        self.address = None

    def _read(self):
        for line in self.proc.stdout:
            msg = json.loads(line)
            if "event" in msg:
                self.events.append(msg)
            self.lines.put(msg)

    def wait_for(self, key: str, timeout: float = 30.0):
        end = time.monotonic() + timeout
        while True:
            try:
                msg = self.lines.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"peer {self.proc.pid} did not say {key!r} within {timeout} s") from None
            if key in msg:
                return msg[key]

    def start(self):
        self.address = self.wait_for("address")
        return self

    def report(self) -> dict:
        self.proc.stdin.write("report\n")
        self.proc.stdin.flush()
        return self.wait_for("report", 10)

    def send_restore(self, to, rank: int, step: int, generation: int, timeout: float) -> None:
        """Start sending a restore (the peer's own thread says ``sent``: "ok" or the error)."""
        req = {"to": list(to), "rank": rank, "step": step, "generation": generation, "timeout": timeout}
        self.proc.stdin.write("send " + json.dumps(req) + "\n")
        self.proc.stdin.flush()

    def signal(self, sig) -> float:
        os.kill(self.proc.pid, sig)
        return time.monotonic()

    def reap(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture
def peers():
    yield from made_and_ended(Peer, Peer.reap)


def restore(src, dst, rank: int, step: int, generation: int = 1, failure=None, timeout: float = 10.0):
    """A restore as a recovery makes it: ``dst`` expects it, its source ``src`` (a Replicator, on a thread here, or a
    Peer) sends it, ``dst`` waits for it. Returns the slot; raises what ``wait_restore`` raises."""
    failure = failure or threading.Event()
    dst.expect_restore(rank, step, generation)
    if isinstance(src, Peer):
        src.send_restore(dst.address, rank, step, generation, timeout)
        return dst.wait_restore(failure, timeout)
    th = threading.Thread(target=lambda: _quiet(src.send_restore, dst.address, rank, step, generation, failure,
                                                timeout))
    th.start()
    try:
        return dst.wait_restore(failure, timeout)
    finally:
        th.join(timeout + 2)


def _quiet(fn, *args):
    try:
        fn(*args)
    except (PeerFailure, ReplicaError):
        pass   # the target's wait says what went wrong


# ---- push, ack, commit -------------------------------------------------------------------------
@pytest.mark.e2e
def test_push_is_committed_once_both_holders_ack_it(reps, peers):
    n = 1 << 20
    h1, h2 = peers(nbytes=n, held=[3]), peers(nbytes=n, held=[3])
    h1.start(), h2.start()
    me = reps(n)
    me.configure(0, 3, [h1.address, h2.address], [])
    state = state_of(n, 1)
    flag = threading.Event()
    for step in (7, 8):
        me.node.submit(step, state)
        me.node.wait_committed(step, flag, 20)
    assert h1.report()["held"] == {"3": [7, 8]} and h2.report()["held"] == {"3": [7, 8]}
    assert me.report() == {"own_rank": 3, "own": [7, 8], "held": {}}
    assert me.own.get(8).crc == checksum(state[0].numpy().view(np.uint8))
    assert me.bytes_sent == 4 * n and not me.log_.named("replica_transfer_abandoned")


def test_pushes_share_one_kept_connection_which_a_holder_quiesce_replaces(reps):
    """Issue 7: one push thread per holder keeps its connection between steps (no connect, accept and two
    threads per step); a holder's quiesce shuts it down, and the next push opens a new one, losing nothing."""
    n = 1 << 18
    holder, me = reps(n), reps(n)
    holder.configure(0, None, [], [0])
    me.configure(0, 0, [holder.address], [])
    state, flag = state_of(n, 5), threading.Event()
    for step in range(1, 6):
        me.node.submit(step, state)
        me.node.wait_committed(step, flag, 10)
    assert holder.holder.handlers == 1, "five pushes should have used one connection"
    holder.quiesce()   # the holder alone (the sender's connection is left idle, then found shut)
    holder.configure(0, None, [], [0])
    for step in range(6, 9):
        me.node.submit(step, state)
        me.node.wait_committed(step, flag, 10)
    wait_until(lambda: holder.holder.handlers == 1, 2.0, "the shut-down connection's handler to end")
    assert holder.report()["held"] == {"0": [7, 8]}
    assert not me.log_.named("replica_transfer_abandoned"), me.log_.events
    assert me.bytes_sent == 8 * n


def test_no_holders_commits_once_the_local_copy_is_done(reps):
    me = reps()
    me.configure(0, 0, [], [])
    me.node.submit(4, state_of(1 << 16, 2))
    me.node.wait_committed(4, threading.Event(), 5)
    assert me.report()["own"] == [4]


def test_push_before_the_holder_is_configured_is_retried_until_it_is(reps):
    holder, me = reps(), reps()
    me.configure(0, 0, [holder.address], [])
    me.node.submit(1, state_of(1 << 16, 3))
    time.sleep(0.3)  # the holder is still quiesced (not configured): it answers "retry"
    holder.configure(0, None, [], [0])
    me.node.wait_committed(1, threading.Event(), 10)
    assert holder.report()["held"] == {"0": [1]}


# ---- nothing is trusted without its signature and checksum -----------------------------------------
class BadCrcLayout(StateLayout):
    """Stamps a wrong CRC: what a payload corrupted between the agent's checksum and the wire looks like."""

    def stamp_written(self, slot, step, should_stop=None):
        ok = super().stamp_written(slot, step, should_stop)
        slot.crc ^= 0x1
        return ok


def rejected(log, role: str) -> list[str]:
    """The reasons of the ``replica_rejected`` events of ``role`` in ``log``."""
    return [e["reason"] for e in log.named("replica_rejected") if e["role"] == role]


def test_a_payload_failing_its_checksum_is_rejected_and_not_committed(reps):
    n = 1 << 16
    holder, me = reps(n), reps(n)
    me.layout = BadCrcLayout([torch.empty(n // 4)], 0)
    holder.configure(0, None, [], [0])
    me.configure(0, 0, [holder.address], [])
    me.node.submit(5, state_of(n, 4))
    with pytest.raises(PeerFailure, match="step 5 not committed within 1 s"):
        me.node.wait_committed(5, threading.Event(), 1.0)
    assert holder.report()["held"] == {"0": []}
    [why] = rejected(me.log_, "sender")
    assert "refused the replica" not in why and "checksum mismatch" in why
    [ev] = holder.log_.named("replica_rejected")
    assert ev["role"] == "holder" and ev["step"] == 5 and "checksum" in ev["reason"]


def test_a_push_signed_with_another_secret_is_rejected_before_its_payload(reps):
    holder, me = reps(), reps(secret=b"not-the-job-secret-0123456789abc")
    holder.configure(0, None, [], [0])
    me.configure(0, 0, [holder.address], [])
    me.node.submit(5, state_of(1 << 16, 5))
    t = time.monotonic()
    with pytest.raises(PeerFailure, match=r"step 5 not committed within 1 s"):
        me.node.wait_committed(5, threading.Event(), 1.0)
    assert 0.9 < time.monotonic() - t < 3.0
    assert holder.report()["held"] == {"0": []}
    assert any("HMAC" in e["reason"] for e in holder.log_.named("replica_rejected"))
    [ev] = me.log_.named("replica_transfer_abandoned")
    assert ev["kind"] == "push" and ev["peer"].startswith("127.0.0.1:") and ev["step"] == 5


def test_a_wrong_size_or_an_unheld_rank_is_rejected(reps):
    holder = reps(1 << 16)
    holder.configure(0, None, [], [0])
    big = reps((1 << 16) + 4)
    big.configure(0, 0, [holder.address], [])
    big.node.submit(1, state_of((1 << 16) + 4, 6))
    wait_until(lambda: rejected(big.log_, "sender"), 10, "the refusal of the wrong size")
    assert "65540 bytes, expected 65536" in rejected(big.log_, "sender")[0]
    with pytest.raises(PeerFailure, match="step 1 not committed"):
        big.node.wait_committed(1, threading.Event(), 0.2)
    other = reps(1 << 16, timeout=0.5)   # rank 9 is not held: "retry" until its timeout, then refused: transient
    other.configure(0, 9, [holder.address], [])  # (a holder busy or not yet configured: the recovery's to fix)
    other.node.submit(1, state_of(1 << 16, 7))
    wait_until(lambda: rejected(other.log_, "sender"), 10, "the pusher to give up")
    assert rejected(other.log_, "sender") == ["still refused after 0.5 s: rank 9 is not held here (held ranks: [0])"]
    assert other.committed_step == -1
    assert holder.report()["held"] == {"0": []}
    assert rejected(holder.log_, "holder") == ["payload of 65540 bytes, expected 65536"]


def test_an_ack_commits_only_the_step_it_names(reps):
    """A holder that acks another step (e.g. one of an older generation) must not commit this one."""
    srv = socket.create_server(("127.0.0.1", 0))
    me = reps()

    def fake_holder():
        sock, _ = srv.accept()
        link = Link(sock, "fake", idle=5)
        hdr = link.recv_msg(SECRET)
        link.send_msg(Go(ok=True, retry=False, reason=""), SECRET)
        link.recv_into(bytearray(hdr.nbytes))
        link.send_msg(Ack(ok=True, reason="", rank=hdr.rank, step=hdr.step - 1, crc=hdr.crc), SECRET)
        time.sleep(0.5)
        link.close()

    t = threading.Thread(target=fake_holder)
    t.start()
    try:
        me.configure(0, 0, [["127.0.0.1", srv.getsockname()[1]]], [])
        me.node.submit(3, state_of(1 << 16, 8))
        with pytest.raises(PeerFailure, match="step 3 not committed"):
            me.node.wait_committed(3, threading.Event(), 1.0)
        assert "ack of rank 0 step 3" in me.log_.named("replica_transfer_abandoned")[0]["reason"]
    finally:
        t.join(5)
        srv.close()


# ---- a holder that dies or freezes mid-push -------------------------------------------------------
def step_1_is_never_committed(me) -> None:
    """The training process's view of a push that never completes: waiting for step 1's commit ends with a
    PeerFailure as soon as the failure flag is set (0.2 s here), or after the wait's own timeout (0.5 s)."""
    flag = threading.Event()
    threading.Timer(0.2, flag.set).start()
    t = time.monotonic()
    with pytest.raises(PeerFailure, match="a peer failed"):
        me.node.wait_committed(1, flag, 30)
    assert time.monotonic() - t < 1.5      # the flag, not the 30 s timeout
    t = time.monotonic()
    with pytest.raises(PeerFailure, match=r"not committed within 0\.5 s"):
        me.node.wait_committed(1, threading.Event(), 0.5)
    assert 0.45 < time.monotonic() - t < 2.0


@pytest.mark.e2e
def test_holder_killed_mid_push(reps, peers):
    n = 32 << 20
    h = peers(nbytes=n, held=[0], slow_receive=True).start()
    me = reps(n)
    me.configure(0, 0, [h.address], [])
    state = state_of(n, 9)
    me.node.submit(1, state)
    h.wait_for("mid_push")
    t_kill = h.signal(signal.SIGKILL)
    wait_until(lambda: me.log_.named("replica_transfer_abandoned"), 1.5, "the push to notice the kill")
    assert time.monotonic() - t_kill < 1.5
    step_1_is_never_committed(me)
    [ev] = me.log_.named("replica_transfer_abandoned")
    assert ev["peer"].startswith("127.0.0.1:") and ev["reason"].startswith("PeerGone")


@pytest.mark.e2e
def test_holder_frozen_mid_push_and_quiesce_is_prompt(reps, peers):
    n = 32 << 20
    h = peers(nbytes=n, held=[0], slow_receive=True).start()
    me = reps(n)
    me.configure(0, 0, [h.address], [])
    me.node.submit(1, state_of(n, 10))
    h.wait_for("mid_push")
    h.signal(signal.SIGSTOP)
    step_1_is_never_committed(me)
    assert not me.log_.named("replica_transfer_abandoned")   # a frozen peer: the push is still waiting
    t = time.monotonic()
    me.quiesce()
    assert time.monotonic() - t < 1.0
    wait_until(lambda: me.log_.named("replica_transfer_abandoned"), 1.0, "the push to be abandoned")
    assert "quiesced" in me.log_.named("replica_transfer_abandoned")[0]["reason"]
    assert me.report()["own"] == [1]        # the local copy is complete and verified, only the push was dropped


# ---- restore: the source sends, the target expects ------------------------------------------------------
def test_restore_round_trip_is_bit_for_bit_and_calls_restore_send_hook(reps):
    n = 3 << 20
    state = state_of(n, 11)
    rng = torch.get_rng_state()
    layout = StateLayout(state, rng.numel())
    log = Log()
    server = Replicator(SECRET, layout, log, host="127.0.0.1")
    spare = Replicator(SECRET, layout, Log(), host="127.0.0.1")
    try:
        server.configure(0, 2, [], [])
        node = SnapNode(server)
        node.commit(6, state, rng)
        node.close()
        calls = []
        server.restore_send_hook = lambda *a: calls.append(a)
        spare.configure(1, None, [], [])
        slot = restore(server, spare, 2, 6)
        assert slot.step == 6 and slot.crc == server.own.get(6).crc
        assert slot.from_replica and not server.own.get(6).from_replica   # a restored payload: no kept shares of its own
        assert np.array_equal(slot.buf, server.own.get(6).buf)
        out = [torch.empty_like(state[0])]
        got_rng = layout.read(slot, out)
        assert torch.equal(out[0], state[0]) and torch.equal(got_rng, rng)
        assert spare.report()["own"] == [6]
        sent = [c[2] for c in calls]
        assert calls[0][:2] == (2, 6) and sent == sorted(sent) and sent[-1] == calls[-1][3] == layout.nbytes
        with pytest.raises(ReplicaError, match=r"rank 2 step 7 .*no verified copy.*own rank 2: \[6\]"):
            restore(server, spare, 2, 7)      # the source says why, the target's wait raises it
        with pytest.raises(ReplicaError, match="no verified copy of rank 5"):
            restore(server, spare, 5, 6)
        # a source that comes before the target read the decision is asked again until it expects the restore
        sent = []
        early = threading.Thread(target=lambda: sent.append(server.send_restore(spare.address, 2, 6, 4,
                                                                                threading.Event(), 10)))
        early.start()
        time.sleep(0.3)
        assert early.is_alive() and spare.report()["own"] == [6]
        spare.expect_restore(2, 6, 4)
        assert spare.wait_restore(threading.Event(), 10).step == 6
        early.join(5)
        assert sent == [None]
        # a source without the copy that comes before the target expects it still tells the target why
        early = threading.Thread(target=lambda: _quiet(server.send_restore, spare.address, 2, 9, 5,
                                                       threading.Event(), 10))
        early.start()
        time.sleep(0.2)
        t = time.monotonic()
        spare.expect_restore(2, 9, 5)
        with pytest.raises(ReplicaError, match=r"rank 2 step 9 from 127\.0\.0\.1:\d+ .*no verified copy"):
            spare.wait_restore(threading.Event(), 10)
        assert time.monotonic() - t < 1.0
        early.join(5)
        # the restore of an older generation, or of another rank, than the one expected is refused for good
        spare.expect_restore(2, 6, 5)
        with pytest.raises(ReplicaError, match="refused: this process expects rank 2 step 6 for generation 5, not "
                                               "rank 2 step 6 for generation 4"):
            server.send_restore(spare.address, 2, 6, 4, threading.Event(), 10)
        with pytest.raises(PeerFailure, match=r"rank 2 step 6 .*generation 5\): it did not arrive within 0\.3 s"):
            spare.wait_restore(threading.Event(), 0.3)
    finally:
        server.close()
        spare.close()


def test_an_ack_sent_after_the_target_took_its_copy_still_reaches_the_source(reps, monkeypatch):
    """The target's agent takes the copy (its wait ends) before the receiving thread sends the ack: the ack must
    still go (it went nowhere once, and the source reported a restore that had succeeded as failed)."""
    n = 1 << 16
    src, dst = reps(n), reps(n)
    src.configure(0, 3, [], [])
    src.node.submit(2, state_of(n, 3))
    src.node.wait_committed(2, threading.Event(), 10)
    send_msg = Link.send_msg

    def late_ack(self, msg, secret):
        if isinstance(msg, Ack):
            time.sleep(0.3)   # the target's wait has returned by now
        return send_msg(self, msg, secret)

    monkeypatch.setattr(Link, "send_msg", late_ack)
    assert restore(src, dst, 3, 2).step == 2
    assert not src.log_.named("replica_transfer_abandoned") and not dst.log_.named("replica_transfer_abandoned")
    done = []
    t = threading.Thread(target=lambda: done.append(src.send_restore(dst.address, 3, 2, 2, threading.Event(), 5)))
    dst.expect_restore(3, 2, 2)
    t.start()
    dst.wait_restore(threading.Event(), 5)
    t.join(5)
    assert done == [None]   # acknowledged


@pytest.mark.e2e
def test_restore_from_a_killed_source_fails_fast(reps, peers):
    n = 32 << 20
    srv = peers(nbytes=n, rank=1, own_step=4, seed=12, slow_restore_send=True).start()
    me = reps(n)
    me.configure(1, None, [], [])
    killed = []
    threading.Thread(target=lambda: (srv.wait_for("mid_restore_send"), killed.append(srv.signal(signal.SIGKILL)))).start()
    with pytest.raises(PeerFailure, match=r"rank 1 step 4 from 127\.0\.0\.1:\d+ .*failed: .*closed the connection "
                                          r"after"):
        restore(srv, me, 1, 4, timeout=30)
    assert killed and time.monotonic() - killed[0] < 1.5
    assert me.report()["own"] == []          # the half-written slot is never reported
    srv.proc.wait(5)                         # gone for good (its listening socket too): a send to it fails at once
    t = time.monotonic()
    with pytest.raises(PeerFailure, match="cannot connect.*ECONNREFUSED"):
        me.send_restore(srv.address, 1, 4, 1, threading.Event(), 30)
    assert time.monotonic() - t < 1.0


@pytest.mark.e2e
def test_restore_from_a_frozen_source_respects_timeout_and_failure_flag(reps, peers):
    n = 32 << 20
    srv = peers(nbytes=n, rank=1, own_step=4, seed=13, slow_restore_send=True).start()
    me = reps(n)
    me.configure(1, None, [], [])
    threading.Thread(target=lambda: (srv.wait_for("mid_restore_send"), srv.signal(signal.SIGSTOP))).start()
    t = time.monotonic()
    with pytest.raises(PeerFailure, match="did not arrive within 2 s"):
        restore(srv, me, 1, 4, timeout=2.0)
    assert 1.9 < time.monotonic() - t < 3.5
    # the receiving thread let go of the own slot with the wait: the next restore is not held up behind it
    src = reps(n)
    src.configure(1, 1, [], [])
    src.node.submit(4, state_of(n, 13))
    src.node.wait_committed(4, threading.Event(), 10)
    assert restore(src, me, 1, 4, generation=2).crc == src.own.get(4).crc
    flag = threading.Event()
    threading.Timer(0.3, flag.set).start()
    t = time.monotonic()
    with pytest.raises(PeerFailure, match="failure flag set"):
        me.expect_restore(1, 4, 3)
        me.wait_restore(flag, 30)             # nothing comes: the frozen source stays frozen
    assert 0.25 < time.monotonic() - t < 1.5   # the flag, not the 30 s timeout


# ---- quiesce and configure on the receiving side -------------------------------------------------
def test_quiesce_drops_an_incoming_push_but_restores_go_on(reps):
    n = 1 << 20
    holder, me, spare = reps(n), reps(n), reps(n)
    holder.configure(0, None, [], [0])
    me.configure(0, 0, [holder.address], [])
    state = state_of(n, 14)
    me.node.submit(1, state)
    me.node.wait_committed(1, threading.Event(), 10)
    # a sender that stops half-way through step 2's payload
    link = Link.connect(holder.address, idle=5)
    payload = state[0].numpy().view(np.uint8)
    link.send_msg(Push(generation=0, rank=0, step=2, nbytes=n, crc=checksum(payload)), SECRET)
    assert link.recv_msg(SECRET).ok
    link.send(payload[: n // 2])
    wait_until(lambda: holder.state.writing, 2, "the holder to be receiving")
    t = time.monotonic()
    holder.quiesce()
    assert time.monotonic() - t < 1.0
    with pytest.raises(Exception):
        link.send(payload[n // 2:])
        link.recv_msg(SECRET)
    link.close()
    wait_until(lambda: holder.log_.named("replica_transfer_abandoned"), 1.0, "the holder to drop the push")
    assert "quiesced" in holder.log_.named("replica_transfer_abandoned")[0]["reason"]
    assert holder.report()["held"] == {"0": [1]}      # step 2's slot stays invalid
    slot = restore(holder, spare, 0, 1)   # sending restores goes on while quiesced
    assert np.array_equal(slot.buf, payload)
    me.configure(1, 0, [holder.address], [])  # the next generation (a recovery reconfigures every process)
    me.node.submit(3, state)          # a new push to a quiesced holder is refused ("retry") ...
    time.sleep(0.2)
    assert holder.report()["held"] == {"0": [1]}
    holder.configure(1, None, [], [0])   # ... and lands once it is configured again
    me.node.wait_committed(3, threading.Event(), 10)
    assert holder.report()["held"] == {"0": [1, 3]}


def test_a_push_from_an_older_generation_cannot_evict_a_newer_copy(reps):
    """A process left behind on an older generation (fenced but alive, or a stale push in flight) must not
    replace the copies the live rank committed since (a review found step 9 of generation 3 evicting step 11)."""
    n = 1 << 16
    holder, live, stale = reps(n), reps(n), reps(n)
    holder.configure(5, None, [], [0])
    live.configure(5, 0, [holder.address], [])
    for step in (10, 11):
        live.node.submit(step, state_of(n, step))
        live.node.wait_committed(step, threading.Event(), 10)
    stale.configure(3, 0, [holder.address], [])
    stale.node.submit(9, state_of(n, 9))
    wait_until(lambda: rejected(stale.log_, "sender"), 10, "the holder's refusal")
    assert rejected(stale.log_, "sender") == ["push of generation 3; this holder is at generation 5"]
    assert stale.committed_step == -1
    assert holder.report()["held"] == {"0": [10, 11]}


def test_configure_keeps_still_held_ranks_and_frees_the_others(reps):
    n = 1 << 20
    holder, r0, r1 = reps(n), reps(n), reps(n)
    holder.configure(0, None, [], [0, 1])
    for rank, r in ((0, r0), (1, r1)):
        r.configure(0, rank, [holder.address], [])
        r.node.submit(10 + rank, state_of(n, rank))
        r.node.wait_committed(10 + rank, threading.Event(), 10)
    assert holder.report()["held"] == {"0": [10], "1": [11]}
    gone = weakref.ref(holder.held(0))
    kept = holder.held(1)
    holder.quiesce()
    holder.configure(1, None, [], [1, 2])
    gc.collect()
    assert gone() is None                                    # rank 0's two slots are freed
    assert holder.held(1) is kept and holder.report()["held"] == {"1": [11], "2": []}
    with pytest.raises(ReplicaError, match=r"no replica of rank 0; held ranks: \[1, 2\]"):
        holder.held(0)
    with pytest.raises(ValueError, match="not \\[host, port\\]"):
        holder.configure(2, 0, [["127.0.0.1"]], [])


# ---- real size: 200 MB never starves a heartbeat-like thread ----------------------------------------
@pytest.mark.e2e
def test_200mb_push_and_restore_leave_a_5ms_ticker_alone(reps, peers):
    n = 200_000_000
    h = peers(nbytes=n, held=[0]).start()
    me, spare = reps(n), reps(n)
    me.configure(0, 0, [h.address], [])
    spare.configure(1, None, [], [])
    state = state_of(n, 15)
    gaps, stop = [], threading.Event()

    def tick():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(1.0)                      # the machine is shared: what does the ticker see with nothing to do?
        idle = max(gaps)
        gaps.clear()
        t = time.monotonic()
        me.node.submit(1, state)
        me.node.wait_committed(1, threading.Event(), 30)
        t_push = time.monotonic() - t
        t = time.monotonic()
        slot = restore(h, spare, 0, 1, timeout=30)
        t_fetch = time.monotonic() - t
    finally:
        stop.set()
        ticker.join()
    assert np.array_equal(slot.buf, state[0].numpy().view(np.uint8))
    print(f"200 MB: push {n / t_push / 1e6:.0f} MB/s, restore {n / t_fetch / 1e6:.0f} MB/s, "
          f"ticker's longest gap {max(gaps) * 1e3:.1f} ms (idle: {idle * 1e3:.1f} ms)")
    assert max(gaps) < 0.25 + idle, f"a 5 ms ticker waited {max(gaps):.3f} s (idle machine: {idle:.3f} s)"



def test_memory_stays_flat_across_generations_of_pushes_and_restores(reps):
    """No per-transfer payload buffers and no graveyard: resident memory does not grow per generation."""
    def rss_mb() -> float:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

    n = 8 << 20
    me, holder, spare = reps(n), reps(n), reps(n)
    state, flag, step, after = state_of(n, 16), threading.Event(), 0, []
    for gen in range(5):
        for r in (me, holder, spare):
            r.quiesce()
        me.configure(gen, 0, [holder.address], [])
        holder.configure(gen, None, [], [0])
        spare.configure(gen, None, [], [])
        for _ in range(4):
            step += 1
            me.node.submit(step, state)
            me.node.wait_committed(step, flag, 10)
            assert restore(holder, spare, 0, step, generation=gen, failure=flag).step == step
        gc.collect()
        after.append(rss_mb())
    assert max(after[1:]) - after[0] < 5, f"resident MB after each generation: {after}"


# ---- the transport extension point (replica/transports.py) ---------------------------------------
def test_unix_transport_pushes_commits_and_restores_bit_for_bit(reps):
    """The built-in ``unix`` transport under the same protocol: a push is committed once the holder acked it, and a
    restore sends the same bytes; the addresses are abstract Unix socket names, not TCP ports."""
    from deadpool_hpc.replica.transports import check_transport

    unix = check_transport("unix")
    n = 1 << 20
    holder, me, spare = reps(n, transport=unix), reps(n, transport=unix), reps(n, transport=unix)
    assert holder.address[0] == "unix" and holder.address[1].startswith("deadpool-replica-")
    holder.configure(0, None, [], [4])
    me.configure(0, 4, [holder.address], [])
    state = state_of(n, 5)
    me.node.submit(3, state)
    me.node.wait_committed(3, threading.Event(), 20)
    assert holder.report()["held"] == {"4": [3]} and me.committed_step == 3
    spare.configure(1, None, [], [])
    slot = restore(holder, spare, 4, 3)
    assert slot.crc == me.own.get(3).crc and np.array_equal(slot.buf, me.own.get(3).buf)
    with pytest.raises(PeerFailure, match="unix:nobody"):
        holder.send_restore(["unix", "nobody"], 4, 3, 1, threading.Event(), 2)


def test_an_unknown_or_broken_transport_is_refused_by_name():
    from deadpool_hpc.plugins import PluginError
    from deadpool_hpc.replica.transports import check_transport

    with pytest.raises(PluginError, match=r"--replica-transport 'rdma': .*accepted: .*tcp.*unix"):
        check_transport("rdma")
    with pytest.raises(ValueError, match="is a wildcard"):
        check_transport("tcp").listen("0.0.0.0")
