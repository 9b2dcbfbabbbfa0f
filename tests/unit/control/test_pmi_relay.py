"""The PMI-1 relay (deadpool_hpc/control/pmi_relay.py): the reply rewrite as pure logic, then the real
relay process between two real sockets standing for slurmstepd and the rank."""
from __future__ import annotations

import os
import socket
import time

import pytest

from deadpool_hpc.control import pmi_relay


def test_rewrite_lowers_vallen_max_only_in_maxes_reply():
    maxes = b"cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024\n"
    assert pmi_relay.rewrite_reply(maxes, 512) == b"cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=512\n"
    assert pmi_relay.rewrite_reply(maxes, 2048) == maxes                 # never raised
    other = b"cmd=get_result rc=0 value=vallen_max=1024\n"
    assert pmi_relay.rewrite_reply(other, 512) == other
    with pytest.raises(ValueError, match="vallen_max"):
        pmi_relay.rewrite_reply(maxes, 0)


def test_wanted_only_for_srun_tasks_with_a_pmi_socket():
    assert pmi_relay.wanted({"PMI_FD": "5", "SLURM_STEP_ID": "0"})
    assert not pmi_relay.wanted({"PMI_FD": "5"})                       # mpiexec/hydra, not srun
    assert not pmi_relay.wanted({"PMI_FD": "5", "SLURM_STEP_ID": "0", "DEADPOOL_PMI_RELAY": "0"})


def _recv_line(sock, timeout=10.0):
    sock.settimeout(timeout)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        assert chunk, f"relay closed the socket after {buf!r}"
        buf += chunk
    return buf


@pytest.mark.e2e
def test_relay_process_rewrites_maxes_passes_requests_whole_and_closes_with_the_rank(monkeypatch):
    slurm, task_end = socket.socketpair()                 # slurmstepd's end / the task's PMI_FD
    env = {"PMI_FD": str(task_end.detach()), "SLURM_STEP_ID": "0"}
    monkeypatch.setattr(pmi_relay, "_relay_fd", None)
    pid = pmi_relay.install(env)
    assert pid is not None and env["PMI_FD"] != ""
    rank = socket.socket(fileno=int(env["PMI_FD"]))       # what MPICH would use
    try:
        assert pmi_relay.install(env) is None              # once per process
        import signal

        for sig in (signal.SIGUSR2, signal.SIGTERM):       # what Slurm sends to every process of a step
            os.kill(pid, sig)
        time.sleep(0.3)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the relay died of a signal meant for the rank"
        rank.sendall(b"cmd=get_maxes\n")
        assert _recv_line(slurm) == b"cmd=get_maxes\n"
        slurm.sendall(b"cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024\n")
        assert _recv_line(rank).endswith(b"vallen_max=512\n")
        # a request written in pieces reaches Slurm as one line
        line = b"cmd=put kvsname=3.0 key=k value=" + b"AB" * 200 + b"\n"
        rank.sendall(line[:100])
        time.sleep(0.2)
        rank.sendall(line[100:])
        assert _recv_line(slurm) == line
        # the rank dies: Slurm's end sees EOF, the relay exits
        rank.close()
        slurm.settimeout(10)
        assert slurm.recv(10) == b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the relay did not exit after the rank closed its socket")
    finally:
        slurm.close()
        rank.close()
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def test_install_rejects_a_bad_pmi_fd_and_a_bad_vallen(monkeypatch):
    monkeypatch.setattr(pmi_relay, "_relay_fd", None)
    with pytest.raises(RuntimeError, match="PMI_FD='x'"):
        pmi_relay.install({"PMI_FD": "x", "SLURM_STEP_ID": "0"})
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="DEADPOOL_PMI_VALLEN_MAX='-3'"):
            pmi_relay.install({"PMI_FD": str(r), "SLURM_STEP_ID": "0", "DEADPOOL_PMI_VALLEN_MAX": "-3"})
    finally:
        os.close(r)
        os.close(w)
