"""The MPI transport check (deadpool_hpc/control/mpi.py): which environments it refuses, as pure logic (the UCX
send guard's build, which runs the C compiler, is tested in tests/e2e/test_mpi_transport.py)."""
from __future__ import annotations

import pytest

from deadpool_hpc.control.mpi import CHECK_OFF, GUARD_OFF, build_send_guard, check_transport, transport_hazard
from deadpool_hpc.errors import ConfigError


@pytest.mark.parametrize("tls", ["tcp", "TCP", "tcp,self", " tcp ", "^sm", "^shm,ib", "^mm"])
def test_tcp_without_shared_memory_is_a_hazard(tls):
    assert "UCX_TLS=" in transport_hazard({"UCX_TLS": tls})


@pytest.mark.parametrize("env", [{}, {"UCX_TLS": ""}, {"UCX_TLS": "tcp,sm"}, {"UCX_TLS": "sm,self"},
                                 {"UCX_TLS": "posix,tcp"}, {"UCX_TLS": "all"}, {"UCX_TLS": "^ib"},
                                 {"UCX_TLS": "^tcp"}, {"MPIR_CVAR_CH4_NETMOD": "ucx"}])
def test_shared_memory_or_default_is_no_hazard(env):
    assert transport_hazard(env) is None


@pytest.mark.parametrize("var", ["MPIR_CVAR_CH4_NETMOD", "MPICH_CH4_NETMOD"])
def test_ofi_netmod_is_a_hazard_even_guarded(var):
    assert "ofi" in transport_hazard({var: "ofi"})
    with pytest.raises(ConfigError, match="ofi"):
        check_transport({var: "ofi"}, guarded=True)


def test_tcp_is_refused_unguarded_with_the_setting_and_what_is_accepted():
    with pytest.raises(ConfigError, match=r"UCX_TLS=tcp.*send guard.*not loaded.*accepted: .*"
                                          r"DEADPOOL_MPI_TRANSPORT_CHECK=0"):
        check_transport({"UCX_TLS": "tcp"}, guarded=False)
    check_transport({"UCX_TLS": "tcp"}, guarded=True)            # no error: the guard keeps the survivors alive
    check_transport({"UCX_TLS": "sm,self"}, guarded=False)
    check_transport({"UCX_TLS": "tcp", CHECK_OFF: "0"}, guarded=False)   # the user accepted the risk


def test_preflight_without_a_compiler_or_with_the_guard_off_refuses_tcp(tmp_path):
    with pytest.raises(ConfigError, match="send guard"):
        check_transport({"UCX_TLS": "tcp", "DEADPOOL_CACHE": str(tmp_path), "CC": "no-such-compiler-here"})
    with pytest.raises(ConfigError, match="send guard"):
        check_transport({"UCX_TLS": "tcp", "DEADPOOL_CACHE": str(tmp_path), GUARD_OFF: "0"})
    assert build_send_guard({"DEADPOOL_CACHE": str(tmp_path), "CC": "no-such-compiler-here"}) is None
