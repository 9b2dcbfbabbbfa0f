"""Training process entry point: ``python -m deadpool_hpc.worker.entry RUN_DIR LOCAL_RANK``.

Started by its node agent (agent/supervisor.py), never by a launcher: it calls no MPI. Reads
``RUN_DIR/config.json`` and the per-job secret (``DEADPOOL_JOB_SECRET``, hex), connects to its agent
(``DEADPOOL_AGENT_SOCK``), imports the training function named by ``config.train_fn`` ("module:function") and
calls it with a Context (spares included). Exits when the run is over for it, or at once when its agent is gone.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys
import traceback

from ..process.malloc import cap_malloc_arenas
from ..rundir import RunDir


def load_train_fn(spec: str):
    """Import "package.module:function". Raises ValueError naming the spec if it cannot. The current directory
    is searched last (as ``python -m`` does first), so ``deadpool run --train-fn examples.ddp_gpt:train`` works from
    a checkout's root, in the launcher's check and in the workers, which inherit its directory."""
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise ValueError(f"train_fn {spec!r} is not of the form 'package.module:function'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    return getattr(importlib.import_module(mod), fn)


def _allow_agent_to_trace() -> None:
    """Under Yama's ptrace_scope 1 only an ancestor may read a process (py-spy, agent/stacks.py); a process forked
    by the local launcher's fork server is not its agent's descendant: name the agent (``DEADPOOL_AGENT_PID``) as
    its tracer (``PR_SET_PTRACER``; py-spy, the agent's child, inherits the permission). Without Yama the call fails
    with EINVAL and nothing is needed. UNTESTED with Yama: this machine's kernel has none."""
    agent = os.environ.get("DEADPOOL_AGENT_PID", "")
    if agent.isdigit():
        import ctypes

        PR_SET_PTRACER = 0x59616D61
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, int(agent), 0, 0, 0)


def bind_device(cfg, local: int, log=None, node: int = 0):
    """Resolve the run's backend for this process (``cfg.backend``: auto, nccl or gloo; dataplane/backend.py) and
    bind its device: under NCCL ``cuda:i`` becomes the current device (``i``: the local rank modulo the node's
    GPUs; under ``deadpool run``, whose emulated nodes share the machine's GPUs, the process's machine-wide index,
    dataplane/backend.py ``device_index``), the
    product's NCCL environment is set, a known-bad NCCL is refused, and the CUDA context and the caching allocator
    are warmed now (a spare does it while idle, so a promotion does not pay for them). Returns (backend, device).
    Raises BackendError (nccl without a GPU, an unknown setting) or RuntimeError (a refused NCCL version), naming
    the value and what is accepted. The NCCL branch is written, not run on a device (no GPU in this suite)."""
    import torch

    from ..dataplane import backend as be

    os.environ["LOCAL_RANK"] = str(local)   # dataplane/groups.device_for and training functions read it
    name = be.resolve_backend(cfg.layout.backend)
    shared = os.environ.get(be.SHARED_GPUS_ENV) == "1"   # deadpool run: the emulated nodes share this machine's GPUs
    index = be.device_index(local, node, cfg.layout.ranks_per_node, shared)
    os.environ[be.DEVICE_INDEX_ENV] = str(index)   # dataplane/groups.device_for reads it
    device = be.device_of(name, index)
    info = {"backend": name, "device": str(device)}
    if name == "nccl":
        version = be.nccl_version()
        info["nccl"] = ".".join(map(str, version)) if version else None
        problem = be.nccl_version_problem(version) if version else None
        if problem:
            raise RuntimeError(problem)
        be.nccl_environment()
        if shared:   # each emulated node a host of its own to NCCL, as to MPI (launch/local.py): NCCL refuses two
            # ranks of one communicator on one GPU of one host ("Duplicate GPU detected"); across hosts it connects
            # them through its network transport, as it does real nodes
            os.environ.setdefault("NCCL_HOSTID", f"deadpool-emulated-node{node}")
        torch.cuda.set_device(device)
        be.warm_cuda(device)
        if log is not None:   # the NCCL version in the event log, and on stderr (the agent's tail of it)
            log.emit("device", **info)
        print(f"deadpool: backend nccl on {device}, NCCL {info['nccl']}", file=sys.stderr, flush=True)
    return name, device


