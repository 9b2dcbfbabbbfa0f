"""The recovery decision as a pure function (control/agreement.py), its wire form (control/decision.py), and the
replica placement it uses (placement.py)."""
import dataclasses
import json

import pytest

from deadpool_hpc.control.agreement import decide as _decide
from deadpool_hpc.control.decision import Decision, RoundFailure, decision_from_wire, from_int_runs, int_runs
from deadpool_hpc.control.messages import Report
from deadpool_hpc.errors import ReplicaError
from deadpool_hpc.placement import held_by, holder_nodes, holders_of


def decide(**kw):
    """``agreement.decide`` with each report read from its wire form (a dict; {}: a spare that holds nothing)."""
    return _decide(**dict(kw, reports={m: Report.from_wire(json.loads(json.dumps(r))) for m, r in kw["reports"].items()}))


def reports(own_steps, held, assignment=None):
    """own_steps: {mpi: [steps]} (own_rank from ``assignment``, default identity); held: {holder_mpi: (rank, [steps])}."""
    out = {}
    for m, steps in own_steps.items():
        r = assignment.index(m) if assignment else m
        out[m] = {"own_rank": r, "own": steps, "done_step": max(steps)}
    for m, (r, steps) in held.items():
        out.setdefault(m, {})["held"] = {str(r): steps}
    return out


def test_ring_over_nodes():
    assert [holders_of(r, 1, 3) for r in range(3)] == [[1], [2], [0]]
    assert [holders_of(r, 2, 2) for r in range(4)] == [[2], [3], [0], [1]]
    assert all(held_by(holders_of(r, 2, 3)[0], 2, 3) == [r] for r in range(6))
    assert holders_of(1, 1, 4, k=2) == [2, 3] and held_by(1, 1, 4, k=2) == [0, 3]
    with pytest.raises(ValueError, match="2 replica"):
        holders_of(0, 1, 2, k=2)
    # the pre-start check's node-level ring (faultplan.py) is the same ring
    assert all(holder_nodes(n, 4, 2) == [h // 3 for h in holders_of(3 * n + 1, 3, 4, k=2)] for n in range(4))


def test_node_loss_maps_to_spare_and_cuts_at_common_step():
    # 3 nodes x 1 rank + 1 spare (mpi 3). Node 1 died; rank 1's replica lives on rank 2.
    reps = reports({0: [40, 41], 2: [40, 41]}, {0: (2, [40, 41]), 2: (1, [40])})
    reps[3] = {}
    d = decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed={1}, reports=reps)
    assert d.assignment == (0, 3, 2)
    assert d.promoted == {1: 3} and d.sources == {1: 2}
    assert d.cut_step == 40 and d.recomputed_steps == 1
    assert d.fenced == (1,) and d.spare_nodes == () and d.members == (0, 2, 3)


def test_whole_node_is_fenced_and_replaced_rank_for_rank():
    # 2 nodes x 2 ranks + 1 spare node (mpi 4, 5); one rank of node 0 hung -> node 0 is lost.
    reps = reports({1: [9, 10], 2: [9, 10], 3: [9, 10]}, {2: (0, [9, 10]), 3: (1, [10])})
    reps[4], reps[5] = {}, {}
    d = decide(generation=2, ranks_per_node=2, assignment=[0, 1, 2, 3], spare_nodes=[2], failed={0}, reports=reps)
    assert d.fenced == (0, 1)
    assert d.assignment == (4, 5, 2, 3)
    assert d.cut_step == 10


def test_no_spare_left_still_cuts_for_a_checkpoint():
    reps = reports({0: [4, 5], 2: [4, 5]}, {2: (1, [5])})
    d = decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[], failed={1}, reports=reps)
    assert d.exhausted and d.promoted == {} and d.assignment == (0, 1, 2)
    assert d.cut_step == 5 and d.sources == {1: 2}


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
    assert d.assignment == (0, 1, 2) and d.promoted == {} and d.spare_nodes == (4,)
    assert d.reason == "spare lost"
    assert d.cut_step == 4 and d.recomputed_steps == 0


def test_preemption_saves_at_the_newest_common_step_without_promoting():
    # nobody failed; one rank is a step behind: the cut is the newest step every rank holds
    reps = reports({0: [11, 12], 1: [10, 11], 2: [11, 12]}, {})
    reps[3] = {}
    d = decide(generation=2, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed=set(), reports=reps,
               preempt=True)
    assert d.exhausted and d.reason == "preempted"
    assert d.promoted == {} and d.assignment == (0, 1, 2) and d.spare_nodes == (3,)
    assert d.cut_step == 11 and d.sources == {} and d.fenced == ()
    assert d.members == (0, 1, 2, 3)
    swap = decide(generation=2, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed=set(), reports=reps)
    assert not swap.exhausted and swap.reason == "rebuild"


