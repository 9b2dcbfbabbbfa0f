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

``node_gpus`` and ``resolve_ranks_per_node`` give a node's training processes before any starts (the Slurm batch
script's ``write-config`` / ``copy-config``, launch/batch.py): ``--ranks-per-node 0`` is one per GPU of the node (1
without a GPU), and more than the node's GPUs under ``--backend nccl`` is refused (NCCL takes one GPU per rank).

``misplaced_parameter`` names a model's parameter that is not on the training process's device (``ctx.device``),
which ``ctx.protect`` and ``ctx.zero_adamw`` refuse before step 0. ``warm_cuda`` creates the CUDA context and fills
the caching allocator (every training process, spares while idle); ``cuda_context_problem`` says whether the CUDA
context still works after an NCCL abort (a sticky error leaves it unusable: the process then exits with
``CUDA_UNUSABLE_EXIT``, and its agent handles it as a lost training process).

UNTESTED on a GPU (this suite runs without CUDA): the NCCL and CUDA branches are written, not run on a device.
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


# A training process's exit code when its CUDA context is unusable after an NCCL abort (a sticky CUDA error: no kernel
# runs again in this process). Its node agent handles it as any lost training process (agent/node.py: the node fails
# with cause "exit", and returns to the spare pool after its check, agent/comeback.py), its reason says so. Not 1
# (an error in user code, which ends the job), 3 (start-up) nor 4 (crash loop).
CUDA_UNUSABLE_EXIT = 5


class BackendError(ValueError):
    """A backend setting that cannot be honoured here (its message names the value and what is accepted)."""


class DeviceUnusable(RuntimeError):
    """This process's CUDA context no longer works (after an NCCL abort): it must exit with ``CUDA_UNUSABLE_EXIT``
    (worker/entry.py), never ask the job to stop."""


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


def node_gpus(environ=None, count: int | None = None) -> int:
    """The GPUs of this node for its layout: ``SLURM_GPUS_ON_NODE`` where Slurm set it (the GPUs the job holds on the
    node; a number, else ignored), else the CUDA devices this process sees (``count`` instead, for tests)."""
    environ = os.environ if environ is None else environ
    text = str(environ.get("SLURM_GPUS_ON_NODE", "")).strip()
    if text.isdigit():
        return int(text)
    return cuda_devices() if count is None else count


def resolve_ranks_per_node(requested: int, backend: str, gpus: int) -> int:
    """The training processes per node for ``--ranks-per-node requested`` on a node with ``gpus`` GPUs under the
    ``backend`` setting: ``requested``, or for 0 one per GPU (1 without a GPU). Raises BackendError, naming the
    value and the GPU count, for more processes than GPUs under "nccl" (NCCL needs a GPU of its own per rank of a
    communicator), or "nccl" on a node without a GPU."""
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise BackendError(f"--ranks-per-node {requested!r}: accepted: 1 or more, or 0 (one per GPU of the node)")
    n = requested or max(1, gpus)
    if backend == "nccl":
        if gpus <= 0:
            raise BackendError("--backend nccl needs a GPU on each node, and this node has 0 (SLURM_GPUS_ON_NODE / "
                               "CUDA); accepted here: --backend gloo or auto")
        if n > gpus:
            raise BackendError(f"--ranks-per-node {n} with --backend nccl: this node has {gpus} GPU(s) "
                               f"(SLURM_GPUS_ON_NODE / CUDA) and NCCL needs one per training process; accepted: "
                               f"1..{gpus}, or 0 (one per GPU)")
    return n


def misplaced_parameter(model, device, backend: str = "nccl") -> str | None:
    """Why ``model`` cannot be trained by a process whose device is ``device`` (``ctx.device``), or None: the first
    parameter (by ``named_parameters``) that lives elsewhere, its name, its device and ``device``. A parameter on
    ``device``'s type with no index (``cuda``) or the same index matches. Under gloo a CUDA parameter is accepted on
    a CPU ``device`` (gloo's collectives take CUDA tensors: benchmarks/gpu_check_train.py); a ``meta`` parameter
    (never materialised) is refused everywhere."""
    import torch

    want = torch.device(device)
    for name, p in model.named_parameters():
        have = p.device
        if have.type == want.type and (have.index is None or want.index is None or have.index == want.index):
            continue
        if backend == "gloo" and want.type == "cpu" and have.type == "cuda":
            continue
        return (f"parameter {name!r} is on {have} but this training process's device (ctx.device) is {want}; "
                f"accepted: every parameter on {want} (move the model there before ctx.protect: model.to(ctx.device))")
    return None


def warm_cuda(device, nbytes: int = 64 << 20) -> None:
    """Create the CUDA context on ``device`` and leave ``nbytes`` in the caching allocator (allocated, then freed:
    torch keeps the block), so the first step after a promotion pays for neither. Every training process does it when
    it starts, a spare's while it waits (worker/entry.py ``bind_device``). Nothing on a CPU ``device``. Written, not
    run on a device."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return
    torch.cuda.init()
    block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    block.zero_()
    torch.cuda.synchronize(device)
    del block


def cuda_context_problem(device) -> str | None:
    """Why the CUDA context of ``device`` cannot run work any more (the CUDA error a tiny kernel and a
    synchronisation raise: after an NCCL abort a sticky error, e.g. an illegal address, poisons the context for the
    process's lifetime), or None if it runs. None on a CPU ``device``. Written, not run on a device."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        probe = torch.ones(1, device=device)
        probe.add_(1)
        torch.cuda.synchronize(device)
        if probe.item() != 2.0:
            return f"a kernel on {device} computed {probe.item()} instead of 2.0"
    except RuntimeError as exc:   # torch.AcceleratorError (a RuntimeError) in recent releases
        return f"{type(exc).__name__}: {exc}"
    return None


DEVICE_INDEX_ENV = "DEADPOOL_DEVICE_INDEX"   # the process's index among the GPUs it may use (``device_index``)
SHARED_GPUS_ENV = "DEADPOOL_SHARED_GPUS"     # "1": the emulated nodes of a local run share this machine's GPUs


def device_index(local_rank: int, node: int, ranks_per_node: int, shared: bool) -> int:
    """The index ``device_of`` takes for training process ``local_rank`` of node ``node``: its local rank on a node
    of its own (Slurm: each node has its GPUs), its machine-wide process index ``node * ranks_per_node +
    local_rank`` when the emulated nodes of a local run (``deadpool run``) share one machine's GPUs, so that as
    long as the run's processes (spares included) are no more than the GPUs, no two share one: NCCL refuses two
    ranks of one communicator on one GPU ("Duplicate GPU detected"). Raises ValueError on a negative id."""
    if min(local_rank, node) < 0 or ranks_per_node < 1:
        raise ValueError(f"device_index: local rank {local_rank}, node {node}, ranks per node {ranks_per_node}; "
                         "accepted: ids >= 0 and ranks per node >= 1")
    return node * ranks_per_node + local_rank if shared else local_rank


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
