"""Which torch.distributed backend and device a training process uses, and the NCCL it may use.

``resolve_backend`` turns the run's ``backend`` setting ("auto", "nccl", "gloo") into the backend a training process
uses: "auto" is NCCL where CUDA is available and the node has a GPU, else gloo. ``device_of`` is the device a rank's
tensors live on: ``cuda:LOCAL_RANK`` (modulo the node's GPU count) under NCCL, the CPU under gloo.

``nccl_environment`` is the environment the product sets for NCCL before any communicator exists (a user's own
setting wins): no asynchronous error handling by torch (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``; 1 and 3 tear the
process down, 2 aborts the failed communicator alone): the product's watchdog aborts every communicator of the
generation together, and a peer's failure leaves the survivors running so they can be hot-swapped), CUDA errors of a
failed collective not rethrown as fatal by the watchdog (``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``), no blocking wait (the
product's own watchdog aborts the communicators,
dataplane/watchdog.py). Variable names and values: PyTorch's ProcessGroupNCCL.hpp (release 2.13).

``nccl_version_problem`` refuses the NCCL versions whose ``ncclCommAbort`` is known to hang (a peer lost inside a
collective then never returns): 2.25.1, and 2.28.3 to 2.28.8. Source: the peers' reports gathered for the GPU path
(NCCL release notes of 2.25.2 and 2.28.9 name the fixes). Pure logic; ``nccl_version`` reads torch's.

UNTESTED on a GPU (this suite runs without CUDA): the NCCL branches are written, not run on a device.
"""
from __future__ import annotations

import os

BACKENDS = ("auto", "nccl", "gloo")

# (first, last) inclusive NCCL version ranges whose abort hangs; each with the reason printed when refused
BAD_NCCL = (((2, 25, 1), (2, 25, 1), "ncclCommAbort can hang with a peer lost inside a collective"),
            ((2, 28, 3), (2, 28, 8), "ncclCommAbort can hang while a kernel waits on a dead peer"))

NCCL_ENV = {
    # no handling by torch's own watchdog: it would abort the failed communicator alone (aborting them one at a time
    # deadlocks), and 1 and 3 end the process; the product's watchdog aborts the generation's communicators together
    # (dataplane/watchdog.py; torch's ``_abort_process_group`` asks for 0 too) and the process lives on
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",    # a CUDA error of a collective raises in the caller, not in a watchdog
    "TORCH_NCCL_BLOCKING_WAIT": "0",          # waits are the product's (dataplane/watchdog.py), never blocking ones
}


class BackendError(ValueError):
    """A backend setting that cannot be honoured here (its message names the value and what is accepted)."""


def cuda_devices() -> int:
    """GPUs this process sees (0 without a CUDA build of torch or without a GPU)."""
    import torch

    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:   # a broken driver: no GPU to use
        return 0


def resolve_backend(setting: str, gpus: int | None = None) -> str:
    """The backend for ``setting`` ("auto", "nccl" or "gloo") on a node with ``gpus`` GPUs (default: the ones this
    process sees). Returns "nccl" or "gloo". Raises BackendError for an unknown setting, or "nccl" without a GPU."""
    if setting not in BACKENDS:
        raise BackendError(f"backend {setting!r} is unknown; accepted: {', '.join(BACKENDS)}")
    gpus = cuda_devices() if gpus is None else gpus
    if setting == "auto":
        return "nccl" if gpus > 0 else "gloo"
    if setting == "nccl" and gpus <= 0:
        raise BackendError("backend 'nccl' needs CUDA and a GPU, and this node has none; accepted here: gloo "
                           "(or auto, which picks gloo without a GPU)")
    return setting


def device_of(backend: str, local_rank: int, gpus: int | None = None):
    """The torch.device of the training process ``local_rank`` of its node under ``backend``: ``cuda:i`` with
    ``i = local_rank % gpus`` under NCCL (several processes share a GPU when there are more than GPUs), the CPU
    under gloo."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    gpus = cuda_devices() if gpus is None else gpus
    return torch.device("cuda", local_rank % max(1, gpus))


def nccl_environment(environ=None) -> dict:
    """Set the product's NCCL variables (``NCCL_ENV``) in ``environ`` (default ``os.environ``) where they are unset;
    returns the ones it set. Call before the first NCCL communicator is created."""
    environ = os.environ if environ is None else environ
    set_now = {}
    for key, value in NCCL_ENV.items():
        if key not in environ:
            environ[key] = value
            set_now[key] = value
    return set_now


def parse_nccl_version(version) -> tuple[int, int, int]:
    """(major, minor, patch) of an NCCL version as torch reports it (``torch.cuda.nccl.version()``: a tuple, or an
    int such as 22503 or 2803 in old releases) or a string "2.25.1". Raises ValueError naming an unreadable one."""
    if isinstance(version, str):
        parts = version.strip().split(".")
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            return tuple(int(p) for p in parts)   # type: ignore[return-value]
    elif isinstance(version, tuple) and len(version) >= 3 and all(isinstance(p, int) for p in version[:3]):
        return tuple(version[:3])   # type: ignore[return-value]
    elif isinstance(version, int) and version > 0:
        if version >= 10000:   # NCCL >= 2.9: major*10000 + minor*100 + patch
            return version // 10000, version // 100 % 100, version % 100
        return version // 1000, version // 100 % 10, version % 100   # older: major*1000 + minor*100 + patch
    raise ValueError(f"NCCL version {version!r} is not readable; accepted: (major, minor, patch), an int such as "
                     f"22503, or a string such as '2.25.3'")


def nccl_version_problem(version) -> str | None:
    """Why NCCL ``version`` (anything ``parse_nccl_version`` reads) must not be used, or None if it may be."""
    v = parse_nccl_version(version)
    for first, last, why in BAD_NCCL:
        if first <= v <= last:
            known = ", ".join(".".join(map(str, a)) if a == b else f"{'.'.join(map(str, a))}-{'.'.join(map(str, b))}"
                              for a, b, _ in BAD_NCCL)
            return (f"NCCL {'.'.join(map(str, v))} is refused: {why} (known bad: {known}); use another NCCL "
                    f"(e.g. a torch wheel with NCCL >= 2.28.9) or --backend gloo")
    return None


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL version torch links, or None without CUDA/NCCL."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return parse_nccl_version(torch.cuda.nccl.version())
    except (RuntimeError, AttributeError, ValueError):
        return None
