"""A training process's share of the pre-flight checks: a small matmul on its device, timed; an all-reduce with
the same local rank of its neighbour nodes.

The node agent asks (``preflight`` message) once every node's training processes have built their model, so that
every node times the same work at about the same moment (agent/preflight.py compares the figures with the job's
median), and again now and then while the node is an idle spare. The work: ``REPS`` repetitions of ``MATMULS``
products of two ``n`` x ``n`` float32 matrices (n = 512 on a CPU: about 2-3 ms each on one core here; 4096 on a
GPU), on a thread of its own so that the process's channel stays responsive. The figure is the median repetition's
wall time in seconds: a device that is throttled, or a node whose CPU share shrank, takes longer for the same work.

The link check (``link`` message, agent/preflight.py ``LinkCheck`` pairs the nodes): for each pair it is given,
the process meets its partner (the process of the same local rank on the neighbour node) through the agents' link
store (``LINK_GENERATION``: served by every agent, spares included), builds a two-member gloo process group with it
and all-reduces ``LINK_NUMEL`` float32 (1 MiB) ``REPS`` times, checking the sum. The answer per pair: whether the
partner came (``seen``: it set the pair's key within ``wait_s`` and stayed; a partner that did not come says nothing
about this node), and if so whether the group came up and every sum was right (``ok``), the
median all-reduce's seconds, or the error (a node whose data-plane interface is down fails here: gloo's "Unable
to find address", or a timeout for its partner). Gloo over TCP on every device: on a GPU node this checks the
node's host network, not NVLink or InfiniBand (the site's ``--health-check`` runs nccl-tests for those).
"""
from __future__ import annotations

import datetime
import os
import statistics
import threading
import time

from ..ipc.messages import LINK_GENERATION, LinkAnswer, LinkAsk, LinkPair, LinkResult, MatmulAsk, MatmulFigure

REPS = 3
MATMULS = 8
LINK_NUMEL = 1 << 18    # float32 elements all-reduced with a neighbour: 1 MiB


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


def answer(client, device, ask: MatmulAsk) -> None:
    """(channel reader thread) Time the matmul on a thread of its own and send the figure back to the agent,
    answering ``ask`` (the agent's ``preflight`` message)."""

    def run() -> None:
        try:
            seconds, error = matmul_seconds(device), None
        except Exception as exc:  # noqa: BLE001 - a device that cannot multiply is what the check is for
            seconds, error = None, f"{type(exc).__name__}: {exc}"[:500]
        try:
            client.send(MatmulFigure.KIND, MatmulFigure(ask.id, seconds, error, str(device)).to_wire())
        except Exception:  # noqa: BLE001 - the agent is gone: the process ends with it
            pass

    threading.Thread(target=run, name="deadpool-preflight", daemon=True).start()


def _device_error() -> str | None:
    """Whether gloo can make this process's devices (on every interface ``GLOO_SOCKET_IFNAME`` names, as a process
    group would, or its default one): None, or gloo's error (an interface that is down or missing)."""
    import torch.distributed as dist

    try:
        names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        for name in names:
            dist.ProcessGroupGloo.create_device(interface=name)
        if not names:
            dist.ProcessGroupGloo.create_default_device()
        return None
    except Exception as exc:  # noqa: BLE001 - reported as the link's failure
        return _short(exc)


def _short(exc: BaseException) -> str:
    text = str(exc)
    if "] " in text and text.startswith("[enforce fail"):   # gloo's C++ prefix: file and line
        text = text.split("] ", 1)[1]
    return f"{type(exc).__name__}: {text}"[:300]


