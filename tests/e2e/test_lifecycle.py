"""The run's own lifecycle on the local launcher: real processes, real signals, real locks.

- The launcher's death by any signal (SIGKILL included) ends every process of the run within seconds;
  SIGHUP/SIGTERM/SIGINT also let it write what it writes at a normal end (``interrupted``).
- The worker-side lifeline on its own (no hydra): a launcher that dies takes the run's processes with
  it, a SIGSTOPped peer included, and never a process whose pid was recycled.
- One run per run directory; a run only ever signals processes it started.
- The console says what happens when no spare is left.

In process: the CLI's path checks (tests/unit/launch/test_cli.py), the console's lines
(tests/unit/launch/test_console.py).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from deadpool_hpc.process.fence import descendants, fence, identity_of, is_alive
from deadpool_hpc.events import EventLog, read_events
from deadpool_hpc.rundir import RunDir, RunDirBusy

import paths  # tests/paths.py: the checkout's folders, wherever this file lies
ROOT = paths.ROOT
GONE_S = 10.0  # every process of the run must be gone this long after the launcher's death (measured: < 1 s)


# ---- helpers ---------------------------------------------------------------------------------------------------
def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "deadpool_hpc.launch.cli", *args]


def events(run_dir) -> list[dict]:
    path = os.path.join(str(run_dir), "events.jsonl")
    return list(read_events(path)) if os.path.exists(path) else []


def wait_for(pred, deadline_s: float, what: str, proc=None):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (rc {proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")


def at_step(run_dir, n: int):
    """The run's events once rank 0 has logged step >= n and every process its hello (else None)."""
    es = events(run_dir)
    if not es:
        return None
    cfg = json.load(open(os.path.join(str(run_dir), "config.json")))["layout"]
    total = (cfg["nodes"] + cfg["spares"]) * cfg["ranks_per_node"]
    if max((e["step"] for e in es if e["event"] == "step"), default=-1) >= n and \
            sum(e["event"] == "hello" and e.get("role") == "trainer" for e in es) == total:
        return es
    return None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def gone_within(idents: list[dict], deadline_s: float) -> float:
    """Seconds until every process of ``idents`` is gone (pid + start time); fails after ``deadline_s``."""
    t0 = time.monotonic()
    while any(is_alive(i) for i in idents):
        if time.monotonic() - t0 > deadline_s:
            left = [(i["pid"], cmdline(i["pid"])[:80]) for i in idents if is_alive(i)]
            raise AssertionError(f"still alive {deadline_s} s after the launcher's death: {left}")
        time.sleep(0.02)
    return time.monotonic() - t0


def _default_stop_signals() -> None:
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@contextmanager
def started(args: list[str], out_path, **kw):
    """Popen in a session of its own; on exit, whatever it started is SIGKILLed by identity (its process
    tree, and the hellos of its run dir), then its process group."""
    out = open(out_path, "w")
    # the stop signals take their default action in the launcher, as from a terminal, even when this test runs
    # under nohup (SIGHUP ignored, inherited: the launcher keeps an ignored signal ignored, on purpose)
    kw.setdefault("preexec_fn", _default_stop_signals)
    p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                         start_new_session=True, **kw)
    seen: list[dict] = []
    try:
        yield p, seen
    finally:
        seen += descendants(p.pid)
        if "--run-dir" in args:
            seen += [e for e in events(args[args.index("--run-dir") + 1]) if e["event"] == "hello"]
        for ident in seen:
            fence(ident)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(30)
        out.close()