def main(argv=None) -> None:
    cap_malloc_arenas()
    # Slurm's stop signals (USR2, TERM) and a terminal's INT are the agent's to act on (it saves and leaves with
    # its node): a training process ignores them, and dies with its agent (parent-death signal, end of channel).
    for name in ("SIGUSR2", "SIGTERM", "SIGINT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2, signal.SIGTERM})
    argv = sys.argv[1:] if argv is None else argv
    run_dir, local = os.path.abspath(argv[0]), int(argv[1])
    import faulthandler

    faulthandler.enable()  # a crash in native code leaves its Python stacks in the log
    # a hung process's stacks, on its agent's signal, where py-spy cannot read them (agent/stacks.py): to stderr,
    # which its agent reads (agent/stderrtail.py)
    from ..cause import STACK_SIGNAL

    faulthandler.register(STACK_SIGNAL, all_threads=True, chain=False)
    _allow_agent_to_trace()
    from ..config import RunConfig
    from ..process.fence import identity
    from ..errors import STARTUP_FAILED_EXIT
    from ..events import EventLog
    from ..logs import setup as setup_logging
    from ..ipc.messages import AbortAsk
    from .client import AgentClient
    from ..process.lifeline import RUN_ENV

    with open(RunDir(run_dir).config) as fh:
        cfg = RunConfig.from_json(fh.read())
    node = int(os.environ.get("DEADPOOL_NODE", "0"))
    setup_logging(f"node{node}.local{local}")  # its training rank changes with promotions: the event log has it
    log = EventLog(RunDir(run_dir).events, background=True, node=node, local=local)   # never holds a step
    if os.environ.get(RUN_ENV):
        log.base["run"] = os.environ[RUN_ENV]
    from ..process import children

    children.install()   # its children (loader workers) hold none of the agent's fds and die with it
    client = AgentClient.connect(None, bytes.fromhex(os.environ["DEADPOOL_JOB_SECRET"]), local,
                                 timeout=min(60.0, cfg.timeouts.startup_timeout), on_lost=lambda *_: os._exit(1))
    log.emit("hello", role="trainer", **identity())
    import torch

    torch.set_num_threads(int(os.environ.get("DEADPOOL_THREADS", "1")))
    from ..dataplane.backend import CUDA_UNUSABLE_EXIT, DeviceUnusable
    from ..dataplane.groups import GenerationGroups
    from .context import Context

    code = 0
    ctx = None
    try:
        backend, device = bind_device(cfg, local, log, node)
        groups = GenerationGroups(backend, cfg.timeouts.wait_timeout, cfg.timeouts.rendezvous_timeout, device=device)
        ctx = Context(cfg, client, groups, log, node, local, backend=backend)
        # how collectives are waited on: polled on gloo (None), the collective watchdog on NCCL (dataplane/watchdog.py)
        from ..dataplane.watchdog import waiter_for

        ctx.watch.waiter = waiter_for(backend, ctx.watch.failure, ctx.watch.timeout, groups.abort_all,
                                      lambda: groups.generation)
        load_train_fn(cfg.train.train_fn)(ctx)
        code = ctx.exit_code
    except DeviceUnusable as exc:  # its CUDA context died with an NCCL abort: this node's loss, not the job's end
        code = CUDA_UNUSABLE_EXIT
        log.emit("device_unusable", error=str(exc)[:2000])
        print(f"deadpool: {exc}; exiting with {CUDA_UNUSABLE_EXIT}", file=sys.stderr, flush=True)
    except BaseException as exc:  # report, ask the agent to end the job (or, at start-up, fail this node), leave
        error = f"{type(exc).__name__}: {exc}"
        if ctx is None or (not ctx.attached and ctx.refusal is None):
            # before this process reached ctx.run (importing the user's module, building the model): a failure of this
            # node like any other, replaced by a spare (its agent sees the exit: cause startup_failed). What ctx.protect
            # refuses is the same on every node: that still ends the job at once, below.
            code = STARTUP_FAILED_EXIT
            log.emit("startup_failed", error=error[:2000], traceback=traceback.format_exc()[-4000:])
        else:
            code = 1
            log.emit("error", error=error, traceback=traceback.format_exc()[-4000:])
            try:
                client.send(AbortAsk.KIND, AbortAsk(error[:2000]).to_wire())
            except Exception:  # noqa: BLE001 - the agent is gone: nothing to tell
                pass
    log.sync()
    os._exit(code)


if __name__ == "__main__":
    main()
