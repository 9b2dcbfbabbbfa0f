"""The per-step snapshot protocol, training-process side: ``SnapshotWriter`` owns claim, granted, written,
wait-committed and the background copy. This docstring is the protocol's one description; the agent's side is
agent/desk.py (``SnapshotDesk``) calling the rank's Replicator (replica/replicator.py ``claim``, ``written``,
``on_commit``).

The interface: four snapshot words of the rank's progress page (ipc/shm.py ``ProgressPage``; each a
``pack_word(generation, step, slot index)``, one aligned store, one writer per word) and the agent's eventfd
``Doorbell``. No channel message and no pass of the agent's main loop per step.

    training process (SnapshotWriter)             node agent (SnapshotDesk thread + the rank's Replicator)
    CLAIM   (g, s)       + ring          ->       g is the Replicator's generation and no own slot is busy:
                                                  ``Replicator.claim`` invalidates the slot for s,
    GRANT   (g, s, i)                    <-       stores the grant (a busy claim is retried every 5 ms)
    copy the state into own slot i (no checksum; shared memory the agent maps too)
    WRITTEN (g, s, i)    + ring          ->       ``Replicator.written``: checksums slot i (CRC-32C), stamps it,
                                                  pushes it to the K holders; once every holder acked a
    COMMITTED (g, s)                     <-       verified copy, ``on_commit`` stores the committed word

Rules both sides keep:
- A word carries the generation (``& GEN_MASK``): the desk never grants a claim of another generation than the
  Replicator's, drops a written word whose claim a ``quiesce``/``configure`` released, and the writer trusts a
  grant or a committed word only of its own generation.
- The writer claims the slot of step s only once every rank's replica of s-1 is committed (the gradient
  all-reduce of s-1 has completed, or the wait before the update returned): the slot it gets is the one not
  holding the newest committed snapshot, so the copy a recovery may cut at is never the one being rewritten.
- The writer does not modify the state it snapshots for step s until ``committed(s)``: the update of step s+1
  waits for it (``wait_committed``; the invariant of docs/architecture.md, "One step").
- The checksum the holders verify is the one the agent takes of what is in the slot: a writer that died
  half-way leaves bytes that cannot pass as another step. The bytes of the slot are stored before the written
  word (x86-64 store order; ipc/shm.py says what aarch64 would need).
- Nothing here blocks without a deadline: a grant not seen within ``grant_timeout``, a commit not seen within
  the caller's timeout, the caller's failure flag or the agent's loss (``lost``) end the wait.

Two ways to copy, one protocol. Inline (``claim_early`` then ``snapshot``): the claim is sent while the optimizer
updates and the copy runs at once on the caller's thread, while what the optimizer wrote is in cache. Background
(``snapshot`` without a granted early claim, or ``submit``): a thread of this object claims (if not claimed yet),
waits for the grant, copies chunk by chunk (abandoned between two chunks by ``quiesce``) and says written; it
overlaps the next forward and backward.

Both copy through the rank's ``DeviceCopier`` (replica/devicecopy.py): on a side stream of the state's device,
ordered after an event recorded when the snapshot is taken; "written" is said once the copy's event completed (on
the CPU: at once, on the copying thread, as the copy is complete when issued).

Owns: the snapshot words this side writes (claim, written), reading grant and committed, the copy thread.
Does not own: the slots' memory (the agent's, mapped here), what is in a payload (replica/snapshot.py
``StateLayout``), when to snapshot (worker/context.py), the agent's answers (agent/desk.py).
"""
from __future__ import annotations

import threading
import time
from collections import deque

from ..errors import PeerFailure
from ..ipc.shm import GEN_MASK