def test_k_replicas_survive_two_adjacent_losses():
    # 4 nodes x 1 rank, K=2: rank 1's replicas on nodes 2 and 3, rank 2's on 3 and 0. Nodes 1 and 2 die.
    reps = {0: {"own_rank": 0, "own": [7, 8], "held": {2: [7, 8], "3": [7, 8]}, "done_step": 8},
            3: {"own_rank": 3, "own": [7, 8], "held": {1: [7, 8], "2": [7, 8]}, "done_step": 8},
            4: {}, 5: {}}
    d = decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2, 3], spare_nodes=[4, 5], failed={1, 2},
               reports=reps, replicas=2)
    assert d.assignment == (0, 4, 5, 3) and d.cut_step == 8
    assert d.sources == {1: 3, 2: 3}  # ring order: the first live holder
    with pytest.raises(ReplicaError, match="rank 1: its node and every holder"):
        decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2, 3], spare_nodes=[4, 5], failed={1, 2},
               reports={0: reps[0], 3: {"own_rank": 3, "own": [8]}, 4: {}, 5: {}}, replicas=2)


def test_a_promoted_spare_whose_restore_failed_is_restored_again_from_a_holder():
    # generation 1 promoted spare 3 for rank 1, then the round failed before its restore (node 2, the first
    # holder, died): rank 1's state now comes from the other holder, node 0.
    reps = {0: {"own_rank": 0, "own": [9, 10], "held": {1: [9, 10], "2": [9, 10]}, "done_step": 10},
            3: {"own_rank": 1, "own": []}, 4: {}}
    d = decide(generation=2, ranks_per_node=1, assignment=[0, 3, 2], spare_nodes=[4], failed={2}, reports=reps,
               replicas=2)
    assert d.assignment == (0, 3, 4) and d.promoted == {2: 4}
    assert d.sources == {1: 0, 2: 0} and d.cut_step == 10


def test_nobody_failed_is_a_rebuild_of_the_same_members():
    reps = reports({0: [4, 5], 1: [5], 2: [4, 5]}, {})
    d = decide(generation=3, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[], failed=set(), reports=reps)
    assert d.reason == "rebuild" and d.assignment == (0, 1, 2) and d.sources == {} and d.cut_step == 5


def _decision():
    reps = reports({0: [40, 41], 2: [40, 41]}, {0: (2, [40, 41]), 2: (1, [40])})
    d = decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed={1}, reports=reps)
    return dataclasses.replace(d, coordinator=0, t_decided=1700000000.5, first_suspicion=1700000000.25)


def test_decision_round_trips_through_json():
    d = _decision()
    wire = json.loads(json.dumps(d.to_wire()))  # what a control message carries
    assert wire["sources"] == {"1": 2} and wire["assignment"] == [[0, 1], [3, 1], [2, 1]]   # runs of ids
    back = decision_from_wire(wire)
    assert back == d and isinstance(back, Decision)
    assert back.sources == {1: 2} and back.promoted == {1: 3} and back.replaced == {1: 3}
    f = RoundFailure(generation=2, error="ReplicaError", message="rank 1: lost", members=(0, 2), failed_nodes=(1,),
                     coordinator=0, t_decided=1.0)
    back = decision_from_wire(json.loads(json.dumps(f.to_wire())))
    assert back == f and isinstance(back.exception(), ReplicaError)
    assert isinstance(RoundFailure(1, "NoSuchError", "x", (), ()).exception(), RuntimeError)


@pytest.mark.parametrize("change, match", [
    (lambda w: w.pop("cut_step"), "lacks key 'cut_step'"),
    (lambda w: w.update(sources={"one": 2}), "key 'sources'"),
    (lambda w: w.update(assignment=[0, "3", 2]), "key 'assignment'"),
    (lambda w: w.update(assignment=[[0, 1], [3, 0]]), "key 'assignment'"),     # a run of no ids
    (lambda w: w.update(members=[[0, 1 << 30]]), "key 'members'.* more than"),  # a list no job has
    (lambda w: w.update(exhausted=0), "key 'exhausted'"),
    (lambda w: w.update(generation=True), "key 'generation'"),
])
def test_bad_wire_decision_names_the_key(change, match):
    wire = _decision().to_wire()
    change(wire)
    with pytest.raises(ValueError, match=match):
        Decision.from_wire(wire)
    with pytest.raises(ValueError, match="lacks key 'message'"):
        decision_from_wire({"generation": 1, "error": "ReplicaError"})


