"""The training processes' fork server program: ``python -m deadpool_hpc.worker.forkserver FD``, one per attempt of a
local run, started by the launcher (``process.forkserver.start``).

It imports what a training process needs (``PRELOAD``), once, then serves the node agents' requests
(``process.forkserver.serve``, which says what a forked process keeps of a fresh one); each forked process runs
``worker.entry`` as ``python -m deadpool_hpc.worker.entry RUN_DIR LOCAL`` would. The preload must not start threads
that a fork would lose: numpy's OpenBLAS pool is kept at one thread (``OPENBLAS_NUM_THREADS=1`` unless set);
torch's CPU pool is created at the first parallel op, after the fork.
"""
from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import time

from ..process.forkserver import die_with, serve

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "deadpool_hpc.worker.context",
           "deadpool_hpc.dataplane.groups", "deadpool_hpc.worker.client")


def _run(argv: list[str]) -> None:
    """In a forked process: the training process's entry point (ends with os._exit)."""
    from . import entry

    sys.argv = [entry.__file__, *argv]   # as ``python -m deadpool_hpc.worker.entry`` sets it

    entry.main(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    listener = socket.socket(fileno=int(argv[0]))
    die_with(os.getppid())   # the launcher
    secret = bytes.fromhex(os.environ["DEADPOOL_JOB_SECRET"])
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")   # torch.cuda.is_available() must not create a context
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the launcher ends it (SIGKILL); a terminal's ^C is the launcher's
    t0 = time.process_time()
    for mod in PRELOAD:
        importlib.import_module(mod)
    if sys.modules["torch"].cuda.is_initialized():   # a child forked now could never use CUDA
        sys.exit("fork server: CUDA was initialised by the preload; forked training processes could not use it")
    print(f"fork server: preloaded {len(PRELOAD)} modules in {time.process_time() - t0:.2f} CPU-s", file=sys.stderr,
          flush=True)
    serve(listener, secret, _run)


if __name__ == "__main__":
    main()
