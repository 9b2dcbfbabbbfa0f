"""Snapshot buffers: preallocated host memory for a rank's unique state, two slots each.

A rank's *payload* is one flat byte buffer: the float32 state tensors it alone holds (its ZeRO-1
parameter shard and optimizer-state shard) followed by its RNG state bytes. A *slot* holds one
payload with the step it belongs to and its CRC-32; a slot being written has step None and is never
reported or read. Two slots per rank and per held replica (DESIGN.md: last committed, in progress),
so the newest complete copy is never overwritten by an incomplete one.
"""
from __future__ import annotations

import zlib

import torch

from ..errors import ReplicaError


def checksum(buf) -> int:
    """CRC-32 of a byte buffer (numpy uint8 array or bytes)."""
    return zlib.crc32(memoryview(buf).cast("B")) & 0xFFFFFFFF


class Slot:
    """One payload buffer of ``nbytes`` bytes (pinned host memory when CUDA is available)."""

    def __init__(self, nbytes: int):
        pin = torch.cuda.is_available()
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.buf = self.tensor.numpy()
        self.step: int | None = None
        self.crc: int | None = None

    def invalidate(self) -> None:
        self.step = None
        self.crc = None


class SlotPair:
    """Two slots: ``begin`` picks the one not holding the newest step, ``commit`` stamps it."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.slots = [Slot(nbytes), Slot(nbytes)]

    def begin(self) -> Slot:
        a, b = self.slots
        newest = a if (a.step is not None and (b.step is None or a.step > b.step)) else b
        slot = b if newest is a else a
        slot.invalidate()
        return slot

    def replace(self, slot: Slot) -> None:
        """Swap in a fresh buffer for ``slot`` (after a transfer into it was abandoned)."""
        i = self.slots.index(slot)
        self.slots[i] = Slot(self.nbytes)

    def steps(self) -> list[int]:
        return sorted(s.step for s in self.slots if s.step is not None)

    def get(self, step: int) -> Slot:
        for s in self.slots:
            if s.step == step:
                return s
        raise ReplicaError(f"no verified copy of step {step}; held steps: {self.steps()}")

    def clear(self) -> None:
        for s in self.slots:
            s.invalidate()


class StateLayout:
    """Where each state tensor and the RNG bytes sit in a payload. Sizes in bytes."""

    def __init__(self, tensors: list[torch.Tensor], rng_nbytes: int):
        self.sizes = [t.numel() * t.element_size() for t in tensors]
        self.dtypes = [t.dtype for t in tensors]
        self.shapes = [tuple(t.shape) for t in tensors]
        self.state_nbytes = sum(self.sizes)
        self.rng_nbytes = rng_nbytes
        self.nbytes = self.state_nbytes + rng_nbytes

    def views(self, slot: Slot) -> list[torch.Tensor]:
        """Tensor views of ``slot`` for each state tensor (copy into them / out of them)."""
        out, off = [], 0
        for size, dtype, shape in zip(self.sizes, self.dtypes, self.shapes):
            out.append(slot.tensor[off:off + size].view(dtype).view(shape))
            off += size
        return out

    def write(self, slot: Slot, tensors: list[torch.Tensor], rng: torch.Tensor, step: int) -> None:
        """Copy ``tensors`` and ``rng`` (uint8) into ``slot``, then checksum and stamp it with ``step``."""
        with torch.no_grad():
            for dst, src in zip(self.views(slot), tensors):
                dst.copy_(src, non_blocking=False)
            slot.tensor[self.state_nbytes:].copy_(rng)
        slot.crc = checksum(slot.buf)
        slot.step = step

    def read(self, slot: Slot, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Copy ``slot`` back into ``tensors``; returns the RNG bytes. Raises ReplicaError on a bad CRC."""
        if slot.step is None or checksum(slot.buf) != slot.crc:
            raise ReplicaError(f"snapshot slot for step {slot.step} fails its checksum")
        with torch.no_grad():
            for dst, src in zip(tensors, self.views(slot)):
                dst.copy_(src)
        return slot.tensor[self.state_nbytes:].clone()
