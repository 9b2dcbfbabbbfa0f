"""Pollable collectives: every collective is issued with ``async_op=True`` and waited on here.

Two implementations of the wait, chosen by the backend (dataplane/watchdog.py ``waiter_for``): on gloo (below) the
training thread polls; on NCCL ``Watch.waiter`` (a CollectiveWatchdog) takes the work, orders the caller's stream
after it and returns at once, and its thread aborts the generation's communicators on a failure or a timeout.

A blocked gloo collective cannot be interrupted, so the training thread never blocks in one:
``wait`` polls the work and the control plane's failure flag together and raises PeerFailure as
soon as either reports a problem (notes/ft-probes.md 1c'), or when the collective has not completed
within the ``Watch``'s timeout (a collective wedged with nobody at fault: the recovery then rebuilds the
process group with the same members). The abandoned work finishes or times out on its own, in the
graveyard of dataplane.groups. While it waits it beats the training process's progress page (ipc/shm.py), which
its agent's supervisor watches for hangs: waiting on peers is not a hang.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from ..errors import PeerFailure


@dataclass
class Watch:
    """What a wait of the training thread watches. failure: the control plane's failure flag; timeout:
    seconds before a wait gives up (the collective timeout); beat(): the progress page's beat. ``waited``: seconds
    the training thread spent blocked in ``wait`` so far (a running total; the step loop subtracts it from a step's
    wall time to get the rank's own work, which the straggler check compares: a rank that waits for a slow peer
    is not slow). ``waiter``: None (gloo: the polled ``wait``), or the NCCL path's CollectiveWatchdog
    (dataplane/watchdog.py), to which ``wait`` hands each work."""

    failure: threading.Event
    timeout: float = 60.0
    beat: object = field(default=lambda: None)
    waited: float = 0.0
    waiter: object = None


def wait(work, watch: Watch, poll: float = 0.005) -> None:
    """Wait for ``work`` (a torch.distributed Work). Raises PeerFailure if the failure flag is set first,
    the collective itself errors (e.g. gloo: "Connection closed by peer"), or ``watch.timeout`` passes.

    The work's future (``Work.get_future``) wakes this wait the moment the collective completes; the failure flag,
    the deadline and the progress beat are looked at every ``poll`` seconds in between (a failure is noticed
    within ``poll``). A work without a future is polled with ``is_completed`` at the same interval. With a
    ``watch.waiter`` (NCCL) the work is handed to it instead (no host synchronisation; dataplane/watchdog.py)."""
    if watch.waiter is not None:
        watch.waiter.wait(work, watch)
        return
    t0 = time.monotonic()
    end = t0 + watch.timeout
    failure = watch.failure
    done = threading.Event()
    try:
        work.get_future().add_done_callback(lambda _fut: done.set())
    except (RuntimeError, AttributeError):  # a backend or work type without futures
        pass
    try:
        while not work.is_completed():
            if failure.is_set():
                raise PeerFailure("a peer failed during a collective")
            watch.beat()
            if time.monotonic() > end:
                raise PeerFailure(f"a collective did not complete within {watch.timeout:.0f} s (no peer suspected)")
            done.wait(poll)
        try:
            work.wait()
        except RuntimeError as exc:
            raise PeerFailure(f"collective failed: {exc}") from exc
    finally:
        watch.waited += time.monotonic() - t0


def all_reduce(tensor, watch: Watch, op=dist.ReduceOp.SUM) -> None:
    wait(dist.all_reduce(tensor, op=op, async_op=True), watch)


def all_gather(out, inp, watch: Watch) -> None:
    wait(dist.all_gather_single(out, inp, async_op=True), watch)


def all_to_all(out, inp, out_splits: list[int], in_splits: list[int], watch: Watch) -> None:
    """``torch.distributed.all_to_all_single`` with split sizes (elements sent to / received from each rank, in
    rank order), waited on like ``wait``. (gloo's point-to-point works have no future and never report
    ``is_completed`` before ``wait``, so they cannot be polled: a variable all-to-all moves uneven data instead.)"""
    wait(dist.all_to_all_single(out, inp, out_splits, in_splits, async_op=True), watch)