# ---- the launcher's death ends the run ---------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGHUP", "SIGTERM", "SIGINT"])
def test_launcher_death_ends_every_process_of_the_run(tmp_path, sig):
    run_dir, summary = tmp_path / "run", tmp_path / "s.json"
    args = cli("run", "--nodes", "2", "--spares", "1", "--steps", "400", "--run-dir", str(run_dir),
               "--summary", str(summary))
    with started(args, tmp_path / "out.txt") as (p, seen):
        es = wait_for(lambda: at_step(run_dir, 5), 120, "step 5", p)
        hellos = [e for e in es if e["event"] == "hello"]
        tree = descendants(p.pid)
        seen += tree
        # one node agent and one training process per node (P = 1): 3 + 3 hellos, all of this run
        assert len(hellos) == 6 and {e["run"] for e in hellos} == {json.load(open(run_dir / "run.lock"))["run_id"]}
        assert sum("mpiexec" in cmdline(i["pid"]) for i in tree) == 1, [cmdline(i["pid"]) for i in tree]
        assert sum("hydra_pmi_proxy" in cmdline(i["pid"]) for i in tree) == 3
        everything = tree + hellos
        assert all(is_alive(i) for i in everything)
        spare = next(e for e in hellos if e.get("mpi_rank") == 2)  # the spare node's agent
        os.kill(spare["pid"], signal.SIGSTOP)  # a frozen process notices nothing: someone else must kill it
        os.kill(p.pid, getattr(signal, sig))
        took = gone_within(everything, GONE_S)
        rc = p.wait(30)
    print(f"{sig}: every process of the run gone {took:.3f} s after the signal")
    RunDir(str(run_dir)).acquire()  # the lock went with the launcher
    if sig == "SIGKILL":
        assert rc == -signal.SIGKILL
        return
    num = getattr(signal, sig)
    assert rc == 128 + num, (tmp_path / "out.txt").read_text()[-2000:]
    out = (tmp_path / "out.txt").read_text()
    assert f"interrupted by {sig}" in out and "every process of the run was stopped" in out, out[-2000:]
    for path in (run_dir / "summary.json", summary):
        s = json.loads(path.read_text())
        assert s["interrupted"] == sig and s["completed"] is False and s["steps_completed"] >= 5, s
        assert s["processes_left"] == []
    (last,) = [e for e in events(run_dir) if e["event"] == "interrupted"]
    assert last["signal"] == sig and last["run"] == hellos[0]["run"]


@pytest.mark.e2e
def test_sighup_under_nohup_leaves_the_run_alone(tmp_path):
    run_dir = tmp_path / "run"
    args = ["nohup", *cli("run", "--nodes", "2", "--spares", "1", "--steps", "40", "--run-dir", str(run_dir))]
    with started(args, tmp_path / "out.txt") as (p, seen):
        wait_for(lambda: at_step(run_dir, 5), 120, "step 5", p)
        os.kill(p.pid, signal.SIGHUP)
        assert p.wait(300) == 0, (tmp_path / "out.txt").read_text()[-2000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["completed"] and "interrupted" not in s, s


# ---- the lifeline on its own (no hydra in between) ---------------------------------------------------------------
WORKER = """
import json, os, sys, time
from deadpool_hpc.process import lifeline
from deadpool_hpc.events import EventLog
from deadpool_hpc.process.fence import identity
path, peers, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
line = lifeline.start(path)
line.know(peers, EventLog(path, run=os.environ["DEADPOOL_RUN_ID"], mpi_rank=0))
with open(out + ".tmp", "w") as fh:
    json.dump({"me": identity(), "chain": line.chain}, fh)
os.replace(out + ".tmp", out)
time.sleep(600)  # the main thread is busy (as in MPI_Init, or in a step): the lifeline acts alone
"""

MIDDLE = """
import subprocess, sys, time
subprocess.Popen(sys.argv[1:])
time.sleep(600)
"""

LAUNCHER = """
import os, subprocess, sys, time
from deadpool_hpc.process.lifeline import launcher_env
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.executable, "-c", *sys.argv[2:]],
                 env=dict(os.environ, **launcher_env("r1")))
time.sleep(600)
"""


def spawn(args, **kw) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True, **kw)


