"""Issue 43: the data pipeline as people write it, end to end (real ``deadpool run`` processes, MPI, gloo, SIGKILLs,
torchdata's worker processes): ``tests/trainfns_data.py`` (a DDP MLP with AdamW fed by a shuffled loader, one
iterator made before ``ctx.run`` or one per epoch) with a node and a rank killed in one run ends bitwise equal to its
failure-free run; the killed rank's node comes back to the spare pool (its fresh training process admitted, though
the killed one's loader workers once held its channel) and takes the next failure; no process of the run, loader
workers included, outlives it.
Run: .venv/bin/python -m pytest -q -n 0 tests/e2e/test_data_pipeline.py
"""
from __future__ import annotations

import os

import pytest

from runs import run_events, run_faults  # tests/runs.py

pytestmark = pytest.mark.e2e   # every test launches a run (tests/README.md)

pytest.importorskip("torchdata.stateful_dataloader")

STEPS = 60


def _run_processes(run_id: str) -> list[int]:
    """Live processes whose environment names the run (every process a run starts inherits it: loader workers
    too)."""
    want = f"DEADPOOL_RUN_ID={run_id}".encode()
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    if want in fh.read().split(b"\0"):
                        out.append(int(pid))
            except OSError:
                pass
    return out


def check(tmp_path, failure_free, name, args, kills, promoted_last=None):
    base = failure_free(nodes=3, steps=STEPS, train_fn="trainfns_data:train", train_args=args)
    s = run_faults(tmp_path, name, *kills, steps=STEPS, train_fn="trainfns_data:train", train_args=args)
    assert s["completed"] and s["errors"] == [], s
    assert [f["target"] for f in s["failures"]] == [k.split()[1].split("@")[0] for k in kills], s["failures"]
    assert all(f["outcome"] == "hot swap" and f["recomputed_steps"] <= 1 for f in s["failures"]), s["failures"]
    assert s["param_digest"] == base["param_digest"], "the data order after the recovery was not the failure-free run's"
    events = run_events(tmp_path / name)
    assert [e for e in events if e["event"] == "agent_refused"] == []
    back = [e for e in events if e["event"] == "node_readmitted" and e.get("returned") == 2]
    assert back, "node2 (its rank killed) did not come back to the spare pool"
    if promoted_last is not None:
        assert s["failures"][-1]["promoted"] == promoted_last, s["failures"][-1]
    run_id = next(e["run"] for e in events if e.get("run"))
    assert _run_processes(run_id) == [], "processes of the run (loader workers?) outlived it"
    return s


@pytest.mark.parametrize("workers", [2, 0])
def test_iterator_made_once_kill_node1_and_rank2(tmp_path, failure_free, workers):
    """The must-show case: StatefulDataLoader (StatefulDistributedSampler, shuffled), ``it = iter(loader)`` once
    before ctx.run, 3 + 2 nodes, node1 killed at step 20 and rank 2 at step 40."""
    check(tmp_path, failure_free, f"once{workers}", {"loader": "sdl", "workers": workers, "shape": "once", "pace": 0.3},
          ["kill node1@20", "kill rank2@40"])


def test_iterator_per_epoch_with_a_cut_behind_the_epoch_s_end_and_the_returned_node_taking_the_next_failure(
        tmp_path, failure_free):
    """torch's DataLoader with a DistributedSampler (2 workers), a new iterator at each epoch's end (22 batches per
    epoch): node1 killed at step 22 (an epoch's first step), rank 2 at 44, rank 0 at 54, which node2, back in the
    pool, takes over."""
    check(tmp_path, failure_free, "epoch", {"loader": "dl", "workers": 2, "shape": "epoch", "samples": 264, "pace": 0.3},
          ["kill node1@22", "kill rank2@44", "kill rank0@54"], promoted_last={"0": 2})


def test_a_hugging_face_iterable_dataset_split_by_node(tmp_path, failure_free):
    """A ``datasets.IterableDataset`` (12 shards) split with ``split_dataset_by_node(rank=ctx.rank or 0, ...)`` in
    a StatefulDataLoader with 2 workers: the split follows the training rank (a promoted spare built its dataset as
    rank 0), the position is the loader's state. Skipped where ``datasets`` is not installed (not a dependency)."""
    pytest.importorskip("datasets")
    check(tmp_path, failure_free, "hfiter", {"loader": "hfiter", "workers": 2, "shape": "once", "pace": 0.3},
          ["kill node1@20", "kill rank2@40"])