def _backoff(done, stop, end: float, pause: float, beat=None) -> bool:
    """Poll ``done()`` with a doubling pause (from ``pause`` up to 5 ms: an answer that comes at once is seen within
    microseconds, a long wait costs ~200 wake-ups a second) until it is true (True), or ``stop()`` is true or the
    monotonic ``end`` passed (False). ``beat()`` after each pause (the progress page's: a wait is not a hang)."""
    while not done():
        if stop() or time.monotonic() > end:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.005)
        if beat is not None:
            beat()
    return True


class SnapshotWriter:
    """The training-process side of one rank's snapshot protocol (the module docstring).

    page: the rank's ProgressPage; bell: the agent's Doorbell (None or closed: the agent is gone, and the waits say
    so); slots: the rank's own slots as ``Slot`` objects over the agent's shared buffers (written here, never
    stamped here: ``step``/``crc`` of these objects mean nothing to the agent); layout: the StateLayout;
    lost: a threading.Event set once the agent is gone; grant_timeout: seconds the copy thread waits for a grant;
    copier: the DeviceCopier of the state's device (replica/devicecopy.py; default: the CPU's).
    """

    def __init__(self, page, bell, slots: list, layout, *, lost: threading.Event, grant_timeout: float,
                 copier=None):
        if copier is None:
            from .devicecopy import DeviceCopier

            copier = DeviceCopier("cpu")
        self.copier = copier
        self.page, self.bell, self.slots, self.layout = page, bell, slots, layout
        self.lost = lost
        self.grant_timeout = grant_timeout
        self.counts = {"inline": 0, "background": 0}   # how the snapshots were copied (summary.json: snapshots)
        self._early: int | None = None   # the step whose slot was claimed early (``claim_early``)
        self._jobs: deque = deque()
        self._cv = threading.Condition()
        self._epoch = 0
        self._current: int | None = None   # the step the copy thread is copying (None: idle)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="deadpool-snapshot", daemon=True)
        self._thread.start()

    # ---- the words ------------------------------------------------------------------------------
    def _ring(self) -> None:
        try:
            self.bell.ring()
        except (OSError, TypeError, AttributeError):
            pass   # the agent is gone: the wait for commit says so

    def claim(self, step: int, generation: int) -> None:
        """Ask for the slot of ``step``'s snapshot (the claim word, and a ring)."""
        self.page.put(self.page.CLAIM, generation, step)
        self._ring()

    def granted(self, step: int, generation: int) -> int | None:
        """The slot index the agent granted for ``step``, or None (not yet, or not for this step and generation)."""
        g, s, index = self.page.get(self.page.GRANT)
        return index if s == step and g == generation & GEN_MASK and index >= 0 else None

    def _written(self, step: int, index: int, generation: int) -> None:
        self.page.put(self.page.WRITTEN, generation, step, index)
        self._ring()

    def committed(self, step: int, generation: int) -> bool:
        """Whether the agent says every holder acknowledged ``step`` (or a later step) of ``generation``."""
        g, s, _ = self.page.get(self.page.COMMITTED)
        return g == generation & GEN_MASK and s >= step

    # ---- a step's snapshot ----------------------------------------------------------------------
    def claim_early(self, step: int, generation: int) -> None:
        """Claim ``step``'s slot ahead of ``snapshot(step)`` (once: a second call before it is ignored), so that the
        grant arrives while the caller does something else (``ctx.protect``: the optimizer's update)."""
        if self._early is None:
            self._early = step
            self.claim(step, generation)

    def snapshot(self, step: int, tensors, rng, generation: int) -> str:
        """Snapshot ``tensors`` + ``rng`` (uint8) as ``step``: at once on this thread when an early claim of ``step``
        was granted ("inline"), else by the copy thread ("background"). Returns which."""
        claimed, self._early = self._early == step, None
        index = self.granted(step, generation) if claimed else None
        if index is None:
            self.submit(step, tensors, rng, generation, claimed=claimed)
            return "background"
        self.counts["inline"] += 1
        # no checksum here: the agent takes the one it ships and the holders verify (stamp_written)
        done = self.copier.copy(self.layout, self.slots[index], tensors, rng, step)
        if done is not None:   # "written" once the copy's event completed (the CPU: now)
            self.copier.when_done(done, lambda: self._written(step, index, generation))
        return "inline"

    def submit(self, step: int, tensors, rng, generation: int, claimed: bool = False) -> None:
        """Copy ``step``'s ``tensors`` + ``rng`` of ``generation`` on the copy thread (``claimed``: its claim was
        sent already). The caller must not modify ``tensors`` until ``committed(step)``. The copy is ordered after
        what the caller's stream has been given so far (the optimizer step)."""
        after = self.copier.mark()
        with self._cv:
            self.counts["background"] += 1
            self._jobs.append((step, tensors, rng, self._epoch, generation, claimed, after))
            self._cv.notify_all()

    def wait_committed(self, step: int, generation: int, failure: threading.Event, timeout: float,
                       beat=None) -> float:
        """Return once ``committed(step, generation)``; the seconds waited (0.0 when it already was: the usual case,
        the replica was committed while the step computed). Raises PeerFailure when ``failure`` is set, the agent is
        lost, or after ``timeout`` seconds. ``beat()``, if given, is called while it waits. The caller's stream
        waits for the last snapshot copy on the device (``DeviceCopier.before_update``)."""
        self.copier.before_update()
        if self.committed(step, generation):
            return 0.0
        t0 = time.perf_counter()
        stop = lambda: failure.is_set() or self.lost.is_set()  # noqa: E731
        if not _backoff(lambda: self.committed(step, generation), stop, time.monotonic() + timeout, 0.0005, beat):
            if stop():
                raise PeerFailure(f"replica of step {step} not committed: a peer failed")
            raise PeerFailure(f"replica of step {step} not committed within {timeout:g} s")
        return time.perf_counter() - t0

    def settle(self, step: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the copy of ``step`` (queued or under way) to be written, so that a
        recovery can cut at the step this process completed. True if none is left."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._current == step or any(j[0] == step for j in self._jobs) or not self.copier.idle():
                if time.monotonic() > end:
                    return False
                self._cv.wait(0.002)
        return True

    def quiesce(self) -> None:
        """Drop the early claim and the queued snapshots, stop the copy in progress (its slot is never stamped: the
        agent's quiesce releases the claim); returns once the copy thread is idle."""
        with self._cv:
            self._early = None
            self._epoch += 1
            self._jobs.clear()
            self.copier.drop_pending()
            while self._current is not None:
                self._cv.wait(0.005)

    def close(self) -> None:
        """End the copy thread (within about 0.1 s); what is queued is dropped."""
        self.quiesce()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(1.0)
        self.copier.close()

    # ---- the copy thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait(0.1)
                if self._closed:
                    return
                step, tensors, rng, epoch, gen, claimed, after = self._jobs.popleft()
                if epoch != self._epoch:
                    continue
                self._current = step
            try:
                stop = lambda: self._epoch != epoch  # noqa: E731
                if not claimed:
                    self.claim(step, gen)
                # a quiesce ends the wait: a recovery must not wait for a grant that a paused Replicator holds back
                found = []
                if not _backoff(lambda: found.append(self.granted(step, gen)) or found[-1] is not None,
                                lambda: stop() or self.lost.is_set(), time.monotonic() + self.grant_timeout, 0.0002):
                    continue   # quiesced while waiting, the agent gone, or no grant within the timeout
                index = found[-1]
                done = None if stop() else self.copier.copy(self.layout, self.slots[index], tensors, rng, step,
                                                            should_stop=stop, after=after)
                # this thread waits for the copy's event (a quiesce ends the wait), then says written
                if done is not None and self.copier.complete(done, stop) and not stop():
                    self._written(step, index, gen)
            except Exception:  # noqa: BLE001 - the agent failed the claim or is gone: the wait for commit says so
                pass
            finally:
                with self._cv:
                    self._current = None
                    self._cv.notify_all()
