"""The recovery decision as a pure function (control/agreement.py)."""
import pytest

from deadpool_hpc.control.agreement import decide, held_by, holder_of
from deadpool_hpc.errors import ReplicaError


def reports(own_steps, held):
    """own_steps: {mpi: [steps]}; held: {holder_mpi: (rank, [steps])}."""
    out = {}
    for m, steps in own_steps.items():
        out[m] = {"own": steps, "done_step": max(steps)}
    for m, (r, steps) in held.items():
        out.setdefault(m, {})["held"] = {str(r): steps}
    return out


def test_ring_over_nodes():
    assert [holder_of(r, 1, 3) for r in range(3)] == [1, 2, 0]
    assert [holder_of(r, 2, 2) for r in range(4)] == [2, 3, 0, 1]
    assert all(held_by(holder_of(r, 2, 3), 2, 3) == r for r in range(6))


def test_node_loss_maps_to_spare_and_cuts_at_common_step():
    # 3 nodes x 1 rank + 1 spare (mpi 3). Node 1 died; rank 1's replica lives on rank 2.
    reps = reports({0: [40, 41], 2: [40, 41]}, {0: (2, [40, 41]), 2: (1, [40])})
    reps[3] = {}
    d = decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed={1}, reports=reps)
    assert d["assignment"] == [0, 3, 2]
    assert d["promoted"] == {"1": 3} and d["sources"] == {"1": 2}
    assert d["cut_step"] == 40 and d["recomputed_steps"] == 1
    assert d["fenced"] == [1] and d["spare_nodes"] == [] and d["members"] == [0, 2, 3]


def test_whole_node_is_fenced_and_replaced_rank_for_rank():
    # 2 nodes x 2 ranks + 1 spare node (mpi 4, 5); one rank of node 0 hung -> node 0 is lost.
    reps = reports({1: [9, 10], 2: [9, 10], 3: [9, 10]}, {2: (0, [9, 10]), 3: (1, [10])})
    reps[4], reps[5] = {}, {}
    d = decide(generation=2, ranks_per_node=2, assignment=[0, 1, 2, 3], spare_nodes=[2], failed={0}, reports=reps)
    assert d["fenced"] == [0, 1]
    assert d["assignment"] == [4, 5, 2, 3]
    assert d["cut_step"] == 10


def test_no_spare_left_still_cuts_for_a_checkpoint():
    reps = reports({0: [4, 5], 2: [4, 5]}, {2: (1, [5])})
    d = decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[], failed={1}, reports=reps)
    assert d["exhausted"] and d["promoted"] == {} and d["assignment"] == [0, 1, 2]
    assert d["cut_step"] == 5 and d["sources"] == {"1": 2}


def test_replica_lost_with_its_holder():
    reps = reports({0: [5]}, {})
    reps[3], reps[4] = {}, {}
    with pytest.raises(ReplicaError, match="lost together"):
        decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3, 4], failed={1, 2}, reports=reps)


def test_no_common_step_is_an_error():
    reps = reports({0: [7, 8], 2: [7, 8]}, {2: (1, [5])})
    reps[3] = {}
    with pytest.raises(ReplicaError, match="no step"):
        decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed={1}, reports=reps)


def test_failed_spare_only_shrinks_the_spare_list():
    reps = reports({0: [3, 4], 1: [3, 4], 2: [3, 4]}, {1: (0, [4]), 2: (1, [4]), 0: (2, [4])})
    reps[4] = {}
    d = decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3, 4], failed={3}, reports=reps)
    assert d["assignment"] == [0, 1, 2] and d["promoted"] == {} and d["spare_nodes"] == [4]
    assert d["cut_step"] == 4 and d["recomputed_steps"] == 0


def test_preemption_saves_at_the_newest_common_step_without_promoting():
    # nobody failed; one rank is a step behind: the cut is the newest step every rank holds
    reps = reports({0: [11, 12], 1: [10, 11], 2: [11, 12]}, {})
    reps[3] = {}
    d = decide(generation=2, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed=set(), reports=reps,
               preempt=True)
    assert d["exhausted"] and d["reason"] == "preempted"
    assert d["promoted"] == {} and d["assignment"] == [0, 1, 2] and d["spare_nodes"] == [3]
    assert d["cut_step"] == 11 and d["sources"] == {} and d["fenced"] == []
    assert d["members"] == [0, 1, 2, 3]
    swap = decide(generation=2, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed=set(), reports=reps)
    assert not swap["exhausted"] and swap["reason"] == "hot swap"
