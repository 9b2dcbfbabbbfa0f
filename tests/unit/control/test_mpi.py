"""The MPI transport check (deadpool_hpc/control/mpi.py): which environments it refuses, as pure logic."""
from __future__ import annotations

import pytest

from deadpool_hpc.control.mpi import CHECK_OFF, check_transport, transport_hazard
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
def test_ofi_netmod_is_a_hazard(var):
    assert "ofi" in transport_hazard({var: "ofi"})


def test_check_names_the_setting_and_what_is_accepted():
    with pytest.raises(ConfigError, match=r"UCX_TLS=tcp.*accepted: UCX_TLS unset.*DEADPOOL_MPI_TRANSPORT_CHECK=0"):
        check_transport({"UCX_TLS": "tcp"})
    check_transport({"UCX_TLS": "sm,self"})                      # no error
    check_transport({"UCX_TLS": "tcp", CHECK_OFF: "0"})          # the user accepted the risk
