"""Shared memory between a node agent and its training processes: anonymous ``memfd`` buffers passed as fds.

Owns: creating byte buffers (agent side, ``SharedBuffer.create``), mapping a received fd (training side,
``SharedBuffer.attach``), the *progress page* layout (``ProgressPage``), the doorbell (``Doorbell``) and pinning a
mapping for CUDA copies. Does not own: passing the fds (``agent/channel.py`` and ``worker/client.py`` do, with
SCM_RIGHTS), what is written in a buffer (``replica/snapshot.py``, whose ``slot_pair`` lays snapshot slots over two
buffers), nor deciding that a process hangs (the agent's supervisor reads the page and decides).

Why ``os.memfd_create``: the memory has no name (nothing in /dev/shm), it lives as long as one process maps it
or holds its fd, so nothing leaks when either side is SIGKILLed, and a snapshot written into the agent's buffer
survives the training process that wrote it. Once sized, a buffer is sealed against shrinking and growing
(``F_SEAL_SHRINK | F_SEAL_GROW``): a training process cannot truncate it under the agent, whose reads past
the new end would otherwise die of SIGBUS. Every fd is close-on-exec (training processes and the children they
spawn never inherit one by accident).

No torch import at module level: the agent's channel code and its tests use this without torch;
``SharedBuffer.tensor`` imports it when called.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import select
import time

from ..errors import ChannelError

PAGE_BYTES = 4096
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SharedBuffer:
    """``nbytes`` bytes of memory shared between processes, mapped in this one (read-write, MAP_SHARED).

    Views: ``view`` (memoryview of bytes), ``array`` (numpy uint8, shape (nbytes,)), ``tensor`` (torch uint8,
    shape (nbytes,), ``torch.frombuffer``); all share the memory, none copies. ``fd`` is the memfd (agent side:
    kept, to be sent with ``ChannelServer.send(..., fds=[buf.fd])``; training side: closed once mapped, None).
    """

    def __init__(self, fd: int | None, nbytes: int, mm: mmap.mmap):
        self.fd = fd
        self.nbytes = nbytes
        self._mm = mm
        self.view = memoryview(mm)
        self._array = None
        self._tensor = None
        self._pinned = False

    @classmethod
    def create(cls, nbytes: int, name: str = "deadpool") -> "SharedBuffer":
        """A new zero-filled buffer of ``nbytes`` bytes (>= 1), sealed at that size. Raises ValueError for a bad
        size; OSError if the system refuses the memory."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
            raise ValueError(f"shared buffer size {nbytes!r} is not a positive number of bytes")
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, nbytes, mm)

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> "SharedBuffer":
        """Map the buffer behind a received ``fd`` that should hold ``nbytes`` bytes; takes ownership of ``fd``
        (closed here, mapped or not). Raises ChannelError if the fd's size differs or it is not sealed against
        shrinking (a buffer that could shrink under us would make our reads die of SIGBUS)."""
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise ChannelError(f"shared buffer fd holds {size} bytes; the message said {nbytes}")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if not seals & fcntl.F_SEAL_SHRINK:
                raise ChannelError("shared buffer fd is not sealed against shrinking; refusing to map it")
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(None, nbytes, mm)

    @property
    def array(self):
        """numpy uint8 view, shape (nbytes,)."""
        if self._array is None:
            import numpy as np

            self._array = np.frombuffer(self._mm, dtype=np.uint8)
        return self._array

    @property
    def tensor(self):
        """torch uint8 view, shape (nbytes,) (``torch.frombuffer``: shares the memory)."""
        if self._tensor is None:
            import warnings

            import torch

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # mmap is writable; torch warns about buffers in general
                self._tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._tensor

    def pin(self) -> bool:
        """Page-lock this mapping for fast, asynchronous CUDA copies (``cudaHostRegister``); only where
        ``torch.cuda.is_available()``. Returns True if pinned. Call it in the process that issues the copies (the
        training process: a device-to-host snapshot copy on a side stream, a host-to-device restore); the agent only
        reads with the CPU and needs no pinning. UNTESTED: no GPU on the development machine; the cudart call and
        its flags (0 = cudaHostRegisterDefault) follow the CUDA runtime API. Raises ChannelError if CUDA refuses."""
        import torch

        if self._pinned or not torch.cuda.is_available():
            return self._pinned
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
        if int(getattr(err, "value", err)) != 0:
            raise ChannelError(f"cudaHostRegister of a {self.nbytes}-byte shared buffer failed: error {err}")
        self._pinned = True
        return True

    def close(self) -> None:
        """Unmap and close the fd (idempotent). If views handed out (``array``/``tensor`` or slices of them) are
        still alive elsewhere, the mapping stays until the last of them is gone (no crash, no leak)."""
        if self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        self._array = None
        self._tensor = None
        if self.view is not None:
            self.view.release()
            self.view = None
        try:
            self._mm.close()
        except BufferError:
            pass   # someone still holds a view: the mapping goes with it
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