def test_ids_travel_as_runs_and_come_back_in_order():
    for ids in ([], [5], [0, 1, 2, 7, 3], list(range(100)) + [200] + list(range(101, 150)), [3, 2, 1]):
        assert from_int_runs(int_runs(ids)) == tuple(ids)
    assert int_runs([0, 1, 2, 7, 3]) == [[0, 3], [7, 1], [3, 1]]


def test_a_decision_for_8192_ranks_fits_a_control_message():
    """1,024 nodes x 8 ranks, one node lost and swapped for a spare: written out id by id its assignment and members
    made the decision 80 KB, over the 64 KiB a control message may carry (wire.MAX_MESSAGE_BYTES); as runs, a few
    hundred bytes."""
    from deadpool_hpc.ipc import wire

    P, nodes = 8, 1024
    W = nodes * P
    reps = {m: {"own_rank": m, "own": [0], "held": {str(((m // P - 1) % nodes) * P + m % P): [0]}, "done_step": 0}
            for m in range(W) if m // P != 3}
    reps.update({m: {} for m in range(W, W + 2 * P)})
    d = decide(generation=1, ranks_per_node=P, assignment=list(range(W)), spare_nodes=[nodes, nodes + 1],
               failed=set(range(3 * P, 4 * P)), reports=reps)
    msg = wire.encode("decision", d.to_wire(), b"k" * 32)
    assert len(msg) < 4096
    kind, body = wire.decode(msg, len(msg), b"k" * 32)
    assert decision_from_wire(body) == d and d.assignment[3 * P:4 * P] == tuple(range(W, W + P))



def test_a_node_lost_before_any_step_starts_its_ranks_fresh():
    """Issue 28. node1 died during start-up, before rank 1's first snapshot was committed; ranks 0 and 2 hold
    their own step 0 and nobody trained a step. Rank 1 starts fresh on the spare (no source); the others restore
    their own step 0."""
    reps = {0: {"own_rank": 0, "own": [0], "held": {"2": [0]}, "done_step": 0},
            2: {"own_rank": 2, "own": [0], "held": {}, "done_step": 0}, 3: {}}
    d = decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed={1}, reports=reps)
    assert d.fresh == (1,) and d.sources == {} and d.promoted == {1: 3}
    assert d.cut_step == 0 and d.recomputed_steps == 0 and d.reason == "hot swap"
    # no process had attached yet: every rank starts fresh
    d = decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed={1},
               reports={0: {}, 2: {}, 3: {}})
    assert d.fresh == (0, 1, 2) and d.cut_step == 0 and d.sources == {}
    # a requeued attempt that resumed from step 40: its fresh start is that checkpoint
    reps = {0: {"own_rank": 0, "own": [40], "done_step": 40, "start_step": 40},
            2: {"own_rank": 2, "own": [40], "done_step": 40, "start_step": 40}, 3: {}}
    d = decide(generation=5, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed={1}, reports=reps)
    assert d.fresh == (1,) and d.cut_step == 40
    # the wire form carries it
    assert decision_from_wire(json.loads(json.dumps(d.to_wire()))).fresh == (1,)


def test_once_a_step_was_trained_a_state_found_nowhere_is_still_an_error():
    """Past step 0 every rank's snapshot 0 was committed at its holders first: a rank whose state is nowhere then
    lost its node and every holder together, and no fresh start can rebuild it (it would not be bitwise equal)."""
    reps = {0: {"own_rank": 0, "own": [1], "done_step": 1}, 3: {}}
    with pytest.raises(ReplicaError, match="rank 1: its node and every holder"):
        decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2], spare_nodes=[3], failed={1, 2}, reports=reps)


def test_one_promotion_rule_for_the_decision_and_the_pre_start_check():
    """placement.promotion: lost nodes in node-id order take the spares in promotion order; decide and faultplan
    both call it (issue 29: faultplan had its own copy)."""
    from deadpool_hpc.placement import promotion

    assert promotion([3, 1], [5, 4]) == {1: 5, 3: 4}
    assert promotion([], [4]) == {}
    with pytest.raises(ValueError, match=r"2 lost node\(s\) \[1, 3\] but 1 spare"):
        promotion([3, 1], [4])
    # the decision: nodes 1 and 3 of 4 lost, spares 5 then 4 -> node 1's ranks on node 5, node 3's on node 4
    d = decide(generation=1, ranks_per_node=1, assignment=[0, 1, 2, 3], spare_nodes=[5, 4], failed={3, 1},
               reports={**{m: {"own_rank": m, "own": [2], "held": {str((m - 1) % 4): [2]}, "done_step": 2,
                               "start_step": 0} for m in (0, 2)}, 4: {}, 5: {}})
    assert d.promoted == {1: 5, 3: 4} and d.spare_nodes == (), d
