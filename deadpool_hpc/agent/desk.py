"""The snapshot desk: the thread of a node agent that answers its training processes' per-step snapshot protocol.

Each step a training process claims a slot for its next snapshot, writes the snapshot into it, says it is written,
and waits, before its next update, until every holder acknowledged it (worker/context.py). These four moves go
through the snapshot words of its progress page (ipc/shm.py ``ProgressPage``: claim, grant, written,
committed), not through channel messages: the training process stores a word and rings the agent's ``Doorbell``;
this thread wakes, reads the claim and written words of every local rank, and calls the rank's Replicator
(``claim``, ``written``: replica/replicator.py), which pushes the snapshot to the holders and, once they all
acknowledged it, stores the committed word itself (``Replicator.on_commit``, wired by ``attach``). The agent's main loop
is not on this path: on 2 shared cores each pass of that loop costs ~0.23 ms of CPU, and per-step channel messages would
wake it 3
times a step (docs/architecture.md, the overhead paragraph, has the measurement).

Owns: answering claim and written words, the committed word (``attach``), and retrying a claim refused while an own slot
was busy (every 5 ms). Does not own: what a claim or a written snapshot does (the Replicator), the slots (ipc/shm.py),
what the agent does
with a written step (``on_written``: agent/node.py keeps it for planned swaps, agent/planned.py).
"""
from __future__ import annotations

import threading

from ..ipc.shm import GEN_MASK, Doorbell, unpack_word


class SnapshotDesk:
    """``reps``: the node agent's local rank -> Replicator (a live dict: ranks are added as they attach);
    ``progress(local)``: that rank's ProgressPage, or None; ``on_written(local, step)``: called from this thread for
    each snapshot written in the current generation; ``log``: EventLog; ``bell``: the Doorbell its training
    processes ring. Starts its thread at once; ``close()`` ends it (within about 1 s)."""

    def __init__(self, reps: dict, progress, on_written, log, bell: Doorbell):
        self.reps = reps
        self.progress = progress
        self.on_written = on_written
        self.log = log
        self.bell = bell
        self.pending: dict[int, tuple[int, int]] = {}   # local -> (generation, step) of a claim refused while busy
        self._seen: dict[tuple[int, int], int] = {}     # (local, word) -> the last word answered
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="deadpool-desk", daemon=True)
        self._thread.start()

    def attach(self, local: int, rep) -> None:
        """Make this desk the agent's one owner of local rank ``local``'s protocol: ``rep`` (its Replicator, already
        in ``reps``) stores the committed word on the rank's (current) progress page once every holder acknowledged a
        snapshot (``Replicator.on_commit``: called under its lock, so a store and nothing more)."""
        page = self.progress(local)
        rep.on_commit = lambda generation, step: page.put(page.COMMITTED, generation, step)
        with self._lock:   # a new process of the rank (a node back in the spare pool): a new page, nothing seen
            for word in (page.CLAIM, page.WRITTEN):
                self._seen.pop((local, word), None)
            self.pending.pop(local, None)

    def _run(self) -> None:
        while not self._closed:
            try:
                self.bell.wait(0.005 if self.pending else 1.0)
            except (OSError, ValueError, TypeError):   # closed under us
                return
            if self._closed:
                return
            try:
                self.serve()
            except Exception as exc:  # noqa: BLE001 - one rank's bad word must not end the desk of every rank
                # the step it concerned is never committed: that rank's wait before its update times out and the
                # recovery that follows reconfigures the Replicator
                self.log.emit("snapshot_desk_error", error=f"{type(exc).__name__}: {exc}"[:300])

    def serve(self) -> None:
        """One pass: every local rank's new claim and written words, in step order (a claim before the written of
        the same step), then the claims still pending."""
        with self._lock:
            for local, rep in list(self.reps.items()):
                page = self.progress(local)
                if page is None:
                    continue
                new = []
                for word in (page.CLAIM, page.WRITTEN):
                    raw = page.raw(word)
                    if raw != self._seen.get((local, word), 0):
                        self._seen[(local, word)] = raw
                        g, step, index = unpack_word(raw)
                        new.append((step, word == page.WRITTEN, g, index))
                for step, is_written, g, index in sorted(new):
                    if is_written:
                        self._written(local, rep, g, step, index)
                    else:
                        self._claim(local, rep, page, g, step)
                claimed_now = any(not is_written for _, is_written, _, _ in new)
                if local in self.pending and not claimed_now:   # a new claim replaced it
                    g, step = self.pending.pop(local)
                    self._claim(local, rep, page, g, step)

    def drop_pending(self) -> None:
        """A recovery round starts: a claim waiting for a slot belongs to the failed generation."""
        with self._lock:
            self.pending.clear()

    def _claim(self, local: int, rep, page, g: int, step: int) -> None:
        cur = rep.generation
        if g != cur & GEN_MASK:
            return   # a claim of an older generation (or a round the agent has already replaced): never granted
        index = rep.claim(step, generation=cur)
        if index is not None:
            self.pending.pop(local, None)
            page.put(page.GRANT, cur, step, index)
        else:
            self.pending[local] = (g, step)   # an own slot is busy (a push or a restore reads it): ask again

    def _written(self, local: int, rep, g: int, step: int, index: int) -> None:
        if g != rep.generation & GEN_MASK or not rep.written(step, index):
            return   # of an older generation, or of a claim a quiesce dropped: not this generation's snapshot
        self.on_written(local, step)

    def close(self) -> None:
        self._closed = True
        try:
            self.bell.ring()
        except (OSError, TypeError):
            pass
        self._thread.join(2.0)
        self.bell.close()
