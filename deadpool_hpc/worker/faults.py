"""Fault injection for tests and demos: real signals to real processes, at a given step.

``--kill node1@60`` SIGKILLs every process of emulated node 1 when its ranks reach step 60;
``--kill rank2@60`` SIGKILLs the process holding training rank 2; ``--hang ...`` sends SIGSTOP
instead (the process stays, frozen, with its sockets open: what a hung node looks like). The i-th
fault (ordered by step) fires only in generation i, so a step recomputed after a recovery does not
fire the same fault twice. The event ``fault_injected`` is written (and fsynced) before the signal,
so recovery times can be measured from it.
"""
from __future__ import annotations

import os
import signal


def ordered(faults) -> list:
    return sorted(faults, key=lambda f: (f.step, f.target_kind, f.index))


def maybe_inject(faults, *, step: int, generation: int, train_rank: int, mpi_rank: int, ranks_per_node: int,
                 idents: list[dict], log) -> None:
    """Fire the fault due at ``step`` in ``generation`` if it targets this process (never returns then).

    ``faults`` must be in ``ordered`` order (the i-th fires only in generation i)."""
    if generation >= len(faults):
        return
    f = faults[generation]
    if f.step != step:
        return
    node, local = divmod(mpi_rank, ranks_per_node)
    if f.target_kind == "rank":
        if f.index != train_rank:
            return
        victims = [mpi_rank]
    else:
        if f.index != node or local != 0:
            return  # the node's first process fires for the whole node
        victims = list(range(node * ranks_per_node, (node + 1) * ranks_per_node))
    sig = signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP
    pids = [int(idents[m]["pid"]) for m in victims]
    log.emit("fault_injected", kind=f.kind, target=f.target, step=step, generation=generation,
             node=node, pids=pids, signal=sig.name)
    log.sync()
    for pid in pids:
        if pid != os.getpid():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    os.kill(os.getpid(), sig)