@pytest.mark.e2e
def test_lifeline_ends_its_process_its_peers_and_the_processes_in_between(tmp_path):
    """launcher -> middle (as mpiexec and the proxy) -> worker with a lifeline. Peers: a running and a
    SIGSTOPped process, and a decoy named by its pid with another start time (a recycled pid): when the
    launcher is SIGKILLed, all but the decoy must go."""
    log, out = tmp_path / "events.jsonl", tmp_path / "w.json"
    sleepers = [spawn(["sleep", "600"]) for _ in range(3)]
    known: list[dict] = []
    try:
        peer, frozen, decoy = (identity_of(p.pid) for p in sleepers)
        os.kill(frozen["pid"], signal.SIGSTOP)
        recycled = dict(decoy, start=decoy["start"] + 1)
        launcher = spawn([sys.executable, "-c", LAUNCHER, MIDDLE, WORKER, str(log),
                          json.dumps([peer, frozen, recycled]), str(out)])
        sleepers.append(launcher)
        wrote = wait_for(lambda: out.exists() and json.loads(out.read_text()), 60, "the worker's lifeline", launcher)
        me, chain = wrote["me"], wrote["chain"]
        known += [me] + chain
        assert len(chain) == 1 and "-c" in cmdline(chain[0]["pid"])  # the middle process, and not the launcher
        launcher.kill()
        took = gone_within([me, chain[0], peer, frozen], GONE_S)
        print(f"lifeline alone: worker, middle and peers gone {took:.3f} s after SIGKILL of the launcher")
        assert is_alive(decoy), "a pid named with another start time was signalled"
        (lost,) = [e for e in read_events(str(log)) if e["event"] == "launcher_lost"]
        assert lost["launcher"] == launcher.pid and lost["pid"] == me["pid"] and lost["run"] == "r1"
        assert set(lost["targets"]) == {peer["pid"], frozen["pid"], decoy["pid"], chain[0]["pid"]}
    finally:
        for ident in known:
            fence(ident)
        for p in sleepers:
            p.kill()
            p.wait()


@pytest.mark.e2e
def test_lifeline_of_a_worker_whose_launcher_is_already_gone_ends_it_at_once(tmp_path):
    dead = spawn(["sleep", "600"])
    ident = identity_of(dead.pid)
    dead.kill()
    dead.wait()
    env = dict(os.environ, DEADPOOL_LAUNCHER=f"{ident['pid']}:{ident['start']}", DEADPOOL_RUN_ID="r2")
    log = tmp_path / "events.jsonl"
    w = spawn([sys.executable, "-c", WORKER, str(log), "[]", str(tmp_path / "w.json")], env=env)
    try:
        assert w.wait(30) == -signal.SIGKILL
        assert [e["launcher"] for e in read_events(str(log)) if e["event"] == "launcher_lost"] == [ident["pid"]]
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()


