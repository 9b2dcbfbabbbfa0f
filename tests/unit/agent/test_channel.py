"""The local channel between a node agent and its training processes (agent/channel.py, ipc/shm.py,
agent/store.py, worker/client.py), with real processes on real sockets: training processes SIGKILLed and
SIGSTOPped mid-conversation, an agent SIGKILLed under its client. Every child is killed and reaped at the end.
Run: DEADPOOL_SLURM_TESTS=0 .venv/bin/python -m pytest -q tests/unit/agent/test_channel.py
"""
from __future__ import annotations

import base64
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from deadpool_hpc.agent.channel import ChannelServer
from deadpool_hpc.agent.store import GenerationStore
from deadpool_hpc.errors import AgentLost, ChannelError, ChannelTimeout, PeerFailure
from deadpool_hpc.ipc.shm import ProgressPage, SharedBuffer
from deadpool_hpc.replica.snapshot import StateLayout, checksum, slot_pair
from deadpool_hpc.worker.client import AgentClient, AgentStore

from testkit import SECRET, Log, made_and_ended, wait_until  # tests/testkit.py


def memfds() -> list[str]:
    """This process's open memfd descriptors and memfd mappings (both must be gone after a close)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:" in os.readlink(f"/proc/self/fd/{fd}"):
                out.append(f"fd {fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as fh:
        out += [line.split()[-2] for line in fh if "memfd:" in line]
    return out


# ---- the agent side, driven by a thread of this process -----------------------------------------------
class Agent:
    """A ChannelServer (the code under test) polled by a thread that answers ``ping`` with ``pong``, ``layout``
    with shared slots, store messages from ``store``; everything else is queued for the test."""

    def __init__(self, secret=SECRET, store: GenerationStore | None = None, **kw):
        self.log = Log()
        self.srv = ChannelServer(secret, log=self.log, **kw)
        self.store = store
        self.msgs: queue.Queue = queue.Queue()
        self.bufs: dict[int, list[SharedBuffer]] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            for lr, kind, body in self.srv.poll(0.05):
                if self.store is not None and self.store.handle(lr, kind, body, self.srv.send):
                    continue
                if kind == "ping":
                    self.srv.send(lr, "pong", body)
                elif kind == "layout":
                    bufs = self.bufs[lr] = [SharedBuffer.create(body["nbytes"]) for _ in range(body["count"])]
                    self.srv.send(lr, "slots", {"nbytes": body["nbytes"], "count": body["count"]},
                                  fds=[b.fd for b in bufs])
                else:
                    self.msgs.put((lr, kind, body))
            if self.store is not None:
                self.store.expire()

    def expect(self, kind: str, timeout: float = 30.0):
        end = time.monotonic() + timeout
        while True:
            try:
                lr, k, body = self.msgs.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the agent got no {kind!r} within {timeout} s") from None
            if k == kind:
                return lr, body

    def close(self):
        self._stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()
        t = time.monotonic()
        self.srv.close()
        assert time.monotonic() - t < 1.0
        for bufs in self.bufs.values():
            for b in bufs:
                b.close()


@pytest.fixture
def agents():
    yield from made_and_ended(Agent, Agent.close)


# ---- a training process (or an agent) in a child process -------------------------------------------
CLIENT = r"""
import json, os, socket, statistics, sys, time, timeit
a = json.loads(sys.argv[1])
def say(**kw):
    print(json.dumps(kw), flush=True)
secret = a["secret"].encode()
mode = a["mode"]
if mode == "raw":   # speak the protocol by hand: frames, raw bytes, silence; report what comes back
    from deadpool_hpc.ipc.frames import FrameReader, address_of, encode_frame
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(address_of(a["name"]))
    for op, *args in a["send"]:
        if op == "frame":
            s.sendall(encode_frame(args[0], args[1], args[2].encode() if len(args) > 2 else secret))
        elif op == "bytes":
            s.sendall(bytes.fromhex(args[0]))
        elif op == "sleep":
            time.sleep(args[0])
    reader, replies = FrameReader(secret), []
    while True:
        data = s.recv(65536)
        if not data:
            break
        reader.feed(data)
        replies += [[k, b] for k, b in reader.messages()]
    say(replies=replies, eof=True)
    sys.exit(0)
