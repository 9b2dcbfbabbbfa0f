"""A training process's share of the pre-flight speed check: a small matmul on its device, timed.

The node agent asks (``preflight`` message) once every node's training processes have built their model, so that
every node times the same work at about the same moment (agent/preflight.py compares the figures with the job's
median), and again now and then while the node is an idle spare. The work: ``REPS`` repetitions of ``MATMULS``
products of two ``n`` x ``n`` float32 matrices (n = 512 on a CPU: about 2-3 ms each on one core here; 4096 on a
GPU), on a thread of its own so that the process's channel stays responsive. The figure is the median repetition's
wall time in seconds: a device that is throttled, or a node whose CPU share shrank, takes longer for the same work.
"""
from __future__ import annotations

import statistics
import threading
import time

REPS = 3
MATMULS = 8


def matmul_seconds(device) -> float:
    """Median seconds of one repetition (MATMULS products of n x n float32 matrices) on ``device``."""
    import torch

    cuda = device.type == "cuda"
    n = 4096 if cuda else 512
    gen = torch.Generator(device="cpu").manual_seed(0)   # leaves the training RNG alone
    a = torch.randn(n, n, generator=gen).to(device)
    b = torch.randn(n, n, generator=gen).to(device)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)   # this process's GPU
    (a @ b)   # warm-up: allocations, kernel selection
    sync()
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        for _ in range(MATMULS):
            a @ b
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def answer(client, device, body: dict) -> None:
    """(channel reader thread) Time the matmul on a thread of its own and send the figure back to the agent."""
    def run() -> None:
        try:
            seconds, error = matmul_seconds(device), None
        except Exception as exc:  # noqa: BLE001 - a device that cannot multiply is what the check is for
            seconds, error = None, f"{type(exc).__name__}: {exc}"[:500]
        try:
            client.send("preflight", {"id": body.get("id"), "seconds": seconds, "error": error,
                                      "device": str(device)})
        except Exception:  # noqa: BLE001 - the agent is gone: the process ends with it
            pass

    threading.Thread(target=run, name="deadpool-preflight", daemon=True).start()
