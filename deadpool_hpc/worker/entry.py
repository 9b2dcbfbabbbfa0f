"""Process entry point: ``python -m deadpool_hpc.worker.entry RUN_DIR``, one per MPI rank.

Started by the local launcher (mpiexec, one hydra proxy per emulated node) or by ``srun`` under
Slurm. Reads ``RUN_DIR/config.json`` and the per-job secret (``DEADPOOL_JOB_SECRET``, hex), starts
the control plane, imports the training function named by ``config.train_fn`` ("module:function"),
calls it with a Context on every process (spares included), and exits without MPI_Finalize.
"""
from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import traceback


def load_train_fn(spec: str):
    """Import "package.module:function". Raises ValueError naming the spec if it cannot."""
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise ValueError(f"train_fn {spec!r} is not of the form 'package.module:function'")
    return getattr(importlib.import_module(mod), fn)


# Slurm's "save and leave" signals: SIGUSR2 (``--signal=USR2@SECONDS``, submitit's convention, forwarded by
# sbatch/train.sbatch when it reaches the batch shell) and SIGTERM (preemption with a grace time, ``scancel``,
# the time limit: Slurm sends SIGTERM, then SIGKILL after KillWait). Both mean the same to a worker: save a
# persistent checkpoint at the next agreed step and exit 75. Whether the job is then requeued (a signal while
# the job goes on) or ends (a cancelled job) is the launcher's decision (docs/slurm.md, "Signals").
STOP_SIGNALS = ("SIGUSR2", "SIGTERM")
_signalled = {"usr2": False, "agent": None}  # a signal may come before the control plane exists


def _on_stop_signal(sig, _frame) -> None:
    """SIGUSR2 or SIGTERM: ask the control plane to save a checkpoint at the next agreed step and leave.
    Only stores flags (safe in a signal handler); the control plane's agent thread acts on them."""
    _signalled["usr2"] = True
    _signalled["name"] = signal.Signals(sig).name
    if _signalled["agent"] is not None:
        _signalled["agent"].preempt_by = _signalled["name"]
        _signalled["agent"].request_preempt()


def _cap_malloc_arenas(n: int = 2) -> None:
    """Cap glibc's malloc arenas (``mallopt(M_ARENA_MAX)``) unless MALLOC_ARENA_MAX is set. Each thread that
    allocates may get an arena of its own, and recoveries start short-lived threads (replica transfers, the
    process-group reaper). Measured on a rank surviving 4 recoveries: resident memory grew 3-10 MB per
    generation with glibc's defaults; with 2 arenas and a ``malloc_trim`` after each generation's old groups
    are dropped (dataplane/groups.py) it stayed within 1-3 MB over 3 generations. Must run before other threads."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, n)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass  # not glibc: nothing to cap


def main(argv=None) -> None:
    import signal

    _cap_malloc_arenas()
    stop = {getattr(signal, name) for name in STOP_SIGNALS}
    for sig in stop:  # first: the default action of both would kill the rank
        signal.signal(sig, _on_stop_signal)
        signal.siginterrupt(sig, False)  # SA_RESTART: a system call of another thread must not fail EINTR
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)  # the task wrapper spawns us with them blocked
    argv = sys.argv[1:] if argv is None else argv
    run_dir = argv[0]
    from . import lifeline

    line = lifeline.start(os.path.join(run_dir, "events.jsonl"))  # local launcher only: its death ends the run
    import faulthandler

    faulthandler.enable()  # a crash in native code leaves its Python stacks in launcher.log
    import torch

    torch.set_num_threads(int(os.environ.get("DEADPOOL_THREADS", "1")))
    from ..config import RunConfig
    from ..control.plane import ControlPlane
    from ..dataplane.groups import GenerationGroups, store_host
    from ..errors import Fenced
    from ..events import EventLog
    from .context import Context

    with open(os.path.join(run_dir, "config.json")) as fh:
        cfg = RunConfig.from_json(fh.read())
    if not cfg.replicate:  # no snapshot to save (preempt_ignored): SIGTERM keeps its default action, ending us
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Start-up deadline: MPI_Init and the first collectives (identity exchange, broadcast, barrier) cannot time
    # out, and a process lost meanwhile blocks them for ever; mpi4py holds the GIL in MPI_Init, so no Python
    # thread could act. faulthandler's watchdog is a C thread: it prints every thread's stack to stderr (the
    # launcher's log, or the task's under Slurm) and exits 1.
    faulthandler.dump_traceback_later(cfg.startup_timeout, exit=True)
    secret_hex = os.environ.get("DEADPOOL_JOB_SECRET", "")
    if len(secret_hex) < 32:
        sys.exit("DEADPOOL_JOB_SECRET is missing or shorter than 16 bytes (hex); the launcher sets it")
    log = EventLog(os.path.join(run_dir, "events.jsonl"))
    if os.environ.get(lifeline.RUN_ENV):  # in every line, hello included: a launcher reaps only its own run
        log.base["run"] = os.environ[lifeline.RUN_ENV]
    # this process's replica server (replica/transport.py), bound where its peers reach it
    listener = socket.create_server((store_host(), 0), backlog=64)
    cp = ControlPlane(secret=bytes.fromhex(secret_hex), ranks_per_node=cfg.ranks_per_node, active_nodes=cfg.nodes,
                      period=cfg.heartbeat_period, deadline=cfg.heartbeat_deadline, log=log,
                      hang_timeout=cfg.hang_timeout, ready_timeout=cfg.ready_timeout,
                      recovery_timeout=cfg.recovery_timeout, replicas=cfg.replicas if cfg.replicate else 0,
                      extra_identity={"replica": list(listener.getsockname()[:2])})
    log.base.update(mpi_rank=cp.me, node=cp.me // cfg.ranks_per_node)
    if line is not None:
        line.know(cp.idents, log)  # from now on a lost launcher takes every process of the run with it
    _signalled["agent"] = cp.agent
    if _signalled["usr2"]:
        cp.agent.preempt_by = _signalled.get("name")
        cp.agent.request_preempt()
    code = 0
    try:
        ctx = Context(cfg, cp, GenerationGroups("gloo", cfg.wait_timeout, cfg.rendezvous_timeout), log, listener)
        faulthandler.cancel_dump_traceback_later()  # the control plane runs: every wait from here on has its own
        load_train_fn(cfg.train_fn)(ctx)
        code = ctx.exit_code
    except Fenced as exc:  # declared failed by the others: leave quietly (they go on without this process)
        code = 1
        log.emit("fenced", error=str(exc))
    except BaseException as exc:  # report, tell the others, leave
        code = 1
        log.emit("error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        cp.abort(f"{type(exc).__name__}: {exc}")
        cp.wait_sends()
    log.sync()
    cp.exit(code)


if __name__ == "__main__":
    main()
