"""Fault injection for tests and demos: real signals to real processes, at a given step.

``--kill node1@60`` SIGKILLs every process of emulated node 1 when its ranks reach step 60;
``--kill rank2@60`` SIGKILLs the process holding training rank 2; ``--hang ...`` sends SIGSTOP
instead (the process stays, frozen, with its sockets open: what a hung node looks like). A fault
fires on the first pass through its step only, so a step recomputed after a recovery does not
fire the same fault twice (the step loop fires faults only above the job's high-water step).
The event ``fault_injected`` is written (and fsynced) before the signal, so recovery times can be
measured from it.
"""
from __future__ import annotations

import os
import signal


def ordered(faults) -> list:
    return sorted(faults, key=lambda f: (f.step, f.target_kind, f.index))


def maybe_inject(faults, *, step: int, train_rank: int, mpi_rank: int, ranks_per_node: int,
                 assignment: list[int], idents: list[dict], log) -> None:
    """Fire the faults due at ``step`` that target this process (a kill or stop of itself ends it here).

    The caller calls this only on the first pass through ``step``, so a recomputed step never fires a
    fault twice. A fault whose target is not training at that step (a spare, a node already lost)
    cannot fire: training rank 0 logs ``fault_skipped`` for it.
    """
    node, local = divmod(mpi_rank, ranks_per_node)
    active = {m // ranks_per_node for m in assignment}
    for f in faults:
        if f.step != step:
            continue
        if f.target_kind == "node" and f.index not in active:
            if train_rank == 0:
                log.emit("fault_skipped", kind=f.kind, target=f.target, step=step,
                         reason=f"node{f.index} is not training at step {step} (a spare, or already lost)")
            continue
        if f.target_kind == "rank" and f.index != train_rank:
            continue
        if f.target_kind == "node" and (f.index != node or local != 0):
            continue  # the node's first process fires for the whole node
        victims = [mpi_rank] if f.target_kind == "rank" else list(range(node * ranks_per_node, (node + 1) * ranks_per_node))
        _fire(f, victims, step, node, idents, log)


def _fire(f, victims, step, node, idents, log) -> None:
    sig = signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP
    pids = [int(idents[m]["pid"]) for m in victims]
    log.emit("fault_injected", kind=f.kind, target=f.target, step=step, node=node, pids=pids, signal=sig.name)
    log.sync()
    for pid in pids:
        if pid != os.getpid():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    os.kill(os.getpid(), sig)
