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


# ---- the layout: training processes per node from the node's GPUs -----------------------------------------------
def test_node_gpus_reads_slurm_first_then_cuda():
    assert be.node_gpus({"SLURM_GPUS_ON_NODE": "4"}, count=8) == 4
    assert be.node_gpus({"SLURM_GPUS_ON_NODE": "0"}, count=8) == 0
    assert be.node_gpus({}, count=2) == 2
    assert be.node_gpus({"SLURM_GPUS_ON_NODE": "gpu:a100:4"}, count=3) == 3   # not a number: CUDA's count
    if not torch.cuda.is_available():
        assert be.node_gpus({}) == 0


@pytest.mark.parametrize("requested, backend, gpus, want", [
    (0, "auto", 4, 4), (0, "nccl", 8, 8), (0, "auto", 0, 1), (0, "gloo", 0, 1),   # 0: one per GPU, 1 without
    (2, "nccl", 4, 2), (4, "nccl", 4, 4), (3, "gloo", 1, 3), (6, "auto", 2, 6), (1, "gloo", 0, 1)])
def test_ranks_per_node_default_is_the_node_gpu_count(requested, backend, gpus, want):
    assert be.resolve_ranks_per_node(requested, backend, gpus) == want


def test_more_ranks_than_gpus_under_nccl_is_refused_naming_value_and_count():
    with pytest.raises(be.BackendError, match=r"--ranks-per-node 5 with --backend nccl: this node has 4 GPU\(s\).*"
                                              r"accepted: 1\.\.4, or 0"):
        be.resolve_ranks_per_node(5, "nccl", 4)
    with pytest.raises(be.BackendError, match=r"--backend nccl needs a GPU on each node, and this node has 0"):
        be.resolve_ranks_per_node(0, "nccl", 0)
    with pytest.raises(be.BackendError, match=r"--ranks-per-node -1: accepted: 1 or more, or 0"):
        be.resolve_ranks_per_node(-1, "gloo", 0)


# ---- a model's parameters and ctx.device ----------------------------------------------------------------------
def test_a_parameter_on_another_device_is_named_with_both_devices():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert be.misplaced_parameter(model, torch.device("cpu"), "gloo") is None
    with torch.device("meta"):
        model[1] = torch.nn.Linear(2, 2)
    why = be.misplaced_parameter(model, torch.device("cpu"), "gloo")
    assert why.startswith("parameter '1.weight' is on meta but this training process's device (ctx.device) is cpu")
    assert "accepted: every parameter on cpu" in why


def test_a_device_without_index_matches_any_index_of_its_type():
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    assert be.misplaced_parameter(model, torch.device("meta")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a CPU parameter under a CUDA ctx.device)")
def test_cpu_parameters_under_a_cuda_device_are_refused():
    model = torch.nn.Linear(2, 2)
    why = be.misplaced_parameter(model, torch.device("cuda", 0), "nccl")
    assert why.startswith("parameter 'weight' is on cpu but this training process's device (ctx.device) is cuda:0")
    assert be.misplaced_parameter(model.to("cuda:0"), torch.device("cuda", 0), "nccl") is None
    # gloo over CUDA tensors (benchmarks/gpu_check_train.py): accepted on a CPU ctx.device
    assert be.misplaced_parameter(model.to("cuda:0"), torch.device("cpu"), "gloo") is None


# ---- the CUDA context: warmed while idle, checked after an abort ----------------------------------------------
def test_on_the_cpu_warming_and_the_context_check_do_nothing():
    be.warm_cuda(torch.device("cpu"))
    assert be.cuda_context_problem(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()   # no CUDA context was made on the CPU path


def test_the_unusable_context_exit_code_is_distinct():
    from deadpool_hpc.errors import CRASH_LOOP_EXIT, STARTUP_FAILED_EXIT

    assert be.CUDA_UNUSABLE_EXIT not in (0, 1, 2, STARTUP_FAILED_EXIT, CRASH_LOOP_EXIT, 75)
    assert issubclass(be.DeviceUnusable, RuntimeError) and not issubclass(be.DeviceUnusable, ValueError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CUDA context and its caching allocator)")
def test_warming_leaves_the_block_in_the_caching_allocator_and_the_context_works():
    dev = torch.device("cuda", 0)
    be.warm_cuda(dev, nbytes=8 << 20)
    assert torch.cuda.is_initialized()
    assert torch.cuda.memory_reserved(dev) >= 8 << 20 and torch.cuda.memory_allocated(dev) == 0
    assert be.cuda_context_problem(dev) is None


def test_the_device_index_is_the_local_rank_on_a_node_and_the_machine_wide_index_when_nodes_share_gpus():
    """On a node of its own a process takes its local rank's GPU; under ``deadpool run`` the emulated nodes share
    the machine's GPUs, so node 1's local rank 0 of a 2-rank-per-node run takes GPU 2, not node 0's GPU 0 (NCCL
    refuses two ranks of one communicator on one GPU); a bad id is refused with what is accepted."""
    assert be.device_index(1, 3, 2, shared=False) == 1
    assert be.device_index(0, 1, 2, shared=True) == 2
    assert [be.device_index(0, n, 1, shared=True) for n in range(3)] == [0, 1, 2]
    assert be.device_of("nccl", be.device_index(0, 2, 1, shared=True), gpus=2) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="accepted"):
        be.device_index(-1, 0, 1, shared=True)


def test_a_local_run_tells_its_processes_the_nodes_share_the_machines_gpus():
    from deadpool_hpc.config import RunConfig
    from deadpool_hpc.launch.local import emulated_node_env

    assert emulated_node_env(RunConfig(nodes=2, spares=1))[be.SHARED_GPUS_ENV] == "1"
