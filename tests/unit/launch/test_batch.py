"""The batch script's commands on the allocation (launch/batch.py): ``--ranks-per-node`` resolved from the node's
GPUs before any process starts. The GPU count is injected (``SLURM_GPUS_ON_NODE``, or the ``gpus`` argument); no
process is launched."""
import json
import os

import pytest

from deadpool_hpc.config import RunConfig
from deadpool_hpc.errors import ConfigError
from deadpool_hpc.launch import batch


def layout(path):
    with open(os.path.join(path, "config.json")) as fh:
        return json.load(fh)["layout"]


@pytest.mark.parametrize("requested, gpus, want", [(0, 4, 4), (0, 0, 1), (2, 4, 2), (3, 0, 3)])
def test_resolve_layout_defaults_to_the_node_gpu_count(requested, gpus, want):
    cfg = batch.resolve_layout(RunConfig(nodes=2, spares=1, ranks_per_node=requested), gpus=gpus)
    assert cfg.layout.ranks_per_node == want and cfg.layout.world_size == 2 * want


def test_resolve_layout_refuses_more_ranks_than_gpus_under_nccl():
    with pytest.raises(ConfigError, match=r"--ranks-per-node 8 with --backend nccl: this node has 4 GPU"):
        batch.resolve_layout(RunConfig(nodes=2, ranks_per_node=8, backend="nccl"), gpus=4)
    assert batch.resolve_layout(RunConfig(nodes=2, ranks_per_node=0, backend="nccl"), gpus=4).layout.ranks_per_node == 4


def test_write_config_resolves_from_slurm_gpus_on_node(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "3")
    rc = batch.main(["write-config", "--run-dir", str(tmp_path), "--nodes", "2", "--spares", "1",
                     "--ranks-per-node", "0", "--backend", "gloo", "--steps", "5"])
    assert rc == 0 and layout(tmp_path)["ranks_per_node"] == 3


def test_write_config_refuses_nccl_above_the_gpu_count_with_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    monkeypatch.setattr("deadpool_hpc.config.cuda_available", lambda: True)   # the node has CUDA (injected)
    rc = batch.main(["write-config", "--run-dir", str(tmp_path), "--nodes", "2", "--spares", "1",
                     "--ranks-per-node", "3", "--backend", "nccl", "--steps", "5"])
    err = capsys.readouterr().err
    assert rc == 2 and "--ranks-per-node 3 with --backend nccl: this node has 2 GPU(s)" in err
    assert not (tmp_path / "config.json").exists()   # nothing written, nothing started


def test_copy_config_resolves_a_submitted_zero(tmp_path, monkeypatch):
    src = tmp_path / "submitted.json"
    src.write_text(RunConfig(nodes=2, spares=1, ranks_per_node=0, steps=5).to_json())   # deadpool submit's default
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "0")
    assert batch.main(["copy-config", str(src), str(run_dir)]) == 0
    assert layout(run_dir)["ranks_per_node"] == 1   # no GPU: one, as before
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    assert batch.main(["copy-config", str(src), str(run_dir)]) == 0
    assert layout(run_dir)["ranks_per_node"] == 4
    src.write_text(RunConfig(nodes=2, spares=1, ranks_per_node=2, steps=5).to_json())   # an explicit value stays
    assert batch.main(["copy-config", str(src), str(run_dir)]) == 0
    assert layout(run_dir)["ranks_per_node"] == 2


def test_submit_defaults_to_one_rank_per_gpu_and_run_to_one(tmp_path, monkeypatch, capsys):
    import argparse

    from deadpool_hpc.launch import cli, executors
    from deadpool_hpc.launch.options import add_run_options

    seen = []
    monkeypatch.setattr(executors.SlurmExecutor, "render", lambda self, cfg: seen.append(cfg) or "#!/bin/bash")
    assert cli.main(["submit", "--dry-run", "--run-dir", str(tmp_path), "--nodes", "2", "--steps", "5"]) == 0
    assert seen[0].layout.ranks_per_node == 0   # resolved on the allocation (copy-config)
    p = argparse.ArgumentParser()
    add_run_options(p)
    assert p.parse_args([]).ranks_per_node == 1   # deadpool run: as before
