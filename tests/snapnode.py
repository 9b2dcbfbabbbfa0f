"""One local rank's snapshot path in one process, for the Replicator's tests and benchmarks/transport.py: a Replicator
(the agent's, replica/replicator.py), the rank's progress page and the agent's doorbell (ipc/shm.py), the agent's
snapshot desk (agent/desk.py) over a stand-in for the few NodeAgent attributes it reads, and the training process's
SnapshotWriter (replica/writer.py) over the Replicator's own slots. The same protocol, words and threads as a run
(replica/writer.py describes it), without the processes: a snapshot is ``submit`` + ``wait_committed``.
"""
from __future__ import annotations

import threading

import torch

from deadpool_hpc.agent.desk import SnapshotDesk
from deadpool_hpc.ipc.shm import Doorbell, ProgressPage
from deadpool_hpc.replica.snapshot import Slot
from deadpool_hpc.replica.writer import SnapshotWriter

NO_RNG = torch.empty(0, dtype=torch.uint8)


class Channel:
    """What the desk uses of the agent's ChannelServer: each local rank's progress page, and a wake-up."""

    def __init__(self, pages):
        self.pages = pages
        self.wakes = 0

    def progress(self, local):
        return self.pages.get(local)

    def wake(self):
        self.wakes += 1


class Swaps:
    current = None


class Agent:
    """The NodeAgent attributes the desk reads (agent/node.py): reps, channel, written, swaps, log."""

    def __init__(self, reps, pages, log=None):
        self.reps = reps
        self.channel = Channel(pages)
        self.written = {}
        self.swaps = Swaps()
        self.log = log

    def on_written(self, local, step):
        self.written[local] = step
        if self.swaps.current is not None:
            self.channel.wake()

    def desk(self) -> SnapshotDesk:
        """A SnapshotDesk over this node (started; ``close()`` it)."""
        return SnapshotDesk(self.reps, self.channel.progress, self.on_written, self.log, Doorbell.create())


class SnapNode:
    """``rep`` (a Replicator, local rank 0) with its desk and the writer of its training process. The committed word
    is stored by ``rep.on_commit``, wired by the desk's ``attach`` as in agent/node.py. ``close()`` ends the desk
    and the writer (not ``rep``)."""

    def __init__(self, rep, grant_timeout: float = 30.0):
        self.rep = rep
        self.page = ProgressPage.create()
        self.lost = threading.Event()
        self.agent = Agent({0: rep}, {0: self.page}, rep.state.log)
        self.desk = self.agent.desk()
        self.desk.attach(0, rep)
        slots = [Slot(rep.layout.nbytes, s.tensor) for s in rep.own.slots]   # the same memory, the writer's view
        self.writer = SnapshotWriter(self.page, self.desk.bell, slots, rep.layout, lost=self.lost,
                                     grant_timeout=grant_timeout)

    def submit(self, step: int, tensors, rng=NO_RNG) -> None:
        """Snapshot ``tensors`` as ``step`` of the Replicator's generation, in the background."""
        self.writer.submit(step, tensors, rng, self.rep.generation)

    def wait_committed(self, step: int, failure: threading.Event | None = None, timeout: float = 10.0) -> float:
        return self.writer.wait_committed(step, self.rep.generation, failure or threading.Event(), timeout)

    def commit(self, step: int, tensors, rng=NO_RNG, timeout: float = 10.0) -> float:
        self.submit(step, tensors, rng)
        return self.wait_committed(step, timeout=timeout)

    def close(self) -> None:
        self.writer.close()
        self.desk.close()
        self.page.close()
