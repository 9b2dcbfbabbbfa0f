"""Snapshot buffers: preallocated host memory for a rank's unique state, two slots each.

A rank's *payload* is one flat byte buffer: the float32 state tensors it alone holds (its ZeRO-1
parameter shard and optimizer-state shard) followed by its RNG state bytes. A *slot* holds one
payload with the step it belongs to and its CRC-32C; a slot being written has step None and is never
reported or read. Two slots per rank and per held replica (DESIGN.md: last committed, in progress),
so the newest complete copy is never overwritten by an incomplete one.

Owns: the slots, the payload layout, and the one checksum used for payloads everywhere (snapshots,
replicas on the wire, checkpoint shards on disk). Does not own: moving slots between processes
(``replicator.py``) or files (``persist.py``).

The checksum is CRC-32C (google-crc32c, hardware-accelerated), not zlib's CRC-32: 3x faster on 200 MB
here (16 ms against 48 ms, ``benchmarks/transport.py``). It is handed the numpy buffer itself (no copy,
no allocation); google-crc32c keeps the GIL for such a buffer (it releases it only for ``bytes``), so
buffers go in pieces of ``CRC_PIECE`` (about 0.1 ms each) and a waiting thread gets the GIL between
two. Measured against the alternatives with a busy Python thread alongside: copying each piece to
``bytes`` (GIL released in the CRC) or ``zlib.crc32`` (GIL released) made 1 GB take 1.4-1.6 s instead
of 0.16 s, each piece waiting up to a switch interval (5 ms) to take the GIL back.

No torch import at module level: a node agent holds, stamps and ships slots as numpy bytes, so it can spawn its
training processes before it imports torch (importing torch and torch.distributed.checkpoint cost each agent 2.5-4
s of CPU, once on the path of every run's start-up; agent/__main__.py now imports them after the spawn, for a
checkpoint save); ``Slot.tensor`` and the tensor views import torch where a training process or a save uses them.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import google_crc32c
import numpy as np

from ..errors import ReplicaError

if TYPE_CHECKING:
    import torch

if google_crc32c.implementation != "c":  # the pure-Python fallback is ~1000x slower: fail loudly, not slowly
    raise ImportError("google-crc32c was installed without its C extension; reinstall it from a binary wheel "
                      "(pip install --force-reinstall google-crc32c)")

CRC_NAME = "crc32c"
CRC_PIECE = 1 << 20            # bytes per google-crc32c call (the GIL is held for about 0.1 ms)
COPY_CHUNK = 4 << 20           # bytes copied (then checksummed, still in cache) per step of StateLayout.write


def checksum(buf, crc: int = 0) -> int:
    """CRC-32C of a byte buffer (numpy array, bytes, bytearray, memoryview), continuing from ``crc``.

    ``checksum(b, checksum(a)) == checksum(a + b)``, so a stream can be checksummed piece by piece.
    """
    a = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    a = a.reshape(-1).view(np.uint8)
    for off in range(0, a.size, CRC_PIECE):
        crc = google_crc32c.extend(crc, a[off:off + CRC_PIECE])
    return crc


class Slot:
    """One payload buffer of ``nbytes`` bytes (pinned host memory when CUDA is available).

    ``step``/``crc`` are set only once the whole payload is in place and verified. ``rank`` is the
    training rank whose state it holds (set by whoever writes it). ``readers`` counts the transfers
    reading it (a push or a restore being sent): a slot with readers is never rewritten. ``from_replica``: its payload
    is a replica its source sent for a restore, which carries only the wire part (``StateLayout.wire``): the local
    prefix (a ``ctx.protect`` rank's kept shares) is not this rank's; reset when the slot is invalidated.

    tensor: an existing buffer of ``nbytes`` bytes to use instead of a new one: a 1-D uint8 CPU tensor, or a 1-D
    uint8 numpy array (a node agent's slot in memory shared with its training process, see ipc/shm.py); it is
    used as is, not pinned. A new buffer is a torch tensor (pinned when CUDA is available) in a process that has
    imported torch, and a numpy array in one that has not (a node agent: the replicas it holds).

    buf: the numpy uint8 view, shape (nbytes,); tensor: the torch uint8 view of the same memory (made on first use).
    """

    def __init__(self, nbytes: int, tensor=None):
        if tensor is None:
            torch = sys.modules.get("torch")
            if torch is None:
                tensor = np.empty(nbytes, dtype=np.uint8)
            else:
                tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        if isinstance(tensor, np.ndarray):
            if tensor.dtype != np.uint8 or tensor.ndim != 1 or tensor.size != nbytes:
                raise ReplicaError(f"a slot of {nbytes} bytes needs a 1-D uint8 buffer of that size, got a numpy "
                                   f"{tensor.dtype} array of shape {tensor.shape}")
            self._tensor = None
            self.buf = tensor
        else:
            import torch

            if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() != nbytes or tensor.is_cuda:
                raise ReplicaError(f"a slot of {nbytes} bytes needs a 1-D uint8 CPU tensor of that size, got "
                                   f"{tensor.dtype} of shape {tuple(tensor.shape)} on {tensor.device}")
            self._tensor = tensor
            self.buf = tensor.numpy()
        self.step: int | None = None
        self.crc: int | None = None
        self.rank: int | None = None
        self.readers = 0
        self.from_replica = False

    @property
    def tensor(self) -> "torch.Tensor":
        """The slot's bytes as a torch uint8 tensor, shape (nbytes,), sharing ``buf``'s memory (imports torch)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.from_numpy(self.buf)
        return self._tensor

    def invalidate(self) -> None:
        self.step = None
        self.crc = None
        self.from_replica = False

    def stamp(self, step: int, crc: int) -> None:
        self.crc = crc
        self.step = step   # last: a reader that sees the step sees its CRC


class SlotPair:
    """Two slots: ``begin(step)`` hands out the one whose loss costs nothing, invalidated.

    tensors: two existing buffers for the slots (see ``Slot``), e.g. shared memory; default: two new ones.
    """

    def __init__(self, nbytes: int, tensors: list | None = None):
        self.nbytes = nbytes
        if tensors is not None and len(tensors) != 2:
            raise ReplicaError(f"a slot pair takes 2 buffers, got {len(tensors)}")
        self.slots = [Slot(nbytes, t) for t in (tensors or (None, None))]

    def target(self, step: int | None = None) -> Slot:
        """The slot ``begin(step)`` would hand out for writing ``step``. In order: an empty slot; a slot ahead of
        ``step`` (after a rollback to ``step`` its state will never be needed: the recovery cut at ``step``);
        the slot that does not already hold ``step``; the older slot. So the copy a recovery may need (``step``
        itself, else the newest step before it) stays valid while the other slot is written. Without ``step``:
        the slot not holding the newest step."""
        a, b = self.slots
        for slot in self.slots:
            if slot.step is None:
                return slot
        if step is not None:
            ahead = [x for x in self.slots if x.step > step]
            if ahead:
                return max(ahead, key=lambda x: x.step)
            if a.step == step:
                return b
            if b.step == step:
                return a
        return a if a.step < b.step else b

    def begin(self, step: int | None = None) -> Slot:
        """Invalidate and return the slot to write ``step`` into (``target``). Raises ReplicaError if a transfer
        reads it."""
        slot = self.target(step)
        if slot.readers:
            raise ReplicaError(f"the slot of step {slot.step} is being read by {slot.readers} transfer(s)")
        slot.invalidate()
        return slot

    def steps(self) -> list[int]:
        return sorted(s.step for s in self.slots if s.step is not None)

    def find(self, step: int) -> Slot | None:
        for s in self.slots:
            if s.step == step:
                return s
        return None

    def get(self, step: int) -> Slot:
        slot = self.find(step)
        if slot is None:
            raise ReplicaError(f"no verified copy of step {step}; held steps: {self.steps()}")
        return slot

    def clear(self) -> None:
        for s in self.slots:
            s.invalidate()


def slot_pair(buffers: list):
    """A SlotPair whose two slots live in ``buffers`` (two ``ipc.shm.SharedBuffer`` of equal size, or anything with
    ``nbytes`` and a uint8 ``array``): the agent's own snapshot slots, written by its training process, stamped and
    shipped by the agent. Each slot keeps a reference to its buffer (``slot.shared``) so the memory outlives nothing
    it backs."""
    if len(buffers) != 2 or buffers[0].nbytes != buffers[1].nbytes:
        raise ValueError(f"a slot pair needs two shared buffers of equal size, got sizes {[b.nbytes for b in buffers]}")
    pair = SlotPair(buffers[0].nbytes, tensors=[b.array for b in buffers])  # numpy: the agent needs no torch
    for slot, b in zip(pair.slots, buffers):
        slot.shared = b
    return pair


class StateLayout:
    """Where each state tensor and the RNG bytes sit in a payload. Sizes in bytes.

    local_nbytes: the payload's first bytes (whole leading tensors) that stay in the node's own snapshot and are
    never sent (``ctx.protect``'s data-parallel state, identical on every rank: each rank keeps its share and the
    shares of the ranks whose replica it holds, worker/protect.py). The rest, ``wire(slot)`` (``wire_nbytes``), is
    what a replica holds, what the checksum covers and what a restore verifies. 0 (default): all of it.

    tensors: the state tensors in payload order (meta tensors will do), or their ``(dtype name, shape)`` pairs as
    a training process sends them to its node agent (``("float32", [128, 64])``; the names of ``torch.float32``
    etc.): an agent builds its layout from those without importing torch. Raises ReplicaError for a dtype name
    that is not one of torch's (the accepted names are listed).
    """

    def __init__(self, tensors: list, rng_nbytes: int, local_nbytes: int = 0):
        specs = [_spec_of(t) for t in tensors]
        self.dtype_names = [name for name, _ in specs]
        self.shapes = [shape for _, shape in specs]
        self.sizes = [_itemsize(name) * _numel(shape) for name, shape in specs]
        self._dtypes = None
        self.state_nbytes = sum(self.sizes)
        self.rng_nbytes = rng_nbytes
        self.nbytes = self.state_nbytes + rng_nbytes
        bounds = [sum(self.sizes[:i]) for i in range(len(self.sizes) + 1)]
        if local_nbytes not in bounds:
            raise ReplicaError(f"local_nbytes {local_nbytes} is not the end of a leading tensor of the layout "
                               f"(accepted: one of {bounds[:8]}{' ...' if len(bounds) > 8 else ''})")
        self.local_nbytes = local_nbytes
        self.wire_nbytes = self.nbytes - local_nbytes

    @property
    def dtypes(self) -> list:
        """The state tensors' torch dtypes (imports torch on first use)."""
        if self._dtypes is None:
            import torch

            self._dtypes = [getattr(torch, name) for name in self.dtype_names]
        return self._dtypes

    def wire(self, slot: Slot):
        """The bytes of ``slot`` a replica carries (numpy view): all but the local prefix."""
        return slot.buf[self.local_nbytes:]

    def views(self, slot: Slot) -> list[torch.Tensor]:
        """Tensor views of ``slot`` for each state tensor (copy into them / out of them)."""
        out, off = [], 0
        for size, dtype, shape in zip(self.sizes, self.dtypes, self.shapes):
            out.append(slot.tensor[off:off + size].view(dtype).view(shape))
            off += size
        return out

    def write(self, slot: Slot, tensors: list[torch.Tensor], rng: torch.Tensor, step: int,
              should_stop=None, crc: bool = True, non_blocking: bool = False) -> bool:
        """Copy ``tensors`` and ``rng`` (uint8) into ``slot``, checksum it, stamp it with ``step``. An entry of
        ``tensors`` may be a list of 1-D uint8 tensors instead: pieces copied one after the other into that
        tensor's place (their sizes must add up to it), e.g. byte ranges of several live tensors.

        The copy and the CRC go chunk by chunk (``COPY_CHUNK`` bytes: each chunk is checksummed while
        it is still in cache). ``should_stop()`` is asked between chunks: if it turns true the slot is
        left invalid and False is returned. Returns True once the slot is stamped. ``crc=False``: copy only
        (the slot is stamped with CRC 0) for a writer whose reader checksums the slot itself (a training
        process writing its node agent's shared slot: the agent's ``stamp_written`` is the checksum trusted).
        ``non_blocking`` (with ``crc=False``): device-to-host copies are queued on the current stream and may still
        be running when this returns (replica/devicecopy.py records an event after them); the slot is stamped all
        the same, so its reader must wait for that event.
        """
        import torch

        slot.invalidate()
        value, off = 0, 0
        mv = memoryview(slot.buf)
        with torch.no_grad():
            dsts = self.views(slot) + [slot.tensor[self.state_nbytes:]]
            if crc is False:
                if not self._copy_batched(dsts, list(tensors) + [rng], should_stop, non_blocking):
                    return False
                slot.stamp(step, 0)
                return True
            for dst, src in _flat_pairs(dsts, list(tensors) + [rng]):
                pieces = _chunk_pairs(dst, src) if src.is_contiguous() else [(dst, src)]
                for d, s in pieces:
                    if should_stop is not None and should_stop():
                        return False
                    d.copy_(s)
                    n = d.numel() * d.element_size()
                    if crc is not False and off >= self.local_nbytes:
                        value = checksum(mv[off:off + n], value)
                    off += n
            if off != self.nbytes:
                raise ReplicaError(f"payload layout wrote {off} bytes, expected {self.nbytes}")
        slot.stamp(step, value)
        return True

    def _copy_batched(self, dsts: list[torch.Tensor], srcs: list, should_stop, non_blocking: bool = False) -> bool:
        """``write`` without a checksum: the pieces go in ``torch._foreach_copy_`` batches of about COPY_CHUNK
        bytes (one call into torch per batch, which releases the GIL, instead of a Python loop per piece; the
        micro GPT's snapshot is ~150 pieces), asking ``should_stop()`` before each batch."""
        import torch

        batch_d: list[torch.Tensor] = []
        batch_s: list[torch.Tensor] = []
        pending = off = 0
        for d, s in _split_large(_flat_pairs(dsts, srcs)):
            if pending >= COPY_CHUNK:
                torch._foreach_copy_(batch_d, batch_s, non_blocking=non_blocking)
                batch_d, batch_s, pending = [], [], 0
            if not batch_d and should_stop is not None and should_stop():
                return False
            n = d.numel() * d.element_size()
            batch_d.append(d)
            batch_s.append(s)
            pending += n
            off += n
        if batch_d:
            torch._foreach_copy_(batch_d, batch_s, non_blocking=non_blocking)
        if off != self.nbytes:
            raise ReplicaError(f"payload layout wrote {off} bytes, expected {self.nbytes}")
        return should_stop is None or not should_stop()

    def stamp_written(self, slot: Slot, step: int, should_stop=None) -> bool:
        """Checksum ``slot`` as written by another process (a training process writing into its node agent's
        shared slot) and stamp it with ``step``; chunk by chunk, asking ``should_stop()`` in between (then the
        slot stays invalid and False is returned). A writer that died half-way leaves bytes whose checksum the
        holders verify against this one: the slot is only trusted with the checksum taken here."""
        crc, mv = 0, memoryview(slot.buf)
        for off in range(self.local_nbytes, self.nbytes, COPY_CHUNK):
            if should_stop is not None and should_stop():
                return False
            crc = checksum(mv[off:off + COPY_CHUNK], crc)
        slot.stamp(step, crc)
        return True

    def read(self, slot: Slot, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Copy ``slot`` back into ``tensors``; returns the RNG bytes. Raises ReplicaError on a bad CRC (of the
        ``wire`` bytes; the local prefix is checked by its user: worker/protect.py keeps its CRC-32C in the wire
        bytes)."""
        if slot.step is None or checksum(self.wire(slot)) != slot.crc:
            raise ReplicaError(f"snapshot slot for step {slot.step} fails its checksum")
        import torch

        with torch.no_grad():
            for dst, src in zip(tensors, self.views(slot)):
                dst.copy_(src)
        return slot.tensor[self.state_nbytes:].clone()


# bytes per element of each torch dtype, by its name (torch.float32 -> "float32"): what a node agent needs to lay out
# a payload without importing torch (tests/unit/replica/test_snapshot.py checks the table against torch's own element
# sizes)
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
            "complex32": 4, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2,
            "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
            "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1}


def _itemsize(name: str) -> int:
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise ReplicaError(f"state tensor dtype {name!r} is not supported in a snapshot; accepted: "
                           f"{', '.join(sorted(ITEMSIZE))}") from None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _spec_of(t) -> tuple[str, tuple]:
    """(dtype name, shape) of a tensor, or of a ``(dtype name, shape)`` pair as it is."""
    if isinstance(t, (tuple, list)):
        name, shape = t
        return str(name), tuple(int(d) for d in shape)
    return str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _flat_pairs(dsts: list[torch.Tensor], srcs: list):
    """(dst, src) pairs; a src that is a list of uint8 pieces becomes one pair per piece (dst: its byte range)."""
    for dst, src in zip(dsts, srcs):
        if not isinstance(src, (list, tuple)):
            yield dst, src
            continue
        import torch

        flat, off = dst.reshape(-1).view(torch.uint8), 0
        for piece in src:
            n = piece.numel()
            yield flat[off:off + n], piece
            off += n
        if off != flat.numel():
            raise ReplicaError(f"pieces of {off} bytes for a tensor of {flat.numel()} bytes")


def _split_large(pairs):
    """The (dst, src) ``pairs``, a contiguous one of more than COPY_CHUNK bytes cut into COPY_CHUNK pieces."""
    for d, s in pairs:
        if d.numel() * d.element_size() > COPY_CHUNK and s.is_contiguous():
            yield from _chunk_pairs(d, s)
        else:
            yield d, s


def _chunk_pairs(dst: torch.Tensor, src: torch.Tensor):
    """(dst, src) flat pieces of at most COPY_CHUNK bytes each (both contiguous, same dtype/size)."""
    d, s = dst.reshape(-1), src.reshape(-1)
    step = max(1, COPY_CHUNK // max(1, d.element_size()))
    return [(d[i:i + step], s[i:i + step]) for i in range(0, d.numel(), step)]


class RunningCrc:
    """CRC-32C of a buffer filled front to back (a payload arriving from a socket), computed in pieces of >= 1 MiB
    as bytes arrive: ``update(upto)`` after each piece; ``value`` once the buffer is full."""

    PIECE = 1 << 20

    def __init__(self, buf):
        self.mv = memoryview(buf).cast("B")
        self.done = 0
        self.value = 0

    def update(self, upto: int) -> None:
        if upto - self.done >= self.PIECE or upto == len(self.mv):
            self.value = checksum(self.mv[self.done:upto], self.value)
            self.done = upto
