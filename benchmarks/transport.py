"""Replica transport on loopback: checksum speed, push and restore throughput, and what a heartbeat-like
thread sees meanwhile. Numbers are medians of ``--reps`` runs (the machine is shared: compare side by side).

1. CRC of 200 MB: zlib.crc32 vs google-crc32c (via snapshot.checksum), and the ratio; alone, then with
   a pure-Python thread spinning alongside (a thread that gives the GIL back between pieces waits for it).
2. For each payload size: local snapshot only (copy + CRC-32C into a slot, K=0), push to a holder in
   another process (the path of a run, tests/snapnode.py: the training process's SnapshotWriter claims, copies and
   says written, the agent's desk and Replicator checksum, push; the holder's CRC check, ack, commit), and a restore
   that holder sends back as a recovery's source (connect, header, payload, CRC check), in MB/s (1 MB = 1e6 bytes).
3. The longest gap seen by a thread that sleeps 5 ms in a loop (it stands in for the control plane's
   heartbeat thread), in the sender/restoring process and in the holder process, while a push and a
   restore of the largest payload run; and the same thread's longest gap with nothing running.

    .venv/bin/python benchmarks/transport.py --sizes 1 20 200 --reps 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import torch

from deadpool_hpc.replica.snapshot import StateLayout, checksum
from deadpool_hpc.replica.replicator import Replicator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from snapnode import SnapNode  # noqa: E402 - tests/snapnode.py: one local rank's snapshot path in one process

SECRET = b"bench-secret-32-bytes-----------"


class NullLog:
    def emit(self, name, **fields):
        print(f"  event {name} {fields}", file=sys.stderr)


class Ticker:
    """A thread that sleeps 5 ms in a loop and records the longest time between two wake-ups."""

    def __init__(self):
        self.max_gap = 0.0
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        last = time.perf_counter()
        while not self._stop:
            time.sleep(0.005)
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last)
            last = now

    def reset(self):
        self.max_gap = 0.0

    def stop(self):
        self._stop = True
        self._t.join()


def layout_of(nbytes: int) -> StateLayout:
    return StateLayout([torch.empty(nbytes // 4)], 0)


def peer(nbytes: int) -> None:
    """Holder process: holds rank 0, answers 'gap' (ticker's longest gap, then reset) and 'send {json}' (sends a
    restore of rank 0, then says "ok") until stdin closes."""
    torch.set_num_threads(1)
    rep = Replicator(SECRET, layout_of(nbytes), NullLog(), host="127.0.0.1")
    rep.configure(0, None, [], [0])
    ticker = Ticker()
    print(json.dumps(rep.address), flush=True)
    for line in sys.stdin:
        if line.strip() == "gap":
            print(json.dumps(ticker.max_gap), flush=True)
            ticker.reset()
        elif line.startswith("send "):
            r = json.loads(line[5:])
            rep.send_restore(r["to"], 0, r["step"], r["generation"], threading.Event(), 60)
            print(json.dumps("ok"), flush=True)
    rep.close()


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def _spin(stop: threading.Event, out: list) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    out.append(n)


def bench_crc(nbytes: int, reps: int) -> None:
    """zlib.crc32 vs snapshot.checksum (google-crc32c), alone and with a busy pure-Python thread."""
    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    mv = memoryview(buf)

    def zlib_pieces():  # pieces, like a transfer does: each call gives the GIL back and takes it again
        crc = 0
        for off in range(0, nbytes, 4 << 20):
            crc = zlib.crc32(mv[off:off + (4 << 20)], crc)

    for busy in (False, True):
        times = {"zlib": [], "google": []}
        for _ in range(reps):
            for name, f in (("zlib", zlib_pieces), ("google", lambda: checksum(buf))):
                stop, out = threading.Event(), []
                spinner = threading.Thread(target=_spin, args=(stop, out)) if busy else None
                if spinner:
                    spinner.start()
                t = time.perf_counter(); f(); times[name].append(time.perf_counter() - t)
                if spinner:
                    stop.set(); spinner.join()
        z, g = statistics.median(times["zlib"]), statistics.median(times["google"])
        print(f"CRC of {nbytes / 1e6:.0f} MB{' with a busy Python thread' if busy else ''}: "
              f"zlib.crc32 {z * 1e3:.1f} ms ({mbps(nbytes, z):.0f} MB/s), google-crc32c {g * 1e3:.1f} ms "
              f"({mbps(nbytes, g):.0f} MB/s), zlib/google = {z / g:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 20, 200], help="payload sizes in MB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer:
        return peer(a.peer)
    torch.set_num_threads(1)
    bench_crc(int(max(a.sizes) * 1e6), a.reps)
    failure = threading.Event()
    print(f"{'payload':>9} {'local copy+CRC':>15} {'push (commit)':>14} {'restore':>10}   (MB/s, median of {a.reps})")
    for size in a.sizes:
        nbytes = int(size * 1e6) // 4 * 4
        layout = layout_of(nbytes)
        state = [torch.randn(nbytes // 4)]
        rng = torch.empty(0, dtype=torch.uint8)
        child = subprocess.Popen([sys.executable, __file__, "--peer", str(nbytes)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        sender = Replicator(SECRET, layout, NullLog(), host="127.0.0.1")
        node = SnapNode(sender, grant_timeout=60)
        restorer = Replicator(SECRET, layout, NullLog(), host="127.0.0.1")
        ticker = Ticker()
        try:
            holder = json.loads(child.stdout.readline())
            local, push, restore = [], [], []
            sender.configure(0, 0, [], [])
            for i in range(a.reps):
                t = time.perf_counter(); node.submit(i, state, rng); node.wait_committed(i, failure, 60)
                local.append(time.perf_counter() - t)
            sender.quiesce()
            sender.configure(1, 0, [holder], [])
            restorer.configure(1, None, [], [])
            child.stdin.write("gap\n"); child.stdin.flush(); child.stdout.readline()  # reset the holder's ticker
            ticker.reset()
            for i in range(a.reps):
                step = 100 + i
                t = time.perf_counter(); node.submit(step, state, rng); node.wait_committed(step, failure, 60)
                push.append(time.perf_counter() - t)
                t = time.perf_counter()
                restorer.expect_restore(0, step, 2 + i)
                child.stdin.write("send " + json.dumps({"to": restorer.address, "step": step, "generation": 2 + i})
                                  + "\n")
                child.stdin.flush()
                slot = restorer.wait_restore(failure, 60)
                restore.append(time.perf_counter() - t)
                assert json.loads(child.stdout.readline()) == "ok"
                assert slot.step == step and np.array_equal(slot.buf, sender.own.get(step).buf)
            gap_here = ticker.max_gap
            child.stdin.write("gap\n"); child.stdin.flush()
            gap_holder = json.loads(child.stdout.readline())
            print(f"{size:>7g}MB {mbps(nbytes, statistics.median(local)):>15.0f} "
                  f"{mbps(nbytes, statistics.median(push)):>14.0f} {mbps(nbytes, statistics.median(restore)):>10.0f}"
                  f"   5 ms ticker's longest gap: {gap_here * 1e3:.1f} ms here, {gap_holder * 1e3:.1f} ms in the holder")
        finally:
            ticker.stop()
            node.close()
            sender.close()
            restorer.close()
            child.stdin.close()
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    idle = Ticker()
    time.sleep(2)
    idle.stop()
    print(f"idle reference: the same ticker's longest gap over 2 s with nothing running: {idle.max_gap * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