if mode == "agent":   # a node agent whose client is this test
    from deadpool_hpc.agent.channel import ChannelServer
    srv = ChannelServer(secret)
    say(name=srv.name)
    while True:
        for lr, kind, body in srv.poll(0.5):
            if kind == "ping":
                srv.send(lr, "pong", body)
from deadpool_hpc.worker.client import AgentClient
try:
    c = AgentClient.connect(a["name"], secret, a["local_rank"], a.get("timeout", 20))
except Exception as e:
    say(error=type(e).__name__, message=str(e))
    sys.exit(3)
say(connected=os.getpid(), agent_pid=c.agent_pid)
if mode == "echo":
    c.on("ping", lambda b: c.send("pong", b))
    c.get("finish", 60)
elif mode == "rtt":
    ts = []
    for i in range(a["n"]):
        t0 = time.perf_counter()
        c.send("ping", {"i": i})
        c.get("pong", 10)
        ts.append(time.perf_counter() - t0)
    beat = c.progress.beat
    ns = [timeit.timeit(beat, number=200000) / 200000 * 1e9 for _ in range(5)]
    say(rtt_us=statistics.median(ts) * 1e6, beat_ns=statistics.median(ns))
elif mode == "beats":
    p = c.progress
    for _ in range(a["beats"]):
        p.beat()
    p.set_step(41)
    p.arm()
    c.send("beaten", {"n": a["beats"]})
    c.get("finish", 60)
elif mode == "slots":
    import numpy as np, torch
    from deadpool_hpc.replica.snapshot import checksum
    bufs = c.attach_slots(a["nbytes"], 20)
    pattern = np.random.default_rng(a["seed"]).integers(0, 256, a["nbytes"], dtype=np.uint8)
    bufs[0].tensor.copy_(torch.from_numpy(pattern))   # the training side writes with torch
    c.send("written", {"slot": 0, "step": 7, "crc": checksum(pattern)})
    c.get("check", 20)               # the agent wrote slot 1: read it here
    c.send("seen", {"crc": checksum(bufs[1].array)})
    c.get("finish", 20)
    for b in bufs:
        b.close()
    c.close()
    left = [l for l in open("/proc/self/maps") if "memfd:" in l]
    for f in os.listdir("/proc/self/fd"):
        try:
            if "memfd:" in os.readlink(f"/proc/self/fd/{f}"):
                left.append(f + " " + os.readlink(f"/proc/self/fd/{f}"))
        except OSError:
            pass
    say(left=left)
elif mode == "forks":   # a training process whose child (a loader worker) outlives it unless ended with it
    if a.get("install"):
        from deadpool_hpc.process import children as ch
        ch.install()   # as worker/entry.py does
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    say(forked=pid, sock=c.sock.fileno())
    time.sleep(60)
elif mode == "chatter":
    i = 0
    while True:
        c.progress.beat()
        c.send("written", {"step": i, "slot": i % 2})
        i += 1
        if i == 100:
            say(chattering=True)
elif mode == "gloo":
    import datetime as dt
    import torch, torch.distributed as dist
    from deadpool_hpc.worker.client import AgentStore
    torch.set_num_threads(1)
    store = dist.PrefixStore("gen1", AgentStore(c, 1, timeout=a["store_timeout"]))
    say(joining=time.time())
    try:
        dist.init_process_group("gloo", store=store, rank=a["rank"], world_size=a["world"],
                                timeout=dt.timedelta(seconds=a["pg_timeout"]))
    except Exception as e:
        say(init_error=type(e).__name__, message=str(e)[:400], t=time.time())
        sys.exit(4)
    t = torch.tensor([float(a["rank"] + 1)])
    dist.all_reduce(t)
    say(sum=t.item())
    dist.destroy_process_group()
