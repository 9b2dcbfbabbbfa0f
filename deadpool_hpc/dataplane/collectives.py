"""Pollable collectives: every collective is issued with ``async_op=True`` and waited on here.

A blocked gloo collective cannot be interrupted, so the training thread never blocks in one:
``wait`` polls the work and the control plane's failure flag together and raises PeerFailure as
soon as either reports a problem (notes/ft-probes.md 1c'). The abandoned work finishes or times out
on its own, in the graveyard of dataplane.groups.
"""
from __future__ import annotations

import threading

import torch.distributed as dist

from ..errors import PeerFailure


def wait(work, failure: threading.Event, poll: float = 0.0005) -> None:
    """Wait for ``work`` (a torch.distributed Work). Raises PeerFailure if ``failure`` is set first
    or the collective itself errors (e.g. gloo: "Connection closed by peer")."""
    while not work.is_completed():
        if failure.wait(poll):
            raise PeerFailure("a peer failed during a collective")
    try:
        work.wait()
    except RuntimeError as exc:
        raise PeerFailure(f"collective failed: {exc}") from exc


def all_reduce(tensor, failure, op=dist.ReduceOp.SUM) -> None:
    wait(dist.all_reduce(tensor, op=op, async_op=True), failure)


def all_gather(out, inp, failure) -> None:
    wait(dist.all_gather_single(out, inp, async_op=True), failure)
