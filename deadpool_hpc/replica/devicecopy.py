"""The snapshot copy, device-generic: a step's state tensors into the rank's host slot, on a side stream.

Written against torch's device-generic API (``torch.Stream``, ``torch.Event``, ``torch.accelerator``), so one code
path serves a GPU and the CPU suite:

- ``mark()`` (the training thread, right after the optimizer step): an event recorded on the caller's current stream.
- ``copy(...)`` (the training thread for an inline snapshot, the writer's copy thread for a background one): the
  side stream waits for that event (``Stream.wait_event``: on the device, not the host), the tensors are copied into
  the slot on the side stream (``non_blocking``: device-to-host into pinned memory overlaps the next forward and
  backward), and an event is recorded after the copy; returned.
- ``when_done(event, callback)``: the callback (the writer's "written") runs once the copy's event completed: at
  once if it has, else on this object's helper thread, which polls the event. The agent checksums the slot only
  after "written", so it never reads a slot the device is still filling.
- ``before_update()`` (the training thread, before the next optimizer step): the caller's current stream waits for
  the last copy's event (a stream wait), so the update never overwrites what is being copied. (The protocol's host
  wait for ``committed`` already implies it: the commit follows "written"; the stream wait keeps the order on the
  device by itself.)

State that lives on the host (the RNG bytes, ``ctx.protect``'s document: AdamW step counts, scheduler, loader) is a
CPU tensor built when the snapshot is taken; copying it is a host copy.

On the CPU (no accelerator) torch's CPU stream runs every operation when issued and the CPU has no events
(``Event.record`` raises there): an unrecorded event reports complete (``query()`` True), ``wait_event`` on one
returns at once, so the copy is complete when ``copy`` returns and "written" is said at once, on the caller's
thread, exactly as before this module existed. Only ``record`` is skipped on the CPU.

UNTESTED on a GPU (no CUDA in this suite): the CUDA branches (events recorded, pinning, the helper thread) are
written, not run on a device.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import torch


class DeviceCopier:
    """Side-stream snapshot copies for the state tensors of ``device`` (module docstring).

    device: the device the state lives on (``ctx.device``); pin: shared buffers to page-lock for asynchronous
    device-to-host copies (objects with ``pin()``: ipc/shm.SharedBuffer; only on CUDA). Raises ChannelError
    (from ``pin``) if CUDA refuses to register a buffer.
    """

    def __init__(self, device, pin=()):
        self.device = torch.device(device)
        self.events = self.device.type != "cpu"   # the CPU has no events: its streams are trivially ordered
        self.stream = torch.Stream(device=self.device)   # the side stream (the CPU's: runs what it is given at once)
        self._last: torch.Event | None = None    # the last copy's completion event
        self._pending: deque = deque()           # (event, callback) the helper thread waits on
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        if self.events:
            for buf in pin:
                buf.pin()

    # ---- events and streams ----------------------------------------------------------------------
    def _event(self, stream) -> torch.Event:
        """An event recorded on ``stream`` (on the CPU: unrecorded, so complete)."""
        ev = torch.Event(device=self.device)
        if self.events:
            ev.record(stream)
        return ev

    def _current(self):
        """The caller's current stream on the device (on the CPU: the CPU stream, which has no queue)."""
        return torch.accelerator.current_stream(self.device) if self.events else self.stream

    # ---- the copy ------------------------------------------------------------------------------
    def mark(self) -> torch.Event:
        """An event after everything issued so far on the caller's current stream (call it after the optimizer
        step, on the training thread): the copy is ordered after it."""
        return self._event(self._current())

    def copy(self, layout, slot, tensors, rng, step: int, should_stop=None, after: torch.Event | None = None):
        """Copy ``tensors`` + ``rng`` into ``slot`` (``layout.write`` without a checksum) on the side stream, after
        ``after`` (default: ``mark()`` now). Returns the copy's completion event, or None if ``should_stop()``
        turned true (the slot is left invalid). Raises what ``layout.write`` raises (ReplicaError on a layout
        mismatch)."""
        after = self.mark() if after is None else after
        self.stream.wait_event(after)
        with self.stream:
            ok = layout.write(slot, tensors, rng, step, should_stop=should_stop, crc=False, non_blocking=self.events)
            done = self._event(self.stream)
        if not ok:
            return None
        self._last = done
        return done

    def before_update(self) -> None:
        """Make the caller's current stream wait (on the device) for the last copy (call before the optimizer
        modifies the state again)."""
        if self._last is not None and self.events:
            self._current().wait_event(self._last)

    @staticmethod
    def complete(event: torch.Event | None, stop=None, timeout: float | None = None) -> bool:
        """Wait on the host until ``event`` completed (True), polling so that ``stop()`` (False) or ``timeout``
        seconds (False) end the wait: a copy queued behind a collective on a dead peer completes only once the
        collective watchdog aborted it. None: nothing to wait for (True)."""
        if event is None or event.query():
            return True
        end = None if timeout is None else time.monotonic() + timeout
        pause = 0.0001
        while not event.query():
            if (stop is not None and stop()) or (end is not None and time.monotonic() > end):
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.002)
        return True

    def when_done(self, event: torch.Event, callback) -> None:
        """Call ``callback()`` once ``event`` completed: at once when it has (always on the CPU), else on the helper
        thread. Callbacks run in the order given."""
        with self._cv:
            if not self._pending and event.query():
                run_now = True
            else:
                run_now = False
                self._pending.append((event, callback))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="deadpool-copy-events", daemon=True)
                    self._thread.start()
                self._cv.notify_all()
        if run_now:
            callback()

    def drop_pending(self) -> None:
        """Forget the callbacks not yet run (a recovery's quiesce: their "written" must not be said)."""
        with self._cv:
            self._pending.clear()

    def idle(self) -> bool:
        """No callback is waiting for its event."""
        with self._cv:
            return not self._pending

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._pending.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(1.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait(0.1)
                if self._closed:
                    return
                event, callback = self._pending[0]
            self.complete(event, stop=lambda: self._closed)
            with self._cv:
                if not self._pending or self._pending[0][1] is not callback:
                    continue   # dropped meanwhile
                self._pending.popleft()
            try:
                callback()
            except Exception:  # noqa: BLE001 - the agent is gone: the wait for commit says so
                pass