def link_pair(store, key: str, rank: int, wait_s: float, timeout_s: float) -> dict:
    """One pair of the link check: ``store`` (a torch Store every agent serves), ``key`` (the pair's, e.g.
    ``"0-1/0"``: the same on both sides only when both take the other for a neighbour), ``rank`` (0 or 1 in the
    pair), ``wait_s`` (seconds to wait for the partner), ``timeout_s`` (each later step's timeout, seconds: the
    partner's device, the group, each all-reduce).
    Returns ``{"seen": False}`` (the partner did not come, or left before this side came: nothing is judged by
    it) or ``{"seen": True, "ok": bool, "seconds": float | None, "error": str | None, "partner": bool}`` (partner:
    the failure is the partner's own, its device could not be made)."""
    import torch
    import torch.distributed as dist

    def failed(error: str, partner: bool = False) -> dict:
        return {"seen": True, "ok": False, "seconds": None, "error": error, "partner": partner}

    td = datetime.timedelta(seconds=timeout_s)
    try:
        pair = dist.PrefixStore(f"link/{key}", store)
        pair.set(f"here{rank}", b"1")
        try:
            pair.wait([f"here{1 - rank}"], datetime.timedelta(seconds=wait_s))
        except Exception:  # noqa: BLE001 - the partner did not come: its own failure is found elsewhere
            return {"seen": False}
        # each side says whether it could make its gloo device, so a partner whose interface is down costs this
        # side no group timeout; this key is also the partner's answer that it stayed for the check
        error = _device_error()
        pair.set(f"device{rank}", (error or "").encode())
        if error:
            return failed(error)
        try:
            pair.wait([f"device{1 - rank}"], td)
        except Exception:  # noqa: BLE001 - it gave up its wait for this side as this side came: no evidence
            return {"seen": False}
        theirs = pair.get(f"device{1 - rank}").decode()
        if theirs:
            return failed(f"the partner's device: {theirs}", partner=True)   # its fault, as it says itself
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", pair), rank, 2, td)
        x = torch.empty(LINK_NUMEL)
        times = []
        for _ in range(REPS):
            x.fill_(float(rank + 1))
            t0 = time.perf_counter()
            pg.allreduce([x]).wait()
            times.append(time.perf_counter() - t0)
            if not bool((x == 3.0).all()):
                return failed(f"the all-reduce's sum is wrong in {int((x != 3.0).sum())} of {LINK_NUMEL} elements")
        del pg
        return {"seen": True, "ok": True, "seconds": statistics.median(times), "error": None}
    except Exception as exc:  # noqa: BLE001 - a link that cannot carry an all-reduce is what the check is for
        return failed(_short(exc))


def link_answer(client, ask: LinkAsk) -> None:
    """(channel reader thread) Run every pair of the agent's ``link`` message ``ask``, each on a thread of its own,
    and send the results (by peer node) back to the agent."""
    from .client import AgentStore

    pairs, wait_s, timeout_s = ask.pairs, ask.wait_s, ask.timeout_s

    def run() -> None:
        results: dict[int, dict] = {}
        t_start = time.monotonic()
        try:
            # one per process, kept on the client: an AgentStore must outlive torch's use of it, and each new one
            # takes a place among the generations' stores the client keeps alive (worker/client.py AgentStore)
            store = getattr(client, "link_store", None)
            if store is None:
                store = client.link_store = AgentStore(client, LINK_GENERATION, timeout=30.0)

            def one(p: LinkPair) -> None:
                results[p.peer] = link_pair(store, p.key, p.rank, wait_s, timeout_s)

            threads = [threading.Thread(target=one, args=(p,), name="deadpool-link", daemon=True) for p in pairs]
            for t in threads:
                t.start()
            end = time.monotonic() + wait_s + (2 + REPS) * timeout_s + 2.0   # link_pair's longest
            for t in threads:
                t.join(max(0.0, end - time.monotonic()))
            for p in pairs:   # a pair still running met its partner and then stalled
                results.setdefault(p.peer, {"seen": True, "ok": False, "seconds": None,
                                            "error": f"did not end within {end - t_start:.0f} s"})
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the agent judges
            results = {p.peer: {"seen": True, "ok": False, "seconds": None,
                                "error": f"{type(exc).__name__}: {exc}"[:300]} for p in pairs}
        try:
            answer = LinkAnswer(ask.id, {q: LinkResult(**r) for q, r in results.items()})
            client.send(LinkAnswer.KIND, answer.to_wire())
        except Exception:  # noqa: BLE001 - the agent is gone: the process ends with it
            pass

    threading.Thread(target=run, name="deadpool-link-check", daemon=True).start()
