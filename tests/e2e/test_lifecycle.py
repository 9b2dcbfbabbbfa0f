"""The run's own lifecycle on the local launcher: real processes, real signals, real locks.

- The launcher's death by any signal (SIGKILL included) ends every process of the run within seconds;
  SIGHUP/SIGTERM/SIGINT also let it write what it writes at a normal end (``interrupted``).
- The worker-side lifeline on its own (no hydra): a launcher that dies takes the run's processes with
  it, a SIGSTOPped peer included, and never a process whose pid was recycled.
- One run per run directory; a run only ever signals processes it started.
- Bad paths exit 2 with a message before anything trains. The console says what happens.
"""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from deadpool_hpc.config import RunConfig
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


def test_lifeline_only_under_the_local_launcher(tmp_path):
    from deadpool_hpc.process import lifeline

    assert lifeline.start(str(tmp_path / "e.jsonl"), environ={}) is None  # Slurm: nothing starts
    with pytest.raises(ValueError, match="DEADPOOL_LAUNCHER='12x'"):
        lifeline.start(str(tmp_path / "e.jsonl"), environ={"DEADPOOL_LAUNCHER": "12x"})


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


# ---- bad input: exit 2 with a message, before anything trains -----------------------------------------------------
def bad_cases(tmp):
    (tmp / "file").write_text("x")
    (tmp / "adir").mkdir()
    proj = tmp / "project"
    (proj / "checkpoint").mkdir(parents=True)
    (proj / "checkpoint" / "model.pt").write_text("precious")
    (proj / "config.json").write_text('{"lr": 1}')
    ok = str(tmp / "new-run")
    return [
        (["--run-dir", str(tmp / "file")], "exists and is not a directory"),
        (["--run-dir", str(tmp / "file" / "sub")], "is not a directory, so"),
        (["--run-dir", ""], "--run-dir '': empty"),
        (["--run-dir", "/proc"], "cannot create files in /proc"),
        (["--run-dir", str(proj)], "holds other files and no deadpool run"),
        (["--run-dir", ok, "--summary", str(tmp / "adir")], "is a directory; accepted: a file path"),
        (["--run-dir", ok, "--summary", str(tmp / "file" / "s.json")], f"its directory {tmp / 'file'} is not a directory"),
        (["--run-dir", ok, "--summary", str(tmp / "nowhere" / "s.json")], "does not exist"),
        (["--run-dir", ok, "--summary", "/proc/s.json"], "cannot create files in /proc"),
        (["--run-dir", ok, "--seed", "-1"], "--train-arg seed=-1: accepted"),
    ]


def test_bad_paths_exit_2_with_a_message_before_anything_runs(tmp_path, capsys):
    """In process (the CLI's own ``main``): checking paths starts nothing. The exit status of the command itself is
    test_second_run_in_the_same_run_dir_is_refused_and_the_first_is_untouched's."""
    from deadpool_hpc.launch.cli import main

    for args, msg in bad_cases(tmp_path):
        t0 = time.monotonic()
        try:
            code = main(["run", "--nodes", "2", "--spares", "1", "--steps", "10", *args])
        except SystemExit as exc:
            code = exc.code
        took = time.monotonic() - t0
        err = capsys.readouterr().err
        assert code == 2 and msg in err and "Traceback" not in err, (args, err[-2000:])
        assert took < 30, (args, took)
    assert not (tmp_path / "new-run").exists(), "a refused run created its run directory"
    assert (tmp_path / "project" / "checkpoint" / "model.pt").read_text() == "precious"


def test_launch_checks_paths_too(tmp_path):
    from deadpool_hpc.errors import ConfigError
    from deadpool_hpc.launch import LocalExecutor

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        LocalExecutor().run(RunConfig(nodes=2, spares=1, steps=2, run_dir=str(tmp_path / "file")))
    with pytest.raises(ConfigError, match="is a directory"):
        LocalExecutor().run(RunConfig(nodes=2, spares=1, steps=2, run_dir=str(tmp_path / "r"),
                                      summary_path=str(tmp_path)))
    assert not (tmp_path / "r").exists()