"""


class Child:
    """A child process running CLIENT in ``mode``; SIGKILLed and reaped by the fixture whatever happened."""

    def __init__(self, mode: str, name: str = "", local_rank: int = 0, secret: bytes = SECRET, **args):
        args = dict(args, mode=mode, name=name, local_rank=local_rank, secret=secret.decode())
        self.proc = subprocess.Popen([sys.executable, "-c", CLIENT, json.dumps(args)], stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.pid = self.proc.pid
        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def said(self, key: str, timeout: float = 30.0):
        end = time.monotonic() + timeout
        while True:
            try:
                msg = self.lines.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"child {self.pid} did not say {key!r} within {timeout} s") from None
            if key in msg:
                return msg if len(msg) > 1 else msg[key]

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def kill(self):
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)   # our own child, by pid
        self.proc.wait(10)
        self.reader.join(5)
        self.proc.stdout.close()


@pytest.fixture
def children():
    made = []

    def make(*a, **kw):
        c = Child(*a, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.kill()


# ---- admission ------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_hello_is_welcomed_and_messages_flow_both_ways(agents, children):
    agent = agents(ranks=2)
    assert agent.srv.name.startswith("deadpool-") and str(os.getpid()) in agent.srv.name
    child = children("echo", agent.srv.name, local_rank=1)
    hello = child.said("connected")
    lr, body = agent.expect("hello")
    assert lr == 1 and body == {"local_rank": 1, "pid": child.pid, "uid": os.getuid()}
    assert hello["agent_pid"] == os.getpid() and agent.srv.connected() == [1]
    assert agent.srv.peer(1) == {"pid": child.pid, "uid": os.getuid()} and not agent.srv.closed(1)
    assert agent.srv.send(1, "ping", {"x": [1, "two"]}) and agent.expect("pong") == (1, {"x": [1, "two"]})
    assert not agent.srv.send(0, "ping", {})          # nobody is local rank 0
    agent.srv.send(1, "finish", {})
    assert child.wait() == 0
    lr, body = agent.expect("closed")
    assert lr == 1 and "EOF" in body["why"] and agent.srv.closed(1) and agent.srv.connected() == []
    assert agent.log.named("agent_refused") == []


@pytest.mark.e2e
def test_a_client_without_the_secret_is_refused_and_logged(agents, children):
    agent = agents()
    child = children("echo", agent.srv.name, secret=b"another-jobs-secret-0123456789ab")
    err = child.said("error")
    assert child.wait() == 3
    assert err["error"] == "ChannelError" and "job secret" in err["message"], err
    wait_until(lambda: agent.log.named("agent_refused"), 5, "agent_refused")
    ev = agent.log.named("agent_refused")[0]
    assert "HMAC" in ev["reason"] and ev["peer_pid"] == child.pid and ev["peer_uid"] == os.getuid()
    assert agent.srv.connected() == [] and agent.msgs.empty()


@pytest.mark.e2e
def test_a_wrong_first_message_and_other_bad_hellos_are_refused(agents, children):
    agent = agents(ranks=2, hello_timeout=1.0)
    cases = {   # what the connecting process sends -> words of the refusal
        "first message is 'layout'": [["frame", "layout", {"nbytes": 8}]],
        "local_rank 5 is not 0..1": [["frame", "hello", {"local_rank": 5, "pid": 1}]],
        "pid 1 is not the connecting process's": [["frame", "hello", {"local_rank": 0, "pid": 1}]],
        "frame length": [["bytes", "7fffffff" + "00" * 8]],
        "no hello within 1 s": [["sleep", 3]],
    }
    kids = {why: children("raw", agent.srv.name, send=send) for why, send in cases.items()}
    for why, kid in kids.items():
        out = kid.said("replies")
        assert kid.wait() == 0
        assert len(out["replies"]) == 1 and out["replies"][0][0] == "refused" and why in out["replies"][0][1]["why"], \
            (why, out)
    reasons = [e["reason"] for e in agent.log.named("agent_refused")]
    assert all(any(why in r for r in reasons) for why in cases), reasons
    assert agent.srv.connected() == [] and agent.msgs.empty()


@pytest.mark.e2e
def test_one_connection_per_local_rank(agents, children):
    agent = agents()
    first = children("echo", agent.srv.name, local_rank=0)
    first.said("connected")
    second = children("echo", agent.srv.name, local_rank=0)
    err = second.said("error")
    assert second.wait() == 3 and f"local rank 0 is already connected (pid {first.pid})" in err["message"], err
    assert agent.srv.connected() == [0] and agent.srv.peer(0)["pid"] == first.pid
    assert any("already connected" in e["reason"] for e in agent.log.named("agent_refused"))
    agent.srv.send(0, "ping", {"still": "first"})
    assert agent.expect("pong") == (0, {"still": "first"})


# ---- shared memory ----------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_slots_are_shared_both_ways_and_back_a_slot_pair(agents, children):
    before = memfds()
    agent = agents()
    nbytes = 3 * (1 << 20) + 13
    child = children("slots", agent.srv.name, nbytes=nbytes, seed=5)
    _, written = agent.expect("written")
    bufs = agent.bufs[0]
    pattern = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)
    assert np.array_equal(bufs[0].array, pattern) and checksum(bufs[0].array) == written["crc"]
    # the agent's replicator view: a SlotPair over the shared buffers; the agent stamps after verifying
    pair = slot_pair(bufs)
    slot = pair.begin(written["step"])
    assert slot.tensor.data_ptr() == bufs[0].tensor.data_ptr()
    slot.stamp(written["step"], checksum(slot.buf))
    assert pair.get(7) is slot and slot.crc == written["crc"]
    layout = StateLayout([torch.empty(nbytes // 4)], nbytes - 4 * (nbytes // 4))
    state = [torch.empty(nbytes // 4)]
    rng = layout.read(slot, state)
    assert state[0].numpy().view(np.uint8).tobytes() == pattern[:4 * (nbytes // 4)].tobytes()
    assert rng.numpy().tobytes() == pattern[4 * (nbytes // 4):].tobytes()
    other = np.random.default_rng(6).integers(0, 256, nbytes, dtype=np.uint8)
    bufs[1].array[:] = other                               # the agent fetched state into slot 1 (a restore)
    agent.srv.send(0, "check", {})
    _, seen = agent.expect("seen")
    assert seen["crc"] == checksum(other)
    agent.srv.send(0, "finish", {})
    assert child.said("left") == [] and child.wait() == 0   # the child unmapped and closed everything
    del pair, slot, state, layout, rng
    agent.close()
    agent.bufs.clear()
    assert memfds() == before


def test_sealed_buffers_and_a_wrong_size_are_refused():
    buf = SharedBuffer.create(4096)
    try:
        with pytest.raises(OSError):
            os.ftruncate(buf.fd, 10)              # sealed: a training process cannot shrink it under the agent
        with pytest.raises(ChannelError, match="holds 4096 bytes; the message said 100"):
            SharedBuffer.attach(os.dup(buf.fd), 100)
        with pytest.raises(ValueError, match="not a positive number of bytes"):
            SharedBuffer.create(0)
    finally:
        buf.close()


def test_a_buffer_sent_may_be_closed_by_the_agent_at_once(agents):
    before = memfds()
    agent = agents()
    c = AgentClient.connect(agent.srv.name, SECRET, 0, 20)
    try:
        agent.expect("hello")
        buf = SharedBuffer.create(1000)
        buf.array[:] = 42
        assert agent.srv.send(0, "slots", {"nbytes": 1000, "count": 1}, fds=[buf.fd])
        buf.close()                                    # the queued frame holds its own duplicate
        body = c.get("slots", 10)
        got = SharedBuffer.attach(body["_fds"][0], 1000)
        assert (got.array == 42).all()
        got.close()
    finally:
        c.close()
        agent.close()
    assert memfds() == before


@pytest.mark.e2e
def test_progress_beats_are_seen_by_the_agent(agents, children):
    agent = agents()
    child = children("beats", agent.srv.name, beats=12345)
    agent.expect("hello")
    page = agent.srv.progress(0)
    assert isinstance(page, ProgressPage)
    _, body = agent.expect("beaten")
    assert page.beats() == body["n"] == 12345 and page.step == 41 and page.armed
    assert page.stalled_for() < 0.5                 # it changed since the page was made
    time.sleep(0.3)
    assert page.stalled_for() >= 0.25               # and has not changed since
    agent.srv.send(0, "finish", {})
    assert child.wait() == 0


# ---- deaths and freezes --------------------------------------------------------------------------------
@pytest.mark.e2e
def test_a_training_process_killed_mid_conversation_is_reported_closed_and_nothing_leaks(agents, children):
    shm_before = set(os.listdir("/dev/shm"))   # other sessions' MPI runs come and go there: look at ours only
    fds_before, mem_before = sorted(os.listdir("/proc/self/fd")), memfds()
    agent = agents()
    child = children("chatter", agent.srv.name)
    child.said("chattering")
    page = agent.srv.progress(0)
    wait_until(lambda: page.beats() > 100, 5, "beats")
    t = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    steps = []
    while True:
        lr, kind, body = agent.msgs.get(timeout=5)
        if kind == "closed":
            break
        if kind == "written":
            steps.append(body["step"])
    took = time.monotonic() - t
    assert lr == 0 and agent.srv.closed(0) and took < 1.0, (body, took)
    assert len(steps) >= 100 and steps == list(range(len(steps)))   # every whole frame before the kill, in order
    child.kill()
    agent.close()
    page = None  # drop our reference to the shared page
    assert [f for f in set(os.listdir("/dev/shm")) - shm_before if "deadpool" in f or "memfd" in f] == []
    assert memfds() == mem_before
    assert sorted(os.listdir("/proc/self/fd")) == fds_before


@pytest.mark.e2e
def test_a_stopped_training_process_never_blocks_the_agent(agents, children):
    agent = agents(max_outbox=1 << 20)
    child = children("echo", agent.srv.name)
    child.said("connected")
    agent.expect("hello")
    os.kill(child.pid, signal.SIGSTOP)
    try:
        page = agent.srv.progress(0)
        big = {"pad": "x" * 60000}
        slowest, sent = 0.0, 0
        while sent < 100:
            t = time.perf_counter()
            ok = agent.srv.send(0, "ping", big)
            slowest = max(slowest, time.perf_counter() - t)
            if not ok:
                break
            sent += 1
        assert not ok and slowest < 0.1, (sent, slowest)   # dropped once ~1 MiB waited; no send ever blocked
        lr, body = agent.expect("closed", 5)
        assert "not reading" in body["why"] and agent.srv.closed(0)
        assert page.stalled_for() >= 0.0 and page.beats() == 0
    finally:
        os.kill(child.pid, signal.SIGCONT)
    assert child.wait(20) != 0          # it woke to a closed channel: its reader saw EOF, get("finish") failed


@pytest.mark.e2e
def test_the_client_notices_its_agent_s_death_at_once(children):
    agent = children("agent")
    name = agent.said("name")
    lost = []
    c = AgentClient.connect(name, SECRET, 0, 20, on_lost=lambda why: lost.append((time.monotonic(), why)))
    try:
        c.send("ping", {"a": 1})
        assert c.get("pong", 10) == {"a": 1}
        errors = []

        def waiter():
            try:
                c.get("never", 30)
            except AgentLost as exc:
                errors.append((time.monotonic(), exc))

        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.2)
        t = time.monotonic()
        os.kill(agent.pid, signal.SIGKILL)
        assert c.lost.wait(2.0)
        th.join(2.0)
        end = time.monotonic() + 2.0   # on_lost runs in the reader thread just after ``lost`` is set
        while not lost and time.monotonic() < end:
            time.sleep(0.005)
        assert lost and lost[0][0] - t < 0.5 and "closed" in lost[0][1], lost
        print(f"the client saw its agent's SIGKILL after {(lost[0][0] - t) * 1000:.1f} ms")
        assert errors and errors[0][0] - t < 0.5, errors
        with pytest.raises(AgentLost):
            c.send("ping", {})
        with pytest.raises(AgentLost):
            c.request("store_get", {"key": "k"}, 5)
    finally:
        c.close()


@pytest.mark.e2e
def test_every_wait_has_a_deadline(children):
    with pytest.raises(ChannelTimeout, match="no node agent listens"):
        AgentClient.connect("deadpool-nobody-here", SECRET, 0, 0.3)
    with pytest.raises(ValueError, match="positive, finite"):
        AgentClient.connect("deadpool-nobody-here", SECRET, 0, float("inf"))
    agent = children("agent")
    name = agent.said("name")
    c = AgentClient.connect(name, SECRET, 0, 20, send_timeout=1.0)
    try:
        with pytest.raises(ValueError, match="positive, finite"):
            c.get("pong", None)
        t = time.monotonic()
        with pytest.raises(ChannelTimeout, match="within 0.3 s"):
            c.get("nothing", 0.3)
        assert time.monotonic() - t < 1.0
        flag = threading.Event()
        threading.Timer(0.2, lambda: (flag.set(), c.wake())).start()
        t = time.monotonic()
        with pytest.raises(PeerFailure):
            c.get("nothing", 10, failure=flag)
        assert time.monotonic() - t < 1.0
        os.kill(agent.pid, signal.SIGSTOP)          # a frozen agent: nothing is ever answered
        t = time.monotonic()
        with pytest.raises(ChannelTimeout):
            AgentClient.connect(name, SECRET, 1, 0.5)   # the kernel accepts it; the hello is never answered
        assert time.monotonic() - t < 1.5
        store = AgentStore(c, 1, timeout=0.5)
        t = time.monotonic()
        with pytest.raises(ChannelTimeout):
            store.get("k")                            # the agent's own deadline cannot answer: ours does
        assert time.monotonic() - t < 2.5
        t = time.monotonic()
        with pytest.raises(ChannelTimeout, match="frozen"):
            for _ in range(10000):                    # fills the socket buffer, then waits send_timeout
                c.send("ping", {"pad": "x" * 60000})
        assert time.monotonic() - t < 10 and c.lost.is_set()
    finally:
        os.kill(agent.pid, signal.SIGCONT)
        c.close()


# ---- the generation's store -----------------------------------------------------------------------------------
def test_generation_store_replicates_parks_and_fails_every_wait_at_once():
    stores = {}
    bcast = lambda me: (lambda k, v: [s.apply(k, v) for g, s in stores.items() if g != me])  # noqa: E731
    stores.update({n: GenerationStore(3, broadcast=bcast(n)) for n in range(3)})
    replies = []
    send = lambda lr, kind, body: replies.append((time.monotonic(), lr, kind, body))  # noqa: E731
    value = base64.b64encode(b"\0x").decode()
    assert stores[0].handle(0, "store_set", {"id": 1, "generation": 3, "key": "a", "value": value}, send)
    assert replies[-1][3] == {"ok": True, "id": 1} and all("a" in s for s in stores.values())
    stores[2].handle(1, "store_get", {"id": 2, "generation": 3, "key": "a"}, send)
    assert replies[-1][3]["value"] == base64.b64encode(b"\0x").decode()
    stores[2].handle(1, "store_wait", {"id": 3, "generation": 3, "keys": ["a", "b"], "timeout": 30}, send)
    stores[1].handle(0, "store_get", {"id": 4, "generation": 3, "key": "c", "timeout": 30}, send)
    assert len(replies) == 2 and stores[2].parked() == 1
    stores[1].set("b", b"B")                                       # another agent's training process sets b
    assert replies[-1][3] == {"ok": True, "id": 3} and stores[2].parked() == 0
    stores[0].handle(0, "store_get", {"id": 5, "generation": 2, "key": "a"}, send)
    assert replies[-1][3]["code"] == "bad" and "generation 2" in replies[-1][3]["error"]
    assert not stores[0].handle(0, "written", {}, send)
    stores[0].handle(0, "store_wait", {"id": 6, "generation": 3, "keys": ["z"], "timeout": 0.05}, send)
    time.sleep(0.1)
    assert stores[0].expire() == 1 and replies[-1][3]["code"] == "timeout"
    t = time.monotonic()
    assert stores[1].fail_all("the failure flag rose") == 1          # the parked get of c
    took = replies[-1][0] - t
    assert replies[-1][3]["id"] == 4 and replies[-1][3]["code"] == "failed" and took < 0.1
    assert "failure flag rose" in replies[-1][3]["error"]
    stores[1].handle(0, "store_get", {"id": 7, "generation": 3, "key": "a"}, send)   # present, but the store failed
    assert replies[-1][3]["code"] == "failed"


class Node:
    """One emulated node's agent for the store test: a ChannelServer + a GenerationStore, polled by a thread."""

    def __init__(self, agents, generation=1):
        self.store = GenerationStore(generation)
        self.agent = agents(store=self.store)