GEN_MASK = 0xFFFFF   # the generation bits of a snapshot word: compare a generation with ``generation & GEN_MASK``


def pack_word(generation: int, step: int, index: int = -1) -> int:
    """One uint64 word of the snapshot words of a ``ProgressPage``: ``generation`` (20 bits), slot ``index`` + 1
    (4 bits; 0: none) and ``step`` + 1 (40 bits; 0: none). One aligned store: a reader never sees half of it."""
    return ((generation & GEN_MASK) << 44) | (((index + 1) & 0xF) << 40) | ((step + 1) & 0xFF_FFFF_FFFF)


def unpack_word(word: int) -> tuple[int, int, int]:
    """(generation, step, index) of a ``pack_word`` word; step -1 / index -1: none."""
    return word >> 44, (word & 0xFF_FFFF_FFFF) - 1, ((word >> 40) & 0xF) - 1


class ProgressPage:
    """One page shared by a training process and its agent, per local rank.

    Layout, native-endian uint64 words: ``[0]`` beats, incremented by the training thread at every step boundary
    and while it waits in a bounded wait (``beat()``: one store to shared memory, no syscall, ~60-90 ns from
    Python); ``[1]`` step + 1 (0: none yet); ``[2]`` armed (1 while the training process says a hang should be
    detected, i.e. inside a step; 0 while it waits for a decision or is done). One writer per word; an aligned
    8-byte store is atomic on x86-64 and aarch64, and the agent only compares values, so no lock.

    The snapshot words (``pack_word``: generation, step, slot index) carry the per-step snapshot protocol without a
    message and without the agent's main loop: ``[3]`` claim (training process: the slot for this step, please),
    ``[4]`` grant (agent: this slot), ``[5]`` written (training process: the step is in that slot), ``[6]``
    committed (agent: every holder acknowledged this step). A training process rings the agent's ``Doorbell``
    after writing a claim or a written word; the agent's answers are read where they are needed (the snapshot, the
    wait before the update). The generation in each word tells a stale one from the current generation's. The desk
    trusts that a written word is seen after the slot's bytes stored before it: true of x86-64's store order (TSO);
    on a weakly ordered CPU (aarch64) the word could be seen first unless the desk reads it after consuming the ring
    that followed it (the eventfd's lock orders them), which a ring from another local rank does not guarantee.
    UNTESTED on aarch64: no such machine here.

    The work words (the straggler check, agent/stragglers.py), written by the training thread once per
    step (``add_step``), read by the agent every few seconds (``work``): ``[7]`` steps measured, ``[8]`` the
    rank's own work over them (microseconds: the step's wall time less its waits on peers, ``add_step``), ``[9]``
    their wall time (microseconds). Running totals: the reader takes differences; no message per step.

    Agent side: ``beats()``, ``step``, ``armed``, ``work()``, and ``stalled_for()``: seconds since the beat count
    last changed, as seen by successive calls (the supervisor calls it every iteration).
    """

    CLAIM, GRANT, WRITTEN, COMMITTED = 3, 4, 5, 6
    STEPS, OWN_US, WALL_US = 7, 8, 9

    def __init__(self, buf: SharedBuffer):
        if buf.nbytes < 24:
            raise ValueError(f"a progress page needs at least 24 bytes, got {buf.nbytes}")
        self.buf = buf
        self._q = buf.view.cast("Q")
        self._seen = self._q[0]
        self._seen_t = time.monotonic()

    @classmethod
    def create(cls) -> "ProgressPage":
        return cls(SharedBuffer.create(PAGE_BYTES, "deadpool-progress"))

    @classmethod
    def attach(cls, fd: int) -> "ProgressPage":
        return cls(SharedBuffer.attach(fd, PAGE_BYTES))

    @property
    def fd(self) -> int | None:
        return self.buf.fd

    # ---- training process (writer) ----
    def beat(self) -> None:
        """One unit of progress (no syscall)."""
        self._q[0] += 1

    def set_step(self, step: int) -> None:
        self._q[1] = step + 1

    def arm(self) -> None:
        self._q[2] = 1

    def disarm(self) -> None:
        self._q[2] = 0

    def add_step(self, own_s: float, wall_s: float) -> None:
        """One more step measured: ``own_s`` seconds of the rank's own work (compute, the snapshot copy: the step's
        wall time less its waits on peers), ``wall_s`` its wall time (seconds). The totals are written before the
        count, so a reader that sees the count sees the figures of every step it counts (x86-64 store order)."""
        q = self._q
        q[self.OWN_US] += max(0, int(own_s * 1e6))
        q[self.WALL_US] += max(0, int(wall_s * 1e6))
        q[self.STEPS] += 1

    # ---- the snapshot words (either side writes its own) ----
    def put(self, word: int, generation: int, step: int, index: int = -1) -> None:
        """Store ``pack_word(generation, step, index)`` in word ``word`` (``CLAIM`` ... ``COMMITTED``)."""
        self._q[word] = pack_word(generation, step, index)

    def get(self, word: int) -> tuple[int, int, int]:
        """(generation, step, index) in word ``word``; (0, -1, -1) before anything was stored."""
        return unpack_word(self._q[word])

    def raw(self, word: int) -> int:
        return self._q[word]

    # ---- agent (reader) ----
    def beats(self) -> int:
        return self._q[0]

    @property
    def step(self) -> int | None:
        s = self._q[1]
        return None if s == 0 else s - 1

    @property
    def armed(self) -> bool:
        return self._q[2] == 1

    def work(self) -> tuple[int, float, float]:
        """(steps measured, own work seconds, wall seconds): running totals since the process started (``add_step``)."""
        q = self._q
        n = q[self.STEPS]
        return n, q[self.OWN_US] / 1e6, q[self.WALL_US] / 1e6

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds (monotonic) since the beat count last changed between two calls of this method (0 when it
        changed since the previous call)."""
        now = time.monotonic() if now is None else now
        b = self._q[0]
        if b != self._seen:
            self._seen, self._seen_t = b, now
        return now - self._seen_t

    def close(self) -> None:
        self._q.release()
        self.buf.close()


class Doorbell:
    """An eventfd a node agent's training processes ring (``ring``: one 8-byte write, ~2 us) to say a snapshot word
    of their progress page changed; the agent's ``SnapshotDesk`` thread waits on it (``wait``). One per agent,
    shared by its training processes (the fd is passed with the ``slots`` message). ``fd``: the eventfd."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def create(cls) -> "Doorbell":
        return cls(os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK))

    def ring(self) -> None:
        """Wake the waiter. Raises OSError or TypeError once closed."""
        os.eventfd_write(self.fd, 1)

    def wait(self, timeout: float) -> bool:
        """Up to ``timeout`` seconds for a ring (True) or none (False); consumes every ring so far."""
        r, _, _ = select.select([self.fd], [], [], timeout)
        if not r:
            return False
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        fd, self.fd = self.fd, None   # first: a ring racing the close fails (TypeError), never hits a reused fd
        if fd is not None:
            os.close(fd)
