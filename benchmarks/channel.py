"""The local agent channel's costs: a message round trip, a progress beat, a store round trip.
Medians over ``--rounds`` rounds (the machine is shared: compare side by side, not with other days).

1. Round trip: a training process (child) sends ``ping``, the agent (this process, its poll loop on a thread,
   as in a node agent) answers ``pong``, the child's ``get`` returns: ``--n`` times per round, median in µs.
   Side by side: the same over a bare Unix socketpair (4 bytes each way, blocking, no framing/HMAC/JSON, no
   threads), i.e. what the kernel alone costs.
2. ``ProgressPage.beat()`` (a store to shared memory) against the beat of the in-process watchdog the page replaced
   (``Watchdog.beat()`` below: two attribute stores and a ``time.monotonic()`` call), in ns, and their ratio.
3. ``AgentStore.get`` of a present key (base64 + JSON + HMAC each way), median in µs.

    .venv/bin/python benchmarks/channel.py --rounds 5 --n 1000
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading

from deadpool_hpc.agent.channel import ChannelServer
from deadpool_hpc.agent.store import GenerationStore

SECRET = b"bench-secret-32-bytes-----------"

CHILD = r"""
import json, socket, statistics, sys, time, timeit
a = json.loads(sys.argv[1])
from deadpool_hpc.worker.client import AgentClient, AgentStore
class Watchdog:   # the beat of the in-process watchdog that the progress page replaced: the comparison's baseline
    def __init__(self):
        self.t, self.where = time.monotonic(), ""
    def beat(self, where=None):
        self.t = time.monotonic()
        if where is not None:
            self.where = where
c = AgentClient.connect(a["name"], a["secret"].encode(), 0, 30)
n = a["n"]
def rtt(fn):
    ts = []
    for i in range(n):
        t0 = time.perf_counter(); fn(i); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6
ping = rtt(lambda i: (c.send("ping", {"i": i}), c.get("pong", 10)))
store = AgentStore(c, 1, timeout=10)
store_get = rtt(lambda i: store.get("k"))
raw = socket.socket(fileno=a["raw_fd"])
def raw_rt(i):
    raw.sendall(b"ping"); raw.recv(4)
raw_us = rtt(raw_rt)
wd = Watchdog()
def per(fn):
    return statistics.median(timeit.timeit(fn, number=200000) / 200000 * 1e9 for _ in range(5))
print(json.dumps({"rtt_us": ping, "store_get_us": store_get, "raw_us": raw_us,
                  "beat_ns": per(c.progress.beat), "watchdog_ns": per(wd.beat)}), flush=True)
c.close()
"""


def one_round(n: int) -> dict:
    srv = ChannelServer(SECRET)
    store = GenerationStore(1)
    store.apply("k", b"x" * 64)
    stop = threading.Event()

    def agent():
        while not stop.is_set():
            for lr, kind, body in srv.poll(0.1):
                if not store.handle(lr, kind, body, srv.send) and kind == "ping":
                    srv.send(lr, "pong", body)

    def echo(s):
        while True:
            b = s.recv(4)
            if not b:
                return
            s.sendall(b)

    here, there = socket.socketpair()
    th = [threading.Thread(target=agent, daemon=True), threading.Thread(target=echo, args=(here,), daemon=True)]
    for t in th:
        t.start()
    args = {"name": srv.name, "secret": SECRET.decode(), "n": n, "raw_fd": there.fileno()}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], pass_fds=[there.fileno()],
                          capture_output=True, text=True, timeout=300)
    there.close()
    here.shutdown(socket.SHUT_RDWR)
    stop.set()
    th[0].join(5)
    srv.close()
    here.close()
    if proc.returncode:
        raise SystemExit(f"child failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=1000)
    a = ap.parse_args()
    rounds = [one_round(a.n) for _ in range(a.rounds)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {a.rounds} rounds x {a.n}")
    print(f"round trip, agent channel      : {med['rtt_us']:7.1f} us  (median of round medians)")
    print(f"round trip, bare socketpair    : {med['raw_us']:7.1f} us  "
          f"ratio channel/bare {med['rtt_us'] / med['raw_us']:.1f}")
    print(f"AgentStore.get (key present)   : {med['store_get_us']:7.1f} us")
    print(f"ProgressPage.beat()            : {med['beat_ns']:7.1f} ns")
    print(f"Watchdog.beat() (in-process)   : {med['watchdog_ns']:7.1f} ns  ratio page/watchdog "
          f"{med['beat_ns'] / med['watchdog_ns']:.2f}")
    print("per round:", json.dumps([{k: round(v, 1) for k, v in r.items()} for r in rounds]))


if __name__ == "__main__":
    main()