def _nodes(agents, n):
    nodes = [Node(agents) for _ in range(n)]
    for node in nodes:   # the lead wires broadcast to the control plane; here: straight to the other stores
        others = [o.store for o in nodes if o is not node]
        node.store.broadcast = lambda k, v, others=others: [s.apply(k, v) for s in others]
    return nodes


def test_link_store_drops_a_judged_re_checks_keys_only():
    """agent/node.py: an idle spare's link re-check uses fresh keys each time; once judged they are dropped, so a
    multi-week job's link store does not grow (GenerationStore.drop)."""
    st = GenerationStore(-1)
    for key in ("link/0-1/0/here0", "link/1-4/r1/0/here0", "link/1-4/r1/0/device0", "link/1-4/r2/0/here0"):
        st.set(key, b"1")
    assert st.drop("link/1-4/r1/") == 2
    assert "link/1-4/r1/0/here0" not in st and "link/1-4/r2/0/here0" in st and "link/0-1/0/here0" in st
    assert st.drop("link/9-9/") == 0


@pytest.mark.e2e
def test_gloo_rendezvous_through_agent_stores(agents, children):
    nodes = _nodes(agents, 3)
    kids = [children("gloo", node.agent.srv.name, rank=r, world=3, store_timeout=30, pg_timeout=30)
            for r, node in enumerate(nodes)]
    for kid in kids:
        assert kid.said("sum", 60) == 6.0
    assert [kid.wait() for kid in kids] == [0, 0, 0]
    keys = nodes[0].store.keys()
    assert keys and all(node.store.keys() == keys for node in nodes)


