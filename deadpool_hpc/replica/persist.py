"""Persistent checkpoints on disk (torch.distributed.checkpoint), the fallback when no spare is left.

Layout under ``root`` (``RUN_DIR/checkpoint``): ``step{T}/rank{r}/`` holds one rank's unique state
at step T (parameter shard, AdamW shard, RNG state), written with ``torch.distributed.checkpoint``
(``no_dist``: each shard is written by whichever process holds it: the rank itself, or the holder of
a lost rank's replica), plus ``rank{r}.json`` with the step and the CRC-32C of the payload
(``snapshot.checksum``; shards recorded with a zlib CRC-32 under ``crc`` by earlier versions are
still verified with it). ``LATEST``
names the newest *complete* checkpoint; it is written (temp file + rename) only after every rank's
shard is on disk, so a half-written checkpoint is never read back as good, and ``load_shard``
verifies the checksum again. ``assemble_shard`` builds the shard a rank's snapshot slot gives (its tensors, RNG and
kept shares), for both writers: the no-spare checkpoint (agent/recovery.py) and background persistence
(agent/persister.py).

torch and torch.distributed.checkpoint are imported by the functions that write or read shards, not by this
module: a node agent reads LATEST (``rundir.latest_checkpoint``, the one reader) at start-up, before it spawns its
training processes, and importing both there cost it 2.5-4 s of CPU on every run's critical path
(agent/__main__.py imports them after the spawn).
"""
from __future__ import annotations

import json
import os
import socket
from typing import TYPE_CHECKING, Callable, NamedTuple

from ..errors import ReplicaError
from .snapshot import CRC_NAME, checksum

if TYPE_CHECKING:
    import torch

    from .snapshot import Slot, StateLayout

NAMES = ("param_shard", "exp_avg", "exp_avg_sq", "rng")


class Shard(NamedTuple):
    """One rank's shard as ``save_shard`` takes it (``assemble_shard``): the payload's state tensors, the RNG bytes
    (uint8), and which kept shares of a ``ctx.protect`` payload are the rank's (None: no local prefix)."""

    tensors: list
    rng: object
    kept: list | None


def _names(n: int) -> tuple:
    """Names of a payload of ``n`` state tensors + the RNG: ZeRO's three, or (ctx.protect's layout) t0, t1, ..."""
    return NAMES if n == 3 else tuple(f"t{i}" for i in range(n)) + ("rng",)


def _payload_crc(tensors) -> int:
    import torch

    crc = 0
    for t in tensors:
        crc = checksum(t.contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def _legacy_crc32(tensors) -> int:
    """zlib CRC-32, as recorded (key ``crc``) by versions before CRC-32C: read-only compatibility."""
    import zlib

    import torch

    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc & 0xFFFFFFFF


def save_shard(root: str, step: int, rank: int, tensors: list[torch.Tensor], rng: torch.Tensor,
               kept: list[bool] | None = None) -> None:
    """Write rank ``rank``'s state at ``step`` (``tensors``: the payload's tensors, e.g. [param shard, exp_avg,
    exp_avg_sq] for ZeRO-1). ``kept``: for a ``ctx.protect`` payload, which of the shares in its local prefix hold
    this rank's bytes (all when saved from the rank's own snapshot; only its own share when saved from a replica,
    which carries none: worker/protect.py), recorded with it (``shard_record``)."""
    import torch.distributed.checkpoint as dcp

    d = os.path.join(root, f"step{step}")
    os.makedirs(d, exist_ok=True)
    names = _names(len(tensors))
    state = dict(zip(names, [t.clone() for t in tensors] + [rng.clone()]))
    dcp.save(state, checkpoint_id=os.path.join(d, f"rank{rank}"), no_dist=True)
    rec = {"step": step, "rank": rank, CRC_NAME: _payload_crc([state[n] for n in names])}
    if kept is not None:
        rec["kept"] = [bool(k) for k in kept]
    _write_json(os.path.join(d, f"rank{rank}.json"), rec)


def assemble_shard(layout: StateLayout, slot: Slot, tensors: list[torch.Tensor] | None = None,
                   keeper: Callable[[], tuple[Slot, int]] | None = None) -> Shard:
    """The shard ``save_shard`` writes for one rank, from a snapshot slot of it (``slot``: the rank's own snapshot,
    or the replica of a lost rank this node holds): its state tensors, its RNG bytes and, for a ``ctx.protect``
    payload (``layout.local_nbytes`` > 0: the local prefix is n equal uint8 shares, worker/protect.py), which shares
    hold this rank's bytes (``kept``). The one assembly of both checkpoint paths: the no-spare checkpoint
    (agent/recovery.py) and background persistence (agent/persister.py).

    ``tensors``: where to read the state to (reused across calls; ``save_shard`` clones what it writes); default:
    new tensors of the layout's shapes and dtypes. ``kept``: every share when ``slot`` is the rank's own snapshot,
    none when that snapshot is itself a restored replica (``Slot.from_replica``: a replica carries no share).
    ``keeper``: for a lost rank's shard assembled from its replica, where the share this node kept for it lies, as
    ``(own, index)``: this node's rank's own snapshot of the same step and the index of that share among its views
    (1 + the lost rank's place among the ranks it holds, ``placement.held_by``); asked only when the prefix has
    more than one share (with one kept region, HSDP's replicate group's shards whole, the lost rank's region is not
    this rank's to give: ``kept`` [False], its group's ranks restore it from theirs).

    Raises ReplicaError when ``slot`` (or the keeper's) fails its checksum, or holds no step (``StateLayout.read``).
    """
    import torch

    if tensors is None:
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in zip(layout.shapes, layout.dtypes)]
    rng = layout.read(slot, tensors)   # verifies the CRC the agent took when the snapshot was written
    kept = None
    if layout.local_nbytes:
        n = layout.local_nbytes // tensors[0].numel()   # the shares: equal uint8 tensors
        kept = [not slot.from_replica] * n
        if keeper is not None and n == 1:
            kept = [False]
        elif keeper is not None:
            own, index = keeper()
            tensors[0].copy_(layout.views(own)[index])
            kept = [not own.from_replica] + [False] * (n - 1)
    return Shard(tensors, rng, kept)


