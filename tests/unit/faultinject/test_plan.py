"""Fault specs checked against the layout before any process starts (faultplan.py): a pure simulation."""
import pytest

from deadpool_hpc.faultinject import plan as faultplan
from deadpool_hpc.config import RunConfig
from deadpool_hpc.faultinject.spec import Fault, parse_fault
from deadpool_hpc.errors import ConfigError


def cfg(*specs, **kw):
    faults = [parse_fault(kind, spec) for kind, spec in (s.split(" ") for s in specs)]
    return RunConfig(**{**dict(nodes=3, spares=2, steps=100), **kw, "faults": faults})


def test_phase_specs_parse():
    assert parse_fault("kill", "node2@rebuild") == Fault("kill", "node", 2, None, "rebuild", 1)
    assert parse_fault("hang", "rank1@agree#2") == Fault("hang", "rank", 1, None, "agree", 2)
    assert str(parse_fault("kill", "node2@restore#3")) == "--kill node2@restore#3"
    with pytest.raises(ConfigError, match="PHASE one of startup, build, first, detect, agree"):
        parse_fault("kill", "node2@rebuilt")


def test_two_adjacent_nodes_at_once_need_two_replicas():
    with pytest.raises(ConfigError, match=r"logical node 0 and every holder of its replica \(logical node\(s\) 1\)"):
        cfg("kill node0@40", "kill node1@40").validate()
    cfg("kill node0@40", "kill node1@40", replicas=2).validate()
    cfg("kill node0@40", "kill node1@41").validate()  # one at a time: re-replicated in between
    cfg("kill node0@40", "kill node2@40", nodes=4).validate()  # holders node1 and node3 survive


def test_replicas_need_enough_nodes():
    with pytest.raises(ConfigError, match="--replicas 3 with --nodes 3"):
        cfg(replicas=3).validate()
    with pytest.raises(ConfigError, match="without replicas"):
        cfg("kill node1@5", replicate=False).validate()


def test_a_second_loss_during_recovery_is_simulated():
    # node2 holds node1's replica (K=1): losing it while node1's recovery runs loses node1's state
    with pytest.raises(ConfigError, match="lost together"):
        cfg("kill node1@10", "kill node2@agree").validate()
    with pytest.raises(ConfigError, match="lost together"):
        cfg("kill node1@10", "kill node2@restore").validate()
    for phase in ("detect", "agree", "decided", "rebuild", "restore", "resume"):
        cfg("kill node1@10", f"kill node2@{phase}", replicas=2).validate()
    # node0 does not hold node1's replica (node2 does); after the swap node0's replica is on node3 (fresh): at
    # the first step after the recovery node3 has not re-made it yet, so node0 would be lost
    cfg("kill node1@10", "kill node0@agree", replicas=2).validate()
    with pytest.raises(ConfigError, match="logical node 0"):
        cfg("kill node1@10", "kill node0@resume").validate()


def test_spares_targets_and_counts():
    cfg("kill node4@agree", "kill node1@40").validate()          # the repro: an idle spare dies mid-recovery
    cfg("kill node4@5", "kill node1@10", "kill node2@30", spares=3).validate()  # a spare lost, then 2 swaps
    with pytest.raises(ConfigError, match="no spare node is left"):
        cfg("kill node4@5", "kill node3@6", "kill node1@10").validate()
    with pytest.raises(ConfigError, match="it is a spare"):
        cfg("kill node1@10", "kill node4@rebuild").validate()    # node3 is promoted, node4 stays a spare
    cfg("kill node1@10", "kill node3@rebuild", replicas=2).validate()  # the promoted spare dies joining
    with pytest.raises(ConfigError, match="already lost"):
        cfg("kill node1@10", "kill node1@20").validate()


def test_phase_of_a_recovery_that_never_happens():
    with pytest.raises(ConfigError, match="no recovery happens before it"):
        cfg("kill node2@rebuild").validate()
    with pytest.raises(ConfigError, match="recovery 2 never happens"):
        cfg("kill node1@10", "kill node2@agree#2", replicas=2).validate()
    # a failed round (node2 dies joining) is itself a round: #2 names the round after it
    cfg("kill node1@10", "kill node2@rebuild", "kill node0@detect#2", nodes=4, spares=3, replicas=3).validate()


def test_rounds_of_the_matrix_case():
    r = faultplan.rounds(cfg("kill node1@10", "kill node2@rebuild", replicas=2).validate())
    assert [x["promoted"] for x in r] == [{1: 3}, {2: 4}]


def test_requeue_when_no_spare_is_left():
    cfg("kill node1@10", "kill node2@20", spares=1, requeue=True).validate()
    with pytest.raises(ConfigError, match="cannot be combined with a requeue"):
        cfg("kill node1@10", "kill node2@agree", spares=0, requeue=True, replicas=2).validate()


def test_a_promoted_node_holds_replicas_again_after_its_first_step():
    # node1 -> node2 (the spare) at step 40; at step 120 node0 dies: its replica is on logical node 1, now node2,
    # which re-made it at its first step after the swap (a review found this refused)
    cfg("kill node1@40", "kill node0@120", nodes=2, spares=2, steps=200).validate()
    cfg("kill node1@40", "kill node0@70", nodes=3, spares=2).validate()


def test_start_up_phases():
    """Issue 28: the start-up is one window before step 0 that needs spares, not replicas (nothing to recover yet)."""
    assert parse_fault("kill", "node1@startup") == Fault("kill", "node", 1, None, "startup", 1)
    with pytest.raises(ConfigError, match="takes no recovery number"):
        parse_fault("kill", "node1@build#2")
    # two adjacent nodes at start-up with one replica: fine (each starts fresh), given a spare for each
    assert faultplan.rounds(cfg("kill node0@startup", "kill node1@build")) == [
        {"round": 1, "lost_slots": [0, 1], "promoted": {0: 3, 1: 4}, "requeued": False}]
    faultplan.check(cfg("kill node1@first", "kill node3@startup", "kill node2@50", spares=3))   # and a later step fault
    with pytest.raises(ConfigError, match="no spare node is left"):
        faultplan.check(cfg("kill node0@startup", "kill node1@build", spares=1))
    with pytest.raises(ConfigError, match="never reaches the first phase"):
        faultplan.check(cfg("kill node3@first"))
    with pytest.raises(ConfigError, match="cannot be combined with a recovery-phase fault"):
        faultplan.check(cfg("kill node1@startup", "kill node2@10", "kill node0@rebuild#2"))