@pytest.mark.e2e
def test_a_failed_generation_ends_a_parked_rendezvous_at_once(agents, children):
    nodes = _nodes(agents, 3)
    kids = [children("gloo", nodes[r].agent.srv.name, rank=r, world=3, store_timeout=60, pg_timeout=60)
            for r in range(2)]                                       # rank 2 never comes
    for kid in kids:
        kid.said("joining", 60)
    wait_until(lambda: all(n.store.parked() for n in nodes[:2]), 30, "both ranks waiting in their stores")
    time.sleep(0.2)
    t = time.time()
    for node in nodes:
        node.store.fail_all("node 2 failed during the rendezvous")
    errs = [kid.said("init_error", 10) for kid in kids]
    assert [kid.wait() for kid in kids] == [4, 4]
    lags = [e["t"] - t for e in errs]
    assert all(lag < 1.0 for lag in lags), lags                      # not the 60 s timeout
    assert all("node 2 failed" in e["message"] for e in errs), errs
    print(f"init_process_group raised {[round(x * 1000) for x in lags]} ms after fail_all ({errs[0]['init_error']})")


# ---- costs (printed; asserted only loosely: the machine is shared) ------------------------------------------------
@pytest.mark.e2e
def test_round_trip_and_beat_costs(agents, children):
    agent = agents()
    child = children("rtt", agent.srv.name, n=1000)
    out = child.said("rtt_us", 60)
    assert child.wait() == 0
    print(f"channel round trip median {out['rtt_us']:.0f} us (1000), beat() {out['beat_ns']:.0f} ns")
    assert out["rtt_us"] < 5000 and out["beat_ns"] < 2000


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.e2e
def test_a_dead_process_is_dead_whatever_its_children_hold(agents, children):
    """Issue 43: a training process SIGKILLed while a child it forked (without the at-fork handler: the agent's
    side alone) still holds the channel's socket is reported closed at once (its pidfd), and a fresh process is
    admitted as the same local rank, instead of 'local rank 0 is already connected (pid ...)'."""
    agent = agents()
    child = children("forks", agent.srv.name)
    got = child.said("forked")
    grandchild = got["forked"]
    assert not _gone(grandchild)
    t = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    lr, body = agent.expect("closed", 5)
    assert lr == 0 and "pidfd" in body["why"] and time.monotonic() - t < 1.0, body
    fresh = children("echo", agent.srv.name)
    assert fresh.said("connected")["connected"] == fresh.pid
    assert agent.log.named("agent_refused") == []
    assert not _gone(grandchild)   # it still holds the socket: the pidfd judged, not the EOF
    os.killpg(child.pid, signal.SIGKILL)   # the grandchild: our child's own process group (start_new_session)
    wait_until(lambda: _gone(grandchild), 5, "the grandchild's end")


@pytest.mark.e2e
def test_a_training_process_s_children_hold_none_of_the_agent_s_fds_and_die_with_it(agents, children):
    """Issue 43: with the at-fork handler a training process installs (process/children.py), a child it forks
    holds /dev/null where the channel's socket was, and dies when the training process is SIGKILLed."""
    agent = agents()
    child = children("forks", agent.srv.name, install=True)
    got = child.said("forked")
    grandchild, fd = got["forked"], got["sock"]
    # the child's at-fork handler runs after the fork returned in the parent, which may speak first
    wait_until(lambda: os.readlink(f"/proc/{grandchild}/fd/{fd}") == "/dev/null", 5, "/dev/null in the child")
    assert os.readlink(f"/proc/{child.pid}/fd/{fd}").startswith("socket:")
    os.kill(child.pid, signal.SIGKILL)
    lr, body = agent.expect("closed", 5)
    assert lr == 0, body
    wait_until(lambda: _gone(grandchild), 5, "the grandchild's end with its parent (parent-death signal)")
