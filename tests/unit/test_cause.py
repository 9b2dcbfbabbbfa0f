"""Why a failure happened: the evidence a node agent takes of its training processes, with real processes and
real signals (agent/stacks.py: py-spy and the in-process faulthandler dump; agent/stderrtail.py: the stderr tail),
and the one line per failure that ``deadpool status`` prints (cause.py, pure). One training run (the last test:
an exit with a code and stderr, a SIGKILL, a hang in a named function); the other tests start a small Python
process of their own and end it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from deadpool_hpc import cause
from runs import run_events, run_faults  # tests/runs.py
from deadpool_hpc.agent import stacks
from deadpool_hpc.agent.stderrtail import StderrTails

# a process like a hung training process: a helper thread, and its main thread stuck inside a named function;
# its stack handler registered as worker/entry.py does
HUNG = f"""
import faulthandler, signal, sys, threading, time
faulthandler.register({int(cause.STACK_SIGNAL)}, all_threads=True, chain=False)
def helper_loop():
    while True:
        time.sleep(1)
threading.Thread(target=helper_loop, daemon=True).start()
def waiting_for_a_peer_that_never_answers():
    while True:
        time.sleep(0.05)
print("ready", file=sys.stderr, flush=True)
waiting_for_a_peer_that_never_answers()
"""


@pytest.fixture()
def hung():
    """(process, StderrTails) of a HUNG process whose stderr goes through a StderrTails, as a training process's
    does; the process is killed and reaped at the end."""
    tails = StderrTails(out_fd=None)
    err = tails.open(0)
    p = subprocess.Popen([sys.executable, "-c", HUNG], stderr=err, stdin=subprocess.DEVNULL)
    os.close(err)
    end = time.monotonic() + 30
    while "ready" not in tails.tail(0) and time.monotonic() < end:
        time.sleep(0.02)
    assert "ready" in tails.tail(0), "the hung process did not start"
    yield p, tails
    p.kill()
    p.wait()
    tails.close()


@pytest.mark.e2e
def test_pyspy_reads_every_thread_of_a_hung_process(hung):
    p, tails = hung
    if stacks.pyspy_path() is None:
        pytest.fail("py-spy is not installed: it is a dependency of deadpool-hpc (pyproject.toml)")
    st = stacks.take(p.pid, p.send_signal, tails, 0)
    assert st.source == "py-spy", st.errors
    assert st.hung_in["function"] == "waiting_for_a_peer_that_never_answers", st
    assert "helper_loop" in st.text and "MainThread" in st.text
    assert st.seconds < stacks.STACK_TIMEOUT_S
    assert p.poll() is None, "reading its stacks must not end the process"


@pytest.mark.e2e
def test_without_pyspy_the_process_dumps_its_own_stacks(hung):
    """py-spy missing (an executable that is not there): the in-process dump through the stack signal."""
    p, tails = hung
    st = stacks.take(p.pid, p.send_signal, tails, 0, exe="/nonexistent/py-spy")
    assert st.source == "faulthandler", st.errors
    assert st.errors and "py-spy" in st.errors[0]
    assert st.hung_in == {"function": "waiting_for_a_peer_that_never_answers", "where": "<string>:10"}
    assert "helper_loop" in st.text
    assert p.poll() is None


@pytest.mark.e2e
def test_a_stopped_process_is_reported_at_once(hung):
    p, tails = hung
    os.kill(p.pid, signal.SIGSTOP)
    end = time.monotonic() + 10
    while not stacks.stopped(p.pid) and time.monotonic() < end:   # (a hang is declared seconds after it began)
        time.sleep(0.01)
    try:
        t0 = time.monotonic()
        st = stacks.take(p.pid, p.send_signal, tails, 0)
        assert time.monotonic() - t0 < 1.0
        assert st.source is None and st.text == "" and "SIGSTOP" in st.errors[0]
    finally:
        os.kill(p.pid, signal.SIGCONT)


@pytest.mark.e2e
def test_the_stderr_tail_keeps_the_last_lines_and_passes_everything_on(tmp_path):
    """A process writes 5000 lines to stderr and exits with code 3: its agent's stderr gets every byte, the tail
    the last lines, and the wait for the pipe's end returns at the process's end."""
    out = open(tmp_path / "agent-stderr", "wb")
    tails = StderrTails(out_fd=out.fileno())
    err = tails.open(1)
    code = "import sys\nfor i in range(5000): print(f'line {i}', file=sys.stderr)\nsys.exit(3)"
    p = subprocess.Popen([sys.executable, "-c", code], stderr=err)
    os.close(err)
    assert p.wait(30) == 3
    t0 = time.monotonic()
    tail = cause.bound_tail(tails.tail(1, wait=5.0))
    assert time.monotonic() - t0 < 1.0
    tails.close()
    out.close()
    assert tail.splitlines() == [f"line {i}" for i in range(4980, 5000)]
    assert (tmp_path / "agent-stderr").read_text().splitlines() == [f"line {i}" for i in range(5000)]


# ---- the cause line (pure) ---------------------------------------------------------------------------------------
PYSPY_JSON = """[{"pid": 7, "thread_id": 1, "thread_name": "MainThread", "os_thread_id": 7, "frames": [
  {"name": "all_reduce", "filename": "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
   "line": 2501},
  {"name": "sync_grads", "filename": "/home/u/train.py", "line": 40},
  {"name": "main", "filename": "/v/lib/python3.11/site-packages/deadpool_hpc/worker/entry.py", "line": 90}]},
 {"pid": 7, "thread_id": 2, "thread_name": "Thread-1", "os_thread_id": 9, "frames": [
  {"name": "wait", "filename": "/usr/lib/python3.11/threading.py", "line": 320}]}]"""

FAULTHANDLER_TEXT = """noise before
Thread 0x00007f00000000aa (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007f00000000bb (most recent call first):
  File "/home/u/train.py", line 12 in stuck_here
  File "/x/deadpool_hpc/worker/entry.py", line 95 in main
"""


def test_parse_pyspy_and_name_the_training_threads_frame():
    threads = cause.parse_pyspy_json(PYSPY_JSON)
    assert [t.name for t in threads] == ["MainThread (tid 7)", "Thread-1 (tid 9)"]
    assert cause.hung_in(threads) == {"function": "all_reduce", "where": "distributed_c10d.py:2501",
                                      "user_function": "sync_grads", "user_where": "train.py:40"}
    text = cause.format_stack(threads)
    assert text.splitlines()[:2] == ["Thread MainThread (tid 7):",
                                     "    all_reduce (/v/lib/python3.11/site-packages/torch/distributed/"
                                     "distributed_c10d.py:2501)"]
    with pytest.raises(ValueError, match="not JSON"):
        cause.parse_pyspy_json("Error: Failed to suspend process")


def test_parse_faulthandler_text():
    threads = cause.parse_faulthandler(FAULTHANDLER_TEXT)
    assert [len(t.frames) for t in threads] == [1, 2]
    assert cause.hung_in(threads) == {"function": "stuck_here", "where": "train.py:12"}
    assert cause.format_stack(threads * 2000).endswith("characters more)")
    assert len(cause.format_stack(threads * 2000)) < cause.STACK_MAX_CHARS + 100


def test_signal_names_and_tails():
    assert cause.signal_name(-9) == "SIGKILL" and cause.signal_name(-6) == "SIGABRT"
    assert cause.signal_name(3) is None and cause.signal_name(0) is None
    assert cause.bound_tail("a\nb\nc\n", lines=2) == "b\nc"
    assert cause.bound_tail("x" * 5000) == "x" * cause.TAIL_MAX_CHARS


def test_cause_lines():
    hang = {"kind": "not injected", "target": "node2", "failed_nodes": [2],
            "processes": [{"what": "hang", "node": 2, "local": 0, "rank": 2, "step": 40, "stuck_s": 60.04,
                           "hung_in": {"function": "all_reduce", "where": "distributed_c10d.py:2501"},
                           "stack": "...", "stack_source": "py-spy"}]}
    assert cause.cause_line(hang) == ("rank 2 hung in `all_reduce` (distributed_c10d.py:2501) at step 40 for 60.0 s "
                                      "(node2); stack (py-spy) in events.jsonl (hang_detected) and summary.json")
    killed = {"kind": "kill", "target": "rank1", "failed_nodes": [1],
              "processes": [{"what": "exit", "node": 1, "local": 0, "rank": 1, "step": 12, "rc": -9,
                             "signal": "SIGKILL", "stderr_tail": ""}]}
    assert cause.cause_line(killed) == ("rank 1 killed by SIGKILL at step 12 (node1); nothing on stderr; "
                                        "injected: kill rank1")
    code = {"kind": "not injected", "failed_nodes": [0],
            "processes": [{"what": "exit", "node": 0, "rank": 0, "step": 6, "rc": 3, "signal": None,
                           "stderr_tail": "Traceback\nRuntimeError: CUDA error: an illegal memory access\n"}]}
    assert cause.cause_line(code) == ("rank 0 exited with code 3 at step 6 (node0); last stderr: Traceback | "
                                      "RuntimeError: CUDA error: an illegal memory access")
    whole = {"kind": "not injected", "failed_nodes": [3], "processes": [], "t_fault_source":
             "last heartbeat heard (estimated)",
             "slurm": [{"lost_node": 3, "host": "c3", "state": "DOWN+NOT_RESPONDING",
                        "reason": "deadpool job 5: declared dead"}]}
    assert cause.cause_line(whole) == ("node3 (host c3) lost whole (no training process exit or hang reported by its "
                                       "agent; fault time from: last heartbeat heard (estimated)); "
                                       "Slurm c3: DOWN+NOT_RESPONDING, Reason=deadpool job 5: declared dead "
                                       "(deadpool's drain)")
    nostack = dict(hang, processes=[dict(hang["processes"][0], stack="", hung_in=None,
                                         stack_error="process 5 is stopped by a signal (SIGSTOP)")])
    assert cause.cause_line(nostack).endswith("(node2); no stack: process 5 is stopped by a signal (SIGSTOP)")
    startup = {"kind": "not injected", "failed_nodes": [1], "processes": [],
               "reasons": ["the health check 'x' exited with 1 after 0.1 s"]}
    assert cause.cause_line(startup) == "the health check 'x' exited with 1 after 0.1 s"


# ---- one run, three failures, each with its cause --------------------------------------------------------------
@pytest.mark.e2e
def test_each_failure_of_a_run_says_why(tmp_path):
    """2 + 3 nodes, 24 steps (trainfns.why_it_failed): training rank 1 writes to stderr and exits with code 3 at
    step 6; rank 0's training process is killed (SIGKILL) at step 12; rank 1 hangs inside
    ``waiting_for_a_peer_that_never_answers`` at step 18 (--hang-timeout 3). Each failure's entry in the summary,
    its event and ``deadpool status`` say what happened: the code and the stderr tail, the signal, the function."""
    s = run_faults(tmp_path, "why", "kill rank0@12", nodes=2, spares=3, hang_timeout=3.0,
                   train_fn="trainfns:why_it_failed")
    assert s["completed"], s
    by_what = {}
    for f in s["failures"]:
        (p,) = f["processes"]   # one lost node each, one process's evidence
        by_what["hang" if p["what"] == "hang" else p["signal"] or f"code {p['rc']}"] = (f, p)
    assert sorted(by_what) == ["SIGKILL", "code 3", "hang"], s["failures"]

    f, p = by_what["code 3"]
    assert (p["rank"], p["step"], p["rc"], p["signal"]) == (1, 6, 3, None), p
    assert p["stderr_tail"].splitlines()[-2:] == ["loader: reading shard 7",
                                                  "fatal: shard 7 is corrupt (checksum mismatch); giving up"]
    # 3 is also the start-up's exit code (worker/entry.py): a process that trained 6 steps is not starting
    assert f["cause"] == "exit" and not p["during_start_up"] and f["t_fault_source"] == "process exit seen by its agent"
    assert f["why"].startswith("rank 1 exited with code 3 at step 6 (node1); last stderr: loader: reading shard 7 | "
                               "fatal: shard 7 is corrupt"), f["why"]

    f, p = by_what["SIGKILL"]
    assert (p["rank"], p["step"], p["rc"]) == (0, 12, -9), p
    assert f["why"].startswith("rank 0 killed by SIGKILL at step 12"), f["why"]

    f, p = by_what["hang"]
    assert (p["rank"], p["step"], p["stack_source"]) == (1, 18, "py-spy"), p
    assert p["hung_in"]["function"] == "waiting_for_a_peer_that_never_answers", p
    assert p["stuck_s"] >= 3.0 and p["stack_s"] < 2.0, p
    lines = p["stack"].splitlines()   # the training thread first, its innermost frame first; the others after it
    assert lines[0].startswith("Thread MainThread") and lines[1].startswith(
        "    waiting_for_a_peer_that_never_answers ("), lines[:3]
    assert p["stack"].count("\nThread ") >= 2, p["stack"]
    assert f["why"].startswith("rank 1 hung in `waiting_for_a_peer_that_never_answers`"), f["why"]
    (hang,) = [e for e in run_events(tmp_path / "why") if e["event"] == "hang_detected"]
    assert hang["stack"] == p["stack"]

    out = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "status", str(tmp_path / "why")],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0, out.stderr
    for f in s["failures"]:
        assert f["why"] in out.stdout, out.stdout
    assert "hung in `waiting_for_a_peer_that_never_answers`" in out.stdout


# ---- Slurm's view of a lost node (launch/slurm_job.py's watcher; scontrol's answers given here) -----------------
def test_scontrol_node_state_is_parsed():
    from deadpool_hpc.launch.nodestate import is_down, parse_node_state

    line = ("NodeName=node2 Arch=x86_64 CoresPerSocket=2 State=DOWN+DRAIN+NOT_RESPONDING ThreadsPerCore=1 "
            "ExtSensorsTemp=n/s Reason=Not responding [slurm@2026-12-06T02:40:00]\n")
    assert parse_node_state(line) == ("DOWN+DRAIN+NOT_RESPONDING", "Not responding")
    assert parse_node_state("NodeName=n1 State=IDLE+DRAIN Reason=deadpool job 5: declared dead [root@2026-12-06T02:4"
                            "0:00] Comment=x") == ("IDLE+DRAIN", "deadpool job 5: declared dead")
    assert parse_node_state("NodeName=n1 State=IDLE ThreadsPerCore=1") == ("IDLE", None)
    assert [is_down(s) for s in ("MIXED*", "IDLE+DRAIN", "DOWN+DRAIN", "ALLOCATED", None)] == [True, False, True,
                                                                                                False, False]


def test_node_states_are_recorded_until_slurm_sees_the_node_down(tmp_path):
    from deadpool_hpc.events import EventLog, read_events
    from deadpool_hpc.launch.nodestate import NodeStates

    answers = [("ALLOCATED", None), ("ALLOCATED", None), ("MIXED+DRAIN", "deadpool job 5: declared dead"),
               ("DOWN+DRAIN+NOT_RESPONDING", "Not responding")]
    asked = []
    log = EventLog(str(tmp_path / "events.jsonl"))
    states = NodeStates(log, query=lambda h: (asked.append(h), answers[min(len(asked), len(answers)) - 1])[1],
                        wait_s=30.0, every_s=0.0)
    states.lost("node2", 1, 1)
    for _ in range(10):
        states.poll()
    got = [(e["state"], e["reason"], e["settled"]) for e in read_events(str(tmp_path / "events.jsonl"))]
    assert got == [("ALLOCATED", None, False), ("MIXED+DRAIN", "deadpool job 5: declared dead", False),
                   ("DOWN+DRAIN+NOT_RESPONDING", "Not responding", True)]
    assert asked == ["node2"] * 4, "asked again after Slurm settled"


def test_a_whole_node_lost_under_slurm_reads_with_slurms_reason():
    """The summary's failure entry of a node lost whole (no process evidence: its agent died with it) carries the
    watcher's last ``node_state`` of its host, and its line says so (build_summary over these events alone)."""
    from deadpool_hpc.summary import build_summary

    ev = [{"t": 10.0, "event": "suspect", "generation": 0, "node": 2, "last_heard": 9.5},
          {"t": 10.2, "event": "decision", "generation": 1, "t_decided": 10.2, "reason": "failure",
           "failed_nodes": [2], "replaced": {"2": 3}, "promoted": {}, "cut_step": 7},
          {"t": 10.3, "event": "node_state", "host": "c2", "lost_node": 2, "generation": 1, "state": "ALLOCATED",
           "reason": None, "settled": False},
          {"t": 16.0, "event": "node_state", "host": "c2", "lost_node": 2, "generation": 1,
           "state": "DOWN+DRAIN+NOT_RESPONDING", "reason": "Not responding", "settled": True},
          {"t": 17.0, "event": "node_state", "host": "c9", "lost_node": 5, "generation": 1, "state": "DOWN"}]
    (f,) = build_summary(ev)["failures"]
    assert f["processes"] == [] and f["slurm"] == [{"lost_node": 2, "host": "c2", "state": "DOWN+DRAIN+NOT_RESPONDING",
                                                    "reason": "Not responding", "after_s": None, "settled": True}]
    assert f["why"] == ("node2 (host c2) lost whole (no training process exit or hang reported by its agent; fault "
                        "time from: last heartbeat heard (estimated)); Slurm c2: DOWN+DRAIN+NOT_RESPONDING, "
                        "Reason=Not responding")
