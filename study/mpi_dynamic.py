"""MPI dynamic processes study: can a process of another Slurm allocation join the agents' MPI world?

``python -m study.mpi_dynamic OUT_DIR [--runs 5] [--repeat 3] [--tcp] [--scenarios a,b,...]`` on a machine with a Slurm
cluster (the local one: ``bash scripts/slurm-local-cluster.sh up 5``), from the checkout. For each scenario it
submits job A (``sbatch -N2 -n3``, ranks started by ``srun --no-kill --kill-on-bad-exit=0 --mpi=pmi2``, as the
agents are) and one or more jobs B (``sbatch -N1 -n1`` on a node A does not use, the "newcomer"), waits for the
files their ranks write under ``OUT_DIR/<scenario>/<run>/``, cancels every job it submitted (by id) and prints one table
row per scenario. The ranks import MPI as an agent does (control/mpi.py: ``import_mpi``, MPI_THREAD_MULTIPLE).

The handshake (MPI-2 dynamic processes, MPI 5.0 section 11.8): A's rank 0 calls ``MPI_Open_port`` and writes the
port name to ``port.json`` in that directory (a shared directory: not a secret, anyone who reads it may connect); every
rank of A calls ``MPI_Comm_accept`` (collective over A's communicator, in a thread, so the main thread can watch a
deadline); B reads the file and calls ``MPI_Comm_connect``; both sides ``MPI_Intercomm_merge`` (A low, B high) into
one intracommunicator, exchange point-to-point messages and ``MPI_Comm_disconnect``.

Scenarios (``--scenarios``, default all):

- ``basic``: ``--runs`` newcomers, one Slurm job each, join the same job A one after another. B's clocks: connect,
  merge, a round trip to each member over the merged communicator (median over the runs).
- ``tcp``: the same with ``UCX_TLS=tcp`` (the path between real machines; UCX would otherwise use shared memory
  between the emulated nodes, which share one kernel).
- ``killed_before``: B SIGKILLs itself after reading the port, before connecting. A's accept has no timeout. The
  one way out MPI offers is another MPI process that connects to the port and disconnects: A's rank 0 starts such a
  *canceller* (a singleton, ``--cancel-after`` seconds) before it accepts, since its own other threads cannot call
  MPI while it accepts (measured). A's ranks tell it from a newcomer by the file it writes first.
- ``killed_during``: B SIGKILLs itself ``--kill-ms`` ms after starting ``MPI_Comm_connect`` (from a timer thread);
  one delay per repetition.
- ``killed_after_connect``: B SIGKILLs itself once ``MPI_Comm_connect`` returned, before the merge (a collective over
  the intercommunicator, like the disconnect).
- ``member_dead``: A's last rank SIGKILLs itself first; after 1 s (a heartbeat deadline) the survivors build their
  communicator with ``MPI_Comm_create_group`` (as notes/mpi-under-slurm.md did) and accept on it.
- ``newcomer_dies``: after the merge every process sends heartbeats (``Isend``/``Irecv`` + ``Test``, period 0.1 s,
  deadline 1 s) to every other over the merged communicator; B SIGKILLs itself after 1 s; A's members go on for 3 s
  (do their heartbeats to each other still flow? when do they suspect B?), then build a communicator without B
  (``MPI_Comm_create_group``) and run a barrier on it.
- ``member_dies``: no newcomer, for comparison: A's three ranks send each other the same heartbeats over the world
  srun made, and A's last rank SIGKILLs itself after 1 s (with ``--tcp``: does a peer's death over UCX's TCP
  transport hurt the survivors whether or not the peer joined dynamically?).
- ``session``: one rank: ``MPI_Session_init``, its process sets, ``MPI_Comm_create_from_group`` on ``mpi://WORLD``.

``--tcp`` sets ``UCX_TLS=tcp`` in every scenario; ``--repeat`` runs each failure scenario that many times.
In every failure scenario A's main thread keeps sending point-to-point pings among A's members (on a duplicate of
its communicator made before the accept) while the accept/merge thread is blocked: can the process go on?

Files per scenario: ``a-R.json`` (A's rank R: the stage its accept thread reached, times, pings), ``b-I.json``
(newcomer I: its clocks), ``fault.json`` (when the process that was killed died), ``cancel-0*`` (the canceller),
``slurm-*.out`` (with each process's timestamped stages), ``result.json``; ``OUT_DIR/table.json``: the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = ("basic", "tcp", "killed_before", "killed_during", "killed_after_connect", "member_dead",
             "newcomer_dies", "member_dies", "session")
TAG_PING, TAG_PONG, TAG_HB = 11, 12, 13
HB_PERIOD_S, HB_DEADLINE_S = 0.1, 1.0
SRUN = ["srun", "--no-kill", "--kill-on-bad-exit=0", "--mpi=pmi2"]
# Requests never completed (to a process that died or is blocked) and their buffers, kept for the process's life: a
# late message must land in memory that is still this request's, never in a freed buffer.
_ABANDONED: list = []


def _write(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)  # the harness never reads a half-written file


def _read(path: str) -> dict | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _say(who: str, msg: str) -> None:
    """A timestamped line on stdout (Slurm's output file): when a process aborts, its last line says how far it got."""
    print(f"{time.time():.3f} {who}: {msg}", flush=True)


def _die(d: str, who: str, **extra) -> None:
    _write(os.path.join(d, "fault.json"), {"who": who, "t": time.time(), **extra})
    os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------------------------- the ranks' side

def _ping_round(MPI, comm, deadline: float) -> dict:
    """Every process of intracommunicator ``comm`` pings every other (non-blocking, ``deadline`` seconds); returns
    {peer: round trip in ms or None}. Processes answer each other's pings while they wait for their own pongs."""
    import numpy as np

    me, n = comm.Get_rank(), comm.Get_size()
    peers = [p for p in range(n) if p != me]
    out, t0 = {}, {}
    inbuf = {p: np.zeros(1, dtype=np.float64) for p in peers}
    pongbuf = {p: np.zeros(1, dtype=np.float64) for p in peers}
    pings = {p: comm.Irecv(inbuf[p], source=p, tag=TAG_PING) for p in peers}
    pongs = {p: comm.Irecv(pongbuf[p], source=p, tag=TAG_PONG) for p in peers}
    keep = []
    for p in peers:
        t0[p] = time.perf_counter()
        keep.append(comm.Isend(np.array([t0[p]]), dest=p, tag=TAG_PING))  # the request holds its buffer
    answered = set()
    end = time.monotonic() + deadline
    while time.monotonic() < end and (len(out) < len(peers) or len(answered) < len(peers)):
        for p in peers:
            if p not in answered and pings[p].Test():
                answered.add(p)
                keep.append(comm.Isend(inbuf[p].copy(), dest=p, tag=TAG_PONG))
            if p not in out and pongs[p].Test():
                out[p] = round(1000 * (time.perf_counter() - t0[p]), 3)
        time.sleep(0.0005)
    _ABANDONED.append((pings, pongs, keep, inbuf, pongbuf))  # a request to a dead process never completes (MPICH)
    return {p: out.get(p) for p in peers}


def _heartbeats(MPI, comm, seconds: float, *, die_at: float | None = None, d: str = "", who: str = "newcomer") -> dict:
    """Heartbeats to every other process of ``comm`` every HB_PERIOD_S for ``seconds``; a peer silent for
    HB_DEADLINE_S is suspected (and no longer sent to). ``die_at``: monotonic time at which this process SIGKILLs
    itself. Returns {"heard": {peer: [wall times heard]}, "suspected": {peer: wall time}}."""
    import numpy as np

    me, n = comm.Get_rank(), comm.Get_size()
    peers = [p for p in range(n) if p != me]
    bufs = {p: np.zeros(1, dtype=np.float64) for p in peers}
    recv = {p: comm.Irecv(bufs[p], source=p, tag=TAG_HB) for p in peers}
    heard = {p: [] for p in peers}
    last = {p: time.time() for p in peers}
    suspected: dict = {}
    sends = []
    end = time.monotonic() + seconds
    next_send = time.monotonic()
    while time.monotonic() < end:
        now = time.monotonic()
        if die_at is not None and now >= die_at:
            _die(d, who, stage="heartbeats")
        if now >= next_send:
            for p in peers:
                if p not in suspected:
                    sends.append(comm.Isend(np.array([time.time()]), dest=p, tag=TAG_HB))
            next_send += HB_PERIOD_S
        sends = [r for r in sends if not r.Test()]
        for p in peers:
            if recv[p].Test():
                last[p] = time.time()
                heard[p].append(last[p])
                recv[p] = comm.Irecv(bufs[p], source=p, tag=TAG_HB)
            if p not in suspected and time.time() - last[p] > HB_DEADLINE_S:
                suspected[p] = time.time()
        time.sleep(0.005)
    _ABANDONED.append((recv, bufs, sends))
    return {"heard": heard, "suspected": suspected, "pending_sends": len(sends)}


def _side_a(MPI, a) -> None:
    world = MPI.COMM_WORLD
    wme, wn = world.Get_rank(), world.Get_size()
    rec: dict = {"world_rank": wme, "node": os.uname().nodename, "t_start": time.time()}
    comm = world
    world.Barrier()
    if a.scenario == "member_dead":
        if wme == wn - 1:
            _die(a.dir, "member", world_rank=wme)
        time.sleep(1.0)  # stands for the heartbeat deadline that tells the survivors
        t = time.perf_counter()
        comm = world.Create_group(world.Get_group().Excl([wn - 1]), tag=77)
        rec["create_group_ms"] = round(1000 * (time.perf_counter() - t), 2)
    if a.scenario == "member_dies":
        die_at = time.monotonic() + 1.0 if wme == wn - 1 else None
        rec["heartbeats"] = _heartbeats(MPI, world, 4.0, die_at=die_at, d=a.dir, who="member")
        _write(os.path.join(a.dir, f"a-{wme}.json"), rec)
        os._exit(0)
    me, n = comm.Get_rank(), comm.Get_size()
    rec.update(rank=me, size=n)
    side = comm.Dup()  # the main thread's pings among members while the accept thread is blocked
    port = MPI.Open_port() if me == 0 else ""
    if me == 0:
        _write(os.path.join(a.dir, "port.json"), {"port": port, "t": time.time()})
    runs = a.runs if a.scenario in ("basic", "tcp") else 1
    rec["joins"] = []
    for i in range(runs):
        state = {"stage": "accept", "t0": time.time()}

        def join() -> None:
            inter = comm.Accept(port, root=0)
            state["t_accepted"] = time.time()
            state["inter"] = inter
            if os.path.exists(cancel_file):  # the canceller, not a newcomer (it writes the file before connecting)
                state["stage"] = "cancelled"
                inter.Disconnect()
                state["stage"] = "cancelled+disconnected"
                state["t_cancel_done"] = time.time()
                return
            state["stage"] = "merge"
            merged = inter.Merge(high=False)
            state["t_merged"] = time.time()
            state["merged"] = merged
            state["stage"] = "merged"

        cancel_file = os.path.join(a.dir, f"cancel-{i}")
        canceller = None
        if me == 0 and a.scenario not in ("basic", "tcp"):
            canceller = _start_canceller(a, port, cancel_file)
        th = threading.Thread(target=join, daemon=True)
        th.start()
        pings_ok = pings_lost = rounds = 0
        longest = 0.0
        end = time.monotonic() + a.deadline
        while th.is_alive() and time.monotonic() < end:
            th.join(0.2)
            _say(f"A{me}", f"stage {state['stage']}")
            if a.scenario not in ("basic", "tcp") and n > 1:
                t = time.monotonic()
                rtt = _ping_round(MPI, side, 1.0)  # returns after 1 s at most unless an MPI call blocks
                longest = max(longest, time.monotonic() - t)
                rounds += 1
                pings_ok += sum(v is not None for v in rtt.values())
                pings_lost += sum(v is None for v in rtt.values())
        j = {"stage": state["stage"], "pings_ok_while_blocked": pings_ok, "pings_lost_while_blocked": pings_lost,
             "ping_rounds": rounds, "longest_ping_round_s": round(longest, 3)}
        if canceller is not None or a.scenario not in ("basic", "tcp"):
            _say(f"A{me}", f"deadline passed in stage {state['stage']}; waiting for the canceller")
            th.join(max(0.1, a.cancel_after + 5.0 - a.deadline))
            _say(f"A{me}", f"stage {state['stage']}")
            j["stage_after_canceller"] = state["stage"]
            j["cancelled"] = os.path.exists(cancel_file)
            if state.get("t_cancel_done"):
                j["cancel_s"] = round(state["t_cancel_done"] - _read(cancel_file)["t"], 3)
            if not th.is_alive() and n > 1:
                # a fresh communicator: requests abandoned on ``side`` while blocked would match these pings. Dup is
                # a collective: it hangs where a member is still blocked, so it runs in a thread with a deadline
                box: dict = {}
                dup = threading.Thread(target=lambda: box.update(c=comm.Dup()), daemon=True)
                dup.start()
                dup.join(3.0)
                j["pings_after_cancel"] = _ping_round(MPI, box["c"], 2.0) if "c" in box else "Dup hung"
            if canceller is not None:
                j["canceller"] = _read(cancel_file + ".json")
                canceller.kill()  # still connecting where no accept was pending any more
                canceller.wait()
        if not th.is_alive() and "merged" in state:
            merged = state["merged"]
            j["accept_merge_s"] = round(state["t_merged"] - state["t0"], 4)
            if a.scenario == "newcomer_dies":
                hb = _heartbeats(MPI, merged, 4.0)
                j["heartbeats"] = hb
                mine = merged.Get_group().Excl([merged.Get_size() - 1])
                t = time.perf_counter()
                surv = merged.Create_group(mine, tag=78)
                j["create_group_without_newcomer_ms"] = round(1000 * (time.perf_counter() - t), 2)
                done = threading.Event()

                def barrier() -> None:
                    surv.Barrier()
                    done.set()

                threading.Thread(target=barrier, daemon=True).start()
                j["barrier_on_survivors"] = done.wait(5.0)
            else:
                j["rtt_cold_ms"] = _ping_round(MPI, merged, 5.0)  # the first message to a peer connects to it
                j["rtt_ms"] = _ping_round(MPI, merged, 5.0)
                merged.Free()
                state["inter"].Disconnect()
        rec["joins"].append(j)
    rec["t_end"] = time.time()
    _write(os.path.join(a.dir, f"a-{wme}.json"), rec)
    sys.stdout.flush()
    os._exit(0)


def _start_canceller(a, port: str, cancel_file: str):
    """The one way out of an accept that no newcomer completes: another MPI process connects to the port. Started
    before the accept because the accepting root's other threads cannot call MPI while it blocks (measured: see
    docs/replacement-nodes.md). A singleton (no PMI variables), so its MPI world is not A's; it waits
    ``--cancel-after`` seconds, writes ``cancel_file`` (how A's members tell it from a newcomer), connects and
    disconnects, unless a newcomer joined first (``cancel_file + ".skip"``, not used here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "SLURM_"))}
    env["PYTHONPATH"] = ROOT
    args = [sys.executable, "-m", "study.mpi_dynamic", "--side", "canceller", "--dir", a.dir, "--scenario",
            a.scenario, "--cancel-file", cancel_file, "--cancel-after", str(a.cancel_after)]
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=sys.stdout, stderr=sys.stderr)


def _side_canceller(a) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with A's root
    time.sleep(a.cancel_after)
    sys.path.insert(0, ROOT)
    from deadpool_hpc.control.mpi import import_mpi

    MPI = import_mpi()
    port = _read(os.path.join(a.dir, "port.json"))["port"]
    t = time.time()
    _write(a.cancel_file, {"t": t})
    _say("canceller", "connecting")
    rec: dict = {"t": t}
    try:
        inter = MPI.COMM_SELF.Connect(port, root=0)
        rec["connect_ms"] = round(1000 * (time.time() - t), 2)
        _say("canceller", "connected")
        inter.Disconnect()
        rec["ok"] = True
    except Exception as exc:  # noqa: BLE001: the study records whatever the library says
        rec["ok"] = False
        rec["error"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
    _write(a.cancel_file + ".json", rec)
    os._exit(0)


def _side_b(MPI, a) -> None:
    rec: dict = {"node": os.uname().nodename, "index": a.index, "t_start": time.time()}
    path = os.path.join(a.dir, "port.json")
    while _read(path) is None:
        time.sleep(0.02)
    port = _read(path)["port"]
    if a.scenario == "killed_before":
        _die(a.dir, "newcomer", stage="before_connect")
    if a.scenario == "killed_during":
        threading.Timer(a.kill_ms / 1000, _die, (a.dir, "newcomer"),
                        {"stage": "during_connect", "kill_ms": a.kill_ms}).start()
    _say("B", "connecting")
    t0 = time.perf_counter()
    inter = MPI.COMM_WORLD.Connect(port, root=0)
    t1 = time.perf_counter()
    _say("B", f"connected in {1000 * (t1 - t0):.1f} ms")
    if a.scenario == "killed_after_connect":
        _die(a.dir, "newcomer", stage="after_connect")
    merged = inter.Merge(high=True)
    t2 = time.perf_counter()
    rec.update(connect_ms=round(1000 * (t1 - t0), 2), merge_ms=round(1000 * (t2 - t1), 2),
               connect_merge_ms=round(1000 * (t2 - t0), 2), rank=merged.Get_rank(), size=merged.Get_size())
    if a.scenario == "newcomer_dies":
        _write(os.path.join(a.dir, f"b-{a.index}.json"), rec)
        _heartbeats(MPI, merged, 10.0, die_at=time.monotonic() + 1.0, d=a.dir)
    rec["rtt_cold_ms"] = _ping_round(MPI, merged, 5.0)  # the first message to a peer connects to it
    rec["rtt_ms"] = _ping_round(MPI, merged, 5.0)
    merged.Free()
    t3 = time.perf_counter()
    inter.Disconnect()
    rec["disconnect_ms"] = round(1000 * (time.perf_counter() - t3), 2)
    _write(os.path.join(a.dir, f"b-{a.index}.json"), rec)
    os._exit(0)


def _side_session(MPI, a) -> None:
    rec: dict = {"mpi_version": list(MPI.Get_version()), "has_session": hasattr(MPI, "Session")}
    try:
        s = MPI.Session.Init()
        rec["psets"] = [s.Get_nth_pset(i) for i in range(s.Get_num_psets())]
        g = s.Create_group("mpi://WORLD")
        c = MPI.Intracomm.Create_from_group(g, "deadpool.study.session")
        rec["world_from_session_size"] = c.Get_size()
        rec["pset_info_size"] = s.Get_pset_info("mpi://WORLD").Get("mpi_size")
        c.Free()
        g.Free()
        s.Finalize()
        rec["ok"] = True
    except Exception as exc:  # noqa: BLE001: the study records whatever the library says
        rec["ok"] = False
        rec["error"] = f"{type(exc).__name__}: {exc}"
    _write(os.path.join(a.dir, "session.json"), rec)
    os._exit(0)


def rank_main(a) -> None:
    if a.side == "canceller":
        return _side_canceller(a)
    sys.path.insert(0, ROOT)
    if a.side == "a" and a.scenario not in ("basic", "tcp"):  # where a stuck process's threads are blocked
        import faulthandler
        faulthandler.dump_traceback_later(a.deadline + a.cancel_after + 8, exit=False)
    from deadpool_hpc.control.mpi import import_mpi

    MPI = import_mpi()
    {"a": _side_a, "b": _side_b, "session": _side_session}[a.side](MPI, a)


# --------------------------------------------------------------------------------------------- the harness

class Jobs:
    """The Slurm jobs this study submitted, cancelled by id at the end (``cancel_all``)."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def submit(self, d: str, name: str, args: list[str], *, nodes: int, ntasks: int, exclude: str = "",
               env: dict | None = None) -> str:
        cmd = " ".join(SRUN + [sys.executable, "-m", "study.mpi_dynamic"] + args)
        sb = ["sbatch", "--parsable", "--no-requeue", "--no-kill", "-J", f"mpidyn-{name}", "-N", str(nodes),
              "-n", str(ntasks), "--time=3", "-D", ROOT, "-o", os.path.join(d, f"slurm-{name}.out")]
        if exclude:
            sb += ["-x", exclude]
        full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
        out = subprocess.run(sb + ["--wrap", cmd], capture_output=True, text=True, env=full_env, check=True)
        jid = out.stdout.strip().split(";")[0]
        self.ids.append(jid)
        return jid

    def nodes(self, jid: str, timeout: float = 30.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            out = subprocess.run(["squeue", "-h", "-j", jid, "-t", "R", "-o", "%N"], capture_output=True, text=True)
            if out.stdout.strip():
                return out.stdout.strip()
            time.sleep(0.1)
        raise TimeoutError(f"job {jid} did not start in {timeout} s")

    def cancel_all(self) -> None:
        if self.ids:
            subprocess.run(["scancel"] + self.ids, capture_output=True)


def _wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def run_scenario(jobs: Jobs, out: str, scenario: str, runs: int, deadline: float, cancel_after: float,
                 rep: int = 0, kill_ms: float = 5.0, tcp: bool = False) -> dict:
    d = os.path.join(out, scenario, str(rep))
    os.makedirs(d, exist_ok=True)
    common = ["--dir", d, "--scenario", scenario, "--deadline", str(deadline), "--runs", str(runs),
              "--cancel-after", str(cancel_after), "--kill-ms-one", str(kill_ms)]
    env = {"UCX_TLS": "tcp"} if scenario == "tcp" or tcp else None
    t0 = time.time()
    if scenario == "session":
        jobs.submit(d, "session", ["--side", "session"] + common, nodes=1, ntasks=1)
        _wait(lambda: os.path.exists(os.path.join(d, "session.json")), 60)
        return {"scenario": scenario, "session": _read(os.path.join(d, "session.json"))}
    ja = jobs.submit(d, "a", ["--side", "a"] + common, nodes=2, ntasks=3, env=env)
    a_nodes = jobs.nodes(ja)
    a_count = 2 if scenario in ("member_dead", "member_dies") else 3
    if scenario == "member_dies":
        _wait(lambda: sum(os.path.exists(os.path.join(d, f"a-{r}.json")) for r in range(3)) >= a_count, 40)
        time.sleep(0.5)
        return {"scenario": scenario, "a": [f for f in (_read(os.path.join(d, f"a-{r}.json")) for r in range(3)) if f],
                "fault": _read(os.path.join(d, "fault.json")), "a_nodes": a_nodes, "a_log": _tail(d, "slurm-a.out")}
    if not _wait(lambda: os.path.exists(os.path.join(d, "port.json")), 60):
        return {"scenario": scenario, "error": "job A never opened its port"}
    nb = runs if scenario in ("basic", "tcp") else 1
    for i in range(nb):
        jobs.submit(d, f"b{i}", ["--side", "b", "--index", str(i)] + common, nodes=1, ntasks=1, exclude=a_nodes,
                    env=env)
        if scenario in ("basic", "tcp"):
            _wait(lambda: os.path.exists(os.path.join(d, f"b-{i}.json")), 60)
    budget = max(deadline, cancel_after) + 30
    _wait(lambda: sum(os.path.exists(os.path.join(d, f"a-{r}.json")) for r in range(3)) >= a_count, budget)
    time.sleep(0.5)
    a_files = [f for f in (_read(os.path.join(d, f"a-{r}.json")) for r in range(3)) if f]
    b_files = [f for f in (_read(os.path.join(d, f"b-{i}.json")) for i in range(nb)) if f]
    return {"scenario": scenario, "a": a_files, "b": b_files, "fault": _read(os.path.join(d, "fault.json")),
            "a_nodes": a_nodes, "wall_s": round(time.time() - t0, 1), "deadline": deadline, "rep": rep,
            "kill_ms": kill_ms if scenario == "killed_during" else None, "a_log": _tail(d, "slurm-a.out"),
            "b_log": _tail(d, "slurm-b0.out")}


def _tail(d: str, name: str) -> list[str]:
    """The lines of a Slurm output file that say what ended or hurt a process (UCX's noise left out)."""
    try:
        with open(os.path.join(d, name), errors="replace") as fh:
            lines = [ln.strip() for ln in fh if "UCX  ERROR" not in ln]
    except OSError:
        return []
    keys = ("Abort", "abort", "corrupt", "Killed", "error", "Error", "connected", "Segmentation", "MPIDI_UCX")
    return [ln for ln in lines if any(k in ln for k in keys)][:8]


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


def summarize(res: dict) -> dict:
    """One table row from a scenario's files: outcome and timings (ms)."""
    s = res["scenario"]
    if "error" in res:
        return {"scenario": s, "outcome": res["error"]}
    if s == "session":
        x = res["session"] or {}
        return {"scenario": s, "outcome": ("works" if x.get("ok") else f"fails: {x.get('error')}"),
                "detail": f"MPI {x.get('mpi_version')}, psets {x.get('psets')}, "
                          f"WORLD from session size {x.get('world_from_session_size')}"}
    if s == "member_dies":
        t_fault = (res["fault"] or {}).get("t")
        after = [sum(t > t_fault + HB_DEADLINE_S for t in times) for f in res["a"]
                 for p, times in f["heartbeats"]["heard"].items() if int(p) != 2] if t_fault else []
        detect = [round(1000 * (f["heartbeats"]["suspected"]["2"] - t_fault)) for f in res["a"]
                  if t_fault and "2" in f["heartbeats"]["suspected"]]
        ok = len(res["a"]) == 2 and after and min(after) > 0
        return {"scenario": s, "a_nodes": res["a_nodes"], "survivors_reported": len(res["a"]),
                "member_heartbeats_after_death_min": min(after) if after else None,
                "dead_suspected_after_ms": detect,
                "outcome": "survivors go on" if ok else "survivors lost: " + "; ".join(sorted(set(res["a_log"])))}
    a, b = res["a"], res["b"]
    row: dict = {"scenario": s, "a_nodes": res["a_nodes"], "b_nodes": sorted({f["node"] for f in b}),
                 "a_ranks_reported": len(a), "joins": len(b)}
    joins = [j for f in a for j in f["joins"]]
    row["a_stages"] = sorted({j["stage"] for j in joins})
    if s in ("basic", "tcp", "member_dead"):
        row["connect_merge_ms_median"] = _median([f.get("connect_merge_ms") for f in b])
        row["connect_merge_ms_all"] = [f.get("connect_merge_ms") for f in b]
        row["connect_ms_median"] = _median([f.get("connect_ms") for f in b])
        row["merge_ms_median"] = _median([f.get("merge_ms") for f in b])
        row["disconnect_ms_median"] = _median([f.get("disconnect_ms") for f in b])
        row["rtt_ms_median"] = _median([v for f in b for v in f.get("rtt_ms", {}).values()])
        row["rtt_cold_ms_median"] = _median([v for f in b for v in f.get("rtt_cold_ms", {}).values()])
        row["rtt_lost"] = sum(v is None for f in b for v in f.get("rtt_ms", {}).values())
        if s == "member_dead":
            row["create_group_ms"] = [f.get("create_group_ms") for f in a]
        row["outcome"] = ("works" if len(b) == (len(row["connect_merge_ms_all"])) and b and row["rtt_lost"] == 0
                          and all(j["stage"] == "merged" for j in joins) else "FAILS")
    elif s.startswith("killed"):
        row["pings_ok_while_blocked"] = [j["pings_ok_while_blocked"] for j in joins]
        row["pings_lost_while_blocked"] = [j["pings_lost_while_blocked"] for j in joins]
        row["longest_ping_round_s"] = [j["longest_ping_round_s"] for j in joins]
        row["a_stages_after_canceller"] = sorted({j.get("stage_after_canceller") for j in joins})
        row["cancel_s"] = [j.get("cancel_s") for j in joins]
        row["canceller"] = [j["canceller"] for j in joins if j.get("canceller")]
        row["pings_after_cancel"] = [j.get("pings_after_cancel") for j in joins]
        row["accept_errors"] = [ln for ln in res["a_log"] if "MPIDI_" in ln or "Exception" in ln][:2]
        if s == "killed_during":
            row["scenario"] = f"killed_during ({res['kill_ms']:g} ms)"
            row["b_log"] = res["b_log"]
        if len(a) < 3:
            row["outcome"] = f"{3 - len(a)} of 3 A ranks wrote no result (died or stuck): " + "; ".join(
                sorted({ln for ln in res["a_log"] if "connected" not in ln}))
        else:
            row["outcome"] = ("A blocked in " + "/".join(row["a_stages"]) + f" for {res['deadline']} s; then "
                              + "/".join(row["a_stages_after_canceller"]))
    elif s == "newcomer_dies":
        t_fault = (res["fault"] or {}).get("t")
        after, detect = [], []
        for f in a:
            for j in f["joins"]:
                hb = j.get("heartbeats") or {}
                size = f["size"] + 1
                for p, times in hb.get("heard", {}).items():
                    if int(p) != size - 1 and t_fault:
                        after.append(sum(t > t_fault + HB_DEADLINE_S for t in times))
                sus = hb.get("suspected", {})
                if t_fault and str(size - 1) in sus:
                    detect.append(1000 * (sus[str(size - 1)] - t_fault))
                row.setdefault("barrier_on_survivors", []).append(j.get("barrier_on_survivors"))
                row.setdefault("create_group_without_newcomer_ms", []).append(j.get("create_group_without_newcomer_ms"))
                row.setdefault("false_suspicions", 0)
                row["false_suspicions"] += sum(int(p) != size - 1 for p in sus)
        row["member_heartbeats_after_death_min"] = min(after) if after else None
        row["newcomer_suspected_after_ms"] = [round(x) for x in detect]
        row["outcome"] = ("members go on" if after and min(after) > 0 and row["false_suspicions"] == 0
                          and all(row["barrier_on_survivors"]) else "FAILS")
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m study.mpi_dynamic")
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--runs", type=int, default=5, help="newcomers (one Slurm job each) in basic and tcp")
    ap.add_argument("--deadline", type=float, default=5.0, help="seconds A waits for a join before giving up")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--cancel-after", type=float, default=7.0,
                    help="seconds after its start that A's canceller completes a pending accept (failure scenarios)")
    ap.add_argument("--tcp", action="store_true",
                    help="UCX_TLS=tcp in every scenario (as between real machines; the emulated nodes share a kernel, "
                         "so UCX otherwise uses shared memory between them)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each failure scenario (killed_*, newcomer_dies, member_dies), its own jobs each")
    ap.add_argument("--kill-ms", default="3,8,15",
                    help="killed_during: ms after starting its connect that the newcomer dies, one per repetition "
                         "(cycled)")
    ap.add_argument("--side", choices=("a", "b", "session", "canceller"), help=argparse.SUPPRESS)
    ap.add_argument("--cancel-file", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--kill-ms-one", dest="kill_ms", type=float, default=5.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:
        return rank_main(a)
    if not a.out_dir:
        ap.error("OUT_DIR is required")
    chosen = [s for s in a.scenarios.split(",") if s]
    bad = [s for s in chosen if s not in SCENARIOS]
    if bad:
        ap.error(f"unknown scenario(s) {bad}; accepted: {', '.join(SCENARIOS)}")
    if a.runs < 1 or a.repeat < 1:
        ap.error(f"--runs {a.runs} --repeat {a.repeat}: each must be at least 1")
    try:
        if not [float(x) for x in a.kill_ms.split(",") if x]:
            raise ValueError
    except ValueError:
        ap.error(f"--kill-ms {a.kill_ms!r}: expected comma-separated milliseconds, e.g. 3,8,15")
    os.makedirs(a.out_dir, exist_ok=True)
    jobs = Jobs()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` or a kill: still cancel the jobs (finally)
    rows = []
    kill_ms = [float(x) for x in a.kill_ms.split(",") if x]
    try:
        for s in chosen:
            for rep in range(a.repeat if s.startswith("killed") or s in ("newcomer_dies", "member_dies") else 1):
                res = run_scenario(jobs, a.out_dir, s, a.runs, a.deadline, a.cancel_after, rep,
                                   kill_ms[rep % len(kill_ms)], a.tcp)
                _write(os.path.join(a.out_dir, s, str(rep), "result.json"), res)
                row = summarize(res)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        jobs.cancel_all()
    _write(os.path.join(a.out_dir, "table.json"), {"rows": rows, "jobs": jobs.ids})
    print(f"\njobs submitted (all cancelled): {' '.join(jobs.ids)}")
    print("| scenario | outcome | numbers |\n|---|---|---|")
    for r in rows:
        nums = {k: v for k, v in r.items() if k not in ("scenario", "outcome")}
        print(f"| {r['scenario']} | {r['outcome']} | {json.dumps(nums)} |")


if __name__ == "__main__":
    main()