# ---- the console says what happens ------------------------------------------------------------------------------
def console_lines(cfg: RunConfig, evs: list[dict]) -> list[str]:
    from rich.console import Console

    from deadpool_hpc.launch.console import LiveView

    with LiveView(cfg, Console(file=io.StringIO(), width=300)) as view:
        view.update(evs)
    return [t.plain for t in view.lines]


def _no_spare(step: int, reason: str = "no spare node left") -> list[dict]:
    return [{"event": "decision", "t": 1.0, "t_decided": 1.0, "generation": 1, "failed_nodes": [] if reason ==
             "preempted" else [1], "promoted": {}, "cut_step": step, "exhausted": True, "reason": reason},
            {"event": "checkpoint_saved", "t": 2.0, "step": step, "generation": 1, "reason": reason}]


def test_console_after_no_spare_left_says_what_happens():
    stop = console_lines(RunConfig(nodes=2, spares=0), _no_spare(9))
    assert any("no spare left: checkpoint saved at step 9; the run stops here (without --requeue" in x for x in stop)
    assert not any("requeueing" in x for x in stop), stop
    again = console_lines(RunConfig(nodes=2, spares=0, requeue=True), _no_spare(9))
    assert any("requeueing: the run restarts from it" in x for x in again), again
    last = console_lines(RunConfig(nodes=2, spares=0, requeue=True, max_requeues=1),
                         _no_spare(9) + [{"event": "requeued", "t": 3.0, "attempt": 1}] + _no_spare(12))
    assert "the run stops here: it was requeued 1 times already" in last[-1], last
    pre = console_lines(RunConfig(nodes=2, spares=1, requeue=True), _no_spare(7, "preempted"))
    assert any("no node lost, preempted: save a checkpoint" in x for x in pre)
    assert any(x.strip().startswith("preempted (SIGUSR2/SIGTERM): checkpoint saved at step 7") for x in pre), pre


def test_console_shows_each_node_s_step_time_and_a_straggler_swapped_out():
    from rich.console import Console

    from deadpool_hpc.launch.console import LiveView

    cfg = RunConfig(nodes=2, spares=1)
    times = {"0": {"own_s": 0.05, "step_s": 0.12}, "1": {"own_s": 0.11, "step_s": 0.12}}
    evs = [{"event": "fault_injected", "t": 0.5, "kind": "slow", "target": "node1", "node": 1, "step": 40,
            "phase": None, "pids": [7], "signal": "SIGSTOP/SIGCONT"},
           {"event": "node_step_times", "t": 1.0, "generation": 0, "nodes": times},
           {"event": "straggler_detected", "t": 2.0, "node": 1, "ratio": 2.2, "own_s": 0.11, "median_s": 0.05,
            "slow_for_s": 60.2, "action": "swap", "why": None}]
    with LiveView(cfg, Console(file=io.StringIO(), width=200)) as view:
        view.update(evs)
        shown = Console(file=io.StringIO(), width=200)
        shown.print(view._render())
        table = " ".join(shown.file.getvalue().split())
        assert "node1 slow 120 ms (110 ms)" in table and "node0 active 120 ms (50 ms)" in table, table
        view.update([{"event": "decision", "t": 3.0, "t_decided": 3.0, "generation": 1, "failed_nodes": [1],
                      "promoted": {"1": 2}, "cut_step": 70}])
        assert view.roles == {0: "active", 1: "out: slow", 2: "active"} and 1 not in view.step_times
    assert any("straggler: node1's own work 110.0 ms/step, 2.20 x the others' median for 60 s: planned swap" in x
               for x in (t.plain for t in view.lines)), [t.plain for t in view.lines]


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


def test_summary_paths_that_would_wreck_the_run_are_refused(tmp_path):
    """--summary naming the run directory (which the run creates), or one of the run's own files there."""
    from deadpool_hpc.errors import ConfigError
    from deadpool_hpc.rundir import check_output_file

    new = tmp_path / "new"
    with pytest.raises(ConfigError, match="is the run directory"):
        check_output_file(str(new), run_dir=str(new))
    assert check_output_file(str(new / "s.json"), run_dir=str(new)) == str(new / "s.json")  # created by the run
    for name in ("events.jsonl", "config.json", "run.lock"):
        with pytest.raises(ConfigError, match=f"would overwrite the run's own {name}"):
            check_output_file(str(new / name), run_dir=str(new))
