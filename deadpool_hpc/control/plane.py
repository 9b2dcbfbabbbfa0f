"""The control plane: MPI bootstrap, failure detection and agreement for one process.

Owns: MPI initialisation (MPI_THREAD_MULTIPLE), the identity exchange used for fencing, the
heartbeat agent (agent.py), the recovery agreement and the survivors' communicator, built each
generation with ``MPI_Comm_create_group`` (only survivors call it, so the dead cannot block it).
It does not own process groups, replicas or training state: the worker passes it a report and a
callback that hosts the next generation's store, and applies the decision it returns.

Agreement (DESIGN.md "Recovery"): every live process that leaves a generation sends ``ready`` with
its report to the coordinator, the lowest-ranked live process. Once every live process has
reported and no new suspicion arrived for ``settle`` seconds, the coordinator runs
``agreement.decide``, hosts the new generation's store, and sends ``decision`` to every member. If
the coordinator itself is suspected meanwhile, the next lowest takes over and members re-send.
Members then build the survivors' communicator and check, with a non-blocking allreduce, that all
hold the same decision.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

from ..errors import JobAborted
from . import fence as fencing
from . import pmi_relay
from .agent import Agent
from .agreement import decide

_HELLO_BYTES = 512


def _mpi():
    import mpi4py

    # Measured with the MPICH wheel's UCX netmod: a rendezvous transfer whose sender dies kills the
    # receiver (cross-memory attach: "process_vm_readv ... No such process", then SIGTERM; without
    # cma, a segfault in the next send). Replica payloads are small per rank, so send every
    # message eagerly: a dead sender then leaves a receive that never completes, which we abandon.
    os.environ.setdefault("UCX_RNDV_THRESH", "inf")
    pmi_relay.install()  # under srun: keeps every PMI-1 request within Slurm's 1024-byte read (pmi_relay.py)
    mpi4py.rc.thread_level = "multiple"
    mpi4py.rc.finalize = False  # survivors exit with os._exit; MPI_Finalize with dead peers may hang
    from mpi4py import MPI

    return MPI


class ControlPlane:
    """One process's view of the job's membership.

    ranks_per_node / active_nodes / spare_nodes describe the initial layout (MPI rank m lives on
    emulated node m // ranks_per_node). ``log`` is an EventLog.
    """

    def __init__(self, *, secret: bytes, ranks_per_node: int, active_nodes: int, period: float,
                 deadline: float, log, settle: float = 0.02):
        MPI = _mpi()
        self.MPI = MPI
        world = MPI.COMM_WORLD
        self.world = world
        self.me = world.Get_rank()
        self.size = world.Get_size()
        self.P = ranks_per_node
        self.log = log
        self.secret = secret
        self.settle = settle
        for c in (MPI.COMM_SELF, world):
            c.Set_errhandler(MPI.ERRORS_RETURN)
        self.ctrl = world.Dup()
        self.repl = world.Dup()
        for c in (self.ctrl, self.repl):
            c.Set_errhandler(MPI.ERRORS_RETURN)
        self.generation = 0
        W = active_nodes * ranks_per_node
        self.assignment = list(range(W))
        self.spare_nodes = list(range(active_nodes, self.size // ranks_per_node))
        self.members = list(range(self.size))
        self.idents = self._exchange_identities()
        self._wire_up()
        self.survivors = world
        self._ready: dict[int, dict[int, dict]] = {}
        self._decisions: dict[int, tuple[int, dict]] = {}
        self._finish: dict | None = None
        self._abort: dict | None = None
        self.first_suspicion: float | None = None
        log.emit("hello", mpi_rank=self.me, node=self.me // ranks_per_node, **self.idents[self.me])
        self.agent = Agent(self.ctrl, secret, period, deadline, on_suspect=self._on_suspect)
        self.agent.on_preempt = self._on_preempt

    def start(self) -> None:
        """Start the agent. From here on only the agent thread calls MPI (see agent.py)."""
        self.world.Barrier()
        self.agent._last_seen = {p: time.monotonic() for p in self.agent._last_seen}
        self.agent.start()

    # ---- bootstrap ------------------------------------------------------------------------
    def _exchange_identities(self) -> list[dict]:
        mine = json.dumps(fencing.identity()).encode().ljust(_HELLO_BYTES, b" ")
        out = np.empty(_HELLO_BYTES * self.size, dtype=np.uint8)
        self.world.Allgather(np.frombuffer(mine, dtype=np.uint8), out)
        return [json.loads(out[i * _HELLO_BYTES:(i + 1) * _HELLO_BYTES].tobytes()) for i in range(self.size)]

    def _wire_up(self) -> None:
        """Connect every pair of processes at start-up, so no connection is made mid-recovery."""
        MPI = self.MPI
        for comm in (self.world, self.ctrl, self.repl):
            out = np.zeros(self.size, dtype=np.uint8)
            back = np.empty(self.size, dtype=np.uint8)
            reqs = []
            for p in range(self.size):
                if p != self.me:
                    reqs.append(comm.Irecv(back[p:p + 1], source=p, tag=3))
                    reqs.append(comm.Isend(out[p:p + 1], dest=p, tag=3))
            MPI.Request.Waitall(reqs)

    def bcast_text(self, text: str | None, root: int = 0) -> str:
        """Broadcast a short text from ``root`` before ``start`` (all processes alive). No pickle."""
        buf = np.zeros(1024, dtype=np.uint8)
        if self.me == root:
            raw = text.encode()
            buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        self.world.Bcast(buf, root=root)
        return buf.tobytes().rstrip(b"\0").decode()

    # ---- roles ----------------------------------------------------------------------------
    @property
    def train_rank(self) -> int | None:
        """Training rank this process holds now, or None while it is a spare."""
        try:
            return self.assignment.index(self.me)
        except ValueError:
            return None

    @property
    def failure(self):
        """threading.Event set when a peer is suspected or a peer tears the generation down."""
        return self.agent.failure

    def _on_suspect(self, rank: int, reason: str, t: float) -> None:
        if self.first_suspicion is None:
            self.first_suspicion = t
        self.log.emit("suspect", t=t, generation=self.generation, suspect=rank, node=rank // self.P, reason=reason)

    def _on_preempt(self, source: int) -> None:
        if source == self.me:  # the processes that got the signal say so; the others just follow
            self.log.emit("preempt_requested", generation=self.generation)

    # ---- inbox ----------------------------------------------------------------------------
    def pump(self, timeout: float = 0.0) -> None:
        """Move messages from the agent's inbox into per-kind tables. Raises JobAborted on ``abort``."""
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, src, body = self.agent.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if kind == "ready":
                self._ready.setdefault(int(body["g"]), {})[src] = body["report"]
            elif kind == "decision":
                self._decisions[int(body["generation"])] = (src, body)
            elif kind == "finish":
                self._finish = body
            elif kind == "abort":
                self._abort = body
            timeout = 0.0
            deadline = time.monotonic()
        if self._abort is not None:
            raise JobAborted(f"rank {self._abort.get('mpi_rank')} aborted the job: {self._abort.get('error')}")

    def finished(self) -> dict | None:
        self.pump()
        return self._finish

    def finish(self, body: dict) -> None:
        """Tell every live process the run is over (they exit without recovering)."""
        self.agent.stop_watching()
        self.agent.broadcast("finish", body)
        self._finish = body

    def abort(self, error: str) -> None:
        self.agent.stop_watching()
        self.agent.broadcast("abort", {"error": error, "mpi_rank": self.me})

    def wait_sends(self, timeout: float = 2.0) -> None:
        """Give queued sends a moment to leave before the process exits."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self.agent.sends_done():
            time.sleep(0.01)

    # ---- recovery -------------------------------------------------------------------------
    def recover(self, report: dict, host_store) -> dict:
        """Agree on the next generation. Called by every live process after leaving the current one.

        report: this process's {"own", "held", "done_step"} (see agreement.decide).
        host_store(): () -> [host, port] of a fresh TCPStore served by this process; called only on
        the coordinator. Returns the decision dict (agreement.decide's keys plus "store",
        "coordinator", "t_decided"). Raises ReplicaError from ``decide`` (after
        telling the other members), JobAborted if another process aborted.
        """
        g = self.generation + 1
        self.agent.failure.set()
        self.agent.broadcast("teardown", {"g": self.generation})
        sent_to = None
        while True:
            self.pump(0.005)
            if g in self._decisions:
                src, decision = self._decisions[g]
                if not self.agent.is_suspected(src):
                    break
            alive = self.agent.alive()
            coord = alive[0]
            if coord == self.me:
                decision = self._coordinate(g, report, alive, host_store)
                if decision is not None:
                    break
            elif sent_to != coord:
                self.agent.send(coord, "ready", {"g": g, "report": report})
                sent_to = coord
        if "error" in decision:
            raise _error_from(decision)
        self._apply(decision)
        return decision

    def _coordinate(self, g: int, report: dict, alive: list[int], host_store) -> dict | None:
        ready = self._ready.setdefault(g, {})
        ready[self.me] = report
        if any(p not in ready for p in alive):
            return None
        if time.monotonic() - self.agent.last_suspicion < self.settle:
            return None
        failed = {m for m in range(self.size) if self.agent.is_suspected(m)}
        reports = {m: ready[m] for m in alive}
        try:
            decision = decide(generation=g, ranks_per_node=self.P, assignment=self.assignment,
                              spare_nodes=self.spare_nodes, failed=failed, reports=reports,
                              preempt=self.agent.preempted.is_set())
        except Exception as exc:  # tell everybody, then raise the same error everywhere
            decision = {"generation": g, "error": type(exc).__name__, "message": str(exc), "members": alive}
        else:
            decision["store"] = host_store()
        decision["coordinator"] = self.me
        decision["t_decided"] = time.time()
        for m in decision["members"]:
            self.agent.send(m, "decision", decision)
        return decision

    def _apply(self, decision: dict) -> None:
        g = decision["generation"]
        for m in decision["fenced"]:
            self.agent.suspect(m, "fenced by decision", notify=False)
            fencing.fence(self.idents[m])
        self.assignment = list(decision["assignment"])
        self.spare_nodes = list(decision["spare_nodes"])
        self.members = list(decision["members"])
        self.survivors = self.agent.call(self._create_group, self.members, 1000 + g)
        self._check_agreement(decision)
        self.generation = g
        self.agent.generation = g
        self.first_suspicion = None
        self.agent.failure.clear()
        # a suspicion raised after the decision belongs to the next generation (a preemption waits for
        # the next step boundary: Context._one_step)
        if any(self.agent.is_suspected(m) for m in self.members):
            self.agent.failure.set()
        self._ready = {k: v for k, v in self._ready.items() if k > g}

    def _create_group(self, members: list[int], tag: int):
        # MPI_Comm_create_group: collective over the members only, so the dead cannot block it
        return self.ctrl.Create_group(self.ctrl.Get_group().Incl(members), tag=tag)

    def _check_agreement(self, decision: dict, timeout: float = 30.0) -> None:
        keys = ("generation", "assignment", "cut_step", "members", "store")
        digest = hashlib.sha256(json.dumps({k: decision[k] for k in keys}, sort_keys=True).encode()).digest()
        mine = np.frombuffer(digest[:8], dtype=np.int64).copy()
        lo, hi = np.empty_like(mine), np.empty_like(mine)
        MPI, comm = self.MPI, self.survivors
        reqs = self.agent.call(lambda: [comm.Iallreduce(mine, lo, op=MPI.MIN), comm.Iallreduce(mine, hi, op=MPI.MAX)])
        end = time.monotonic() + timeout
        while not self.agent.call(lambda: all([r.Test() for r in reqs])):
            if time.monotonic() > end:
                raise RuntimeError("agreement check did not complete: a member died during recovery")
            time.sleep(0.001)
        if lo[0] != mine[0] or hi[0] != mine[0]:
            raise RuntimeError(f"members hold different decisions for generation {decision['generation']}")

    def barrier(self, timeout: float = 120.0) -> None:
        """Non-blocking barrier over the survivors' communicator, polled (raises on timeout)."""
        comm = self.survivors
        req = self.agent.call(comm.Ibarrier)
        end = time.monotonic() + timeout
        while not self.agent.call(req.Test):
            if time.monotonic() > end:
                raise RuntimeError("survivors' barrier did not complete: a member died")
            time.sleep(0.002)

    def exit(self, code: int = 0) -> None:
        """Leave without MPI_Finalize (peers may be dead); flush the event log first."""
        self.agent.stop()
        os._exit(code)


def _error_from(decision: dict) -> Exception:
    from .. import errors

    cls = getattr(errors, decision["error"], RuntimeError)
    return cls(decision["message"])