# ---- one run per run directory; a run signals only its own processes ---------------------------------------------
@pytest.mark.e2e
def test_second_run_in_the_same_run_dir_is_refused_and_the_first_is_untouched(tmp_path):
    run_dir, summary = tmp_path / "run", tmp_path / "a.json"
    args = cli("run", "--nodes", "2", "--spares", "1", "--steps", "120", "--run-dir", str(run_dir),
               "--summary", str(summary))
    with started(args, tmp_path / "a.txt") as (a, seen):
        wait_for(lambda: at_step(run_dir, 3), 120, "step 3 of the first run", a)
        config = (run_dir / "config.json").read_bytes()
        inode = os.stat(run_dir / "events.jsonl").st_ino
        t0 = time.monotonic()
        b = subprocess.run(cli("run", "--nodes", "3", "--spares", "0", "--steps", "10", "--run-dir", str(run_dir)),
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        assert a.poll() is None, "the first run ended before the second was tried: the test proves nothing"
        assert b.returncode == 2, b.stdout[-2000:] + b.stderr[-2000:]
        assert f"--run-dir {run_dir} is in use by another run (pid {a.pid} on {socket.gethostname()}" in b.stderr, \
            b.stderr
        assert "Traceback" not in b.stderr and took < 60
        assert a.wait(300) == 0, (tmp_path / "a.txt").read_text()[-3000:]
    s = json.loads(summary.read_text())
    assert s["completed"] and s["steps_completed"] == 120 and s["failures"] == [] and s["world_size"] == 2, s
    assert json.loads((run_dir / "summary.json").read_text())["param_digest"] == s["param_digest"]
    assert (run_dir / "config.json").read_bytes() == config and os.stat(run_dir / "events.jsonl").st_ino == inode
    es = events(run_dir)
    assert {e.get("run") for e in es} == {json.loads((run_dir / "run.lock").read_text())["run_id"]}
    assert sorted(e["step"] for e in es if e["event"] == "step") == list(range(1, 121))
    assert sum(e["event"] == "hello" and e.get("role") == "trainer" for e in es) == 3 and (run_dir / "launcher.log").exists()


@pytest.mark.e2e
def test_lock_is_refused_in_process_and_released_with_its_holder(tmp_path):
    a, b = RunDir(str(tmp_path / "d")), RunDir(str(tmp_path / "d"))
    with a.locked("one"):
        with pytest.raises(RunDirBusy) as err:
            b.acquire("two")
        assert err.value.holder["pid"] == os.getpid() and err.value.holder["run_id"] == "one"
    b.acquire("two")  # released
    b.release()
    # a holder killed by SIGKILL releases it too; the lock is not inherited by its children
    holder = spawn([sys.executable, "-c", "import sys, time, subprocess\n"
                    "from deadpool_hpc.rundir import RunDir\n"
                    "RunDir(sys.argv[1]).acquire('k')\n"
                    "subprocess.Popen(['sleep', '600'])\n"
                    "print('locked', flush=True); time.sleep(600)\n", str(tmp_path / "d")],
                   stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert holder.stdout.readline().strip() == "locked"
        child = wait_for(lambda: descendants(holder.pid), 10, "the holder's child")[0]
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid} on"):
            b.acquire("two")
        holder.kill()
        holder.wait()
        assert is_alive(child)
        b.acquire("two")  # the child does not hold it
        b.release()
    finally:
        if child:
            fence(child)
        holder.kill()
        holder.wait()


@pytest.mark.e2e
def test_a_run_kills_only_processes_of_its_own_run_id(tmp_path):
    from deadpool_hpc.launch.local import _stop_run

    sleepers = [spawn(["sleep", "600"]) for _ in range(3)]
    try:
        mine, other, recycled = (identity_of(p.pid) for p in sleepers)
        log = EventLog(str(tmp_path / "events.jsonl"))
        log.emit("hello", **dict(mine, run="mine"))
        log.emit("hello", **dict(other, run="theirs"))
        log.emit("hello", **dict(recycled, run="mine", start=recycled["start"] + 1))
        done = subprocess.Popen(["true"])
        done.wait()
        assert _stop_run(done, str(tmp_path / "events.jsonl"), "mine") == []
        assert not is_alive(mine) and is_alive(other) and is_alive(recycled)
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


# ---- the console says what happens when no spare is left ---------------------------------------------------------
@pytest.mark.e2e
def test_cli_without_requeue_says_the_run_stopped(tmp_path):
    """No spare, no --requeue (the CLI refuses to inject more faults than spares, so the node dies the way
    real ones do: a SIGKILL from outside): the checkpoint is saved and the console says the run stops."""
    run_dir = tmp_path / "run"
    args = cli("run", "--nodes", "2", "--spares", "0", "--steps", "200", "--run-dir", str(run_dir))
    with started(args, tmp_path / "out.txt") as (p, seen):
        es = wait_for(lambda: at_step(run_dir, 5), 120, "step 5", p)
        os.kill(next(e for e in es if e["event"] == "hello" and e.get("mpi_rank") == 1)["pid"], signal.SIGKILL)
        assert p.wait(120) == 1
    out = " ".join((tmp_path / "out.txt").read_text().split())  # rich wraps long lines
    assert "checkpoint saved at step" in out and "the run stops here (without --requeue" in out, out[-3000:]
    assert "requeueing" not in out and "checkpoint + requeue" not in out and "checkpoint, run stopped" in out, out
