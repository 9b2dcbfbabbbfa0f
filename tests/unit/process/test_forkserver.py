"""The local launcher's fork server (process/forkserver.py, its program worker/forkserver.py), with a real server
process, real forked training processes (``worker.entry``, up to their ``hello`` on a real node-agent channel) and
real signals: what a forked process keeps of a fresh one (its own session, the agent's environment, working
directory and output, its exit status seen by its agent) and that it dies with its agent's connection and with the
server. Every process it starts is killed and reaped at the end. Run: DEADPOOL_SLURM_TESTS=0 .venv/bin/python -m pytest -q tests/unit/process/test_forkserver.py
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time

import pytest

from deadpool_hpc.agent.channel import ChannelServer
from deadpool_hpc.config import RunConfig
from deadpool_hpc.process import forkserver

pytestmark = pytest.mark.e2e   # each test starts the run's fork server and training processes

SECRET = bytes(range(32))


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, killed and not yet reaped by its parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server():
    proc, name = forkserver.start(dict(os.environ, DEADPOOL_JOB_SECRET=SECRET.hex()))
    yield proc, name
    proc.kill()
    proc.wait()


@pytest.fixture()
def agent(tmp_path):
    """A real node agent's channel (the forked process's ``hello`` arrives there) and a run directory."""
    srv = ChannelServer(SECRET)
    seen: list = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            seen.extend(srv.poll(0.05))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    (tmp_path / "config.json").write_text(RunConfig(run_dir=str(tmp_path)).to_json())
    env = dict(os.environ, DEADPOOL_JOB_SECRET=SECRET.hex(), DEADPOOL_AGENT_SOCK=srv.name, DEADPOOL_NODE="3")
    yield srv, env, tmp_path
    stop.set()
    t.join(2)


def hellos(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    return [e for e in map(json.loads, open(path)) if e["event"] == "hello"]


def test_a_forked_training_process_is_a_fresh_ones_equal_and_dies_with_its_agents_connection(server, agent):
    proc, name = server
    _srv, env, run_dir = agent
    p = forkserver.spawn(name, [str(run_dir), "0"], env, SECRET)
    try:
        wait_until(lambda: hellos(run_dir), 60, "the forked training process's hello on the agent's channel")
        (h,) = hellos(run_dir)
        # node 3 and the channel name come from the agent's environment (the server has neither)
        assert h["pid"] == p.pid and h["node"] == 3 and h["role"] == "trainer", h
        assert os.getsid(p.pid) == p.pid, "a session of its own, as the agent's Popen(start_new_session=True)"
        assert p.poll() is None
        with open(f"/proc/{p.pid}/stat") as fh:
            assert int(fh.read().rpartition(")")[2].split()[1]) == proc.pid, "its parent is the fork server"
    finally:
        p._conn.close()   # the agent's end closes (as when it dies): the server kills its training process at once
    wait_until(lambda: not alive(p.pid), 5, f"forked process {p.pid} to die with its agent's connection")


def test_its_agent_sees_its_exit_status_and_a_bad_secret_or_a_silent_peer_is_refused(server, agent, tmp_path_factory):
    _proc, name = server
    _srv, env, run_dir = agent
    p = forkserver.spawn(name, [str(run_dir), "0"], env, SECRET)
    wait_until(lambda: hellos(run_dir), 60, "the hello")
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(10) == -signal.SIGKILL, "killed by SIGKILL: the Popen convention, a negative signal number"
    empty = tmp_path_factory.mktemp("no_config")   # no config.json: worker.entry fails before its hello
    q = forkserver.spawn(name, [str(empty), "0"], env, SECRET)
    time.sleep(0.5)   # it exits within ms and the server reaps it: the pidfd it came with still says so
    assert select.select([q.pidfd], [], [], 0)[0] == [q.pidfd], "its pidfd is readable: the process has exited"
    assert q.wait(30) == 1
    os.close(q.pidfd)
    open_fds = len(os.listdir(f"/proc/{_proc.pid}/fd"))
    for _ in range(5):
        with pytest.raises(OSError, match="closed the connection without forking"):
            forkserver.spawn(name, [str(run_dir), "0"], env, b"another job's secret 0123456789ab")
    assert len(os.listdir(f"/proc/{_proc.pid}/fd")) == open_fds, "a refused request's descriptors were closed"
    # a peer that connects and sends nothing is dropped after REQUEST_TIMEOUT_S; the next request is served
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.connect("\0" + name)
    try:
        t0 = time.monotonic()
        r = forkserver.spawn(name, [str(empty), "0"], env, SECRET, timeout=forkserver.REQUEST_TIMEOUT_S + 10)
        assert r.wait(30) == 1 and time.monotonic() - t0 < forkserver.REQUEST_TIMEOUT_S + 10
        os.close(r.pidfd)
    finally:
        silent.close()


def test_its_training_processes_die_with_the_server(agent):
    _srv, env, run_dir = agent
    proc, name = forkserver.start(dict(os.environ, DEADPOOL_JOB_SECRET=SECRET.hex()))
    try:
        p = forkserver.spawn(name, [str(run_dir), "0"], env, SECRET)
        wait_until(lambda: hellos(run_dir), 60, "the hello")
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(0.05)   # still running
    finally:
        proc.kill()
        proc.wait()
    wait_until(lambda: not alive(p.pid), 5, "the forked process to die with its server (parent-death signal)")
    assert p.wait(5) == -signal.SIGKILL, "the server is gone: its agent reads the connection's end as a kill"


def test_a_run_whose_fork_server_dies_ends_with_an_error_naming_it(tmp_path):
    """Its training processes die with the server (every node's at once: nothing to recover from here); the run
    ends promptly, every process gone, with ``ForkServerLost`` in its errors rather than only mpiexec's end."""
    from runs import launch_reaped

    cfg = RunConfig(nodes=2, spares=1, steps=400, run_dir=str(tmp_path / "run")).validate()
    out = {}
    others = _servers()   # this module's own server (the fixture's) is not the run's
    th = threading.Thread(target=lambda: out.update(s=launch_reaped(cfg, 120)), daemon=True)
    th.start()
    ev = tmp_path / "run" / "events.jsonl"
    wait_until(lambda: ev.exists() and any('"event":"step"' in line for line in open(ev)), 90, "the first step")
    (server,) = _servers() - others
    os.kill(server, signal.SIGKILL)
    th.join(90)
    assert not th.is_alive(), "the run did not end after its fork server died"
    s = out["s"]
    assert not s["completed"] and any("ForkServerLost" in e for e in s["errors"]), s["errors"]


def _servers() -> set[int]:
    return {int(d) for d in os.listdir("/proc") if d.isdigit() and _child_server(int(d))}


def _child_server(pid: int) -> bool:
    """A fork server started by this process (the test's in-process launcher)."""
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        ppid = int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1])
    except (OSError, ValueError):
        return False
    return ppid == os.getpid() and b"deadpool_hpc.worker.forkserver" in cmd
