"""Control-plane probe: a node agent's control plane with no training processes, for the scale study (issue 8).

``python -m study.probe OUT_DIR --active N [--watch-k K] [--window S] ...``, one per MPI rank under mpiexec
(benchmarks/control_plane_scale.py starts it) or srun (sbatch/scaling.sbatch), with the checkout on PYTHONPATH.
Each probe is what a node agent is to the rest of the job, minus its training processes: the same ControlPlane
(heartbeats on the ring, tree dissemination, agreement rounds through the lowest live agent, fencing of the
decision's failed nodes) and the same ring link (agent/ringlink.py: a crashed agent is seen at once through its
closed socket). Its recovery report says it holds step 0 of its own rank and of the ranks it is a replica holder
for, so ``decide`` plans a real hot swap.

It writes, under OUT_DIR (JSON, one file per MPI rank and phase):

- ``steady-R.json``: over ``--window`` seconds of a failure-free run: control messages sent and received per
  second (heartbeats included) and this process's CPU seconds per second (all its threads);
- ``recovery-R-G.json`` for each decision applied (generation G): wall times at which this agent first knew of
  each failed node (``knew``) and applied the decision (``applied``), the coordinator's ``t_decided``, and the CPU
  seconds this process spent in the recovery (``recovery_cpu_s``).

- ``fault-crash.json`` / ``fault-freeze.json``: the wall time at which agent ``--crash`` SIGKILLed itself (``--gap``
  seconds after the window) and agent ``--freeze`` SIGSTOPped itself (``--gap`` seconds after the crash's
  recovery): the faults are injected by the probes themselves, so any launcher (mpiexec, srun) runs the study.

It exits ``--exit-after`` seconds after the last fault's recovery, when ``OUT_DIR/stop`` appears, or after
``--lifetime`` seconds. Environment: ``DEADPOOL_JOB_SECRET`` (hex).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time


def _write(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)  # the harness never reads a half-written file


def _ring(sock) -> None:
    try:
        sock.send(b"!")
    except OSError:  # full: the main thread is awake already
        pass


def _drain(sock) -> None:
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass


_KILLER = """import os, signal, sys, time
fd = os.pidfd_open(int(sys.argv[1]))
time.sleep(float(sys.argv[2]))
try:
    signal.pidfd_send_signal(fd, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def _fault(out_dir: str, name: str, rank: int, sig, **extra) -> None:
    """Record the fault (its wall time is what the study times from), then inject it into this very process."""
    if "killer_pid" in extra:
        time.sleep(0.2)  # the killer child has opened its pidfd of this process by then
    _write(os.path.join(out_dir, f"fault-{name}.json"), {"fault": name, "rank": rank, "t": time.time(),
                                                           "signal": signal.Signals(sig).name, **extra})
    os.kill(os.getpid(), sig)


def _thread_cpu(tid: int) -> float:
    """CPU seconds of thread ``tid`` of this process so far (Linux schedstat; 0.0 where unavailable)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as fh:
            return int(fh.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _report(cp) -> dict:
    """{virtual process: Report} (control/messages.py) for this probe's one process: it holds step 0 of its own rank
    and of the ranks it is a replica holder of."""
    from deadpool_hpc.control.messages import Report
    from deadpool_hpc.placement import held_by

    m = cp.me  # one virtual process per node (P = 1)
    if m not in cp.assignment:
        return {m: Report(own_rank=None, own=(), held={}, done_step=-1)}
    r = cp.assignment.index(m)
    held = {h: (0,) for h in held_by(r, 1, len(cp.assignment), cp.replicas)} if cp.replicas else {}
    return {m: Report(own_rank=r, own=(0,), held=held, done_step=0)}


def main(argv=None) -> None:
    from deadpool_hpc.config import RunConfig

    ap = argparse.ArgumentParser(prog="python -m study.probe")
    ap.add_argument("out_dir")
    ap.add_argument("--active", type=int, required=True, help="active nodes; the other MPI ranks are spares")
    ap.add_argument("--watch-k", type=int, default=2, help="agents watching each agent (0: all-to-all)")
    ap.add_argument("--period", type=float, default=RunConfig().timeouts.heartbeat_period, help="heartbeat period, seconds")
    ap.add_argument("--deadline", type=float, default=RunConfig().timeouts.heartbeat_deadline, help="heartbeat deadline, seconds")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds after start-up before the steady window")
    ap.add_argument("--window", type=float, default=10.0, help="steady-state window, seconds")
    ap.add_argument("--lifetime", type=float, default=600.0, help="exit after this many seconds whatever happens")
    ap.add_argument("--crash", type=int, help="MPI rank that SIGKILLs itself --gap seconds after the window")
    ap.add_argument("--freeze", type=int, help="MPI rank that SIGSTOPs itself --gap seconds after the crash's "
                                               "recovery (it is SIGKILLed --freeze-for seconds later)")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds before each fault")
    ap.add_argument("--freeze-for", type=float, default=30.0)
    ap.add_argument("--exit-after", type=float, default=5.0,
                    help="seconds after the last fault's recovery that a probe leaves (0: wait for OUT_DIR/stop)")
    a = ap.parse_args(argv)
    secret = bytes.fromhex(os.environ["DEADPOOL_JOB_SECRET"])
    from deadpool_hpc.agent.ringlink import RingLink
    from deadpool_hpc.control.messages import Finished
    from deadpool_hpc.control.plane import ControlPlane
    from deadpool_hpc.errors import RunFinished
    from deadpool_hpc.events import EventLog
    from deadpool_hpc.hostaddr import store_host

    log = EventLog(os.path.join(a.out_dir, "events.jsonl"))
    host = store_host()  # the address other nodes reach this one at (a node agent's too)
    ring_link = RingLink(-1, secret, host)
    cp = ControlPlane(secret=secret, ranks_per_node=1, active_nodes=a.active, period=a.period, deadline=a.deadline,
                      log=log, ready_timeout=30.0, recovery_timeout=120.0, replicas=1, watch_k=a.watch_k,
                      extra_identity={"watch": ring_link.address}, host=host)
    ring_link.me = cp.me
    log.base.update(mpi_rank=cp.me, node=cp.me)
    addresses = {n: ident["watch"] for n, ident in enumerate(cp.idents)}
    t_window = float(cp.bcast_text(f"{time.time() + a.warmup:.6f}" if cp.me == 0 else None))
    bell_r, bell_w = socket.socketpair()
    for sock in (bell_r, bell_w):
        sock.setblocking(False)
    cp.peers.on_notice = lambda: _ring(bell_w)

    def wait(seconds: float) -> None:
        """Sleep until a control message needs the main thread (on_notice), a watched agent's socket has news, or
        ``seconds`` passed, then act on the watch (the node agent's loop does the same through its channel)."""
        try:
            select.select([bell_r, ring_link.listener, *ring_link.links], [], [], seconds)
        except (OSError, ValueError):
            pass
        _drain(bell_r)
        cp.pump(0)
        for lost in ring_link.poll():
            if cp.finished() is None:  # after the study, agents leave on purpose
                cp.peers.suspect(lost, "its agent's watch connection closed (the process is gone)")
    cp.start()
    ring_link.retarget(cp.peers.alive(), addresses)
    end_of_life = time.monotonic() + a.lifetime
    stop = os.path.join(a.out_dir, "stop")
    steady_done = False
    c0 = None
    last_stat = 0.0
    applied: dict[int, float] = {}  # generation -> wall time this probe applied it
    faults = sum(x is not None for x in (a.crash, a.freeze))
    try:
        while time.monotonic() < end_of_life:
            now = time.time()
            if cp.me == a.crash and steady_done and now >= t_window + a.window + a.gap:
                _fault(a.out_dir, "crash", cp.me, signal.SIGKILL)
            if cp.me == a.freeze and (applied.get(1) or 0) and now >= applied[1] + a.gap:
                # the process stops itself; a child ends it later (a stopped process cannot), so a Slurm step
                # ends too. The child holds a pidfd of this process: its SIGKILL can never hit a reused pid
                killer = subprocess.Popen([sys.executable, "-c", _KILLER, str(os.getpid()), str(a.freeze_for)])
                _fault(a.out_dir, "freeze", cp.me, signal.SIGSTOP, killer_pid=killer.pid)
            if a.exit_after and faults and len(applied) >= faults and now >= applied[max(applied)] + a.exit_after:
                # all leave now: a probe that left alone would be seen leaving (its watch socket closes) and
                # recovered; the others get the notice before this one's sockets close
                cp.finish(Finished())   # the study is done
                cp.wait_sends(1.0)
                time.sleep(0.5)
                break
            if cp.finished() is not None:
                break
            if not steady_done and c0 is None and now >= t_window:
                c0 = (now, time.process_time(), cp.peers.sent, cp.peers.received)
            elif c0 is not None and not steady_done and now >= c0[0] + a.window:
                dt = now - c0[0]
                _write(os.path.join(a.out_dir, f"steady-{cp.me}.json"), {
                    "mpi_rank": cp.me, "pid": os.getpid(), "size": cp.size, "watch_k": a.watch_k, "window_s": dt,
                    "sent_per_s": (cp.peers.sent - c0[2]) / dt, "received_per_s": (cp.peers.received - c0[3]) / dt,
                    "cpu_per_s": (time.process_time() - c0[1]) / dt, "suspected": sorted(cp.peers.suspected)})
                steady_done = True
            wait(0.5)
            if cp.failure.is_set():
                cpu0, a0 = time.process_time(), _thread_cpu(cp.peers.native_id)
                n0 = (cp.peers.passes, cp.peers.mpi_polls, cp.peers.sent, cp.peers.received)
                try:
                    decision = cp.recover(_report(cp), wait=wait)
                except RunFinished:
                    break
                cpu, agent_cpu = time.process_time() - cpu0, _thread_cpu(cp.peers.native_id) - a0
                with cp.peers.lock:
                    knew = {str(n): t for n, t in cp.peers.suspected.items()}
                applied[decision.generation] = time.time()
                _write(os.path.join(a.out_dir, f"recovery-{cp.me}-{decision.generation}.json"), {
                    "mpi_rank": cp.me, "generation": decision.generation, "applied": time.time(), "knew": knew,
                    "t_decided": decision.t_decided, "recovery_cpu_s": cpu, "agent_thread_cpu_s": agent_cpu,
                    "agent_passes": cp.peers.passes - n0[0], "mpi_polls": cp.peers.mpi_polls - n0[1],
                    "sent": cp.peers.sent - n0[2], "received": cp.peers.received - n0[3], "coordinator": decision.coordinator,
                    "failed_nodes": list(decision.failed_nodes), "promoted": decision.promoted})
                ring_link.retarget(cp.peers.alive(), addresses)
            if time.monotonic() - last_stat > 0.5:
                last_stat = time.monotonic()
                if os.path.exists(stop):
                    break
    except Exception as exc:  # a probe that fails says why, then leaves like an agent (no MPI_Finalize)
        log.emit("error", error=f"{type(exc).__name__}: {exc}")
        print(f"probe {cp.me}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        cp.exit(1)
    ring_link.close()
    cp.exit(0)


if __name__ == "__main__":
    main()
