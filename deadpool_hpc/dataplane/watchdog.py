"""How the training thread waits for a collective: one interface, two implementations chosen by the backend.

``waiter_for(backend, abort, generation)`` returns the object ``collectives.wait`` hands each issued work to
(``Watch.waiter``; None: the polled wait):

- gloo: None. ``collectives.wait`` polls the work and the failure flag together on the training thread
  (dataplane/collectives.py): a blocked gloo collective cannot be interrupted, so the thread never blocks in one.
- NCCL: a ``CollectiveWatchdog``. ``wait`` registers the work with it and orders the caller's CUDA stream after the
  collective (``work.wait()`` with blocking wait off: a stream wait, no host synchronisation), then returns, so
  FSDP2's and TP's collectives overlap compute. The watchdog's thread looks at the outstanding works every ``poll``
  seconds against the failure flag and the collective timeout: on a failed work, a set failure flag while works are
  outstanding, or a work older than the timeout, it aborts every communicator of the generation together (``abort``:
  dataplane/groups.py ``GenerationGroups.abort_all``; one at a time deadlocks), so kernels waiting on a dead peer
  return with an error. The training thread raises PeerFailure at its next wait (``check``), or where the aborted
  collective's error reaches it (a host synchronisation raises; worker/context.py turns an error of a step into
  PeerFailure once the failure flag is set, which the watchdog sets when it aborts).

The watchdog's logic is pure (works are anything with ``is_completed()`` and, optionally, ``exception()``) and is
tested with works that never complete (tests/unit/dataplane/test_watchdog.py). Its use on NCCL is written, not run on a
device.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from ..errors import PeerFailure


def _failed(work) -> BaseException | None:
    """The error a completed ``work`` ended with, or None (a work without ``exception`` never reports one)."""
    try:
        exc = work.exception()
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return exc if isinstance(exc, BaseException) else None


class CollectiveWatchdog:
    """Tracks a generation's outstanding async collectives and aborts the generation's communicators together when
    one fails, the failure flag is set while works are outstanding, or a work is outstanding past ``timeout``.

    failure: the control plane's failure flag (threading.Event; set here too when the watchdog aborts, so that the
    step loop treats what the abort makes fail as a peer's failure); timeout: seconds a work may stay outstanding
    (the collective timeout); abort(): aborts every communicator of the current generation (idempotent);
    generation(): the current generation (a tracked work of an earlier one is forgotten); poll: seconds between
    two scans of the thread; clock: a monotonic clock in seconds; start: start the thread (False: call ``scan``).
    """

    def __init__(self, failure: threading.Event, timeout: float, abort: Callable[[], object],
                 generation: Callable[[], int | None] = lambda: 0, poll: float = 0.005,
                 clock: Callable[[], float] = time.monotonic, start: bool = True):
        if timeout <= 0 or poll <= 0:
            raise ValueError(f"watchdog timeout {timeout!r} s and poll {poll!r} s: accepted: both > 0")
        self.failure, self.timeout, self.abort, self.generation = failure, timeout, abort, generation
        self.poll, self.clock = poll, clock
        self._works: list[tuple[object, float, int | None]] = []   # (work, deadline, generation)
        self._lock = threading.Lock()
        self._tripped: tuple[int | None, str] | None = None   # (generation, reason) of the last abort
        self.aborts = 0
        self._closed = threading.Event()
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._run, name="deadpool-collective-watchdog", daemon=True)
            self._thread.start()

    # ---- the training thread's side --------------------------------------------------------------
    def check(self) -> None:
        """Raise PeerFailure if this generation's communicators were aborted (or the failure flag is set)."""
        t = self._tripped
        if t is not None and t[0] == self.generation():
            raise PeerFailure(f"the collective watchdog aborted generation {t[0]}'s communicators: {t[1]}")
        if self.failure.is_set():
            raise PeerFailure("a peer failed during a collective")

    def track(self, work) -> None:
        """Watch ``work`` (issued with ``async_op=True``) until it completes. Raises PeerFailure as ``check``."""
        self.check()
        with self._lock:
            self._works.append((work, self.clock() + self.timeout, self.generation()))

    def wait(self, work, watch) -> None:
        """``collectives.wait`` on NCCL: track ``work`` and order the caller's stream after it (``work.wait()``, a
        stream wait with blocking wait off); no host synchronisation. Raises PeerFailure as ``check``."""
        self.track(work)
        try:
            work.wait()
        except RuntimeError as exc:
            raise PeerFailure(f"collective failed: {exc}") from exc
        watch.beat()

    def outstanding(self) -> int:
        """Works tracked and not yet seen complete."""
        with self._lock:
            return len(self._works)

    # ---- the watchdog's side ---------------------------------------------------------------------
    def scan(self) -> str | None:
        """One look at the outstanding works: drop completed ones; abort (once per generation) on a failed work,
        the failure flag with works outstanding, or a work past its deadline. Returns the reason of an abort made
        now, else None."""
        gen = self.generation()
        now = self.clock()
        reason = None
        with self._lock:
            live = []
            for work, deadline, g in self._works:
                if g != gen:
                    continue   # a work of an abandoned generation: its communicators are gone
                if work.is_completed():
                    exc = _failed(work)
                    if exc is not None and reason is None:
                        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                        reason = f"a collective failed: {first}"
                    continue
                live.append((work, deadline, g))
                if reason is None and now > deadline:
                    reason = f"a collective did not complete within {self.timeout:g} s"
            if reason is None and live and self.failure.is_set():
                reason = "a peer failed while collectives were outstanding"
            if reason is None:
                self._works = live
                return None
            if self._tripped is not None and self._tripped[0] == gen:
                self._works = []
                return None
            self._works = []
            self._tripped = (gen, reason)
        self.aborts += 1
        self.failure.set()
        try:
            self.abort()
        except Exception:  # noqa: BLE001 - an abort that fails leaves kernels to the hang detector; keep watching
            pass
        return reason

    def _run(self) -> None:
        while not self._closed.wait(self.poll):
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - a work that cannot be queried is looked at again next time
                pass

    def close(self) -> None:
        """Stop the thread (within ``poll`` seconds)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(1.0)


def waiter_for(backend: str, failure: threading.Event, timeout: float, abort: Callable[[], object],
               generation: Callable[[], int | None]) -> CollectiveWatchdog | None:
    """The waiter of ``backend``'s collectives (module docstring): a running CollectiveWatchdog for "nccl", None (the
    polled wait of dataplane/collectives.py) for "gloo". Raises ValueError naming another backend."""
    if backend == "gloo":
        return None
    if backend == "nccl":
        return CollectiveWatchdog(failure, timeout, abort, generation)
    raise ValueError(f"backend {backend!r} has no collective waiter; accepted: nccl, gloo")
