"""Node agent entry point: ``python -m deadpool_hpc.agent RUN_DIR``, one per node (the node's only MPI process).

Started by the local launcher (mpiexec, one hydra proxy per emulated node, ``-ppn 1``), by ``srun
--ntasks-per-node=1`` under Slurm (sbatch/train.sbatch, through the task wrapper), or by a submitit task. Reads
``RUN_DIR/config.json`` and the per-job secret (``DEADPOOL_JOB_SECRET``, hex), starts the control plane, spawns
the node's training processes, and serves them (agent/node.py) until the run ends for this node; exits without
MPI_Finalize, with 0 (done), 75 (checkpoint saved: requeue me), 4 (a crash loop stopped the run, its checkpoint
saved: errors.CRASH_LOOP_EXIT, never requeued) or 1.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import traceback
from ..rundir import RunDir

# Slurm's "save and leave" signals reach the agent (the task the step started): SIGUSR2 (``--signal=USR2@SECONDS``,
# submitit's convention, passed on by sbatch/train.sbatch when it reaches the batch shell) and SIGTERM (preemption
# with a grace time, ``scancel``, the time limit: SIGTERM, then SIGKILL after KillWait). Both mean: agree on a cut
# step, save a persistent checkpoint there, exit 75. Whether the job is then requeued (the job goes on) or ends
# (a cancelled job) is the launcher's decision (docs/slurm.md, "Signals"). Training processes ignore both.
STOP_SIGNALS = ("SIGUSR2", "SIGTERM")
_signalled = {"stop": False, "peers": None}  # a signal may come before the control plane exists


def _on_stop_signal(sig, _frame) -> None:
    """Only stores flags (safe in a signal handler); the control thread (control/peers.py) acts on them."""
    _signalled["stop"] = True
    _signalled["name"] = signal.Signals(sig).name
    if _signalled["peers"] is not None:
        _signalled["peers"].preempt_by = _signalled["name"]
        _signalled["peers"].request_preempt()


def main(argv=None) -> None:
    from ..process.malloc import cap_malloc_arenas

    cap_malloc_arenas()
    stop = {getattr(signal, name) for name in STOP_SIGNALS}
    for sig in stop:  # first: the default action of both would kill the agent
        signal.signal(sig, _on_stop_signal)
        signal.siginterrupt(sig, False)  # SA_RESTART: a system call of another thread must not fail EINTR
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)  # the task wrapper spawns us with them blocked
    argv = sys.argv[1:] if argv is None else argv
    joining = "--join" in argv[1:]   # a replacement node from a companion job (control/joining.py)
    if joining:   # its SIGTERM (its companion job cancelled) ends this node, never the job's preemption
        for sig in stop:
            signal.signal(sig, lambda *_: os._exit(143))
    from ..logs import setup as setup_logging

    setup_logging("agent")
    run_dir = os.path.abspath(argv[0])
    events = RunDir(run_dir).events
    from ..process import lifeline

    line = lifeline.start(events)  # local launcher only: its death ends the run
    faulthandler.enable()  # a crash in native code leaves its Python stacks in the log
    from ..config import RunConfig

    with open(RunDir(run_dir).config) as fh:
        cfg = RunConfig.from_json(fh.read())
    # Start-up deadline: MPI_Init and the first collectives cannot time out, and a process lost meanwhile blocks
    # them for ever; mpi4py holds the GIL in MPI_Init, so no Python thread could act. faulthandler's watchdog is
    # a C thread: it prints every thread's stack to stderr and exits 1.
    if not joining:   # (a joining agent arms it once admitted: its wait for a free slot has no bound of its own)
        faulthandler.dump_traceback_later(cfg.timeouts.startup_timeout, exit=True)
    secret_hex = os.environ.get("DEADPOOL_JOB_SECRET", "")
    if len(secret_hex) < 32:
        sys.exit("DEADPOOL_JOB_SECRET is missing or shorter than 16 bytes (hex); the launcher sets it")
    secret = bytes.fromhex(secret_hex)
    from ..control.plane import ControlPlane
    from ..hostaddr import store_host
    from ..errors import Fenced
    from ..events import EventLog
    from ..faultinject.inject import NodeFaults, nic_down_env
    from .channel import ChannelServer
    from ..replica.transports import check_transport
    from .health import DetectorRunner, NodeInfo, load_detectors
    from .node import STARTUP_HEARTBEAT_DEADLINE_S, NodeAgent
    from .preflight import HealthCheck
    from .supervisor import Supervisor
    from .ringlink import RingLink
    from ..control.links import listen

    log = EventLog(events, background=True)   # a blocked write never holds the agent's loop (events.py)
    if os.environ.get(lifeline.RUN_ENV):  # in every line, hello included: a launcher reaps only its own run
        log.base["run"] = os.environ[lifeline.RUN_ENV]
    host = store_host()
    # Slurm's name for this node; not under the local launcher (lifeline: deadpool run), whose emulated nodes are
    # node<index> even inside a Slurm allocation (they would all inherit the same SLURMD_NODENAME)
    slurm_node = os.environ.get("SLURMD_NODENAME") if line is None else None
    slurm_job = os.environ.get("SLURM_JOB_ID") if line is None else None
    transport = check_transport(cfg.replication.replica_transport)  # replica/transports.py: tcp, unix or a plugin's
    listeners = [transport.listen(host) for _ in range(cfg.layout.ranks_per_node)]  # one replica server per local rank
    ring_link = RingLink(-1, secret, host)
    # --spare-floor: where replacement nodes ask to join and joined nodes re-attach (agent/joindesk.py)
    join_listener = listen(host) if cfg.replacement.spare_floor else None
    join_address = {"join": join_listener[1]} if join_listener is not None else {}
    channel = ChannelServer(secret, log=log)
    admission = None
    if joining:
        admission = _join(run_dir, cfg, secret, host, slurm_node, slurm_job, log,
                          {"replica": [transport.address(s) for s in listeners], "watch": ring_link.address,
                           "slurm_node": slurm_node, "companion_job": slurm_job, **join_address})
        faulthandler.dump_traceback_later(cfg.timeouts.startup_timeout, exit=True)
    cp = ControlPlane(secret=secret, ranks_per_node=cfg.layout.ranks_per_node, active_nodes=cfg.layout.nodes,
                      period=cfg.timeouts.heartbeat_period, deadline=cfg.timeouts.heartbeat_deadline, log=log,
                      ceiling=cfg.timeouts.heartbeat_ceiling,
                      ready_timeout=cfg.timeouts.ready_timeout, recovery_timeout=cfg.timeouts.recovery_timeout,
                      replicas=cfg.replication.replicas if cfg.replication.replicate else 0,
                      host=host, crash_loop_limit=cfg.comeback.crash_loop_limit,
                      extra_identity={"replica": [transport.address(s) for s in listeners], "watch": ring_link.address,
                                      "slurm_node": slurm_node, **join_address},
                      admission=admission)
    ring_link.me = cp.me
    setup_logging(f"node{cp.me}")
    log.base.update(mpi_rank=cp.me, node=cp.me)
    if line is not None:
        line.know(cp.idents, log)  # from now on a lost launcher takes every agent (and its node) with it
    _signalled["peers"] = cp.peers
    if _signalled["stop"]:
        cp.peers.preempt_by = _signalled.get("name")
        cp.peers.request_preempt()
    env = dict(os.environ, DEADPOOL_AGENT_SOCK=channel.name, DEADPOOL_NODE=str(cp.me))
    env.pop(lifeline.ENV, None)  # the agent watches the launcher; its training processes die with the agent
    faults_here = () if joining else cfg.internal.faults   # a joining node fires none of the tests' faults
    nic_down_env(faults_here, cp.me, env, log)   # a test's --nic-down: this node's data plane is down
    sup = Supervisor(run_dir, cfg.layout.ranks_per_node, env, cfg.timeouts.hang_timeout, channel.progress)
    code = 1
    check = agent = None
    try:
        # the last collective of the start-up (a barrier), then heartbeats: from here on a node lost is seen by the
        # others and recovered. The barrier comes before the import of torch below: a node lost during that import
        # would otherwise leave every other agent in the barrier until the start-up deadline
        cp.peers.deadline = max(cfg.timeouts.heartbeat_deadline, STARTUP_HEARTBEAT_DEADLINE_S)   # (node.py says why)
        cp.start()
        faulthandler.cancel_dump_traceback_later()  # every wait from here on has its own deadline
        sup.start()
        check = HealthCheck(cfg.preflight.health_check, env, os.path.join(run_dir, f"health-check-node{cp.me}.log")) \
            if cfg.preflight.health_check and not joining else None   # the site's check runs while the processes start
        #  (a joining node's ran before it asked: launch/companion.py)
        faults = NodeFaults(faults_here, node=cp.me, log=log,
                            pids=lambda: {lo: p.pid for lo, p in sup.procs.items()},
                            rank_local=lambda r: next((lo for lo in range(cfg.layout.ranks_per_node)
                                                       if cp.train_rank(lo) == r), None),
                            tell_local=lambda kind, body: [channel.send(lo, kind, body)
                                                           for lo in range(cfg.layout.ranks_per_node)])
        faults.at_phase("startup", 1)  # a fault test's node lost here: its training processes were just spawned
        # torch and torch.distributed.checkpoint, for the one thing the agent needs them for: writing a checkpoint
        # (every --persist-every seconds; on SIGTERM/SIGUSR2 or with no spare left). Under srun, a save on SIGTERM
        # must fit in KillWait (5 s on the emulated cluster; five agents importing torch at that moment took 4.1 s
        # of it): imported now, once the training processes are spawned, so they do not wait for it. The local
        # launcher's nodes share one machine's cores, and an agent importing torch there (1.5-2 CPU-s) delays every
        # node's first step (2 cores, 3 + 2 nodes, 1 step, median of 3: 12.4 s and 23 CPU-s with it, 8.0 s and
        # 14 CPU-s without); nothing bounds a save's time there, so its first write imports it
        # (persist.save_shard). Nothing else in the agent uses torch.
        if line is None:
            import torch.distributed.checkpoint  # noqa: F401
        # the node's health detectors (plugins): a factory that fails ends the run here, at start-up, by name
        detectors = load_detectors(NodeInfo(node=cp.me, hostname=socket.gethostname(), slurm_node=slurm_node,
                                            slurm_job_id=slurm_job, run_dir=run_dir))
        agent = NodeAgent(cfg, cp, channel, sup, ring_link, listeners, log, faults, transport=transport,
                          joined=None if admission is None else {"job_id": slurm_job or "",
                                                                 "t_asked": admission.t_asked,
                                                                 "resume": admission.admit.resume},
                          join_listener=join_listener)
        agent.health_check = check
        agent.health = DetectorRunner(detectors, log, wake=channel.wake).start()
        code = agent.run()
    except Fenced as exc:  # this node failed, or the others declared it failed: they go on without it
        log.emit("fenced", error=str(exc))
    except BaseException as exc:  # report, tell the others, leave
        log.emit("error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        cp.abort(f"{type(exc).__name__}: {exc}")
    finally:
        check = agent.health_check if agent is not None else check   # (an idle spare re-runs it)
        if check is not None and check.result is None:
            check.kill()   # the site's check must not outlive its node's agent
        sup.kill_all(2.0)
        if agent is not None and agent.metrics is not None:
            log.sync()              # its own last lines (a checkpoint persisted) on disk, for the job's view
            agent.metrics.close()   # the textfiles once more (the run's end in them), the endpoints closed
        if cp.peers.is_alive():
            log.emit("heartbeat_stats", **cp.peers.heartbeat_stats())
        log.sync()
        cp.exit(code)


def _join(run_dir, cfg, secret, host, slurm_node, slurm_job, log, extra):
    """(a replacement node) Ask the running job to admit this node (control/joining.py ``request``; waits as long
    as the main job runs). Returns its joining.Admission (the ControlPlane's ``admission``); exits 3 when it is
    refused for good."""
    import time

    from ..control import joining
    from ..control.links import Link
    from ..control.waker import Waker
    from ..process import fence as fencing

    t0 = time.time()
    waker = Waker(host, secret)
    ident = {**fencing.identity(), **extra, "wake": waker.address, "hb": waker.hb_address}
    log.emit("join_requested", host=slurm_node or socket.gethostname(), job_id=slurm_job)
    try:
        sock, admit, idents, rest = joining.request(run_dir, secret, slurm_node or socket.gethostname(),
                                                    slurm_job or "", ident, timeout=float("inf"), log=log)
    except joining.JoinFailed as exc:
        log.emit("join_failed", error=str(exc)[:300], job_id=slurm_job)
        log.sync()
        sys.exit(3)
    return joining.Admission(admit=admit, link=Link(sock, secret, node=admit.coordinator, rest=rest), waker=waker,
                             identity=ident, idents=idents, t_asked=t0)


if __name__ == "__main__":
    main()