def shard_record(root: str, meta: dict, rank: int) -> dict:
    """The record written with rank ``rank``'s shard of checkpoint ``meta`` ({step, rank, crc32c[, kept]})."""
    with open(os.path.join(root, f"step{meta['step']}", f"rank{rank}.json")) as fh:
        return json.load(fh)


def commit(root: str, step: int, world_size: int, generation: int, high_water: int = -1) -> None:
    """Mark ``step`` complete. Raises ReplicaError if any rank's shard is missing."""
    d = os.path.join(root, f"step{step}")
    missing = [r for r in range(world_size) if not os.path.exists(os.path.join(d, f"rank{r}.json"))]
    if missing:
        raise ReplicaError(f"checkpoint step {step} lacks the shards of ranks {missing}; not committed")
    _write_json(os.path.join(root, "LATEST"), {"step": step, "world_size": world_size, "generation": generation,
                                               "high_water": high_water})


def load_shard(root: str, meta: dict, rank: int, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Load rank ``rank``'s state of ``meta['step']`` into ``tensors`` (in place); returns the RNG state.

    Raises ReplicaError if the shard's step or checksum does not match its record.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    d = os.path.join(root, f"step{meta['step']}")
    rec = shard_record(root, meta, rank)
    rng = torch.get_rng_state()
    names = _names(len(tensors))
    state = dict(zip(names, [torch.empty_like(t) for t in tensors] + [torch.empty_like(rng)]))
    dcp.load(state, checkpoint_id=os.path.join(d, f"rank{rank}"), no_dist=True)
    payload = [state[n] for n in names]
    good = (_payload_crc(payload) == rec[CRC_NAME]) if CRC_NAME in rec else (_legacy_crc32(payload) == rec.get("crc"))
    if rec["step"] != meta["step"] or not good:
        raise ReplicaError(f"checkpoint shard of rank {rank} at step {meta['step']} fails its step/checksum check")
    with torch.no_grad():
        for dst, name in zip(tensors, names):
            dst.copy_(state[name])
    return state["rng"]


def _write_json(path: str, obj: dict) -> None:
    """Write ``obj`` to ``path``: temp file, fsync, rename. Raises OSError; a failed write leaves no temp file."""
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def discard_shard(root: str, step: int, rank: int) -> None:
    """Remove what a failed ``save_shard`` of ``rank`` at ``step`` may have left (its record first: without it the
    shard is never committed nor read). Never raises (the directory may be read-only or gone)."""
    import shutil

    d = os.path.join(root, f"step{step}")
    try:
        os.unlink(os.path.join(d, f"rank{rank}.json"))
    except OSError:
        pass
    shutil.rmtree(os.path.join(d, f"rank{rank}"), ignore_errors=True)


def failure_reason(exc: BaseException, path: str | None = None) -> str:
    """What a failed write says, as ``ENAME: text``: an OSError anywhere in ``exc``'s chain (or in a torch
    CheckpointException's per-rank failures); else, for a write under ``path``, what its file system says now
    (read-only: EROFS; under 1 MiB free: ENOSPC; torch's writer turns a full disk into "unexpected pos"); else
    ``Type: first line of the message``. At most 300 characters."""
    import errno as _errno

    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return f"{_errno.errorcode.get(e.errno, 'EIO')}: {e.strerror or e}"[:300]
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)   # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first}"[:200]
    if path is not None:
        try:
            st = os.statvfs(path)
            if st.f_flag & os.ST_RDONLY:
                return f"EROFS: {os.strerror(_errno.EROFS)} ({text})"[:300]
            if st.f_bavail * st.f_frsize < (1 << 20):
                return f"ENOSPC: {os.strerror(_errno.ENOSPC)} ({st.f_bavail * st.f_frsize} bytes free; {text})"[:300]
        except OSError as probe:
            if probe.errno:
                return f"{_errno.errorcode.get(probe.errno, 'EIO')}: {probe.strerror} ({text})"[:300]
    return text[:300]
