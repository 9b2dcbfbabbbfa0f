"""The backend choice and the NCCL rules (dataplane/backend.py): pure logic, no GPU needed. What needs CUDA is
skipped here, never faked."""
import pytest
import torch

from deadpool_hpc.dataplane import backend as be


def test_auto_picks_nccl_only_with_a_gpu():
    assert be.resolve_backend("auto", gpus=0) == "gloo"
    assert be.resolve_backend("auto", gpus=8) == "nccl"
    assert be.resolve_backend("gloo", gpus=8) == "gloo"
    assert be.resolve_backend("nccl", gpus=1) == "nccl"


def test_bad_backend_settings_name_the_value_and_what_is_accepted():
    with pytest.raises(be.BackendError, match=r"'mpi' is unknown; accepted: auto, nccl, gloo"):
        be.resolve_backend("mpi", gpus=1)
    with pytest.raises(be.BackendError, match=r"'nccl' needs CUDA and a GPU.*accepted here: gloo"):
        be.resolve_backend("nccl", gpus=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_auto_is_gloo_on_the_cpu():
    assert be.resolve_backend("auto") == "gloo"
    assert be.device_of("gloo", 3) == torch.device("cpu")


def test_each_training_process_binds_cuda_local_rank():
    assert be.device_of("nccl", 0, gpus=4) == torch.device("cuda", 0)
    assert be.device_of("nccl", 3, gpus=4) == torch.device("cuda", 3)
    assert be.device_of("nccl", 1, gpus=1) == torch.device("cuda", 0)   # two processes on one GPU
    assert be.device_of("gloo", 3, gpus=4) == torch.device("cpu")


@pytest.mark.parametrize("version", [(2, 25, 1), (2, 28, 3), (2, 28, 5), (2, 28, 8), "2.28.8", 22801 + 4])
def test_known_bad_nccl_versions_are_refused(version):
    problem = be.nccl_version_problem(version)
    assert problem is not None and "refused" in problem and "2.25.1, 2.28.3-2.28.8" in problem


@pytest.mark.parametrize("version", [(2, 25, 0), (2, 25, 2), (2, 28, 2), (2, 28, 9), (2, 21, 5), (2, 31, 0), 22703,
                                     "2.27.7", (2, 26, 2, "a")])
def test_other_nccl_versions_pass(version):
    assert be.nccl_version_problem(version) is None


def test_nccl_version_forms():
    assert be.parse_nccl_version(22503) == (2, 25, 3)
    assert be.parse_nccl_version(2708) == (2, 7, 8)    # before 2.9: major*1000 + minor*100 + patch
    assert be.parse_nccl_version("2.28.9") == (2, 28, 9)
    with pytest.raises(ValueError, match=r"'two' is not readable; accepted"):
        be.parse_nccl_version("two")


def test_nccl_environment_sets_only_what_the_user_did_not():
    env = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    set_now = be.nccl_environment(env)
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "1" and "TORCH_NCCL_BLOCKING_WAIT" not in set_now
    # no torch-side abort of one communicator alone, and a peer's failure never tears the survivors down (1 or 3)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_linked_nccl_is_readable_and_allowed_on_this_gpu_machine():
    assert be.nccl_version() is not None
    assert be.nccl_version_problem(be.nccl_version()) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_training_process_without_cuda_binds_the_cpu_and_refuses_nccl(monkeypatch):
    from types import SimpleNamespace

    from deadpool_hpc.config import RunConfig
    from deadpool_hpc.worker.entry import bind_device

    monkeypatch.setenv("LOCAL_RANK", "9")
    emitted = []
    log = SimpleNamespace(emit=lambda kind, **kw: emitted.append(kind))
    assert bind_device(RunConfig(backend="auto"), 2, log) == ("gloo", torch.device("cpu"))
    assert bind_device(RunConfig(backend="gloo"), 0, log) == ("gloo", torch.device("cpu"))
    import os

    assert os.environ["LOCAL_RANK"] == "0" and emitted == []   # gloo: nothing new in the event log
    with pytest.raises(be.BackendError, match="'nccl' needs CUDA"):
        bind_device(RunConfig(backend="nccl"), 0, log)
