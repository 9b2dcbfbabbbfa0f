"""A training process whose CUDA context is unusable after an NCCL abort exits with CUDA_UNUSABLE_EXIT, and its
agent handles it as a lost training process: the node is swapped for a spare and the run ends as the failure-free
one. On the CPU the CUDA check itself cannot fail: the process raises what dataplane/groups.py's ``abandon`` raises
(tests/trainfns.py ``cuda_unusable_rank1``); the check is tested in tests/unit/dataplane/test_backend.py (CUDA
only)."""
import pytest

from deadpool_hpc.dataplane.backend import CUDA_UNUSABLE_EXIT

from runs import SMALL_RUN_STEPS as STEPS, run_events, run_faults  # tests/runs.py

pytestmark = pytest.mark.e2e


def test_an_unusable_cuda_context_is_a_lost_training_process(tmp_path, failure_free):
    digest = failure_free(nodes=3, steps=STEPS)["param_digest"]
    s = run_faults(tmp_path, "unusable", train_fn="trainfns:cuda_unusable_rank1")
    ev = run_events(tmp_path / "unusable")
    exits = [e for e in ev if e["event"] == "process_exited"]
    assert [(e["node"], e["rc"]) for e in exits] == [(1, CUDA_UNUSABLE_EXIT)], exits
    assert any(e["event"] == "device_unusable" and e["node"] == 1 for e in ev)
    failed = [e for e in ev if e["event"] == "node_failed"]
    assert [e["cause"] for e in failed] == ["exit"] and f"code {CUDA_UNUSABLE_EXIT}" in failed[0]["reason"]
    # it comes back as a spare (agent/comeback.py): the return begins at once (its end may come after the last step)
    assert [e["node"] for e in ev if e["event"] == "node_returning"] == [1]
    assert not [e for e in ev if e["event"] in ("error", "job_aborted")]   # the job was never asked to stop
    assert s["completed"] and s["swaps"] == 1 and s["param_digest"] == digest
